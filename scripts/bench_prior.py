"""Benchmark of the O(H·L) Cesàro prior against the dense matrix power it replaces.

The prior ``p(j) = (N^H)[L, j]``, ``N = (1-a) I + a M`` with M the Cesàro matrix, is the
initialization-time position profile of Chowdhury 2026 ("Lost in the Middle at Birth") and the
uniform-attention case of the residual-aware rollout of Herasimchyk et al. 2026. `bench_prior` times
`analysis.measure.prior.prior_profile` at a long context and, at a length where a dense L×L power is still
affordable, both methods, so the speed-up is read at equal L.
"""

import json
import time

import numpy as np

from analysis.measure.prior import prior_profile


def _best_of(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _dense_prior(L: int, H: int, alpha: float) -> np.ndarray:
    M = np.tril(np.ones((L, L))) / np.arange(1, L + 1)[:, None]
    return np.linalg.matrix_power((1 - alpha) * np.eye(L) + alpha * M, H)[-1]


def bench_prior(L: int = 131072, H: int = 80, alpha: float = 0.3, dense_L: int = 2048,
                repeats: int = 5, dense_repeats: int = 1) -> list:
    """Rows ``{name, ours_s, baseline, baseline_s, ratio}``, times in seconds (best of the repeats).

    Row 1 compares ours with ``numpy.linalg.matrix_power`` of the dense N at ``dense_L`` (ratio =
    baseline_s / ours_s; ``max_rel_diff`` checks they agree). Row 2 is ours at ``L``, where the dense
    N alone would not fit in memory, so its baseline_s and ratio are None.
    """
    ours_small, p = _best_of(lambda: prior_profile(dense_L, H, alpha), repeats)
    dense_s, p_dense = _best_of(lambda: _dense_prior(dense_L, H, alpha), dense_repeats)
    ours_big, _ = _best_of(lambda: prior_profile(L, H, alpha), repeats)
    return [
        {
            "name": f"prior_profile L={dense_L} H={H}",
            "ours_s": ours_small,
            "baseline": f"dense matrix power at L={dense_L}",
            "baseline_s": dense_s,
            "ratio": dense_s / ours_small,
            "max_rel_diff": float(np.max(np.abs(p_dense / p - 1))),
        },
        {
            "name": f"prior_profile L={L} H={H}",
            "ours_s": ours_big,
            "baseline": f"none: the dense N at L={L} needs {L * L * 8 / 1e9:.0f} GB",
            "baseline_s": None,
            "ratio": None,
        },
    ]


if __name__ == "__main__":
    for row in bench_prior():
        print(json.dumps(row))
