"""analysis.stats: hand-computed cases, and coverage by simulation (data with a known answer, 400 replicates:
each 95% interval covers the truth within ±3 points of nominal)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from analysis import stats
from analysis.stats import Score, Seeds

REPLICATES = 400
CROSSED_REPLICATES = 800  # three intervals a case, 15 checks in all: at 800 the ±3 points are ~4 standard errors
NOMINAL = 0.95
TOLERANCE = 0.03


def covers(intervals: list[stats.Interval], truth: float) -> float:
    return float(np.mean([iv.low <= truth <= iv.high for iv in intervals]))


# ---------------------------------------------------------------------------------------------- hand cases


def test_mean_interval_draws_whole_questions_and_counts_nonfinite():
    scores = [1.0, 1.0, 0.0, 0.0, np.nan]
    clusters = ["q1", "q1", "q2", "q2", "q3"]
    iv = stats.mean_interval(scores, clusters, n_boot=4000)
    assert iv.value == 0.5 and iv.n == 2 and iv.nonfinite == 1
    # two questions of means 1 and 0: a resample's mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4
    assert (iv.low, iv.high) == (0.0, 1.0)
    assert "2 questions" in iv.method


def test_mean_interval_is_the_same_for_the_same_data():
    x = np.random.default_rng(3).random(50)
    assert stats.mean_interval(x) == stats.mean_interval(x)


def test_pair_by_id_pairs_by_id_not_text_and_refuses_duplicates():
    a = [{"id": "x@0", "query": "same", "correct": 1.0}, {"id": "y@0", "query": "same", "correct": 0.0}]
    b = [{"id": "y@0", "query": "same", "correct": 1.0}, {"id": "x@0", "query": "same", "correct": 1.0}]
    ids, x, y = stats.pair_by_id(a, b)
    assert ids == ["x@0", "y@0"] and x.tolist() == [1.0, 0.0] and y.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="fileB.*'x@0' occurs more than once"):
        stats.pair_by_id(a, b + [b[1]], where=("fileA", "fileB"))
    ids, x, _ = stats.pair_by_id(a, b, keep=lambda o: o["id"].startswith("x"))
    assert ids == ["x@0"]


def test_cluster_of():
    assert stats.cluster_of("mdqa-3@4") == "mdqa-3"
    assert stats.cluster_of("needle-1-512@2") == "needle-1-512"
    assert stats.cluster_of("test-17") == "test-17"


def test_linear_statistics_by_hand():
    y = np.array([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])  # (seeds, questions)
    assert stats.mean_of(4).of(y).tolist() == [0.75, 0.25]
    mid_minus_ends = stats.contrast(np.array([True, True, False, False]))
    assert mid_minus_ends.of(y).tolist() == [0.5 - 1.0, 0.0 - 0.5]


def test_crossed_interval_by_hand_one_arm_two_seeds():
    """y (1 arm, 2 seeds, 3 questions): Vs = var(seed means)/S, Vq = var(question means)/Q, Ve = MS_E/(SQ);
    an arm's own value adds the seed effect Vs - Ve (truncated at 0) to Vq."""
    y = np.array([[[1.0, 2.0, 6.0], [6.0, 5.0, 9.0]]])
    seed_means, q_means = np.array([3.0, 20 / 3]), np.array([3.5, 3.5, 7.5])
    resid = y[0] - seed_means[:, None] - q_means[None] + y.mean()
    vs = seed_means.var(ddof=1) / 2  # one arm: within spread over S - 1 = 1 df
    vq = q_means.var(ddof=1) / 3
    ve = (resid ** 2).sum() / ((2 - 1) * (3 - 1)) / (2 * 3)
    assert vs > ve
    v = vs - ve + vq
    df = v * v / (vs * vs / 1 + vq * vq / 2 + ve * ve / 2)
    half = scipy_stats.t.ppf(0.975, df) * math.sqrt(v)
    iv = stats.crossed_interval(y, stats.mean_of(3), arm=0, seeds=Seeds.independent)
    assert iv.value == pytest.approx(y.mean())
    assert iv.df == pytest.approx(df)
    assert (iv.low, iv.high) == pytest.approx((y.mean() - half, y.mean() + half))


def test_crossed_interval_with_one_seed_says_training_randomness_is_out():
    y = np.random.default_rng(0).random((2, 1, 20))
    iv = stats.crossed_interval(y, stats.mean_of(20), arm=1, reference=0)
    d = y[1, 0] - y[0, 0]
    half = scipy_stats.t.ppf(0.975, 19) * d.std(ddof=1) / math.sqrt(20)
    assert (iv.low, iv.high) == pytest.approx((d.mean() - half, d.mean() + half))
    assert "training randomness not included" in iv.method and iv.df == pytest.approx(19)


def test_crossed_interval_refuses_nonfinite_scores():
    y = np.zeros((2, 2, 5))
    y[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="1 non-finite"):
        stats.crossed_interval(y, stats.mean_of(5), arm=1, reference=0)


