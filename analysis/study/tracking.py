"""The debias study (whether the per-step Jacobian metrics track the curve); the package's docstring says what a study is."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis import stats
from analysis.evaluation.fairness import fairness
from analysis.evaluation.result import ProbeResult
from analysis.study.load import MIN_ARMS, TRACKED, Job, Study, score_vector
from analysis.study.valley import in_set_order


def _logged(job: Job, key: str) -> dict[int, float]:
    """step -> the finite values of `key` in the job's metrics (null or "nan" is no measurement)."""
    return {step: float(row[key]) for step, row in job.metrics.items()
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])}


def tracked_sets(study: Study) -> list[str]:
    """The Jacobian sets any job logged a key of TRACKED for, `vanilla` and `chunked` first."""
    keys = {key for job in study.jobs for row in job.metrics.values() for key in row}
    found = {key.split("/")[1] for key in keys if key.count("/") >= 2}
    return in_set_order(name for name in found if any(t.replace("<set>", name) in keys for t in TRACKED))


def _middle_minus_ends(study: Study, result: ProbeResult) -> float:
    return fairness(score_vector(result, study.ids, study.score), study.bins, study.depths,
                    study.score)["middle_minus_ends"]


def tracking_points(study: Study, key: str) -> list[dict[str, Any]]:
    """One point per job and step s that has both an IN2 eval and a finite `key`, after the job's first such
    step s0: x = `key` at s minus at s0, y = middle minus ends accuracy at s minus at s0."""
    points = []
    for job in study.jobs:
        logged = _logged(job, key)
        steps = [step for step in job.evals if step in logged]  # ascending
        for step in steps[1:]:
            y = _middle_minus_ends(study, job.evals[step]) - _middle_minus_ends(study, job.evals[steps[0]])
            points.append({"arm": job.arm, "seed": job.seed, "job": str(job.path), "base_step": steps[0],
                           "step": step, "x": logged[step] - logged[steps[0]], "y": y})
    return points


def arm_correlation(points: Sequence[Mapping[str, Any]], n_perm: int = stats.N_PERM,
                    seed: int = stats.RNG_SEED) -> dict[str, Any]:
    """Spearman ρ between Δ metric and Δ(middle − ends) over arms, each arm one point (the mean of its jobs'
    points), with the exact permutation p-value (`stats.permutation_correlation`): the jobs of one arm share
    its objective and its steps share a run, so neither is an independent unit; the arms are."""
    by_arm: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        by_arm.setdefault(p["arm"], []).append(p)
    x = [float(np.mean([p["x"] for p in ps])) for ps in by_arm.values()]
    y = [float(np.mean([p["y"] for p in ps])) for ps in by_arm.values()]
    r = stats.permutation_correlation(x, y, n_perm, seed, min_units=MIN_ARMS)
    reason = r.reason
    if reason is not None and reason.startswith("x or y"):
        reason = ("Δ metric equal at every arm" if len(set(np.round(x, stats.RANK_DECIMALS))) == 1
                  else "Δ(middle − ends) equal at every arm")
    return {**r.as_dict(), "reason": reason, "n_points": len(points), "n_jobs": len({p["job"] for p in points}),
            "arm_points": {arm: {"x": xa, "y": ya} for arm, xa, ya in zip(by_arm, x, y)}}


def tracking(
    study: Study, n_perm: int = stats.N_PERM, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED
) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {predictor of TRACKED: {key, rho, p_value, p_holm, resolved, n_units, n_points, n_jobs, reason,
    points, arm_points}}}: how the change in each per-step Jacobian metric ranks with the change in middle minus
    ends accuracy over arms (`tracking_points`, `arm_correlation`); p_holm: Holm-adjusted over every predictor
    and set with a value, `resolved` where it is below alpha."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in tracked_sets(study):
        out[name] = {}
        for predictor in TRACKED:
            key = predictor.replace("<set>", name)
            points = tracking_points(study, key)
            out[name][predictor] = {"key": key, **arm_correlation(points, n_perm, seed), "points": points}
    entries = [e for predictors in out.values() for e in predictors.values()]
    for e, adjusted in zip(entries, stats.holm([e["p_value"] for e in entries])):
        e["p_holm"] = adjusted
        e["resolved"] = bool(np.isfinite(adjusted) and adjusted < alpha)
    return out
