"""Tests of analysis/topology.py on hand-built profiles; every expected number is worked out here by
hand (band edges, trough position, sums), never through the module's own helpers."""

import math

import numpy as np
import pytest

from analysis.prior import prior_profile
from analysis.topology import METRIC_KEYS, prefixed, topology_metrics

KEYS = {
    "valley/peak_to_trough_log10",
    "valley/anchor_to_trough_log10",
    "valley/primacy_to_trough_log10",
    "valley/trough_x",
    "valley/middle_mass",
    "prior/alpha",
    "prior/rmse_log10",
    "prior/spearman",
    "prior/w1",
}


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
    # rho_j = j, L = 100 (width 1). Band 5..94: trough at index 5 (j = 6).
    L = 100
    m = topology_metrics(np.arange(1.0, L + 1), 4)
    assert m["valley/trough_x"] == 5 / 99
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
    assert m["valley/trough_x"] == 1.0
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
    m = topology_metrics(7.0 * prior_profile(2048, 24, 0.3), 24)
    assert m["prior/alpha"] == pytest.approx(0.3, abs=1e-6)
    assert m["prior/rmse_log10"] < 1e-8 and m["prior/w1"] < 1e-9
    assert m["prior/spearman"] == pytest.approx(1.0)
    # The prior's smooth part falls with x, so its trough sits at the right end of the middle band.
    assert m["valley/trough_x"] > 0.9


def test_prefixed():
    assert prefixed({"valley/trough_x": 0.5, "prior/alpha": 0.3}, "vanilla") == {
        "valley/vanilla/trough_x": 0.5,
        "prior/vanilla/alpha": 0.3,
    }
    full = prefixed(topology_metrics(np.linspace(1, 2, 50), 4), "chunked")
    assert set(full) == {k.replace("/", "/chunked/", 1) for k in KEYS}
    with pytest.raises(ValueError):
        prefixed({"alpha": 1.0}, "vanilla")
