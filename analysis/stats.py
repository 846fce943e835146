"""Every interval, test and power figure the project reports, in one place (what each resamples: docs/STATISTICS.md).

Units. A *question* is the cluster: kv and mdqa ask one question at several gold positions, so the items
`q@0`, `q@4`, `q@9` are not independent, and every resampling draws whole questions (`cluster_of`). A
*seed* is a training run; in a study every arm trains each seed with the same initialisation and data order
(train.py seeds both globally), so seed k is one draw shared by every arm (`Seeds.shared`).

Intervals.
- `mean_interval` / `paired_interval`: one run's per-item scores (any score: 0/1 accuracy, word recall,
  log-likelihood in nats), percentile bootstrap over questions (`N_BOOT` resamples, `RNG_SEED`).
- `crossed_interval`: a study's arms x seeds x questions, for statistics linear in the scores (a mean, a
  bin's mean, middle minus ends): variance components of the crossed design, the seed part pooled over
  arms, t quantiles with Satterthwaite degrees of freedom (reported as `df`).
- Extremes over bins (worst bin, gap) get no interval: a minimum of noisy bin means is biased and its
  bootstrap intervals do not cover (issue 40's simulation: 22-67% for a nominal 95%). They get an exact
  paired permutation test (`extreme_permutation_test`) and a minimum detectable effect found by simulating
  that same test (`worst_bin_mde`).
- `permutation_correlation`: Spearman rho over independent units (arms), exact permutation p-value.

Non-finite scores are never dropped silently: every result counts them (`nonfinite`).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

N_BOOT = 2000  # bootstrap resamples of every interval
ALPHA = 0.05  # two-sided: 95% intervals, tests at 5%
RNG_SEED = 0  # every resampling starts from this seed: the same data give the same interval
POWER = 0.8  # the probability with which a minimum detectable effect is detected
N_PERM = 2000  # random permutations of a test whose exact distribution is too large to enumerate
EXACT_PERMUTATIONS = 40320  # 8!: up to this many, a permutation test enumerates them all
RANK_DECIMALS = 12  # values are rounded before ranking, so rounding noise cannot break a tie
CHUNK = 256  # resamples processed at once


class Seeds(StrEnum):
    """How the seeds of different arms relate."""

    shared = "shared"  # seed k of every arm starts from the same init and data order: paired across arms
    independent = "independent"  # each arm's seeds are their own draws


@dataclass(frozen=True)
class Score:
    """A per-item score field of eval outcomes and which way is better."""

    field: str = "correct"
    higher_is_better: bool = True
    rate: bool = True  # a share in [0, 1] (accuracy, recall): ratios and a 0-1 axis make sense
    label: str = "accuracy"  # what a figure's axis calls it


ACCURACY = Score()


@dataclass(frozen=True)
class Interval:
    """A point value with its 1 - ALPHA interval, how it was made, and what it rests on."""

    value: float
    low: float
    high: float
    n: int  # independent units behind it (questions; for a crossed interval questions, seeds in `method`)
    method: str
    df: float | None = None  # degrees of freedom of a t interval; None for a bootstrap percentile interval
    nonfinite: int = 0  # non-finite scores left out (counted, never silently)

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (meaningful for a difference)."""
        return bool(self.low > 0 or self.high < 0)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "resolved": self.resolved}


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan, 0, "no units")


# ---------------------------------------------------------------------------------------------- units


def cluster_of(item_id: str) -> str:
    """The question an item belongs to: the id before its last `@` (`mdqa-3@4` -> `mdqa-3`; an IN2 id, asked
    at one position, is its own question)."""
    return str(item_id).rsplit("@", 1)[0]


def finite_only(values: np.ndarray) -> tuple[np.ndarray, int]:
    """The finite entries of `values` and how many were not."""
    values = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(values)
    return values[keep], int(values.size - keep.sum())


def percentile(samples: np.ndarray, alpha: float = ALPHA) -> tuple[float, float]:
    """The two-sided percentile interval of the finite samples ((nan, nan) without any)."""
    finite, _ = finite_only(samples)
    if finite.size == 0:
        return math.nan, math.nan
    low, high = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def resample_indices(n_units: int, n_boot: int = N_BOOT, seed: int = RNG_SEED) -> np.ndarray:
    """(n_boot, n_units) unit indices drawn with replacement: the one stream every bootstrap here uses."""
    return np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))


