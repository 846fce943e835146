"""Tests of analysis/measure/prior.py: exactness of the O(H·L) Cesàro prior, the residual-aware rollout
properties, the continuous limit, the fits; the CLI (analysis/prior.py) and the benchmark entry point."""

import subprocess
import sys
import warnings
from fractions import Fraction
from math import comb

import mpmath
import numpy as np
import pytest
from scipy.integrate import quad
from scipy.stats import spearmanr

from analysis.measure.prior import (
    FLOOR_REL,
    PriorFit,
    _constant_mixture_weights,
    _mixture_weights,
    alpha_from_gain,
    anchor_mass,
    average_ranks,
    closed_form_exact,
    fit_alpha,
    fit_alpha_w1,
    fit_schedule,
    log10_profile,
    power_schedule,
    prior_density,
    prior_profile,
    recency_weight,
    rollout,
    scaled_prior,
    spearman,
    w1_distance,
)
from analysis.prior import main

EXACT_ALPHAS = [Fraction(1, 20), Fraction(3, 10), Fraction(1, 2), Fraction(9, 10)]


def exact_rows(L, H, a):
    """Rows of N^0 .. N^H at position L by the vector recursion in Fractions (a Fraction or a schedule)."""
    sched = [a] * H if isinstance(a, Fraction) else list(a)
    v = [Fraction(0)] * (L - 1) + [Fraction(1)]
    rows = [v]
    for a_t in reversed(sched):
        s, w = Fraction(0), [None] * L
        for i in range(L - 1, -1, -1):
            s += v[i] / (i + 1)
            w[i] = (1 - a_t) * v[i] + a_t * s
        v = w
        rows.append(v)
    return rows


def mp_profile(L, H, a):
    """The same vector recursion at 50 significant digits."""
    with mpmath.workdps(50):
        a = mpmath.mpf(a)
        v = [mpmath.mpf(0)] * (L - 1) + [mpmath.mpf(1)]
        for _ in range(H):
            s, w = mpmath.mpf(0), [None] * L
            for i in range(L - 1, -1, -1):
                s += v[i] / (i + 1)
                w[i] = (1 - a) * v[i] + a * s
            v = w
        return v


def dense_cesaro(L):
    return np.tril(np.ones((L, L))) / np.arange(1, L + 1)[:, None]


def dense_last_row(mats, lambdas):
    """Last row of N_H ... N_1 by explicit L×L products, map t for layer t (t = 1 first)."""
    L = mats[0].shape[0]
    P = np.eye(L)
    for lam, a in zip(lambdas, mats):
        P = ((1 - lam) * np.eye(L) + lam * a) @ P
    return P[-1]


def cdf(p):
    return np.cumsum(p) / np.sum(p)


def mean_x(p):
    return float(np.sum(p * np.linspace(0, 1, len(p))) / np.sum(p))


# --- exactness -------------------------------------------------------------------------------------


@pytest.mark.parametrize("a", EXACT_ALPHAS, ids=str)
def test_matches_exact_rationals_for_all_small_L_and_H(a):
    for L in range(1, 65):
        for H, exact in enumerate(exact_rows(L, 8, a)):
            got = prior_profile(L, H, float(a))
            want = np.array([float(e) for e in exact])
            assert np.all(np.abs(got - want) <= 1e-12 * want), (L, H)


def test_schedule_matches_exact_rationals():
    sched = [Fraction(1, 10), Fraction(1, 2), Fraction(7, 8), Fraction(1, 3), Fraction(1)]
    exact = np.array([float(e) for e in exact_rows(64, 5, sched)[-1]])
    got = prior_profile(64, 5, [float(a) for a in sched])
    assert np.all(np.abs(got - exact) <= 1e-12 * exact)


@pytest.mark.parametrize("L", [256, 2048])
@pytest.mark.parametrize("a", [0.05, 0.3, 0.5, 0.9])
def test_matches_50_digit_mpmath(L, a):
    ref = mp_profile(L, 24, a)  # ~0.8 s per case at L = 2048
    got = prior_profile(L, 24, a)
    rel = max(abs(mpmath.mpf(float(g)) / r - 1) for g, r in zip(got, ref))
    assert rel <= 1e-12