def test_per_seed_interval_pools_the_interaction_over_arms():
    per_seed = np.array([[0.18, 0.16], [0.167, 0.16], [0.17, 0.167]])
    resid = per_seed - per_seed.mean(axis=1, keepdims=True) - per_seed.mean(axis=0) + per_seed.mean()
    ms = (resid ** 2).sum() / 2  # (A - 1)(S - 1) = 2 df
    iv = stats.per_seed_interval(per_seed, arm=2, reference=0)
    half = scipy_stats.t.ppf(0.975, 2) * math.sqrt(2 * ms / 2)
    assert iv.df == 2 and iv.value == pytest.approx(0.1685 - 0.17)
    assert iv.half_width == pytest.approx(half)


def test_extremes_follow_the_score_direction():
    by_bin = np.array([0.2, 0.5, 0.4])
    assert stats.extreme(by_bin, "worst_bin") == 0.2
    assert stats.extreme(by_bin, "worst_bin", Score("nll", higher_is_better=False, rate=False)) == 0.5
    assert stats.extreme(by_bin, "gap") == pytest.approx(0.3)


def test_permutation_correlation_is_exact_for_six_units():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    y = [0.1, 0.3, 0.2, 0.5, 0.4, 0.6]
    r = stats.permutation_correlation(x, y)
    rhos = [stats.spearman_rho(x, [y[i] for i in order]) for order in itertools.permutations(range(6))]
    assert r.exact and r.permutations == 720
    assert r.p_value == pytest.approx(np.mean(np.abs(rhos) >= abs(r.rho) - 1e-12))
    assert r.rho == pytest.approx(scipy_stats.spearmanr(x, y).statistic)


def test_ranks_do_not_split_a_tie_made_by_rounding():
    a = 0.1 + 0.2  # 0.30000000000000004
    assert stats.spearman_rho([a, 0.3, 0.5], [1.0, 2.0, 3.0]) == pytest.approx(
        scipy_stats.spearmanr([0.3, 0.3, 0.5], [1.0, 2.0, 3.0]).statistic)


def test_holm():
    assert stats.holm([0.01, 0.04, 0.03, np.nan]) == pytest.approx([0.03, 0.06, 0.06, np.nan], nan_ok=True)


# ---------------------------------------------------------------------------------------------- coverage


def _clustered_binary(rng, n_questions, base):
    """0/1 scores of questions asked at every position: (Q, P), success rate base[p] + the question's own
    difficulty (±0.25, each half the time: mean 0), so the truth is mean(base)."""
    difficulty = rng.choice([-0.25, 0.25], size=(n_questions, 1))
    return (rng.random((n_questions, len(base))) < np.asarray(base) + difficulty).astype(float)


def test_mean_interval_covers_over_questions_asked_at_several_positions():
    rng = np.random.default_rng(1)
    base, n_q = [0.3, 0.4, 0.6], 80
    clusters = np.repeat(np.arange(n_q), 3)
    with_clusters, items_only = [], []
    for r in range(REPLICATES):
        y = _clustered_binary(rng, n_q, base).ravel()
        with_clusters.append(stats.mean_interval(y, clusters, n_boot=1000, seed=r))
        items_only.append(stats.mean_interval(y, n_boot=1000, seed=r))
    assert abs(covers(with_clusters, np.mean(base)) - NOMINAL) <= TOLERANCE
    # the items of one question share its difficulty: treating them as independent covers too rarely
    assert covers(items_only, np.mean(base)) < NOMINAL - TOLERANCE


def test_paired_interval_covers_a_continuous_difference():
    """Log-likelihood-like scores: a question's level shared by both runs and its positions, Δ = -0.7 nats."""
    rng = np.random.default_rng(2)
    n_q, positions, delta = 60, 3, -0.7
    clusters = np.repeat(np.arange(n_q), positions)
    intervals = []
    for r in range(REPLICATES):
        level = rng.normal(-10, 3, size=(n_q, 1)) + np.array([0.0, -1.0, 1.0])  # (Q, P)
        shift = rng.normal(0, 1.0, size=(n_q, 1))  # the fine-tune moves each question by its own amount
        before = level + rng.normal(0, 1, size=level.shape)
        after = level + delta + shift + rng.normal(0, 1, size=level.shape)
        intervals.append(stats.paired_interval(after.ravel(), before.ravel(), clusters, n_boot=1000, seed=r))
    assert abs(covers(intervals, delta) - NOMINAL) <= TOLERANCE