# ---------------------------------------------------------------------------------------------- one run


def _cluster_codes(n: int, clusters: Sequence[Any] | None) -> np.ndarray:
    if clusters is None:
        return np.arange(n)
    if len(clusters) != n:
        raise ValueError(f"{len(clusters)} cluster labels for {n} scores")
    return np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)[1]


def mean_interval(
    scores: Sequence[float], clusters: Sequence[Any] | None = None, n_boot: int = N_BOOT, alpha: float = ALPHA,
    seed: int = RNG_SEED,
) -> Interval:
    """Mean of per-item scores with its percentile bootstrap interval, drawing whole clusters (questions) with
    replacement; without `clusters` each item is its own. Non-finite scores are left out and counted."""
    x = np.asarray(scores, dtype=np.float64)
    codes = _cluster_codes(x.size, clusters)
    keep = np.isfinite(x)
    nonfinite = int(x.size - keep.sum())
    x, codes = x[keep], codes[keep]
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "cluster bootstrap", nonfinite=nonfinite)
    codes = np.unique(codes, return_inverse=True)[1]
    n_clusters = int(codes.max()) + 1
    sums = np.bincount(codes, weights=x, minlength=n_clusters)
    counts = np.bincount(codes, minlength=n_clusters).astype(np.float64)
    draws = resample_indices(n_clusters, n_boot, seed)  # (n_boot, C)
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    unit = "question" if n_clusters < x.size else "item"
    return Interval(float(x.mean()), *percentile(means, alpha), n_clusters,
                    f"percentile bootstrap over {n_clusters} {unit}s, {n_boot} resamples", nonfinite=nonfinite)


def pair_by_id(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], score: Score = ACCURACY,
    keep: Callable[[Mapping[str, Any]], bool] = lambda o: True, where: tuple[str, str] = ("a", "b"),
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Item ids both lists of outcomes hold (among those `keep` accepts), sorted, and their scores in each.

    Pairing is by `id`, never by query text (two items may ask the same text); an id that occurs twice in
    one list raises ValueError naming `where` (e.g. the file)."""
    def by_id(outcomes: Sequence[Mapping[str, Any]], name: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for o in outcomes:
            if not keep(o):
                continue
            key = str(o["id"])
            if key in found:
                raise ValueError(f"{name}: item id {key!r} occurs more than once; pairing needs each once")
            found[key] = float(o[score.field])
        return found

    first, second = by_id(a, where[0]), by_id(b, where[1])
    ids = sorted(first.keys() & second.keys())
    return ids, np.array([first[i] for i in ids]), np.array([second[i] for i in ids])


def paired_interval(
    a: Sequence[float], b: Sequence[float], clusters: Sequence[Any] | None = None, n_boot: int = N_BOOT,
    alpha: float = ALPHA, seed: int = RNG_SEED,
) -> Interval:
    """mean(a - b) of items answered in both (a[i], b[i] the same item), drawing whole questions: the
    question-difficulty variance shared by both cancels; a question's positions stay together."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need equal shapes, got {a.shape} and {b.shape}")
    return mean_interval(a - b, clusters, n_boot, alpha, seed)


# ---------------------------------------------------------------------------------------------- a study


@dataclass(frozen=True)
class Linear:
    """A statistic linear in per-question scores: sum_g coef[g] x (mean over the questions of stratum g).

    `strata` (Q,) gives each question's stratum 0..G-1, or -1 to leave it out: the mean is one stratum with
    coefficient 1, a depth bin's mean the same over its questions, middle minus ends two strata (+1, -1)."""

    strata: np.ndarray
    coef: tuple[float, ...]

    def of(self, y: np.ndarray) -> np.ndarray:
        """The statistic of each row of y (..., Q)."""
        y = np.asarray(y, dtype=np.float64)
        out = np.zeros(y.shape[:-1])
        for g, c in enumerate(self.coef):
            out = out + c * y[..., self.strata == g].mean(axis=-1)
        return out


def mean_of(n_questions: int) -> Linear:
    return Linear(np.zeros(n_questions, dtype=np.int64), (1.0,))


def contrast(groups: np.ndarray) -> Linear:
    """Mean of the questions where `groups` is True minus the mean of the others (e.g. middle minus ends)."""
    return Linear(np.where(np.asarray(groups, dtype=bool), 0, 1), (1.0, -1.0))