@pytest.mark.parametrize("L, H, alpha", [
    (1, 5, 0.3), (2, 0, 0.3), (100, 12, 0.05), (2048, 24, 0.9), (131072, 80, 0.3),
    (4096, 6, [0.1, 0.9, 0.5, 1.0, 0.0, 0.3]),
])
def test_profile_sums_to_one(L, H, alpha):
    p = prior_profile(L, H, alpha)
    assert p.dtype == np.float64 and p.shape == (L,)
    assert abs(p.sum() - 1) <= 1e-12


def test_no_dense_matrix_at_huge_L():
    p = prior_profile(1_000_000, 3, 0.3)  # an L×L float64 would need 8 TB
    assert abs(p.sum() - 1) <= 1e-12


def test_alpha_from_gain_matches_unnormalized_layer():
    L, H, a_tilde = 20, 4, 0.5
    assert alpha_from_gain(a_tilde) == pytest.approx(1 / 3)
    row = np.linalg.matrix_power(np.eye(L) + a_tilde * dense_cesaro(L), H)[-1]
    want = prior_profile(L, H, alpha_from_gain(a_tilde))
    np.testing.assert_allclose(row / (1 + a_tilde) ** H, want, rtol=1e-13)


# --- closed form -----------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [Fraction(3, 10), Fraction(9, 10)], ids=str)
def test_closed_form_equals_recursion(a):
    for L in range(1, 41):
        rows = exact_rows(L, 6, a)
        for H in (0, 1, 3, 6):
            assert closed_form_exact(L, H, a) == rows[H], (L, H)


def test_closed_form_schedule_and_cesaro_power():
    sched = [Fraction(1, 4), Fraction(2, 3), Fraction(1)]
    assert closed_form_exact(30, 3, sched) == exact_rows(30, 3, sched)[-1]
    assert closed_form_exact(7, 1, 1) == [Fraction(1, 7)] * 7  # M itself
    assert closed_form_exact(5, 2, "3/10") == exact_rows(5, 2, Fraction(3, 10))[-1]


def test_closed_form_in_float64_cancels_at_L60():
    """Why the closed form is only a cross-check: the same sum in float64 is wrong at L = 60."""
    L, H, a = 60, 8, 0.3
    exact = np.array([float(e) for e in closed_form_exact(L, H, Fraction(a))])
    eig = (1 - a + a / np.arange(1, L + 1)) ** H
    naive = np.array([
        sum((-1) ** (k - j) * float(comb(L - 1, k - 1) * comb(k - 1, j - 1)) * eig[k - 1]
            for k in range(j, L + 1))
        for j in range(1, L + 1)
    ])
    assert np.max(np.abs(naive / exact - 1)) > 1e-2
    assert np.all(np.abs(prior_profile(L, H, a) - exact) <= 1e-12 * exact)


# --- continuous limit ------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [2, 8])
@pytest.mark.parametrize("a", [0.3, 0.7])
def test_density_matches_large_L(H, a):
    # x = j/L as in the design's limit: M^r[L, j] ≈ ln(L/j)^(r-1)/((r-1)! L); off by O(r/j) relatively.
    L = 20_000
    p = prior_profile(L, H, a)
    j = np.arange(1, L + 1)
    band = (j / L >= 0.01) & (j / L <= 0.99)
    np.testing.assert_allclose(L * p[band], prior_density(j[band] / L, H, a), rtol=0.01)
    # The recency delta sits at j = L on top of the smooth part.
    assert p[-1] == pytest.approx(recency_weight(H, a) + prior_density(1.0, H, a) / L, rel=1e-3)


