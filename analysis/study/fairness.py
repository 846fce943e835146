"""The debias study (position fairness of each arm's final scores); the package's docstring says what a study is."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis import stats
from analysis.evaluation.fairness import FAIRNESS_METRICS, middle_of, resampled_metrics
from analysis.study.load import REFERENCE_ARM, StudyError

LINEAR_METRICS = ("mean", "middle_minus_ends")  # linear in the scores: crossed-design t intervals
EXTREME_METRICS = ("worst_bin", "gap")  # extremes over bins: a paired permutation test, no interval


def _stacked(rows: Mapping[str, np.ndarray], arms: Sequence[str]) -> np.ndarray:
    """(A, S, Q) scores of `arms`, each (S, Q) or (Q,) for one seed; StudyError if their seed counts differ."""
    tables = [np.asarray(rows[a], dtype=np.float64).reshape(-1, np.shape(rows[a])[-1]) for a in arms]
    counts = {a: t.shape[0] for a, t in zip(arms, tables)}
    if len(set(counts.values())) > 1:
        raise StudyError(f"arms have different numbers of seeds ({counts}); a crossed analysis needs every arm "
                         "trained at the same seeds")
    return np.stack(tables)


def _statistic(name: str, n: int, middle: np.ndarray) -> stats.Linear:
    return stats.mean_of(n) if name == "mean" else stats.contrast(middle)


def _estimate(y: np.ndarray, stat: stats.Linear, arm: int, reference: int, seeds: stats.Seeds,
              alpha: float) -> dict[str, Any]:
    level = stats.crossed_interval(y, stat, arm, None, seeds, alpha)
    out = {"value": level.value, "low": level.low, "high": level.high, "df": level.df, "method": level.method}
    if arm == reference:
        return out | {"diff": 0.0, "diff_low": 0.0, "diff_high": 0.0, "diff_df": None, "resolved": False}
    diff = stats.crossed_interval(y, stat, arm, reference, seeds, alpha)
    return out | {"diff": diff.value, "diff_low": diff.low, "diff_high": diff.high, "diff_df": diff.df,
                  "diff_method": diff.method, "resolved": diff.resolved}


def fairness_estimates(
    rows: Mapping[str, np.ndarray], bins: np.ndarray, depths: np.ndarray, reference: str = REFERENCE_ARM,
    seeds: stats.Seeds = stats.Seeds.shared, score: stats.Score = stats.ACCURACY, alpha: float = stats.ALPHA,
    n_perm: int = stats.N_PERM, seed: int = stats.RNG_SEED,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{arm: {metric: estimate}} of every arm in `rows` ({arm: (S, Q) per-seed scores}), differences to
    `reference`.

    mean and middle_minus_ends: `stats.crossed_interval` (arms x seeds x questions, seed part pooled over the
    arms), value and difference each with its t interval and df. worst_bin and gap: the value on the seed means
    and the paired permutation test's p-value of the difference (`stats.extreme_permutation_test`): `resolved`
    where p < alpha. middle_over_ends: the value only (a ratio)."""
    arms = [reference, *(a for a in rows if a != reference)]
    y = _stacked(rows, arms)  # (A, S, Q)
    bins, middle = np.asarray(bins, dtype=np.int64), middle_of(np.asarray(depths, dtype=np.float64))
    n_bins, means = int(bins.max()) + 1, y.mean(axis=1)  # (A, Q)
    point, _ = resampled_metrics(means, bins, middle, np.arange(y.shape[2])[None], n_bins, score)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for a, arm in enumerate(arms):
        out[arm] = {name: _estimate(y, _statistic(name, y.shape[2], middle), a, 0, seeds, alpha)
                    for name in LINEAR_METRICS}
        for name in EXTREME_METRICS:
            value = float(point[name][a, 0])
            if a == 0:
                out[arm][name] = {"value": value, "diff": 0.0, "p_value": None, "resolved": False}
                continue
            diff, p = stats.extreme_permutation_test(means[a], means[0], bins, name, score, n_perm, seed)
            out[arm][name] = {"value": value, "diff": float(diff), "p_value": float(p), "resolved": bool(p < alpha)}
        out[arm]["middle_over_ends"] = {"value": float(point["middle_over_ends"][a, 0])}
        per_seed, _ = resampled_metrics(y[a], bins, middle, np.arange(y.shape[2])[None], n_bins, score)
        for name in FAIRNESS_METRICS:
            out[arm][name]["per_seed"] = per_seed[name][:, 0].tolist()
    return out


def flat_curve(
    scores: np.ndarray, bins: np.ndarray, depths: np.ndarray, n_perm: int = stats.N_PERM,
    seed: int = stats.RNG_SEED, score: stats.Score = stats.ACCURACY,
) -> dict[str, np.ndarray]:
    """{metric: (n_perm,)} fairness metrics of a perfectly flat curve at these bin sizes and this accuracy.

    The per-question scores (n,) are shuffled across questions (the depth labels permuted) `n_perm` times
    (fixed `seed`): every bin then has the same expected accuracy, and what remains of worst_bin and gap is
    the chance spread of bins of these sizes (a flat curve's gap is above 0, its worst bin below the mean).
    """
    scores, bins = np.asarray(scores, dtype=np.float64), np.asarray(bins, dtype=np.int64)
    n, n_bins, middle = scores.size, int(bins.max()) + 1, middle_of(np.asarray(depths, dtype=np.float64))
    rng = np.random.default_rng(seed)
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in FAIRNESS_METRICS}
    for start in range(0, n_perm, stats.CHUNK):
        count = min(stats.CHUNK, n_perm - start)
        shuffled = rng.permuted(np.broadcast_to(scores, (count, n)), axis=1)  # (c, n)
        metrics, _ = resampled_metrics(shuffled[None], bins, middle, np.broadcast_to(np.arange(n), (count, n)),
                                       n_bins, score)
        for name, values in metrics.items():
            chunks[name].append(values[0])
    return {name: np.concatenate(values) for name, values in chunks.items()}


def bin_intervals(
    y: np.ndarray, bins: np.ndarray, n_bins: int, seeds: stats.Seeds = stats.Seeds.shared, alpha: float = stats.ALPHA
) -> tuple[np.ndarray, np.ndarray]:
    """Mean score (B,) of each depth bin of one arm's (S, Q) scores and its crossed-design interval (B, 2)
    (`stats.crossed_interval` over the bin's questions); nan for a bin with fewer than 2 questions."""
    y = np.asarray(y, dtype=np.float64).reshape(1, -1, np.shape(y)[-1])  # (1, S, Q)
    value, ci = np.full(n_bins, np.nan), np.full((n_bins, 2), np.nan)
    for b in range(n_bins):
        inside = np.asarray(bins) == b
        if inside.sum() >= 2:
            iv = stats.crossed_interval(y, stats.Linear(np.where(inside, 0, -1), (1.0,)), 0, None, seeds, alpha)
            value[b], ci[b] = iv.value, (iv.low, iv.high)
    return value, ci