def linear_interval(
    scores: Sequence[float], stat: Linear, n_boot: int = N_BOOT, alpha: float = ALPHA, seed: int = RNG_SEED
) -> Interval:
    """A linear statistic of one run's per-item scores (or of paired differences, item by item) with its
    percentile bootstrap, items drawn with replacement within their stratum, so every stratum keeps its size:
    a mean of bin means (VaLProbing's Avg: a bin of a set each stratum) weighs its bins as the statistic does.
    Items are the units: each asked once (no question at several positions). Non-finite scores are left out
    and counted; a stratum left empty makes the value nan."""
    x = np.asarray(scores, dtype=np.float64)
    strata = np.asarray(stat.strata)
    if strata.shape != x.shape:
        raise ValueError(f"{strata.size} strata for {x.size} scores")
    keep = np.isfinite(x)
    nonfinite = int(x.size - keep.sum())
    x, strata = x[keep], strata[keep]
    counts = np.bincount(strata[strata >= 0], minlength=len(stat.coef))
    if (counts[: len(stat.coef)] == 0).any():
        return Interval(math.nan, math.nan, math.nan, int(x.size), "stratified bootstrap: an empty stratum",
                        nonfinite=nonfinite)
    rng = np.random.default_rng(seed)
    value, samples = 0.0, np.zeros(n_boot)
    for g, c in enumerate(stat.coef):
        members = x[strata == g]
        value += c * members.mean()
        samples += c * members[rng.integers(0, members.size, size=(n_boot, members.size))].mean(axis=1)
    n = int((strata >= 0).sum())
    return Interval(float(value), *percentile(samples, alpha), n,
                    f"percentile bootstrap over {n} items within {len(stat.coef)} strata, {n_boot} resamples",
                    nonfinite=nonfinite)


def _components(D: np.ndarray, stat: Linear) -> tuple[float, float, float, float, float]:
    """Question and residual variance parts of a linear statistic of the (S, Q) table D: (Vq, df_q, Ve, df_e,
    the point value). Vq: the spread of the questions' seed means within each stratum; Ve: the seed x question
    residual that Vq and a seed part both carry once (subtracted once by the caller)."""
    S = D.shape[0]
    vq = ve = 0.0
    dq_terms, de_terms = [], []
    for g, c in enumerate(stat.coef):
        block = D[:, stat.strata == g]  # (S, n_g)
        n_g = block.shape[1]
        if n_g < 2:
            raise ValueError(f"stratum {g} has {n_g} question(s); a variance needs at least 2")
        q_means = block.mean(axis=0)
        a = c * c * q_means.var(ddof=1) / n_g
        vq += a
        dq_terms.append((a, n_g - 1))
        if S > 1:
            resid = block - block.mean(axis=1, keepdims=True) - q_means + block.mean()
            ms_e = float((resid ** 2).sum() / ((S - 1) * (n_g - 1)))
            e = c * c * ms_e / (S * n_g)
            ve += e
            de_terms.append((e, (S - 1) * (n_g - 1)))
    df_q = _satterthwaite(dq_terms)
    df_e = _satterthwaite(de_terms) if de_terms else math.inf
    return vq, df_q, ve, df_e, float(stat.of(D.mean(axis=0)))


def _satterthwaite_of(total: float, terms: Sequence[tuple[float, float]]) -> float:
    """Degrees of freedom of a variance estimate `total` built from estimates (value, df) (Welch-Satterthwaite)."""
    denom = sum(v * v / df for v, df in terms if df > 0 and math.isfinite(df))
    return total * total / denom if denom > 0 else math.inf


def _satterthwaite(terms: Sequence[tuple[float, float]]) -> float:
    """Degrees of freedom of a sum of variance estimates (value, df)."""
    return _satterthwaite_of(sum(abs(v) for v, _ in terms), terms)


