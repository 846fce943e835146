"""Tests of analysis/topology.py on hand-built profiles; every expected number is worked out here by
hand (band edges, trough position, sums), never through the module's own helpers."""

import math

import numpy as np
import pytest

from analysis.measure.prior import prior_profile
from analysis.measure.topology import METRIC_KEYS, prefixed, topology_metrics

KEYS = {
    "valley/peak_to_trough_log10",
    "valley/anchor_to_trough_log10",
    "valley/primacy_to_trough_log10",
    "valley/trough_x",
    "valley/middle_mass",
    "valley/anchor_mass",
    "prior/alpha",
    "prior/rmse_log10",
    "prior/spearman",
    "prior/w1",
    "prior/alpha_w1",
    "prior/w1_logfit",
    "prior/anchor_mass",
}


def reference_sag_x(rho):
    """trough_x by its definition, one explicit window at a time: the first band index whose smoothed
    log10 rho sags deepest (within 1e-9 · max(1, max |smoothed|) decades) below the chord joining the
    smoothed first and last points, each point placed at the centre of its (truncated) window."""
    rho = np.asarray(rho, dtype=np.float64)
    L = len(rho)
    w = max(1, L // 64)
    log_rho = np.log10(np.maximum(rho, 1e-30 * rho.max()))
    starts = [max(i - (w - 1) // 2, 0) for i in range(L)]
    ends = [min(i + w // 2, L - 1) for i in range(L)]  # inclusive
    s = np.array([np.mean(log_rho[a:b + 1]) for a, b in zip(starts, ends)])
    c = np.array([(a + b) / 2 for a, b in zip(starts, ends)])
    chord = s[0] + (s[-1] - s[0]) * (c - c[0]) / (c[-1] - c[0])
    lo, hi = 5 * L // 100, math.ceil(95 * L / 100) - 1
    sag = (chord - s)[lo:hi + 1]
    deepest = sag.max() - 1e-9 * max(1.0, np.abs(s).max())
    return (lo + next(k for k, v in enumerate(sag) if v >= deepest)) / (L - 1)


def test_exact_key_set():
    m = topology_metrics(np.linspace(1, 2, 50), 4)
    assert set(m) == KEYS and set(METRIC_KEYS) == KEYS
    assert all(isinstance(v, float) for v in m.values())


@pytest.mark.parametrize("L", [100, 2048])
def test_flat_profile(L):
    # L = 100: width 1, middle band 5..94, first minimum at index 5. L = 2048: width 32, band 102..1945.
    m = topology_metrics(np.ones(L), 8)
    for key in ("peak_to_trough_log10", "anchor_to_trough_log10", "primacy_to_trough_log10"):
        assert m[f"valley/{key}"] == pytest.approx(0, abs=1e-12)
    assert m["valley/middle_mass"] == pytest.approx(0.5, rel=1e-14)  # 4 | L: exactly half the positions
    if L == 100:
        assert m["valley/trough_x"] == 5 / 99
    assert np.isnan(m["prior/spearman"])  # ranks of a constant are undefined


def test_pure_u():
    # L = 101 (width 1): rho = 1 + 9 (2x - 1)^2 at x = k/100, so 10 at both ends and 1 at k = 50.
    L = 101
    k = np.arange(L)
    rho = 1 + 9 * ((k - 50) / 50) ** 2
    m = topology_metrics(rho, 8)
    # Middle band 505 // 100 = 5 .. ceil(95.95) - 1 = 95 holds k = 50.
    assert m["valley/trough_x"] == 0.5
    assert m["valley/peak_to_trough_log10"] == pytest.approx(1.0, abs=1e-14)
    assert m["valley/anchor_to_trough_log10"] == pytest.approx(1.0, abs=1e-14)
    assert m["valley/primacy_to_trough_log10"] == pytest.approx(1.0, abs=1e-14)  # 101 // 100 = 1 position
    # [25%, 75%]: 2525 // 100 = 25 .. ceil(75.75) - 1 = 75, i.e. m = k - 50 in -25..25.
    # sum_{m=-n..n} (1 + 9 m^2/2500) = (2n+1) + 9/2500 · n(n+1)(2n+1)/3.
    total = 101 + 9 / 2500 * 50 * 51 * 101 / 3
    middle = 51 + 9 / 2500 * 25 * 26 * 51 / 3
    assert m["valley/middle_mass"] == pytest.approx(middle / total, rel=1e-14)


def test_pure_ramp():
    # rho_j = j, L = 100 (width 1). Band 5..94: trough (the minimum, for the depths) at index 5 (j = 6).
    L = 100
    m = topology_metrics(np.arange(1.0, L + 1), 4)
    # trough_x was the minimum (5/99) before it became the deepest sag below the chord. log10 j is concave:
    # the chord 2i/99 runs below it, sag(i) = 2i/99 - log10(i+1) < 0 rises for i + 1 > 99/(2 ln 10) ≈ 21.5
    # and is least negative at the band's far end, 94 (-0.079 against -0.677 at 5).
    assert m["valley/trough_x"] == 94 / 99
    assert m["valley/peak_to_trough_log10"] == pytest.approx(math.log10(100 / 6), abs=1e-14)
    assert m["valley/anchor_to_trough_log10"] == pytest.approx(math.log10(100 / 6), abs=1e-14)
    assert m["valley/primacy_to_trough_log10"] == pytest.approx(math.log10(1 / 6), abs=1e-14)
    # Indices 25..74 are j = 26..75: (26 + 75) · 50 / 2 = 2525 of 5050.
    assert m["valley/middle_mass"] == pytest.approx(0.5, rel=1e-14)


def test_zero_is_floored_and_smoothed_odd_width():
    # L = 192: width 3, window i = i-1..i+1. One zero at index 100 becomes 1e-30, i.e. log -30; windows
    # 99, 100, 101 average it to -10 and the first of them wins.
    L = 192
    rho = np.ones(L)
    rho[100] = 0.0
    m = topology_metrics(rho, 4)
    assert m["valley/trough_x"] == 99 / 191
    for key in ("peak_to_trough_log10", "anchor_to_trough_log10", "primacy_to_trough_log10"):
        assert m[f"valley/{key}"] == pytest.approx(10.0, abs=1e-12)
    # [25%, 75%] = 48..143, 96 positions, one of them the zero; the sum uses the raw zero.
    assert m["valley/middle_mass"] == pytest.approx(95 / 191, rel=1e-14)
    assert all(np.isfinite(v) for k, v in m.items() if k != "prior/spearman")


def test_even_width_window_reaches_right():
    # L = 128: width 2, window i = i..i+1, so a dip at index 60 shows at 59 and 60; the first wins.
    L = 128
    rho = np.ones(L)
    rho[60] = 1e-4
    m = topology_metrics(rho, 4)
    assert m["valley/trough_x"] == 59 / 127
    assert m["valley/peak_to_trough_log10"] == pytest.approx(2.0, abs=1e-12)


def test_primacy_uses_first_percent():
    # L = 400: first 4 positions, mean of (100, 0, 0, 0) = 25 against a flat 1 trough (width 6).
    rho = np.ones(400)
    rho[:4] = [100.0, 0.0, 0.0, 0.0]
    m = topology_metrics(rho, 4)
    assert m["valley/primacy_to_trough_log10"] == pytest.approx(math.log10(25), abs=1e-12)
    assert m["valley/peak_to_trough_log10"] == pytest.approx(2.0, abs=1e-12)


def test_tiny_L():
    # L = 2: middle band 0..ceil(1.9) - 1 = 1 and [25%, 75%] = 0..ceil(1.5) - 1 = 1: everything.
    m = topology_metrics([4.0, 1.0], 2)
    # The chord joins the two points, both sag 0: the earliest index (was 1.0, the minimum, before
    # trough_x became the deepest sag below the chord; the depths below still use the minimum).
    assert m["valley/trough_x"] == 0.0
    assert m["valley/peak_to_trough_log10"] == pytest.approx(math.log10(4))
    assert m["valley/anchor_to_trough_log10"] == pytest.approx(0.0)
    assert m["valley/primacy_to_trough_log10"] == pytest.approx(math.log10(4))
    assert m["valley/middle_mass"] == 1.0
    # L = 3: band 0..ceil(2.85) - 1 = 2, the minimum in the middle; [25%, 75%] = 0..ceil(2.25) - 1 = 2.
    m = topology_metrics([2.0, 1.0, 3.0], 2)
    assert m["valley/trough_x"] == 0.5 and m["valley/middle_mass"] == 1.0
    with pytest.raises(ValueError):
        topology_metrics([1.0], 2)
    with pytest.raises(ValueError):
        topology_metrics(np.ones(10), 0)


def test_prior_recovered_from_scaled_prior():
    p = prior_profile(2048, 24, 0.3)
    m = topology_metrics(7.0 * p, 24)
    assert m["prior/alpha"] == pytest.approx(0.3, abs=1e-6)
    assert m["prior/alpha_w1"] == pytest.approx(0.3, abs=1e-6)
    assert m["prior/rmse_log10"] < 1e-8 and m["prior/w1"] < 1e-9 and m["prior/w1_logfit"] < 1e-9
    assert m["prior/spearman"] == pytest.approx(1.0)
    assert m["valley/anchor_mass"] == pytest.approx(p[-1], rel=1e-12)  # the prior sums to 1
    assert m["prior/anchor_mass"] == pytest.approx(p[-1], rel=1e-5)
    # The prior's smooth part falls with x, so its minimum sits at the right end of the middle band
    # (trough_x pinned that, > 0.9, before it became the deepest sag below the chord, which the prior
    # has in the first fifth: log p is convex there, and the chord ends on the last token's spike).
    assert m["valley/trough_x"] == reference_sag_x(7.0 * p)
    assert 0.15 < m["valley/trough_x"] < 0.25


# --- trough_x: the deepest sag below the chord --------------------------------------------------------


def level_u(L, m, depth=2.0):
    """log10 rho = depth · ((x-m)/m)² left of m, depth · ((x-m)/(1-m))² right of it: a U with its minimum
    at x = m and both ends at the same height, x = k/(L-1)."""
    x = np.arange(L) / (L - 1)
    return 10.0 ** (depth * np.where(x < m, ((x - m) / m) ** 2, ((x - m) / (1 - m)) ** 2))


def test_trough_x_is_the_minimum_of_a_level_u_and_moves_with_it():
    # L = 101 (width 1): the chord is level at 10^2, so the deepest sag is the minimum itself, k = 30 or 60.
    for m in (0.3, 0.6):
        assert topology_metrics(level_u(101, m), 4)["valley/trough_x"] == m
    # L = 2048 (width 32): the ends, seen at their window centres 8 and 2039.5 (not 0 and 2047), stand
    # a little below 10^2 and no longer level (-0.05 and -0.02 decades for m = 0.3): the chord tilts, and
    # the deepest sag sits where the slope of log rho equals the chord's, a few thousandths past m.
    for m in (0.3, 0.6):
        rho = level_u(2048, m)
        got = topology_metrics(rho, 24)
        assert got["valley/trough_x"] == pytest.approx(m, abs=0.01)
        assert got["valley/trough_x"] == reference_sag_x(rho)
        # The depths are measured from the smoothed minimum, here the same place: the ends 2 decades up.
        assert got["valley/peak_to_trough_log10"] == pytest.approx(2.0, abs=1e-3)


@pytest.mark.parametrize("L", [100, 2048])
def test_trough_x_of_a_convex_ramp_follows_the_curvature(L):
    # log10 rho = 3 x^p rises and is convex; the chord is 3x, so sag = 3 (x - x^p), deepest at
    # x = p^(-1/(p-1)): 0.5 for p = 2, 4^(-1/3) = 0.630 for p = 4. The minimum stays at the band's first index.
    lo, hi = 5 * L // 100, math.ceil(95 * L / 100) - 1
    x = np.arange(L) / (L - 1)
    where = {}
    for p in (2, 4):
        rho = 10.0 ** (3 * x**p)
        got = topology_metrics(rho, 8)
        where[p] = got["valley/trough_x"]
        assert lo / (L - 1) < where[p] < hi / (L - 1)
        assert where[p] == pytest.approx(p ** (-1 / (p - 1)), abs=max(2e-3, 1 / (L - 1)))  # grid 1/(L-1)
        assert where[p] == reference_sag_x(rho)
        if L == 100:  # width 1: the depths from the minimum at index 5 and the peak 10^3 at the end
            assert got["valley/peak_to_trough_log10"] == pytest.approx(3 - 3 * (5 / 99) ** p, abs=1e-12)
            assert got["valley/anchor_to_trough_log10"] == pytest.approx(3 - 3 * (5 / 99) ** p, abs=1e-12)
    assert where[4] > where[2] + 0.1
    if L == 100:  # 49/99 and 50/99 straddle 0.5 and sag alike, 3 · 49 · 50 / 99²: the earlier wins
        assert where[2] == 49 / 99


@pytest.mark.parametrize("L", [100, 192, 2048])
@pytest.mark.parametrize("slope", [2.0, -3.0, 0.0])
def test_trough_x_of_a_straight_log_line_is_the_first_band_index(L, slope):
    # rho = 10^(slope · x): a moving mean of a line is the line at the window's centre, so with the chord
    # placed at the window centres every sag is 0 (up to rounding): all tie, the earliest index wins.
    # Band starts: 100 -> 5, 192 -> 9, 2048 -> 102.
    rho = 10.0 ** (slope * np.arange(L) / (L - 1))
    m = topology_metrics(rho, 8)
    assert m["valley/trough_x"] == {100: 5, 192: 9, 2048: 102}[L] / (L - 1)


def test_trough_x_matches_reference_on_noisy_profiles():
    rng = np.random.default_rng(7)
    for L in (128, 300, 2048):
        for _ in range(3):
            rho = level_u(L, rng.uniform(0.2, 0.8), rng.uniform(0.5, 3)) * np.exp(rng.standard_normal(L))
            assert topology_metrics(rho, 8)["valley/trough_x"] == reference_sag_x(rho)


# --- anchor mass and the W1-optimal prior ---------------------------------------------------------------


def test_anchor_mass_by_hand():
    m = topology_metrics([1.0, 2.0, 3.0, 4.0], 1)
    assert m["valley/anchor_mass"] == pytest.approx(0.4, rel=1e-15)
    # H = 1: the last row of (1-a) I + a M is a/L everywhere plus 1-a on the last token, so the prior's
    # last-token share is 1 - a + a/L = 0.7 + 0.03 at a = 0.3, L = 10.
    a, L = 0.3, 10
    m = topology_metrics(np.r_[np.full(L - 1, a / L), 1 - a + a / L], 1)
    assert m["prior/alpha"] == pytest.approx(a, abs=1e-7)
    assert m["prior/anchor_mass"] == pytest.approx(0.73, abs=1e-7)
    assert m["valley/anchor_mass"] == pytest.approx(0.73, rel=1e-14)


def test_w1_at_the_w1_optimal_alpha_against_the_log_fit():
    # The situation of the issue: a prior-shaped profile (a = 0.07, H = 24: (1 - a + a/L)^24 ≈ 17.3% on
    # the last token) whose last token holds only 2%. The log fit still finds a ≈ 0.07 (one position of 2048), and
    # the missing 15% of mass, moved from x = 1 to the rest, is most of its W1.
    L, H = 2048, 24
    rho = prior_profile(L, H, 0.07)
    rho[-1] = 0.02 / 0.98 * rho[:-1].sum()
    m = topology_metrics(rho, H)
    assert m["valley/anchor_mass"] == pytest.approx(0.02, rel=1e-12)
    assert m["prior/alpha"] == pytest.approx(0.07, abs=2e-3)
    # N is lower triangular with N[L, L] = 1 - a + a/L, so the prior's last entry is exactly its H-th power.
    a = m["prior/alpha"]
    assert m["prior/anchor_mass"] == pytest.approx((1 - a + a / L) ** H, rel=1e-10)
    assert m["prior/anchor_mass"] == pytest.approx(0.173, abs=3e-3)
    assert m["prior/w1_logfit"] > 2 * m["prior/w1"]
    assert m["prior/alpha_w1"] != m["prior/alpha"]


def test_w1_never_exceeds_the_log_fit_w1():
    rng = np.random.default_rng(11)
    profiles = [np.ones(64), np.arange(1.0, 129), level_u(300, 0.3), level_u(2048, 0.7, 4.0)]
    for L, H in ((64, 2), (512, 8), (2048, 24)):
        for a in (0.02, 0.1, 0.4):
            p = prior_profile(L, H, a) * np.exp(rng.uniform(0, 1.5) * rng.standard_normal(L))
            profiles.append(p)
            spiked = p.copy()
            spiked[-1] *= rng.uniform(0.05, 20)
            profiles.append(spiked)
    profiles += [rng.random(n) for n in (10, 100, 1000)]
    for rho in profiles:
        m = topology_metrics(rho, 8)
        assert m["prior/w1"] <= m["prior/w1_logfit"]
        assert 0 <= m["prior/alpha_w1"] <= 1


def test_prefixed():
    assert prefixed({"valley/trough_x": 0.5, "prior/alpha": 0.3}, "vanilla") == {
        "valley/vanilla/trough_x": 0.5,
        "prior/vanilla/alpha": 0.3,
    }
    full = prefixed(topology_metrics(np.linspace(1, 2, 50), 4), "chunked")
    assert set(full) == {k.replace("/", "/chunked/", 1) for k in KEYS}
    with pytest.raises(ValueError):
        prefixed({"alpha": 1.0}, "vanilla")
