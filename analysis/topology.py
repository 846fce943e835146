"""Valley topology of a positional influence profile: the ``valley/*`` and ``prior/*`` metrics.

For a profile rho over input positions 1..L (a Jacobian-norm profile, or any positional weight) this
measures the U-shaped "lost in the middle" valley (how deep its trough lies below the peak, the last
position and the first positions, where it sits, how much mass the middle holds) and how far the shape
is from the closed-form Cesàro prior of an untrained causal decoder (Chowdhury 2026, "Lost in the Middle
at Birth"; its residual-aware rollout generalization is Herasimchyk et al. 2026). The metric names are
the wandb keys of the design; `prefixed` inserts the evaluation set, e.g. ``valley/vanilla/trough_x``.
"""

import numpy as np

from analysis.prior import FLOOR_REL, fit_alpha, log10_profile

METRIC_KEYS = (
    "valley/peak_to_trough_log10",
    "valley/anchor_to_trough_log10",
    "valley/primacy_to_trough_log10",
    "valley/trough_x",
    "valley/middle_mass",
    "prior/alpha",
    "prior/rmse_log10",
    "prior/spearman",
    "prior/w1",
)


def band(L: int, lo_pct: int, hi_pct: int) -> tuple:
    """0-based inclusive indices ``floor(lo_pct·L/100) .. ceil(hi_pct·L/100) - 1`` of [lo%, hi%] of L.

    Integer arithmetic, so 0.95·L never rounds across an integer; the band is mirror-symmetric
    (index i <-> L-1-i) when lo_pct + hi_pct = 100.
    """
    return (lo_pct * L) // 100, -((-hi_pct * L) // 100) - 1


def smooth_log10(log_rho: np.ndarray, width: int) -> np.ndarray:
    """Centred moving mean of log10 rho (a moving geometric mean of rho).

    Window i covers indices ``i - (width-1)//2 .. i + width//2`` (one more on the right for an even
    width), truncated at the ends of the profile.
    """
    L = len(log_rho)
    cums = np.concatenate([[0.0], np.cumsum(log_rho)])
    i = np.arange(L)
    lo = np.maximum(i - (width - 1) // 2, 0)
    hi = np.minimum(i + width // 2, L - 1) + 1
    return (cums[hi] - cums[lo]) / (hi - lo)


def topology_metrics(profile, H) -> dict:
    """Valley and prior-fit metrics of a profile, keyed by `METRIC_KEYS`.

    With 0-based indices over the L positions:

    - the trough is the minimum, over the middle band ``band(L, 5, 95)``, of the profile smoothed by
      `smooth_log10` with width ``max(1, L // 64)`` (windows may reach outside the band); ties go to
      the earliest index;
    - ``valley/peak_to_trough_log10`` = log10(max rho) - trough,
      ``valley/anchor_to_trough_log10`` = log10(rho[L-1]) - trough,
      ``valley/primacy_to_trough_log10`` = log10(mean rho[0 : max(1, L // 100)]) - trough;
    - ``valley/trough_x`` = trough index / (L-1);
    - ``valley/middle_mass`` = sum of rho over ``band(L, 25, 75)`` / sum of rho;
    - ``prior/*`` are the fields of `analysis.prior.fit_alpha` (alpha, rmse_log10, spearman, w1).

    Logs use rho clipped from below at ``FLOOR_REL * max(rho)`` (1e-30), so a zero reads as a trough
    30 decades deep instead of -inf; sums use the raw rho. At tiny L the bands grow to whole positions
    (L = 2: both bands are both positions).

    Parameters
    ----------
    profile : array_like
        rho over positions 1..L, L >= 2, finite, >= 0, not all zero.
    H : int
        Number of layers of the prior it is compared with (>= 1).

    Returns
    -------
    dict
        str -> float.
    """
    log_rho = log10_profile(profile)
    rho = np.asarray(profile, dtype=np.float64)
    L = len(rho)
    if L < 2:
        raise ValueError(f"topology needs L >= 2 positions, got {L}")

    lo, hi = band(L, 5, 95)
    smooth = smooth_log10(log_rho, max(1, L // 64))
    trough = lo + int(np.argmin(smooth[lo:hi + 1]))
    floor = smooth[trough]
    first = np.maximum(rho[:max(1, L // 100)], FLOOR_REL * rho.max())
    mid_lo, mid_hi = band(L, 25, 75)
    fit = fit_alpha(rho, H)
    return {
        "valley/peak_to_trough_log10": float(log_rho.max() - floor),
        "valley/anchor_to_trough_log10": float(log_rho[-1] - floor),
        "valley/primacy_to_trough_log10": float(np.log10(first.mean()) - floor),
        "valley/trough_x": trough / (L - 1),
        "valley/middle_mass": float(rho[mid_lo:mid_hi + 1].sum() / rho.sum()),
        "prior/alpha": fit.alpha,
        "prior/rmse_log10": fit.rmse_log10,
        "prior/spearman": fit.spearman,
        "prior/w1": fit.w1,
    }


def prefixed(metrics: dict, set_name: str) -> dict:
    """Insert the evaluation set after the group: ``valley/x`` -> ``valley/<set_name>/x``."""
    out = {}
    for key, value in metrics.items():
        group, sep, name = key.partition("/")
        if not sep:
            raise ValueError(f"metric key {key!r} has no 'group/' part")
        out[f"{group}/{set_name}/{name}"] = value
    return out
