"""Valley topology of a positional influence profile: the ``valley/*`` and ``prior/*`` metrics.

For a profile rho over input positions 1..L (a Jacobian-norm profile, or any positional weight) this
measures the U-shaped "lost in the middle" valley (how deep its trough lies below the peak, the last
position and the first positions, where it sits, how much mass the middle holds) and how far the shape
is from the closed-form Cesàro prior of an untrained causal decoder (Chowdhury 2026, "Lost in the Middle
at Birth"; its residual-aware rollout generalization is Herasimchyk et al. 2026). The metric names are
the wandb keys of the design; `prefixed` inserts the evaluation set, e.g. ``valley/vanilla/trough_x``.
"""

import numpy as np

from analysis.measure.prior import (
    FLOOR_REL,
    anchor_mass,
    fit_alpha,
    fit_alpha_w1,
    log10_profile,
    prior_profile,
)

METRIC_KEYS = (
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


def _window_centres(L: int, width: int) -> np.ndarray:
    """Centre ``(first + last) / 2`` of each `smooth_log10` window, truncated windows included."""
    i = np.arange(L)
    return (np.maximum(i - (width - 1) // 2, 0) + np.minimum(i + width // 2, L - 1)) / 2


def sag_below_chord(smooth: np.ndarray, width: int) -> np.ndarray:
    """How far each point of a smoothed log profile lies below the chord joining its two ends.

    The chord is the straight line through ``(c[0], smooth[0])`` and ``(c[L-1], smooth[L-1])``, c the
    window centres of `smooth_log10` of this width; point i is compared with the chord at c[i]. A moving
    mean of a linear function is that function at the window centre, so a straight line (a pure
    exponential rho) sags by exactly 0 everywhere, whatever the width and at truncated windows too.
    Positive = below the chord (a valley), negative = above it (a bulge).
    """
    c = _window_centres(len(smooth), width)
    slope = (smooth[-1] - smooth[0]) / (c[-1] - c[0])
    return smooth[0] + slope * (c - c[0]) - smooth


# Long for its docstring: the one definition of every valley and prior metric a run logs.
def topology_metrics(profile, H) -> dict:
    """Valley and prior-fit metrics of a profile, keyed by `METRIC_KEYS`.

    With 0-based indices over the L positions, ``band = band(L, 5, 95)`` (the middle band) and
    ``smooth`` = `smooth_log10` of log10 rho with width ``w = max(1, L // 64)`` (windows may reach
    outside the band):

    - the trough is the minimum of ``smooth`` over the band; ties go to the earliest index;
    - ``valley/peak_to_trough_log10`` = log10(max rho) - trough,
      ``valley/anchor_to_trough_log10`` = log10(rho[L-1]) - trough,
      ``valley/primacy_to_trough_log10`` = log10(mean rho[0 : max(1, L // 100)]) - trough;
    - ``valley/trough_x`` = i / (L-1) for the index i of the band where ``smooth`` sags deepest below
      the chord (a straight line in log10 space) from the smoothed primacy level ``smooth[0]`` (the mean
      log10 rho of the first ``w // 2 + 1`` positions) to the smoothed anchor level ``smooth[L-1]`` (the
      last ``(w - 1) // 2 + 1``): ``sag[i] = chord(c_i) - smooth[i]``, with c_i the centre of the window
      of index i and the chord through (c_0, smooth[0]) and (c_{L-1}, smooth[L-1]) (`sag_below_chord`).
      Sags within ``1e-9 · max(1, max |smooth|)`` decades of the deepest tie (rounding), and ties go to
      the earliest index. Unlike the minimum, which sits at a band edge whenever the profile is
      monotone, this follows the valley: for a U whose smoothed ends stand level it is the minimum (a
      tilted chord moves it from the minimum toward the higher end); for a
      monotone profile convex in log space it is where the local slope equals the chord's (for
      log10 rho = x^p, x = p^(-1/(p-1))), so it moves with the curvature; for a straight line in log
      space (all sags 0) it is the first index of the band; for a profile concave in log space (all
      sags negative, a bulge) it is the band end nearest the chord. The depths above keep using the
      minimum, not this point;
    - ``valley/middle_mass`` = sum of rho over ``band(L, 25, 75)`` / sum of rho;
    - ``valley/anchor_mass`` = rho[L-1] / sum of rho (`analysis.measure.prior.anchor_mass`);
    - ``prior/alpha``, ``prior/rmse_log10``, ``prior/spearman``, ``prior/w1_logfit``: the fields alpha,
      rmse_log10, spearman and w1 of `analysis.measure.prior.fit_alpha` (log-space least squares with a free
      scale). That fit weighs every position alike, so it hardly sees the prior's ``(1-a)^H`` of mass on
      the last token, which can carry most of the W1 at its a. ``prior/spearman`` ranks rho against the
      prior at that a, but the prior falls with j over positions 1..L-1 in the same order for every
      a in (0, 1] (strictly for H >= 2; only the last token's rank moves with a): it scores how
      monotone rho is, and cannot tell one a from another;
    - ``prior/alpha_w1``, ``prior/w1``: the a in [0, 1] minimising the 1-Wasserstein distance between
      rho/sum(rho) and the prior over x = (j-1)/(L-1), and that distance
      (`analysis.measure.prior.fit_alpha_w1`, the log-fit a also tried, so ``prior/w1 <= prior/w1_logfit``);
      the reading of the paper's "W = 0.02" most comparable with it;
    - ``prior/anchor_mass`` = the prior's share on the last token at ``prior/alpha``, to set against
      ``valley/anchor_mass``.

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
    valley = valley_metrics(profile)  # checks the profile first
    rho = np.asarray(profile, dtype=np.float64)
    fit = fit_alpha(rho, H)
    alpha_w1, w1 = fit_alpha_w1(rho, H, candidates=(fit.alpha,))
    return {
        **valley,
        "prior/alpha": fit.alpha,
        "prior/rmse_log10": fit.rmse_log10,
        "prior/spearman": fit.spearman,
        "prior/w1": w1,
        "prior/alpha_w1": alpha_w1,
        "prior/w1_logfit": fit.w1,
        "prior/anchor_mass": anchor_mass(prior_profile(len(rho), H, fit.alpha)),
    }


def valley_metrics(profile) -> dict:
    """The ``valley/*`` metrics of `topology_metrics` alone (no prior fit): what a profile's shape says."""
    log_rho = log10_profile(profile)
    rho = np.asarray(profile, dtype=np.float64)
    L = len(rho)
    if L < 2:
        raise ValueError(f"topology needs L >= 2 positions, got {L}")

    lo, hi = band(L, 5, 95)
    width = max(1, L // 64)
    smooth = smooth_log10(log_rho, width)
    floor = smooth[lo + int(np.argmin(smooth[lo:hi + 1]))]
    sag = sag_below_chord(smooth, width)[lo:hi + 1]
    tie = 1e-9 * max(1.0, float(np.abs(smooth).max()))
    sag_at = lo + int(np.argmax(sag >= sag.max() - tie))  # the first of the (near-)deepest
    first = np.maximum(rho[:max(1, L // 100)], FLOOR_REL * rho.max())
    mid_lo, mid_hi = band(L, 25, 75)
    return {
        "valley/peak_to_trough_log10": float(log_rho.max() - floor),
        "valley/anchor_to_trough_log10": float(log_rho[-1] - floor),
        "valley/primacy_to_trough_log10": float(np.log10(first.mean()) - floor),
        "valley/trough_x": sag_at / (L - 1),
        "valley/middle_mass": float(rho[mid_lo:mid_hi + 1].sum() / rho.sum()),
        "valley/anchor_mass": anchor_mass(rho),
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
