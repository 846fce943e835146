"""train.py as a recipe (issue 67): moving its code about changes no number a run logs.

tests/data/recipe_metrics.json holds the metrics.jsonl rows of a short `+exp=in2` run at tiny size (the Jacobian,
rollouts, the watch and the evaluations on) as the code before the move wrote them, the timings left out; `python -m
tests.test_recipe --record` records them again."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY
from train import compose_config, run

RECORDED = Path(__file__).resolve().parent / "data" / "recipe_metrics.json"
OVERRIDES = ["+exp=in2", *[o for o in TINY if o != "jacobian=off"], "jacobian.seq_len=64", "jacobian.chunk_len=32",
             "data.num_eval=14", "eval.every=2", "watch.questions=2", "watch.every=2", "trainer.max_steps=4",
             "trainer.save_every=2"]
TIMINGS = ("wall_s", "tokens_per_s", "peak_mem_mib", "seconds")


def logged(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(TIMINGS)} for r in rows]


def test_the_default_run_logs_what_it_logged_before_the_recipe_moved(tmp_path):
    run(compose_config(OVERRIDES), tmp_path)
    recorded, now = json.loads(RECORDED.read_text()), logged(tmp_path)
    assert [sorted(r) for r in now] == [sorted(r) for r in recorded]  # the same rows, the same keys, in order
    for mine, theirs in zip(now, recorded):
        assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-9, nan_ok=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_recipe --record")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run(compose_config(OVERRIDES), Path(tmp))
        RECORDED.write_text(json.dumps(logged(Path(tmp)), indent=1) + "\n")
    print(f"wrote {RECORDED}")
