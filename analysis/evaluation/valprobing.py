"""VaLProbing scored as FILM scores it (`VaLProbing/plot.py` of github.com/microsoft/FILM): per-bin means with
their spread over sets, Avg and Gap, and the paired comparison of two models on the same items (the report and its figure:
`analysis.report.valprobing`).

Metrics (`analysis.evaluation.scoring`), on the whole generation (no first-line cut, as FILM):
- document: recall of the gold sentence's words: |gold ∩ answer| / |gold|, both lower-cased and split on
  whitespace (punctuation stays on its word: `models.` is not `models`);
- code: the function's name (stripped of dots at its ends) is a substring of the answer, case-sensitive;
- database: the label or the description (each stripped of dots, lower-cased) is a substring of the lower-cased
  answer.

A bin's value is the mean over sets of each set's mean over the bin's items; its error bar the population
standard deviation (ddof 0) of those set means; Avg the mean of the bins, Gap the best bin minus the worst.
FILM's `plot.py` builds bin i from `range(50 i, 50 i + 49)`, which leaves the last position of every bin out;
here every position counts, and `film_bins=True` reproduces FILM's bins (docs/VALPROBING.md).

Intervals come from `analysis.stats`: Avg is linear in the item scores (a weighted mean of the cells set x bin),
so it and a paired difference of it get `stats.linear_interval`, items drawn within their cell; Gap is an
extreme over bins, which gets no interval but a paired permutation test (`stats.extreme_permutation_test`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from analysis import stats
from analysis.evaluation.result import ProbeResult
from data_builders.valprobing import Task


def task_of(probe: str) -> Task:
    prefix = "valprobing_"
    if not probe.startswith(prefix):
        raise ValueError(f"{probe!r} is not a VaLProbing probe (valprobing_document, valprobing_code, "
                         "valprobing_database)")
    return Task(probe[len(prefix):])


def _cells(outcomes: Sequence[Mapping[str, Any]], film_bins: bool, bin_width: int) -> tuple[np.ndarray, int, int]:
    """(each outcome's cell set x bin, or -1 when FILM's bins leave it out; the sets; the bins)."""
    sets = np.array([o["extra"]["set"] for o in outcomes], dtype=np.int64)
    bins = np.array([o["position"] for o in outcomes], dtype=np.int64)
    n_sets, n_bins = int(sets.max()) + 1, int(bins.max()) + 1
    cells = sets * n_bins + bins
    if film_bins:
        pieces = np.array([o["extra"]["piece"] for o in outcomes], dtype=np.int64)
        cells = np.where(pieces % bin_width == bin_width - 1, -1, cells)
    return cells, n_sets, n_bins


def bin_width_of(result: ProbeResult) -> int:
    """Pieces a bin: the label (first piece) of bin 1, or every piece in one bin."""
    labels = result.labels()
    if 1 in labels:
        return int(labels[1])
    return max(int(o["extra"]["piece"]) for o in result.outcomes) + 1


@dataclass
class Summary:
    """One model's scores on one VaLProbing task."""

    task: str
    labels: list[str]  # each bin's first piece
    by_set: np.ndarray  # (sets, bins) each set's mean over the bin's items
    avg: stats.Interval  # mean of the bin means, with its interval
    n_items: int
    film_bins: bool
    score: stats.Score

    @property
    def by_bin(self) -> np.ndarray:
        return np.nanmean(self.by_set, axis=0)

    @property
    def spread(self) -> np.ndarray:
        """The population standard deviation over sets of each bin (FILM's error bars)."""
        return np.nanstd(self.by_set, axis=0)

    @property
    def gap(self) -> float:
        return float(np.nanmax(self.by_bin) - np.nanmin(self.by_bin))

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "score": self.score.field, "film_bins": self.film_bins, "items": self.n_items,
                "avg": self.avg.as_dict(), "gap": self.gap, "bins": self.labels, "by_bin": self.by_bin.tolist(),
                "spread": self.spread.tolist(), "by_set": self.by_set.tolist()}


def _stat(cells: np.ndarray, n_sets: int, n_bins: int) -> stats.Linear:
    """Avg as a linear statistic: every cell (set, bin) weighs 1 / (sets x bins)."""
    n = n_sets * n_bins
    return stats.Linear(cells, (1.0 / n,) * n)


def summarize(result: ProbeResult, film_bins: bool = False, score: stats.Score = stats.ACCURACY) -> Summary:
    """Per-bin means over sets, their spread, Avg (with `stats.linear_interval`) and Gap of one result."""
    outcomes = result.outcomes
    if not outcomes:
        raise ValueError(f"{result.probe}: no outcomes")
    width = bin_width_of(result)
    cells, n_sets, n_bins = _cells(outcomes, film_bins, width)
    scores = np.array([o[score.field] for o in outcomes], dtype=np.float64)
    by_set = np.full((n_sets, n_bins), np.nan)
    for s in range(n_sets):
        for b in range(n_bins):
            here = scores[cells == s * n_bins + b]
            if here.size:
                by_set[s, b] = here.mean()
    labels = result.labels()
    return Summary(str(task_of(result.probe)), [labels.get(b, str(b * width)) for b in range(n_bins)], by_set,
                   stats.linear_interval(scores, _stat(cells, n_sets, n_bins)), int((cells >= 0).sum()), film_bins,
                   score)


@dataclass
class Comparison:
    """A fine-tune against its base on the same items: Δ Avg with its paired interval, Δ Gap with its paired
    permutation p-value."""

    task: str
    base: Summary
    tuned: Summary
    delta_avg: stats.Interval
    delta_gap: float
    gap_p: float

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "delta_avg": self.delta_avg.as_dict(), "delta_gap": self.delta_gap,
                "gap_p": self.gap_p, "base": self.base.as_dict(), "tuned": self.tuned.as_dict()}


def compare(base: ProbeResult, tuned: ProbeResult, film_bins: bool = False, score: stats.Score = stats.ACCURACY,
            n_perm: int = stats.N_PERM) -> Comparison:
    """`tuned` minus `base` on the items both answered (paired by id): Δ Avg (`stats.linear_interval` of the
    item differences) and Δ Gap (FILM's bins' Gap of each; `stats.extreme_permutation_test`, whose bins weigh
    each item alike: the same as FILM's when no position of a bin was skipped)."""
    if base.probe != tuned.probe:
        raise ValueError(f"compare one probe: got {base.probe} and {tuned.probe}")
    ids, a, b = stats.pair_by_id(tuned.outcomes, base.outcomes, score, where=("the fine-tune", "the base"))
    if not ids:
        raise ValueError(f"{base.probe}: the two results share no item")
    by_id = {o["id"]: o for o in base.outcomes}
    shared = [by_id[i] for i in ids]
    cells, n_sets, n_bins = _cells(shared, film_bins, bin_width_of(base))
    asked = set(ids)
    pair = [ProbeResult(r.probe, [o for o in r.outcomes if o["id"] in asked], r.settings) for r in (base, tuned)]
    s_base, s_tuned = (summarize(r, film_bins, score) for r in pair)
    used = cells >= 0
    bins = np.array([o["position"] for o in shared], dtype=np.int64)
    observed, p = stats.extreme_permutation_test(a[used], b[used], bins[used], "gap", score, n_perm)
    return Comparison(s_base.task, s_base, s_tuned, stats.linear_interval(a - b, _stat(cells, n_sets, n_bins)),
                      s_tuned.gap - s_base.gap, float(p))
