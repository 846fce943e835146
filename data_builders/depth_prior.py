"""The positional prior's weight of a gold at relative depth d, for depth laws and loss weights.

Kept here, below `analysis.measure.prior` (which holds the prior's general forms, schedules and fits), because
the IN2 builder's `valley` depth law and the `depth_weight` objective (models.training.objectives) both read it and
must not import upwards. It equals `analysis.measure.prior.prior_density` for a constant residual weight (test).
"""
from __future__ import annotations

from math import comb

import numpy as np
from scipy.special import gammaln, xlogy

# Depths below this are read at it: the density grows like ln(1/x)^(H-1) at x -> 0, the first token.
DEPTH_FLOOR = 1 / 256


def depth_prior(depth, H: int, alpha: float) -> np.ndarray:
    """The prior's weight of a gold at relative depth d of a context: ``rho_H(max(d, DEPTH_FLOOR))``.

    rho_H(x) = sum_{r=1..H} C(H,r) (1-a)^(H-r) a^r ln(1/x)^(r-1) / (r-1)!, the smooth part of the Cesàro
    prior's large-L density (Chowdhury 2026). It falls monotonically from the first token to rho_H(1) =
    H a (1-a)^(H-1): the recency delta at x = 1 weights the last token, the question's, never a gold's.
    Both the `valley` depth law (data_builders.in2) and `depth_weight` weight a depth by
    ``depth_prior(d)^(-beta)``.
    """
    if not 0 <= alpha <= 1 or H < 1:
        raise ValueError(f"depth_prior needs H >= 1 and alpha in [0, 1], got H={H}, alpha={alpha}")
    t = -np.log(np.clip(np.asarray(depth, dtype=np.float64), DEPTH_FLOOR, 1.0))[..., None]
    k = np.arange(H)  # r - 1
    c = np.array([comb(H, r) * (1 - alpha) ** (H - r) * alpha**r for r in range(1, H + 1)])
    # t^k / k! through logs: the powers and factorials overflow separately long before their ratio
    return np.sum(c * np.exp(xlogy(k, t) - gammaln(k + 1)), axis=-1)