def _seed_part(per_seed: np.ndarray, arm: int, reference: int | None, seeds: Seeds) -> tuple[float, float]:
    """The seed part of the variance of an arm's statistic (reference None) or of its difference to
    `reference`, pooled over arms: (variance, df). per_seed (A, S) is the statistic of each arm and seed."""
    A, S = per_seed.shape
    within = per_seed - per_seed.mean(axis=1, keepdims=True)
    pooled_within, df_within = float((within ** 2).sum() / (A * (S - 1))), A * (S - 1)
    if seeds is Seeds.independent or A == 1:
        return (pooled_within if reference is None else 2 * pooled_within) / S, df_within
    resid = within - per_seed.mean(axis=0) + per_seed.mean()  # arm x seed interaction
    ms_int, df_int = float((resid ** 2).sum() / ((A - 1) * (S - 1))), (A - 1) * (S - 1)
    if reference is not None:  # the shared seed effect cancels in a difference
        return 2 * ms_int / S, df_int
    # An arm's own value carries the shared seed effect too: every arm's deviations move together, so the
    # within-arm spread pooled over arms would claim A(S-1) df it does not have. Var of one seed's value =
    # var(seed means over arms) + (1 - 1/A) x interaction. The seed means carry S - 1 df, and Satterthwaite's
    # blend with the interaction's claims more than that when the shared effect dominates (simulated coverage
    # 0.90 at 2 seeds): take S - 1.
    seed_means = per_seed.mean(axis=0)  # (S,)
    return (float(seed_means.var(ddof=1)) + (1 - 1 / A) * ms_int) / S, S - 1


def crossed_interval(
    y: np.ndarray, stat: Linear, arm: int, reference: int | None = None, seeds: Seeds = Seeds.shared,
    alpha: float = ALPHA,
) -> Interval:
    """A linear statistic of arm `arm` (reference None) or its difference to arm `reference`, with a t interval
    for a crossed arms x seeds x questions design: y (A, S, Q) the score of every arm, seed and question.

    Variance (random questions and seeds, fixed arms): Vs + Vq - Ve. Vs: the seed part from the per-seed
    statistics, pooled over all arms (an arm's own value: within-arm spread, A(S-1) df; a difference with
    shared seeds: the arm x seed interaction, (A-1)(S-1) df; with independent seeds: 2x the within-arm
    spread). Vq: the spread of questions (of the arm difference, for a difference: paired, shared difficulty
    cancels), within strata. Ve: the seed x question residual, which Vs and Vq both carry. Degrees of
    freedom: Satterthwaite. With one seed, Vs and Ve are 0: the interval holds the questions only, and
    `method` says that training randomness is not in it. Non-finite scores raise (count and drop them first).
    """
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 3:
        raise ValueError(f"y must be (arms, seeds, questions), got shape {y.shape}")
    if not np.isfinite(y).all():
        raise ValueError(f"{int((~np.isfinite(y)).sum())} non-finite scores; count and leave them out first")
    A, S, _ = y.shape
    D = y[arm] - y[reference] if reference is not None else y[arm]  # (S, Q)
    vq, df_q, ve, df_e, value = _components(D, stat)
    if S == 1:
        vs, df_s, v, df = 0.0, math.inf, vq, df_q
        method = f"t({df_q:.0f}) over questions; 1 seed: training randomness not included"
    else:
        vs, df_s = _seed_part(stat.of(y), arm, reference, seeds)
        if reference is not None:
            v = vs + vq - ve
            if v <= 0:  # an estimate of a sum of variances can fall below 0 by chance: keep the larger part
                v = max(vs, vq)
            # Satterthwaite's df, but never below the seed part's: with Ve subtracted, a seed part small by
            # chance would otherwise shrink the df and widen the interval (over-covering).
            df = max(_satterthwaite_of(v, ((vs, df_s), (vq, df_q), (ve, df_e))), df_s)
        else:
            # An arm's own value: the seed effect (Vs - Ve) truncated at 0, as a mixed model's variance component
            # is; with none left, the questions' df stand alone (simulated coverage: tests/test_stats.py).
            seed_effect = max(vs - ve, 0.0)
            v = seed_effect + vq
            df = _satterthwaite_of(v, ((vs, df_s), (vq, df_q), (ve, df_e)) if seed_effect > 0 else ((vq, df_q),))
        pooled = ("interaction" if seeds is Seeds.shared else "within-arm spread") if reference is not None else (
            "seed means" if seeds is Seeds.shared else "within-arm spread")
        method = (f"t({df:.1f}), crossed design: {S} seeds ({seeds.value}, {pooled} pooled over {A} arms, "
                  f"{df_s:.0f} df) x {D.shape[1]} questions")
    half = float(scipy_stats.t.ppf(1 - alpha / 2, df) * math.sqrt(v))
    return Interval(value, value - half, value + half, D.shape[1], method, df)


