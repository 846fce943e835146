"""The debias study (every number of a study (`analyse`)); the package's docstring says what a study is."""
from __future__ import annotations

from typing import Any

import numpy as np

from analysis import stats
from analysis.evaluation.fairness import MIDDLE
from analysis.study.fairness import bin_intervals, fairness_estimates, flat_curve
from analysis.study.load import MDE_SIMULATIONS, REFERENCE_ARM, START, Study, StudyError
from analysis.study.tracking import tracking
from analysis.study.valley import valley_changes


def analyse(
    study: Study, reference: str = REFERENCE_ARM, seeds: stats.Seeds = stats.Seeds.shared, n_perm: int = stats.N_PERM,
    alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED, n_sim: int = MDE_SIMULATIONS,
) -> dict[str, Any]:
    """Every number of the report (what `study.json` holds), arms in report order (reference first).

    Questions with a non-finite score in any job are left out of every arm (the pairing) and counted."""
    if reference not in study.arms:
        raise StudyError(f"{study.sweep_dir}: reference arm {reference!r} has no job; arms: {', '.join(study.arms)}")
    arms = [reference, *(a for a in study.arms if a != reference)]
    rows = {arm: study.seed_scores(arm) for arm in arms}
    start_rows = study.seed_scores(reference, start=True)  # what the arms start from, on the same questions
    finite = np.all([np.isfinite(r).all(axis=0) for r in [*rows.values(), start_rows]], axis=0)  # (Q,)
    if finite.sum() < 4:
        raise StudyError(f"{study.sweep_dir}: {int(finite.sum())} questions with a finite {study.score.field} "
                         "in every job; an interval needs more")
    rows = {arm: r[:, finite] for arm, r in rows.items()}
    start_rows, bins, depths = start_rows[:, finite], study.bins[finite], study.depths[finite]
    fairness = fairness_estimates(rows, bins, depths, reference, seeds, study.score, alpha, n_perm, seed)
    fairness[START] = fairness_estimates({reference: rows[reference], START: start_rows}, bins, depths, reference,
                                         seeds, study.score, alpha, n_perm, seed)[START]
    for name, seed_rows in [*rows.items(), (START, start_rows)]:
        flat = flat_curve(seed_rows.mean(axis=0), bins, depths, n_perm, seed, study.score)
        worst_tail = alpha if study.score.higher_is_better else 1 - alpha
        for metric, tail in (("worst_bin", worst_tail), ("gap", 1 - alpha)):  # the side a flat curve errs to
            fairness[name][metric]["flat"] = {"expected": float(flat[metric].mean()), "quantile": tail,
                                              "bound": float(np.quantile(flat[metric], tail))}

    by_bin = {}
    for arm in arms:
        value, ci = bin_intervals(rows[arm], bins, study.n_bins, seeds, alpha)
        by_bin[arm] = {"accuracy": value.tolist(), "ci": ci.tolist()}
    start_value, start_ci = bin_intervals(start_rows, bins, study.n_bins, seeds, alpha)
    ref_ci = np.asarray(by_bin[reference]["ci"])
    half_widths = (ref_ci[:, 1] - ref_ci[:, 0]) / 2  # (B,)
    n_seeds = rows[reference].shape[0]
    rates = np.asarray(by_bin[reference]["accuracy"])
    mde = (stats.worst_bin_mde(rates, bins, n_seeds, stats.POWER, n_sim, alpha=alpha, seed=seed)
           if study.score.rate and np.isfinite(rates).all() else None)

    return {
        "sweep_dir": str(study.sweep_dir),
        "reference": reference,
        "score": {"field": study.score.field, "higher_is_better": study.score.higher_is_better},
        "seeds": seeds.value,
        "n_perm": n_perm,
        "alpha": alpha,
        "seed": seed,
        "n_questions": int(finite.sum()),
        "nonfinite_questions": int((~finite).sum()),
        "left_out": [{"job": str(job.path), "arm": job.arm, "seed": job.seed, "reason": job.reason}
                     for job in study.left_out],
        "middle": list(MIDDLE),
        "arms": {arm: {
            "seeds": study.seeds(arm),
            "jobs": [str(job.path) for job in study.arm_jobs(arm)],
            "final_steps": [job.final_step for job in study.arm_jobs(arm)],
            "seed_means": rows[arm].mean(axis=1).tolist(),
            "wall_s": [job.wall_s for job in study.arm_jobs(arm)],
        } for arm in arms},
        "fairness": fairness,
        "bins": {"n_bins": study.n_bins, "labels": [study.labels.get(b, f"{b / study.n_bins:g}")
                                                    for b in range(study.n_bins)]},
        "by_bin": by_bin,
        "start": {"arm": reference, "step": 0, "accuracy": start_value.tolist(), "ci": start_ci.tolist()},
        "resolution": {
            "median_bin_halfwidth": float(np.nanmedian(half_widths)) if np.isfinite(half_widths).any() else None,
            "bin_halfwidths": half_widths.tolist(),
            "mean_diff_halfwidth": {arm: (e["mean"]["diff_high"] - e["mean"]["diff_low"]) / 2
                                    for arm, e in fairness.items() if arm not in (reference, START)},
            "power": stats.POWER,
            "worst_bin_mde": mde,
            "mde_simulations": n_sim,
        },
        "valley": valley_changes(study),
        "tracking": tracking(study, n_perm, alpha, seed),
    }