def _study(rng, n_arms, n_seeds, n_q, mu, shared_sd, own_sd, binary):
    """y (A, S, Q): arm effect mu[a] + question difficulty + the arm's question-specific response + a seed
    effect shared by all arms + an arm x seed effect + noise; 0/1 draws at that rate, or the value itself."""
    question = rng.uniform(-0.15, 0.15, size=n_q) if binary else rng.normal(0, 2, size=n_q)
    arm_question = rng.uniform(-0.05, 0.05, size=(n_arms, 1, n_q)) if binary else rng.normal(0, 0.5, (n_arms, 1, n_q))
    seed = rng.normal(0, shared_sd, size=(1, n_seeds, 1))
    arm_seed = rng.normal(0, own_sd, size=(n_arms, n_seeds, 1))
    level = np.asarray(mu)[:, None, None] + question + arm_question + seed + arm_seed
    if binary:
        return (rng.random(level.shape) < level).astype(float)
    return level + rng.normal(0, 1.0, size=level.shape)


CROSSED_CASES = {
    # name: (seeds, shared seed sd, own seed sd, binary, analysed as)
    "0/1, 1 seed": (1, 0.0, 0.0, True, Seeds.shared),
    "0/1, 2 seeds, shared effect": (2, 0.04, 0.015, True, Seeds.shared),
    "0/1, 3 seeds, independent effect": (3, 0.0, 0.03, True, Seeds.independent),
    "continuous, 2 seeds, shared effect": (2, 0.8, 0.3, False, Seeds.shared),
    "continuous, 3 seeds, independent effect": (3, 0.0, 0.5, False, Seeds.independent),
}


@pytest.mark.parametrize("case", list(CROSSED_CASES))
def test_crossed_interval_covers_differences_and_levels(case):
    n_seeds, shared_sd, own_sd, binary, seeds = CROSSED_CASES[case]
    rng = np.random.default_rng(list(CROSSED_CASES).index(case))
    mu = [0.35, 0.40, 0.30, 0.45] if binary else [-10.0, -9.5, -10.5, -9.0]
    n_q = 120
    groups = np.arange(n_q) % 2 == 0  # a fixed middle/ends split (the truth of middle - ends is 0)
    diffs, levels, contrasts = [], [], []
    for _ in range(CROSSED_REPLICATES):
        y = _study(rng, 4, n_seeds, n_q, mu, shared_sd, own_sd, binary)
        diffs.append(stats.crossed_interval(y, stats.mean_of(n_q), arm=1, reference=0, seeds=seeds))
        levels.append(stats.crossed_interval(y, stats.mean_of(n_q), arm=2, seeds=seeds))
        contrasts.append(stats.crossed_interval(y, stats.contrast(groups), arm=3, reference=0, seeds=seeds))
    for intervals, truth in ((diffs, mu[1] - mu[0]), (levels, mu[2]), (contrasts, 0.0)):
        assert abs(covers(intervals, truth) - NOMINAL) <= TOLERANCE, (case, intervals[0].method,
                                                                      covers(intervals, truth))


def test_ignoring_a_shared_seed_effect_in_a_level_covers_too_rarely():
    """The reason the seed part exists: with 2 seeds and a seed effect, questions alone are too narrow."""
    rng = np.random.default_rng(5)
    levels = []
    for _ in range(REPLICATES):
        y = _study(rng, 4, 2, 120, [0.35, 0.4, 0.3, 0.45], 0.04, 0.015, True)
        levels.append(stats.crossed_interval(y[:, :1], stats.mean_of(120), arm=2))  # one seed seen
    assert covers(levels, 0.3) < NOMINAL - 0.1


# ---------------------------------------------------------------------------------------------- extremes


def test_permutation_test_of_the_worst_bin_holds_its_level():
    rng = np.random.default_rng(7)
    bins = np.repeat(np.arange(5), 30)
    rates = np.array([0.1, 0.25, 0.2, 0.3, 0.25])
    ref = (rng.random((REPLICATES, 2, 150)) < rates[bins]).mean(axis=1)
    arm = (rng.random((REPLICATES, 2, 150)) < rates[bins]).mean(axis=1)
    _, p = stats.extreme_permutation_test(arm, ref, bins, n_perm=200)
    assert abs((p <= 0.05).mean() - 0.05) <= TOLERANCE


def test_worst_bin_mde_is_detected_at_the_stated_power():
    bins = np.repeat(np.arange(5), 30)
    rates = np.array([0.06, 0.26, 0.06, 0.21, 0.23])  # the SmolLM2 study's plain arm
    mde = stats.worst_bin_mde(rates, bins, n_seeds=2, n_sim=400, n_perm=200)
    assert math.isinf(mde) or 0 < mde < 1
    # two dips: lifting one leaves the other as the worst bin, so no lift is detectable
    assert math.isinf(mde)
    rates = np.array([0.06, 0.30, 0.35, 0.40, 0.45])
    mde = stats.worst_bin_mde(rates, bins, n_seeds=2, n_sim=400, n_perm=200)
    assert 0.05 < mde < 0.24
    fresh = stats.worst_bin_power(rates, bins, 2, mde, n_sim=1000, n_perm=200, seed=123)
    assert abs(fresh - stats.POWER) <= 0.05