def per_seed_interval(
    per_seed: np.ndarray, arm: int, reference: int | None = None, seeds: Seeds = Seeds.shared, alpha: float = ALPHA
) -> Interval:
    """From the per-seed statistics (A, S) alone (no per-question scores kept): the seed part of
    `crossed_interval`, conditional on the questions asked (question sampling not included)."""
    per_seed = np.asarray(per_seed, dtype=np.float64)
    A, S = per_seed.shape
    if S < 2:
        raise ValueError("a seed-level interval needs at least 2 seeds an arm")
    v, df = _seed_part(per_seed, arm, reference, seeds)
    value = float(per_seed[arm].mean() - (per_seed[reference].mean() if reference is not None else 0.0))
    half = float(scipy_stats.t.ppf(1 - alpha / 2, df) * math.sqrt(v))
    return Interval(value, value - half, value + half, S,
                    f"t({df:.0f}) over seeds ({seeds.value}, pooled over {A} arms), given these questions", df)


# ---------------------------------------------------------------------------------------------- extremes


def bin_means(scores: np.ndarray, bins: np.ndarray, n_bins: int) -> np.ndarray:
    """(..., B) mean score of each bin of the last axis (nan for an empty bin)."""
    scores = np.asarray(scores, dtype=np.float64)
    onehot = (np.asarray(bins)[:, None] == np.arange(n_bins)).astype(np.float64)  # (Q, B)
    counts = onehot.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (scores @ onehot) / counts


def extreme(by_bin: np.ndarray, name: str, score: Score = ACCURACY) -> np.ndarray:
    """`worst_bin` (the lowest bin, or the highest when lower is better) or `gap` (best minus worst, >= 0) of
    bin means (..., B), empty bins left out."""
    worst = np.nanmin(by_bin, axis=-1) if score.higher_is_better else np.nanmax(by_bin, axis=-1)
    if name == "worst_bin":
        return worst
    if name == "gap":
        return np.nanmax(by_bin, axis=-1) - np.nanmin(by_bin, axis=-1)
    raise ValueError(f"unknown extreme {name!r}: worst_bin or gap")


