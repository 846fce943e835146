"""The benchmark runner: real-model benchmarks run only when named, and each table replaces only itself."""
from __future__ import annotations

import pytest

import scripts.bench as bench


def test_write_table_keeps_the_other_part(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    path = tmp_path / "BENCHMARKS.md"
    bench.write_table("| main 1 |", "python -m scripts.bench --write", real_model=False)
    bench.write_table("| real 1 |", "python -m scripts.bench hf_trainer --write", real_model=True)
    bench.write_table("| real 2 |", "python -m scripts.bench hf_trainer --write", real_model=True)
    text = path.read_text()
    assert "| main 1 |" in text and "| real 2 |" in text and "| real 1 |" not in text
    assert text.count(f"## {bench.REAL_MODEL_SECTION}") == 1
    bench.write_table("| main 2 |", "python -m scripts.bench --write", real_model=False)
    text = path.read_text()
    assert text.startswith("# Benchmarks") and "| main 2 |" in text and "| main 1 |" not in text
    assert text.index("| main 2 |") < text.index(f"## {bench.REAL_MODEL_SECTION}") < text.index("| real 2 |")


def fast_rows() -> list[dict]:
    return [{"name": "fast one", "ratio": 1.0}]


def real_model_rows() -> list[dict]:
    raise AssertionError("the real-model benchmark ran")


def test_real_model_benchmarks_run_only_when_named(monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCHMARKS", {"fast": ("tests.test_bench", "fast_rows"),
                                              "hf_trainer": ("tests.test_bench", "real_model_rows")})
    bench.main([])
    assert "fast one" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="the real-model benchmark ran"):
        bench.main(["hf_trainer"])
