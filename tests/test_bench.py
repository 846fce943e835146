"""The benchmark runner: real-model benchmarks run only when named, and each table replaces only itself."""
from __future__ import annotations

import importlib

import pytest

import scripts.bench as bench


def test_write_table_keeps_the_other_part(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    path = tmp_path / "BENCHMARKS.md"
    trainer, loglik = bench.REAL_MODEL["hf_trainer"], bench.REAL_MODEL["loglik"]
    bench.write_table("| main 1 |", "python -m scripts.bench --write", None)
    bench.write_table("| real 1 |", "python -m scripts.bench hf_trainer --write", trainer)
    bench.write_table("| real 2 |", "python -m scripts.bench hf_trainer --write", trainer)
    bench.write_table("| loglik 1 |", "python -m scripts.bench loglik --write", loglik)
    text = path.read_text()
    assert "| main 1 |" in text and "| real 2 |" in text and "| real 1 |" not in text and "| loglik 1 |" in text
    assert text.count(f"## {trainer}") == 1 and text.count(f"## {loglik}") == 1  # each its own section
    bench.write_table("| main 2 |", "python -m scripts.bench --write", None)
    text = path.read_text()
    assert text.startswith("# Benchmarks") and "| main 2 |" in text and "| main 1 |" not in text
    assert text.index("| main 2 |") < text.index(f"## {trainer}") < text.index("| real 2 |") < text.index("| loglik 1 |")


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
    with pytest.raises(SystemExit):  # two sections cannot be written as one table
        bench.main(["hf_trainer", "fast", "--write"])


def test_every_benchmark_names_a_function():
    for name, (module, func) in bench.BENCHMARKS.items():
        assert callable(getattr(importlib.import_module(module), func)), name


def test_the_trainer_comparison_pairs_each_repeat_and_takes_the_median(monkeypatch):
    import scripts.bench_hf_trainer as hf

    trainer_speeds = iter([100.0, 50.0, 100.0, 50.0, 200.0, 50.0])  # (full, LoRA) per repeat

    def fake(fn, steps, skip, overrides):
        if fn is hf._hf_trainer:
            return {"tokens_per_s": next(trainer_speeds), "peak_rss_mib": 1.0}
        return {"tokens_per_s": 150.0 if "data.packing=true" in overrides else 120.0, "peak_rss_mib": 2.0}

    monkeypatch.setattr(hf, "in_fresh_process", fake)
    rows = {("LoRA" in row["name"], "ours packed" in row["name"]): row for row in hf.bench_hf_trainer(repeats=3)}
    assert len(rows) == 4
    full_packed, lora_padded = rows[False, True], rows[True, False]
    assert full_packed["ratios"] == "1.500 1.500 0.750"  # each ours over the Trainer of its own repeat
    assert full_packed["ratio"] == 1.5 and full_packed["spread"] == 0.75 and full_packed["runs_meeting_goal"] == 2
    assert lora_padded["ratio"] == 2.4 and lora_padded["runs_meeting_goal"] == 3 and lora_padded["baseline"] == 50.0


def test_a_bar_in_a_cell_does_not_split_the_table():
    out = bench.table([("b", {"name": "|x - y|", "ratio": 1.0, "note": "a|b"})])
    row = out.splitlines()[-1]
    assert row.count(" | ") == 3 and "\\|x - y\\|" in row and "note=a\\|b" in row