def extreme_permutation_test(
    arm: np.ndarray, reference: np.ndarray, bins: np.ndarray, name: str = "worst_bin", score: Score = ACCURACY,
    n_perm: int = N_PERM, seed: int = RNG_SEED,
) -> tuple[float, float]:
    """(arm minus reference difference of an extreme, two-sided p-value) from a paired permutation test.

    arm, reference: (Q,) or (..., Q) per-question scores (seed means) of the two arms. Under the null that the
    two arms answer each question alike, swapping their scores question by question leaves the distribution
    unchanged: the p-value is the share of swaps whose |difference| reaches the observed one (the observed
    arrangement counted, so p > 0). The level is exact whatever the bins' sizes and the extreme's bias."""
    arm, reference = np.asarray(arm, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    n_bins = int(np.max(bins)) + 1
    observed = extreme(bin_means(arm, bins, n_bins), name, score) - extreme(bin_means(reference, bins, n_bins),
                                                                            name, score)
    swap = np.random.default_rng(seed).random((n_perm, arm.shape[-1])) < 0.5  # (P, Q)
    exceed = np.zeros(arm.shape[:-1])
    for start in range(0, n_perm, CHUNK):
        s = swap[start:start + CHUNK]  # (c, Q)
        a = np.where(s, reference[..., None, :], arm[..., None, :])  # (..., c, Q)
        r = np.where(s, arm[..., None, :], reference[..., None, :])
        diff = extreme(bin_means(a, bins, n_bins), name, score) - extreme(bin_means(r, bins, n_bins), name, score)
        exceed = exceed + (np.abs(diff) >= np.abs(observed)[..., None] - 1e-12).sum(axis=-1)
    return observed, (exceed + 1) / (n_perm + 1)


def worst_bin_power(
    rates: np.ndarray, bins: np.ndarray, n_seeds: int, effect: float, n_sim: int = 400, n_perm: int = 200,
    alpha: float = ALPHA, seed: int = RNG_SEED,
) -> float:
    """The share of simulated studies in which `extreme_permutation_test` finds a worst-bin difference at
    level `alpha`, when the reference's questions succeed at their bin's rate `rates` (B,) and the arm lifts
    the reference's worst bin by `effect` (capped at 1), both averaged over `n_seeds` seeds (0/1 scores).
    Common random numbers: the same seed gives a power that rises with `effect` step by step."""
    rates, bins = np.asarray(rates, dtype=np.float64), np.asarray(bins, dtype=np.int64)
    lifted = rates.copy()
    dip = int(np.nanargmin(rates))
    lifted[dip] = min(1.0, lifted[dip] + effect)
    rng = np.random.default_rng(seed)
    u_ref, u_arm = rng.random((2, n_sim, n_seeds, bins.size))
    ref = (u_ref < rates[bins]).mean(axis=1)  # (n_sim, Q)
    arm = (u_arm < lifted[bins]).mean(axis=1)
    _, p = extreme_permutation_test(arm, ref, bins, "worst_bin", ACCURACY, n_perm, seed + 1)
    return float((p <= alpha).mean())


def worst_bin_mde(
    rates: np.ndarray, bins: np.ndarray, n_seeds: int, power: float = POWER, n_sim: int = 400, n_perm: int = 200,
    alpha: float = ALPHA, seed: int = RNG_SEED, tolerance: float = 0.005,
) -> float:
    """The smallest lift of the reference's worst bin that the paired permutation test detects with
    probability `power` (simulated by `worst_bin_power`, bisection to `tolerance`); inf when no lift does (a
    worst bin can only rise to the second-worst: past that the arm's worst bin is another bin)."""
    low, high = 0.0, 1.0 - float(np.nanmin(rates))
    if worst_bin_power(rates, bins, n_seeds, high, n_sim, n_perm, alpha, seed) < power:
        return math.inf
    while high - low > tolerance:
        mid = (low + high) / 2
        if worst_bin_power(rates, bins, n_seeds, mid, n_sim, n_perm, alpha, seed) >= power:
            high = mid
        else:
            low = mid
    return high


# ---------------------------------------------------------------------------------------------- correlation


@dataclass(frozen=True)
class Correlation:
    """Spearman rho over independent units, with its permutation p-value."""

    rho: float
    p_value: float
    n_units: int
    permutations: int  # how many orderings the p-value counts (all of them when `exact`)
    exact: bool
    reason: str | None = None  # why there is no rho, None when there is one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ranks(x: np.ndarray) -> np.ndarray:
    return scipy_stats.rankdata(np.round(np.asarray(x, dtype=np.float64), RANK_DECIMALS))


def spearman_rho(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho of paired values (ties share a rank; values are rounded first so that the same number
    computed two ways ranks as one); nan when x or y is constant."""
    rx, ry = _ranks(x), _ranks(y)
    if np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def permutation_correlation(x: Sequence[float], y: Sequence[float], n_perm: int = N_PERM,
                            seed: int = RNG_SEED, min_units: int = 3) -> Correlation:
    """Spearman rho of one value pair per independent unit (e.g. an arm's mean over its seeds), and the
    two-sided p-value of |rho| under every reordering of y (exact up to EXACT_PERMUTATIONS, else `n_perm`
    random ones with the observed counted)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = x.size
    if n < min_units:
        return Correlation(math.nan, math.nan, n, 0, False, f"{n} units, fewer than {min_units}")
    rho = spearman_rho(x, y)
    if math.isnan(rho):
        return Correlation(math.nan, math.nan, n, 0, False, "x or y equal at every unit")
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = (rx - rx.mean()) / np.linalg.norm(rx - rx.mean()), (ry - ry.mean()) / np.linalg.norm(ry - ry.mean())
    if math.factorial(n) <= EXACT_PERMUTATIONS:
        orders = np.array(list(itertools.permutations(range(n))))
        rhos = ry[orders] @ rx
        return Correlation(rho, float((np.abs(rhos) >= abs(rho) - 1e-12).mean()), n, len(orders), True)
    rng = np.random.default_rng(seed)
    rhos = np.stack([rng.permutation(ry) for _ in range(n_perm)]) @ rx
    return Correlation(rho, float(((np.abs(rhos) >= abs(rho) - 1e-12).sum() + 1) / (n_perm + 1)), n, n_perm, False)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error over the tests given; nan stays nan)."""
    p = np.asarray(p_values, dtype=np.float64)
    finite = np.flatnonzero(np.isfinite(p))
    adjusted = np.full(p.shape, np.nan)
    order = finite[np.argsort(p[finite])]
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