def test_density_closed_form_values_and_mass():
    H, a, x = 3, 0.4, 0.2
    t = np.log(1 / x)
    want = 3 * 0.6**2 * 0.4 + 3 * 0.6 * 0.4**2 * t + 0.4**3 * t**2 / 2
    assert prior_density(x, H, a) == pytest.approx(want, rel=1e-14)
    assert recency_weight(H, a) == pytest.approx(0.6**3, rel=1e-14)
    for H, alpha in [(8, 0.3), (4, [0.2, 0.5, 0.9, 0.0])]:
        mass, _ = quad(lambda y: prior_density(y, H, alpha), 0, 1, limit=200)
        assert mass + recency_weight(H, alpha) == pytest.approx(1, abs=1e-9)
    assert np.all(prior_density([0.5, 1.0], 0, 0.3) == 0) and recency_weight(0, 0.3) == 1


def test_density_schedule_order_free_and_h1_uniform():
    x = np.array([1e-6, 0.1, 0.5, 1.0])
    np.testing.assert_allclose(prior_density(x, 3, [0.3] * 3), prior_density(x, 3, 0.3), rtol=1e-14)
    np.testing.assert_allclose(prior_density(x, 3, [0.1, 0.5, 0.9]), prior_density(x, 3, [0.9, 0.1, 0.5]),
                               rtol=1e-14)
    np.testing.assert_allclose(prior_density(x, 1, 0.25), 0.25, rtol=1e-15)


# --- residual-aware rollout ------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.3, 1.0])
def test_causal_prefix_mass_increases_with_depth(a):
    L = 128
    cdfs = np.array([cdf(prior_profile(L, H, a)) for H in range(13)])
    assert np.all(np.diff(cdfs, axis=0) >= -1e-15)
    for k in (1, 16, 64, 127):
        mass = cdfs[:, k - 1]
        unsaturated = mass[:-1] < 1 - 1e-9  # attention-only rollout reaches 1 to rounding within ~10 layers
        assert np.all(np.diff(mass)[unsaturated] > 0), k


def test_stronger_residual_moves_mass_to_recent():
    L, H = 256, 12
    strong, weak = rollout(L, [0.2] * H), rollout(L, [0.8] * H)
    assert np.all(cdf(strong) <= cdf(weak) + 1e-15)
    assert mean_x(strong) > mean_x(weak)


def test_alibi_slopes_move_mass_to_recent():
    L, lams = 256, [0.5] * 8
    profiles = [rollout(L, lams, "alibi", slopes=s) for s in (0.0, 0.01, 0.1, 1.0)]
    np.testing.assert_allclose(profiles[0], rollout(L, lams), rtol=1e-13)
    for near, far in zip(profiles, profiles[1:]):
        assert np.all(cdf(far) <= cdf(near) + 1e-15)
        assert mean_x(far) > mean_x(near)
    heads = 2.0 ** (-8 * np.arange(1, 9) / 8)  # the ALiBi paper's slopes for 8 heads
    assert mean_x(rollout(L, lams, "alibi", slopes=heads)) > mean_x(profiles[0])


def test_diagonal_content_moves_mass():
    L, lams = 256, [0.6] * 8
    flat = rollout(L, lams)
    np.testing.assert_allclose(rollout(L, lams, "diag", content=0.0), flat, rtol=1e-13)
    pos, neg = rollout(L, lams, "diag", content=2.0), rollout(L, lams, "diag", content=-2.0)
    assert np.all(cdf(pos) <= cdf(flat) + 1e-15) and mean_x(pos) > mean_x(flat)
    assert np.all(cdf(neg) >= cdf(flat) - 1e-15) and mean_x(neg) < mean_x(flat)


def test_attention_only_collapses_but_summable_residual_does_not():
    L = 64
    first = [rollout(L, [1.0] * H)[0] for H in (2, 4, 8, 16)]
    assert np.all(np.diff(first) > 0) and rollout(L, [1.0] * 256)[0] > 1 - 1e-12
    for H in (64, 2000):
        lams = 0.5 / np.arange(1, H + 1) ** 2
        p = rollout(L, lams)
        assert p[-1] >= np.prod(1 - lams) > 0.3  # the identity path alone keeps a third on token L
        assert p[0] < 0.2


