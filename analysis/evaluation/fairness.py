"""Position fairness of per-question scores: mean, worst depth bin, best-minus-worst gap, middle against ends.

`fairness` scores one vector of answers (a run's end-of-run summary); `resampled_metrics` scores many arms on
many rearrangements of the questions at once (the debias study's flat-curve floor, `analysis.study`).
"""
from __future__ import annotations

import warnings

import numpy as np

from analysis.stats import ACCURACY, Score, extreme

MIDDLE = (0.25, 0.75)  # gold depths in [0.25, 0.75) are the middle, the rest the ends
FAIRNESS_METRICS = ("mean", "worst_bin", "gap", "middle_minus_ends", "middle_over_ends")


def resampled_metrics(
    scores: np.ndarray, bins: np.ndarray, middle: np.ndarray, idx: np.ndarray, n_bins: int,
    score: Score = ACCURACY,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Fairness metrics of every arm on every resample: ({metric: (A, c)}, bin means (A, c, n_bins)).

    scores (A, n) per-question scores of A arms, or (A, c, n) one score vector per arm and resample; bins (n,)
    depth bins; middle (n,) bool; idx (c, n) question indices (a permutation, or the sample itself), the same
    for every arm. A bin without questions has mean nan and is left out of worst_bin and gap; the worst bin
    is the lowest, or the highest where lower scores are better; middle_over_ends is nan for a score that is
    not a rate (a ratio of log-likelihoods means nothing) and where the ends score 0.
    """
    c, n = idx.shape
    keys = (bins[idx] + n_bins * np.arange(c)[:, None]).ravel()  # (c * n,) one bincount for all resamples
    counts = np.bincount(keys, minlength=c * n_bins).reshape(c, n_bins)  # (c, B)
    mid = middle[idx]  # (c, n)
    n_mid, n_ends = mid.sum(axis=1), (~mid).sum(axis=1)  # (c,)
    out: dict[str, list[np.ndarray]] = {name: [] for name in FAIRNESS_METRICS}
    by_bin = []
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan slices: a resample without some bins
        for row in scores:
            s = row[idx] if row.ndim == 1 else np.take_along_axis(row, idx, axis=1)  # (c, n)
            sums = np.bincount(keys, weights=s.ravel(), minlength=c * n_bins).reshape(c, n_bins)
            acc = np.where(counts > 0, sums / counts, np.nan)  # (c, B)
            mid_acc = np.where(mid, s, 0.0).sum(axis=1) / n_mid  # (c,)
            ends_acc = np.where(mid, 0.0, s).sum(axis=1) / n_ends  # (c,)
            out["mean"].append(s.mean(axis=1))
            out["worst_bin"].append(extreme(acc, "worst_bin", score))
            out["gap"].append(extreme(acc, "gap", score))
            out["middle_minus_ends"].append(mid_acc - ends_acc)
            out["middle_over_ends"].append(np.where((ends_acc > 0) & score.rate, mid_acc / ends_acc, np.nan))
            by_bin.append(acc)
    return {name: np.stack(values) for name, values in out.items()}, np.stack(by_bin)


def middle_of(depths: np.ndarray) -> np.ndarray:
    """Which gold depths are the middle, [0.25, 0.75)."""
    return (depths >= MIDDLE[0]) & (depths < MIDDLE[1])


def fairness(scores: np.ndarray, bins: np.ndarray, depths: np.ndarray, score: Score = ACCURACY) -> dict[str, float]:
    """Position-fairness metrics of one vector of per-question scores (n,), with their depth bins and depths.

    mean; worst_bin (lowest bin accuracy); gap (highest minus lowest bin accuracy, bins without questions
    left out); middle_minus_ends (accuracy of depths in [0.25, 0.75) minus that of the others);
    middle_over_ends (their ratio, nan when the ends accuracy is 0).
    """
    scores, bins = np.asarray(scores, dtype=np.float64), np.asarray(bins, dtype=np.int64)
    if scores.shape != bins.shape or scores.shape != np.shape(depths) or scores.ndim != 1 or scores.size == 0:
        raise ValueError(f"need equal non-empty 1-D scores, bins and depths, got shapes {scores.shape}, "
                         f"{bins.shape}, {np.shape(depths)}")
    idx = np.arange(scores.size)[None]  # the sample itself as the one "resample"
    metrics, _ = resampled_metrics(scores[None], bins, middle_of(np.asarray(depths)), idx, int(bins.max()) + 1,
                                   score)
    return {name: float(values[0, 0]) for name, values in metrics.items()}
