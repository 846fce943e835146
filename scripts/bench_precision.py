"""bf16 autocast against fp32 on this CPU, end to end: a short run of issue 39's SmolLM2 recipe in each (issue 42).

    python -m scripts.bench precision --write      # three runs of +exp=in2_smol_mdqa, 8 steps each (~10 min)

Runs, one after the other, each a `python train.py` process: fp32 with seed 0, fp32 with seed 1 (the run-to-run
spread: another LoRA initialisation and data order) and bf16 autocast with seed 0 (`trainer.precision=bf16`: fp32
master weights, bf16 compute). No evaluations; the Jacobian is measured every step as in the recipe.
Rows:

- tokens/s of bf16 over fp32 (seed 0), after the first step;
- the training loss: at each step the gap between bf16 and fp32 (same seed, same samples), beside the gap between the
  two fp32 seeds, the spread bf16 has to stay within to be adopted.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from models.training.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"fp32 seed 0": ["trainer.precision=fp32", "seed=0"], "fp32 seed 1": ["trainer.precision=fp32", "seed=1"],
        "bf16 seed 0": ["trainer.precision=bf16", "seed=0"]}


def _run(out: Path, overrides: list[str], steps: int) -> list[dict]:
    """The run's metrics rows."""
    command = [sys.executable, "train.py", "+exp=in2_smol_mdqa", f"trainer.max_steps={steps}", "eval.every=0",
               "eval.num_examples=0", "trainer.save_every=0", f"data.num_train={steps * 8}", "logger.mode=disabled",
               *overrides, f"hydra.run.dir={out}"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in RunDir(out).metrics.read_text().splitlines()]


def _tokens_per_s(rows: list[dict]) -> float:
    """Tokens over seconds from the end of step 1 (the first, with its warm-up, left out)."""
    timed = [r for r in rows if "train/wall_s" in r]
    return sum(r["train/tokens"] for r in timed[1:]) / (timed[-1]["train/wall_s"] - timed[0]["train/wall_s"])


def _losses(rows: list[dict]) -> np.ndarray:
    return np.array([r["train/loss"] for r in rows if "train/loss" in r])


def bench_precision(steps: int = 8) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        runs = {name: _run(Path(tmp) / f"run{k}", overrides, steps) for k, (name, overrides) in enumerate(RUNS.items())}
    fp32, other_seed, bf16 = (_losses(runs[name]) for name in RUNS)
    bf16_gap, seed_gap = np.abs(bf16 - fp32), np.abs(other_seed - fp32)
    speed = {name: _tokens_per_s(rows) for name, rows in runs.items()}
    return [
        {"name": f"bf16 autocast / fp32 training tokens/s, SmolLM2 recipe (+exp=in2_smol_mdqa), {steps - 1} timed steps",
         "ratio": speed["bf16 seed 0"] / speed["fp32 seed 0"], "bf16_tok_s": speed["bf16 seed 0"],
         "fp32_tok_s": speed["fp32 seed 0"], "fp32_seed1_tok_s": speed["fp32 seed 1"]},
        {"name": f"training loss, |bf16 - fp32| (same seed and samples) over |fp32 seed 1 - fp32 seed 0|, "
                 f"the largest of {steps} steps",
         "ratio": float(bf16_gap.max() / seed_gap.max()), "bf16_gap_max": float(bf16_gap.max()),
         "bf16_gap_mean": float(bf16_gap.mean()), "seed_gap_max": float(seed_gap.max()),
         "seed_gap_mean": float(seed_gap.mean()), "steps_within_seed_gap": int((bf16_gap <= seed_gap).sum()),
         "fp32_loss": " ".join(f"{v:.3f}" for v in fp32), "bf16_loss": " ".join(f"{v:.3f}" for v in bf16),
         "fp32_seed1_loss": " ".join(f"{v:.3f}" for v in other_seed)},
    ]