def test_structured_steps_match_dense_maps():
    L, lams = 40, [0.3, 1.0, 0.7, 0.5, 0.9]
    i, j = np.indices((L, L)) + 1
    causal = j <= i
    s = 0.3
    alibi = np.where(causal, np.exp(-s * (i - j)), 0.0)
    alibi /= alibi.sum(1, keepdims=True)
    c = 1.5
    diag = np.where(causal, np.exp(c * (i == j)), 0.0)
    diag /= diag.sum(1, keepdims=True)
    cases = [(dense_cesaro(L), {}), (alibi, {"attention": "alibi", "slopes": s}),
             (diag, {"attention": "diag", "content": c})]
    for mat, kw in cases:
        want = dense_last_row([mat] * len(lams), lams)
        np.testing.assert_allclose(rollout(L, lams, **kw), want, rtol=1e-12)
        np.testing.assert_allclose(rollout(L, lams, np.stack([mat] * len(lams))), want, rtol=1e-12)


def test_alibi_and_content_combine_in_one_softmax():
    """Row i: softmax over j <= i of -s (i-j) + c [j == i], averaged over the heads' slopes (float64, dense)."""
    L, lams = 40, [0.3, 1.0, 0.7, 0.5, 0.9]
    i, j = np.indices((L, L)) + 1
    causal = j <= i
    for slopes, c in (([0.3], 1.5), ([0.05, 0.3, 2.0], -2.0), ([0.0, 0.7], 0.8), ([0.3], 0.0)):
        heads = [np.where(causal, np.exp(-s * (i - j) + c * (i == j)), 0.0) for s in slopes]
        mat = np.mean([h / h.sum(1, keepdims=True) for h in heads], axis=0)
        want = dense_last_row([mat] * len(lams), lams)
        np.testing.assert_allclose(rollout(L, lams, "alibi", slopes=slopes, content=c), want, rtol=1e-12)
    # Its special cases: no content is ALiBi, slope 0 is the diagonal-content map.
    np.testing.assert_allclose(rollout(L, lams, "alibi", slopes=0.3, content=0.0), rollout(L, lams, "alibi", slopes=0.3),
                               rtol=1e-12)
    np.testing.assert_allclose(rollout(L, lams, "alibi", slopes=0.0, content=1.5), rollout(L, lams, "diag", content=1.5),
                               rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for slopes, c in (([800.0, 0.0], 800.0), ([800.0], -800.0), ([1e-9], 800.0), ([0.5], -800.0)):
            p = rollout(300, [0.5] * 6, "alibi", slopes=slopes, content=c)
            assert np.all(np.isfinite(p)) and abs(p.sum() - 1) <= 1e-12
    assert rollout(10, [1.0], "alibi", slopes=0.5, content=800.0)[-1] == 1.0  # all weight on the diagonal


def test_measured_maps_follow_layer_order():
    rng = np.random.default_rng(0)
    L, lams = 12, [0.4, 0.9, 0.6]
    maps = [np.tril(rng.random((L, L))) for _ in lams]
    maps = [m / m.sum(1, keepdims=True) for m in maps]
    np.testing.assert_allclose(rollout(L, lams, maps), dense_last_row(maps, lams), rtol=1e-12)
    assert not np.allclose(rollout(L, lams, maps), rollout(L, lams[::-1], maps[::-1]))


def test_extreme_logits_stay_finite_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({"attention": "diag", "content": 800.0}, {"attention": "diag", "content": -800.0},
                   {"attention": "alibi", "slopes": [800.0, 0.0]}):
            p = rollout(300, [0.5] * 6, **kw)
            assert np.all(np.isfinite(p)) and abs(p.sum() - 1) <= 1e-12
    assert rollout(10, [1.0], "diag", content=800.0)[-1] == 1.0  # all weight on the diagonal
    np.testing.assert_allclose(rollout(10, [1.0], "diag", content=-800.0), [1 / 9] * 9 + [0], rtol=1e-15)


@pytest.mark.parametrize("call", [
    lambda: prior_profile(0, 2, 0.3),
    lambda: prior_profile(10, -1, 0.3),
    lambda: prior_profile(10, 2, 1.5),
    lambda: prior_profile(10, 2, -0.1),
    lambda: prior_profile(10, 2, float("nan")),
    lambda: prior_profile(10, 2, [0.3, 0.3, 0.3]),
    lambda: rollout(10, [0.5], slopes=0.1),
    lambda: rollout(10, [0.5], "alibi"),
    lambda: rollout(10, [0.5], "alibi", slopes=-1.0),
    lambda: rollout(10, [0.5], "diag"),
    lambda: rollout(10, [0.5], "uniform"),
    lambda: rollout(10, [0.5], np.ones((1, 9, 9))),
    lambda: rollout(10, [0.5], np.ones((1, 10, 10)), slopes=0.1),
    lambda: rollout(10, [0.5], np.ones((1, 10, 10)), content=1.0),
    lambda: rollout(10, [0.5, 0.5], np.ones((1, 10, 10))),
    lambda: alpha_from_gain(-1.0),
    lambda: prior_density(0.0, 2, 0.3),
    lambda: closed_form_exact(5, 2, Fraction(3, 2)),
    lambda: fit_alpha(np.ones(10), 0),
    lambda: fit_alpha_w1(np.ones(10), 0),
    lambda: fit_alpha_w1(np.ones(1), 2),
    lambda: fit_alpha_w1(np.ones(10), 2, candidates=(1.5,)),
    lambda: anchor_mass(np.zeros(4)),
    lambda: anchor_mass([1.0, -1.0]),
    lambda: anchor_mass(np.ones((2, 2))),
    lambda: fit_schedule(np.ones(10), 3, "linear"),
    lambda: log10_profile([1.0, -1.0]),
    lambda: log10_profile(np.zeros(4)),
])
def test_invalid_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


# --- fits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.05, 0.3, 0.7])
def test_fit_alpha_recovers_alpha_under_lognormal_noise(a):
    L, H, scale = 2048, 24, 10**3.7
    rng = np.random.default_rng(0)
    noisy = scale * prior_profile(L, H, a) * np.exp(0.05 * rng.standard_normal(L))
    fit = fit_alpha(noisy, H)
    assert isinstance(fit, PriorFit)
    assert abs(fit.alpha - a) < 1e-3
    assert fit.log10_scale == pytest.approx(3.7, abs=0.01)
    assert fit.rmse_log10 == pytest.approx(0.05 / np.log(10), rel=0.1)
    assert fit.spearman > 0.9 and fit.w1 < 0.01


def test_fit_alpha_noise_free_and_zeros():
    p = prior_profile(512, 8, 0.42)
    fit = fit_alpha(p, 8)
    assert fit.alpha == pytest.approx(0.42, abs=1e-7)
    assert fit.rmse_log10 < 1e-8 and fit.spearman == pytest.approx(1) and fit.w1 < 1e-9
    p[100] = 0.0  # a zero is clipped to FLOOR_REL * max, not -inf
    assert np.isfinite(fit_alpha(p, 8).rmse_log10)
    assert log10_profile(p)[100] == pytest.approx(np.log10(FLOOR_REL * p.max()))


@pytest.mark.parametrize("L, H", [(256, 4), (2048, 24), (4096, 80)])
def test_fit_alpha_mixture_basis_matches_rollout(L, H):
    """fit_alpha combines cached last rows of M^r; the reference is the rollout of N, one a at a time."""
    from scipy.optimize import minimize_scalar

    from analysis.measure.prior import _cesaro_last_rows, _mixture_weights, _schedule

    for a in (0.0, 0.013, 0.5, 0.97, 1.0):
        combined = _mixture_weights(_schedule(H, a)) @ _cesaro_last_rows(L, H)
        np.testing.assert_allclose(combined, prior_profile(L, H, a), rtol=1e-12, atol=1e-300)
    rng = np.random.default_rng(L + H)
    measured = prior_profile(L, H, 0.31) * np.exp(0.3 * rng.standard_normal(L))
    measured[: L // 8] *= 40.0  # a primacy bump no constant a fits exactly

    def reference_loss(a):
        return np.var(log10_profile(measured) - log10_profile(prior_profile(L, H, a)))

    grid = np.linspace(0.0, 1.0, 33)
    k = int(np.argmin([reference_loss(a) for a in grid]))
    ref = minimize_scalar(reference_loss, bounds=(grid[max(k - 1, 0)], grid[min(k + 1, 32)]),
                          method="bounded", options={"xatol": 1e-10})
    fit = fit_alpha(measured, H)
    assert fit.alpha == pytest.approx(ref.x, abs=1e-8)
    assert fit.rmse_log10 == pytest.approx(np.sqrt(ref.fun), rel=1e-9)


def test_scaled_prior_is_the_fit_alpha_curve_and_its_scale_is_least_squares():
    L, H = 512, 8
    rng = np.random.default_rng(3)
    measured = 10**2.5 * prior_profile(L, H, 0.37) * np.exp(0.2 * rng.standard_normal(L))  # float64
    measured[: L // 10] *= 8.0  # a primacy bump: the fit is not exact

    fit = fit_alpha(measured, H)
    curve, alpha = scaled_prior(measured, H)
    assert curve.dtype == np.float64 and alpha == fit.alpha
    np.testing.assert_allclose(curve, prior_profile(L, H, fit.alpha) * 10**fit.log10_scale, rtol=1e-14, atol=0)

    # With a given a, the scale c minimises sum_j (log10 rho_j - log10 c p_j)^2: the mean residual.
    curve, alpha = scaled_prior(measured, H, 0.6)
    prior = prior_profile(L, H, 0.6)
    assert alpha == 0.6

    def sq_error(log10_c):
        return np.sum((np.log10(measured) - log10_c - np.log10(prior)) ** 2)

    best = np.log10(curve[0] / prior[0])
    assert best == pytest.approx(np.mean(np.log10(measured / prior)), abs=1e-12)
    np.testing.assert_allclose(curve / prior, 10**best, rtol=1e-12)
    assert all(sq_error(best) < sq_error(best + d) for d in (-1e-3, 1e-3))


def w1_spiked_last(L, H):
    """The prior at a = 0.07 with its last token cut from (1 - a + a/L)^H ≈ 17% to 2% of the mass."""
    rho = prior_profile(L, H, 0.07)
    rho[-1] = 0.02 / 0.98 * rho[:-1].sum()
    return rho


def w1_boosted_last(L, H):
    """The prior at a = 0.3 with 20 times its mass on the last token."""
    rho = prior_profile(L, H, 0.3)
    rho[-1] *= 20.0
    return rho


def w1_level_u(L, H):
    """A U in log space, minimum at x = 0.3, both ends 2 decades up."""
    x = np.arange(L) / (L - 1)
    return 10.0 ** (2.0 * np.where(x < 0.3, ((x - 0.3) / 0.3) ** 2, ((x - 0.3) / 0.7) ** 2))


@pytest.mark.parametrize("make", [w1_spiked_last, w1_boosted_last, w1_level_u])
def test_fit_alpha_w1_finds_the_dense_grid_minimum(make):
    """Reference: w1_distance against prior_profile (the O(H·L) rollout, not the cached M^r rows) on a
    2001-point grid of a; the fit must be at least as close, and its a within one grid step."""
    L, H = 2048, 24
    rho = make(L, H)
    grid = np.linspace(0.0, 1.0, 2001)
    dense = np.array([w1_distance(rho, prior_profile(L, H, a)) for a in grid])
    k = int(np.argmin(dense))
    alpha, w1 = fit_alpha_w1(rho, H)
    assert isinstance(alpha, float) and isinstance(w1, float)
    assert w1 == w1_distance(rho, prior_profile(L, H, alpha))
    assert w1 <= dense[k] + 1e-12
    assert abs(alpha - grid[k]) <= grid[1]
    logfit = fit_alpha(rho, H)
    assert w1 <= logfit.w1
    if make is w1_spiked_last:
        # The log fit is still a ≈ 0.07: one position of 2048 barely moves a least-squares fit in log space,
        # but the 15% of mass it misplaces from x = 1 is most of its W1.
        assert logfit.alpha == pytest.approx(0.07, abs=2e-3)
        assert logfit.w1 > 2 * w1 and alpha > logfit.alpha + 0.01


def test_fit_alpha_w1_recovers_the_prior_and_honours_candidates():
    L, H = 512, 8
    prior = 5.0 * prior_profile(L, H, 0.42)
    alpha, w1 = fit_alpha_w1(prior, H)
    assert alpha == pytest.approx(0.42, abs=1e-6) and w1 < 1e-8
    # A candidate closer than the search's a (here the true one, W1 at rounding level) is taken as it is.
    alpha, w1 = fit_alpha_w1(prior, H, candidates=(0.9, 0.42))
    assert alpha == 0.42 and w1 == w1_distance(prior, prior_profile(L, H, 0.42))
    rho = w1_spiked_last(L, H)
    best = fit_alpha_w1(rho, H)
    assert fit_alpha_w1(rho, H, candidates=(0.9, 0.0)) == best  # farther candidates change nothing


def test_anchor_mass_by_hand():
    assert anchor_mass([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.4, rel=1e-15)
    assert anchor_mass([0.0, 0.0, 5.0]) == 1.0
    assert anchor_mass([3.0, 0.0]) == 0.0
    # H = 1: the last row of (1-a) I + a M is a/L everywhere plus 1-a on the last token.
    assert anchor_mass(prior_profile(10, 1, 0.3)) == pytest.approx(0.73, rel=1e-14)
    # Any H: N is lower triangular, so the prior's last entry is N[L, L]^H = (1 - a + a/L)^H exactly.
    for L, H, a in ((7, 3, Fraction(1, 5)), (64, 24, Fraction(3, 10))):
        exact = exact_rows(L, H, a)[H]
        assert exact[-1] == (1 - a + a / L) ** H and sum(exact) == 1
        assert anchor_mass(prior_profile(L, H, float(a))) == pytest.approx(float((1 - a + a / L) ** H), rel=1e-13)


def test_spearman_against_the_prior_cannot_tell_alpha_apart():
    """The prior falls with j over positions 1..L-1 in one order for every a in (0, 1]; only the last
    token's rank moves. So a profile's Spearman against it is one number for all a once the last token is
    left out, and hardly moves with it: a monotonicity score, not a fit of a."""
    L, H = 512, 24
    rng = np.random.default_rng(5)
    rho = prior_profile(L, H, 0.3) * np.exp(rng.standard_normal(L))
    alphas = (0.02, 0.1, 0.3, 0.6, 1.0)
    for a in alphas:
        assert np.all(np.diff(prior_profile(L, H, a)[:-1]) < 0)
    body = {spearman(rho[:-1], prior_profile(L, H, a)[:-1]) for a in alphas}
    assert len(body) == 1
    whole = [spearman(rho, prior_profile(L, H, a)) for a in alphas]
    assert max(whole) - min(whole) < 0.01


def test_w1_and_spearman():
    L = 11
    first, second, last = np.eye(L)[0], np.eye(L)[1], np.eye(L)[-1]
    assert w1_distance(first, last) == pytest.approx(1.0)
    assert w1_distance(first, second) == pytest.approx(0.1)
    assert w1_distance(3 * second, second) == 0.0
    assert w1_distance([2.0], [5.0]) == 0.0
    rng = np.random.default_rng(1)
    a, b = rng.random(50), rng.integers(0, 5, 50)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, rel=1e-12)
    assert np.isnan(spearman(np.ones(5), a[:5]))


def test_average_ranks_are_scipys_with_ties():
    from scipy.stats import rankdata

    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 300):
        tied = rng.integers(0, 4, n).astype(float)  # many ties
        untied = rng.normal(size=n)
        np.testing.assert_array_equal(average_ranks(tied), rankdata(tied))
        np.testing.assert_array_equal(average_ranks(untied), rankdata(untied))


def test_a_fits_grid_weights_are_the_one_at_a_time_weights():
    """The fits score their 33-point grid in one array operation: the same weights, bit for bit, as
    `_mixture_weights` of each constant schedule, so the fits find the same alpha they found one point at a time."""
    grid = np.linspace(0.0, 1.0, 33)
    for H in (1, 2, 4, 24):
        one_at_a_time = np.stack([_mixture_weights(np.full(H, a)) for a in grid])
        np.testing.assert_array_equal(_constant_mixture_weights(H, grid), one_at_a_time)


def test_fit_schedule_power_recovers_parameters():
    L, H = 1024, 12
    truth = power_schedule(H, 0.6, 1.5)
    np.testing.assert_allclose(truth, 0.6 * np.arange(1, H + 1) ** -1.5)
    fit = fit_schedule(7.0 * prior_profile(L, H, truth), H, "power")
    assert fit.family == "power"
    assert fit.params["a0"] == pytest.approx(0.6, abs=1e-3)
    assert fit.params["p"] == pytest.approx(1.5, abs=1e-3)
    np.testing.assert_allclose(fit.alphas, power_schedule(H, fit.params["a0"], fit.params["p"]))
    assert fit.rmse_log10 < 1e-4 and fit.log10_scale == pytest.approx(np.log10(7.0), abs=1e-3)


def test_fit_schedule_constant_is_fit_alpha():
    p = prior_profile(300, 6, 0.25)
    fit, ref = fit_schedule(p, 6), fit_alpha(p, 6)
    assert fit.family == "constant" and fit.params == {"alpha": ref.alpha}
    np.testing.assert_array_equal(fit.alphas, np.full(6, ref.alpha))
    assert (fit.rmse_log10, fit.w1) == (ref.rmse_log10, ref.w1)


# --- CLI and benchmark -----------------------------------------------------------------------------


def test_cli_writes_csv_and_png(tmp_path, capsys):
    main(["--L", "64", "--H", "4", "--alpha", "0.3", "--out", str(tmp_path / "prior")])
    csv = tmp_path / "prior" / "prior_L64_H4_a0.3.csv"
    png = tmp_path / "prior" / "prior_L64_H4_a0.3.png"
    assert csv.read_text().splitlines()[0] == "j,x,p"
    table = np.loadtxt(csv, delimiter=",", skiprows=1)
    np.testing.assert_array_equal(table[:, 0], np.arange(1, 65))
    np.testing.assert_allclose(table[:, 1], np.arange(64) / 63, rtol=1e-15)
    np.testing.assert_array_equal(table[:, 2], prior_profile(64, 4, 0.3))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(csv) in capsys.readouterr().out


def test_cli_rejects_bad_alpha_and_runs_as_module(tmp_path):
    with pytest.raises(SystemExit):
        main(["--alpha", "2", "--out", str(tmp_path)])
    done = subprocess.run([sys.executable, "-m", "analysis.prior", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--alpha" in done.stdout and "python -m analysis.prior" in done.stdout


def test_bench_prior_rows():
    from scripts.bench_prior import bench_prior

    rows = bench_prior(L=4096, H=8, dense_L=64, repeats=1)
    assert [r["name"] for r in rows] == ["prior_profile L=64 H=8", "prior_profile L=4096 H=8"]
    equal_L = rows[0]
    assert equal_L["ratio"] == pytest.approx(equal_L["baseline_s"] / equal_L["ours_s"])
    assert equal_L["max_rel_diff"] < 1e-12
    assert rows[1]["ours_s"] > 0 and rows[1]["baseline_s"] is None and rows[1]["ratio"] is None


def test_exact_reference_helper_is_sound():
    """The Fraction reference itself: N^1 row by hand, and N^H row sums exactly 1."""
    a = Fraction(3, 10)
    assert exact_rows(4, 1, a)[1] == [a / 4, a / 4, a / 4, 1 - a + a / 4]
    assert sum(exact_rows(9, 5, a)[5]) == 1
