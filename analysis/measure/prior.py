"""Closed-form positional prior of a causal decoder at initialization, and its residual-aware rollout.

With uniform causal attention, the influence of input position j on the last position L after H
residual layers is ``p(j) = (N^H)[L, j]`` with ``N = (1-a) I + a M`` and M the Cesàro matrix
``M[i, j] = 1/i`` for ``j <= i`` (Chowdhury 2026, "Lost in the Middle at Birth"). Herasimchyk et al.
2026 (residual-aware rollout) generalize it to ``prod_t ((1-λ_t) I + λ_t A_t)`` with ALiBi, content
or measured attention. Every profile here is one row vector pushed through the layers, O(L) per
structured layer, so a prior costs O(H·L) and never an L×L matrix. Also: the continuous large-L
density, the exact discrete closed form (a cross-check), least-squares fits of the residual weight in
log space, and the residual weight nearest a profile in 1-Wasserstein distance.
"""

import functools
import operator
from dataclasses import dataclass
from fractions import Fraction
from math import comb

import numpy as np
from scipy.optimize import minimize, minimize_scalar
from scipy.special import expit, gammaln, xlogy

# Zeros in a measured profile become a trough this many decades below its peak instead of -inf.
FLOOR_REL = 1e-30


def _check_length(L) -> int:
    L = operator.index(L)
    if L < 1:
        raise ValueError(f"L must be >= 1, got {L}")
    return L


def _check_depth(H) -> int:
    H = operator.index(H)
    if H < 0:
        raise ValueError(f"H must be >= 0, got {H}")
    return H


def _weights_01(values, name: str) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)) or np.any(values < 0) or np.any(values > 1):
        raise ValueError(f"{name} must lie in [0, 1], got {values}")
    return values


def _schedule(H: int, alpha, name: str = "alpha") -> np.ndarray:
    """Per-layer weights, layer 1 (next to the embeddings) first: a scalar repeats H times."""
    if np.ndim(alpha) == 0:
        return np.full(H, _weights_01(alpha, name))
    sched = _weights_01(alpha, name)
    if sched.ndim != 1 or len(sched) != H:
        raise ValueError(f"{name} schedule must have H={H} entries, got shape {sched.shape}")
    return sched


def _rev_cumsum_(a: np.ndarray) -> None:
    """In place, ``a[j] <- sum_{i >= j} a[i]``."""
    rev = a[::-1]
    np.cumsum(rev, out=rev)


def alpha_from_gain(a_tilde: float) -> float:
    """Residual weight ``a = a~/(1+a~)`` of a layer written ``I + a~ M`` (same shape, other scale)."""
    a_tilde = float(a_tilde)
    if not (np.isfinite(a_tilde) and a_tilde >= 0):
        raise ValueError(f"a_tilde must be finite and >= 0, got {a_tilde}")
    return a_tilde / (1.0 + a_tilde)


# A step writes v A_t into a preallocated `out`: at L ~ 1e5 fresh temporaries cost more than the arithmetic.
def _cesaro_step(L: int):
    inv_i = 1.0 / np.arange(1, L + 1)

    def step(v, out):  # (vM)_j = sum_{i >= j} v_i / i
        np.multiply(v, inv_i, out=out)
        _rev_cumsum_(out)

    return step


def _alibi_step(L: int, slopes: np.ndarray):
    i = np.arange(1, L + 1)
    heads = []
    for s in slopes:
        # Row i weighs j by r^(i-j) / Z_i with r = e^-s and Z_i = sum_{k<i} r^k.
        norm = i.astype(np.float64) if s == 0 else np.expm1(-s * i) / np.expm1(-s)
        heads.append((np.exp(-s), 1.0 / norm))

    # scipy.signal takes ~1 s to import, a tenth of a training run's start-up, for ALiBi rollouts only.
    from scipy.signal import lfilter

    def step(v, out):
        # (vA)_j = sum_{i >= j} (v_i / Z_i) r^(i-j): the backward recursion S_j = w_j + r S_{j+1},
        # run by lfilter in O(L); the closed form r^-j sum r^i w_i would overflow for large s·L.
        out[:] = 0.0
        for r, inv_norm in heads:
            out += lfilter([1.0], [1.0, -r], (v * inv_norm)[::-1])[::-1]
        out /= len(heads)

    return step


def _alibi_content_step(L: int, slopes: np.ndarray, c: float):
    """ALiBi and a diagonal content logit in one softmax: row i weighs j < i by r^(i-j) / Z_i and itself by
    e^c / Z_i, with r = e^-s and Z_i = O_i + e^c, O_i = sum_{k=1}^{i-1} r^k the off-diagonal mass."""
    i = np.arange(1, L + 1, dtype=np.float64)
    heads = []
    for s in slopes:
        with np.errstate(divide="ignore"):  # row 1 has no off-diagonal mass: log 0 = -inf is meant
            # log O_i = -s + log((1 - r^(i-1)) / (1 - r)); s = 0: log(i - 1)
            log_off = np.log(i - 1) if s == 0 else -s + np.log(-np.expm1(-s * (i - 1))) - np.log(-np.expm1(-s))
        log_z = np.logaddexp(log_off, c)  # (L,)
        # r / Z_i, not 1 / Z_i: with s and -c both large 1/Z_i overflows while r^(i-j) underflows to 0.
        # Row 1 has no off-diagonal weights (r / Z_1 would overflow there, and is never used).
        r_over_z = np.concatenate([[0.0], np.exp(-s - log_z[1:])])
        heads.append((np.exp(-s), r_over_z, np.exp(c - log_z)))  # r, r / Z_i, diagonal share e^c / Z_i

    from scipy.signal import lfilter

    def step(v, out):
        # (vA)_j = sum_{i > j} u_i r^(i-j-1) + v_j e^c / Z_j with u = v r / Z: the ALiBi recursion T over u,
        # read one position on (T_{j+1}), plus the diagonal.
        out[:] = 0.0
        for r, r_over_z, diag in heads:
            tail = lfilter([1.0], [1.0, -r], (v * r_over_z)[::-1])[::-1]  # T_j = sum_{i >= j} u_i r^(i-j)
            out[:-1] += tail[1:]
            out += v * diag
        out /= len(heads)

    return step


def _diag_step(L: int, c: float):
    m = np.arange(1, L, dtype=np.float64)  # off-diagonal count i-1 of rows i = 2..L
    # Row i: diagonal e^c/(e^c+m), each of the m earlier positions 1/(e^c+m); expit keeps |c| >> 1 finite.
    diag = np.concatenate([[1.0], expit(c - np.log(m))])
    off = expit(np.log(m) - c) / m

    def step(v, out):
        out[-1] = 0.0
        np.multiply(v[1:], off, out=out[:-1])
        _rev_cumsum_(out[:-1])  # out[j] = sum over rows i > j of v_i / (e^c + i - 1)
        out += v * diag

    return step


def _dense_steps(L: int, maps) -> list:
    mats = [np.asarray(a, dtype=np.float64) for a in maps]
    for t, a in enumerate(mats):
        if a.shape != (L, L):
            raise ValueError(f"attention map {t} must have shape ({L}, {L}), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"attention map {t} has non-finite entries")
    return [lambda v, out, a=a: np.matmul(v, a, out=out) for a in mats]


def _attention_steps(L: int, H: int, attention, slopes, content) -> list:
    """`rollout`'s per-layer maps v -> vA_t (layer 1 first), its arguments checked."""
    is_name = isinstance(attention, str)
    if slopes is not None and not (is_name and attention == "alibi"):
        raise ValueError("slopes only apply to attention='alibi'")
    if content is not None and not (is_name and attention in ("diag", "alibi")):
        raise ValueError("content only applies to attention='diag' or 'alibi'")
    if not is_name:
        steps = _dense_steps(L, attention)
        if len(steps) != H:
            raise ValueError(f"got {len(steps)} attention maps for {H} lambdas")
        return steps
    if attention == "cesaro":
        return [_cesaro_step(L)] * H
    if attention == "alibi":
        if slopes is None:
            raise ValueError("attention='alibi' needs slopes")
        slopes = np.atleast_1d(np.asarray(slopes, dtype=np.float64))
        if slopes.ndim != 1 or len(slopes) == 0 or not np.all(np.isfinite(slopes)) or np.any(slopes < 0):
            raise ValueError(f"slopes must be finite, >= 0 and 1-D, got {slopes}")
        if content is not None and not np.isfinite(content):
            raise ValueError(f"content must be a finite logit, got {content}")
        return [_alibi_step(L, slopes) if content is None else _alibi_content_step(L, slopes, float(content))] * H
    if attention == "diag":
        if content is None or not np.isfinite(content):
            raise ValueError(f"attention='diag' needs a finite content logit, got {content}")
        return [_diag_step(L, float(content))] * H
    raise ValueError(f"attention must be 'cesaro', 'alibi', 'diag' or an array, got {attention!r}")


def rollout(L, lambdas, attention="cesaro", *, slopes=None, content=None) -> np.ndarray:
    """Last row of the residual-aware rollout ``N_H ... N_1``, ``N_t = (1-λ_t) I + λ_t A_t``.

    Parameters
    ----------
    L : int
        Sequence length.
    lambdas : sequence of float
        ``λ_t`` in [0, 1] for layers t = 1..H, layer 1 next to the embeddings; H = len(lambdas).
        ``λ_t = 1`` is attention-only rollout.
    attention : {"cesaro", "alibi", "diag"} or array_like
        ``"cesaro"``: uniform causal attention (the Cesàro matrix), O(L) per layer.
        ``"alibi"``: causal softmax of ``-slope (i-j)`` for every head in ``slopes``, averaged over
        heads, the same in every layer; O(L) per head and layer. With ``content``, the diagonal's
        content logit joins the same softmax: ``-slope (i-j) + content [j == i]``.
        ``"diag"``: row i is the softmax over j <= i of ``content * [j == i]``; O(L) per layer.
        An array of shape (H, L, L) or a list of H (L, L) arrays: measured (head-averaged) attention,
        map t for layer t; O(L²) per layer.
    slopes : float or sequence of float, optional
        ALiBi slopes >= 0, required with (and only with) ``"alibi"``; slope 0 is uniform attention.
    content : float, optional
        Diagonal content logit, required with ``"diag"`` (0 is uniform attention), optional with
        ``"alibi"`` (the two combine in one softmax).

    Returns
    -------
    np.ndarray
        float64 of length L: the influence of input position j on position L.
    """
    L = _check_length(L)
    lambdas = _weights_01(lambdas, "lambdas")
    if lambdas.ndim != 1:
        raise ValueError(f"lambdas must be a 1-D sequence, got shape {lambdas.shape}")
    steps = _attention_steps(L, len(lambdas), attention, slopes, content)
    v = np.zeros(L)
    v[-1] = 1.0
    av = np.empty(L)
    # The last row of N_H ... N_1 meets the top layer first.
    for lam, step in zip(lambdas[::-1], steps[::-1]):
        step(v, av)
        v *= 1.0 - lam
        av *= lam
        v += av
    return v


def prior_profile(L, H, alpha) -> np.ndarray:
    """Last row of ``N^H``, ``N = (1-a) I + a M``, by H reversed cumulative sums in O(H·L).

    Parameters
    ----------
    L, H : int
        Sequence length (>= 1) and number of layers (>= 0).
    alpha : float or sequence of float
        Residual weight a in [0, 1], or H per-layer values (layer 1 first).

    Returns
    -------
    np.ndarray
        float64 of length L, sums to 1; ``p[j-1]`` is the weight of position j.
    """
    H = _check_depth(H)
    return rollout(L, _schedule(H, alpha), "cesaro")


def _mixture_weights(sched: np.ndarray) -> np.ndarray:
    """``c_r`` in ``N^H = sum_r c_r M^r``: coefficients of ``prod_t ((1-a_t) + a_t z)``."""
    c = np.ones(1)
    for a in sched:
        c = np.convolve(c, [1.0 - a, a])
    return c


def _constant_mixture_weights(H: int, alphas: np.ndarray) -> np.ndarray:
    """`_mixture_weights` of the constant schedules a = alphas[i] over H layers, (n, H+1): the same products and
    sums, a row per a, so a fit's grid costs one array operation instead of a Python call per point."""
    a = np.asarray(alphas, dtype=np.float64)[:, None]
    c = np.ones((len(a), 1))
    for r in range(1, H + 1):
        nxt = np.zeros((len(a), r + 1))
        nxt[:, :-1] = c * (1.0 - a)
        nxt[:, 1:] += c * a
        c = nxt
    return c


def recency_weight(H, alpha) -> float:
    """Weight ``prod_t (1-a_t)`` of the delta at x = 1 that the continuous limit carries apart."""
    return float(np.prod(1.0 - _schedule(_check_depth(H), alpha)))


def prior_density(x, H, alpha) -> np.ndarray:
    """Smooth part of the large-L limit of ``L·p(j)`` at ``x = j/L``.

    ``rho(x) = sum_{r=1..H} c_r ln(1/x)^(r-1)/(r-1)!`` with ``c_r = C(H,r) (1-a)^(H-r) a^r`` for a
    constant a (for a schedule, the coefficients of ``prod_t ((1-a_t) + a_t z)``). It integrates to
    ``1 - recency_weight(H, alpha)``; the rest sits in a delta at x = 1.

    Parameters
    ----------
    x : array_like
        Relative positions in (0, 1].
    H : int
        Number of layers.
    alpha : float or sequence of float
        As in `prior_profile`.

    Returns
    -------
    np.ndarray
        float64, the shape of x.
    """
    c = _mixture_weights(_schedule(_check_depth(H), alpha))
    x = np.asarray(x, dtype=np.float64)
    if not np.all((x > 0) & (x <= 1)):
        raise ValueError("x must lie in (0, 1]")
    t = -np.log(x)[..., None]
    k = np.arange(len(c) - 1)  # r - 1
    # t^k / k! through logs: the powers and factorials overflow separately long before their ratio.
    return np.sum(c[1:] * np.exp(xlogy(k, t) - gammaln(k + 1)), axis=-1)


def closed_form_exact(L, H, alpha) -> list:
    """Exact ``(N^H)[L, j]`` from the discrete closed form, in rational arithmetic.

    The Cesàro matrix is the Hausdorff mean ``M = Δ diag(1/k) Δ`` with
    ``Δ[i, k] = (-1)^(k-1) C(i-1, k-1)`` and ``Δ² = I``, so ``M^r[i, j] = sum_{k=j..i} (-1)^(k-j)
    C(i-1, k-1) C(k-1, j-1) k^-r``. Summing ``c_r M^r`` over r turns ``k^-r`` into the eigenvalue
    ``prod_t (1 - a_t + a_t/k)`` of N:

        p(j) = sum_{k=j..L} (-1)^(k-j) C(L-1, k-1) C(k-1, j-1) prod_t (1 - a_t + a_t/k).

    This is a cross-check, not the production path: the binomial terms reach ~2^L while p(j) is
    O(1/L), so in float64 the alternating sum cancels away all significant digits already at L ≈ 60.

    Parameters
    ----------
    L, H : int
        Sequence length and number of layers.
    alpha : Fraction, int, str, float or a sequence of H of them
        Converted exactly with `fractions.Fraction` (``"3/10"`` is 3/10, ``0.3`` its binary value).

    Returns
    -------
    list of Fraction
        Length L.
    """
    L, H = _check_length(L), _check_depth(H)
    sched = [Fraction(alpha)] * H if np.ndim(alpha) == 0 else [Fraction(a) for a in alpha]
    if len(sched) != H or not all(0 <= a <= 1 for a in sched):
        raise ValueError(f"alpha must be in [0, 1], one value or H={H} of them")
    eig = [Fraction(1)] * (L + 1)
    for k in range(1, L + 1):
        for a in sched:
            eig[k] *= 1 - a + a / k
    return [
        sum((-1) ** (k - j) * comb(L - 1, k - 1) * comb(k - 1, j - 1) * eig[k] for k in range(j, L + 1))
        for j in range(1, L + 1)
    ]


def log10_profile(rho) -> np.ndarray:
    """``log10(rho)`` with entries below ``FLOOR_REL * max(rho)`` raised to that floor.

    rho must be 1-D, finite, >= 0 and have a positive entry.
    """
    rho = np.asarray(rho, dtype=np.float64)
    if rho.ndim != 1 or len(rho) == 0:
        raise ValueError(f"profile must be a non-empty 1-D array, got shape {rho.shape}")
    if not np.all(np.isfinite(rho)) or np.any(rho < 0) or not np.any(rho > 0):
        raise ValueError("profile must be finite, >= 0 and have a positive entry")
    return np.log10(np.maximum(rho, FLOOR_REL * rho.max()))


def w1_distance(p, q) -> float:
    """1-Wasserstein distance between p/sum(p) and q/sum(q) placed at x = (j-1)/(L-1) in [0, 1].

    ``sum_j |CDF_p(j) - CDF_q(j)| / (L-1)``: 0 for the same shape, 1 for all mass at opposite ends.
    """
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"p and q must be 1-D of one length, got {p.shape} and {q.shape}")
    if len(p) < 2:
        return 0.0
    gap = np.cumsum(p / p.sum() - q / q.sum())[:-1]
    return float(np.abs(gap).sum() / (len(p) - 1))


def average_ranks(x) -> np.ndarray:
    """1-based ranks of a 1-D array, ties sharing their average rank (`scipy.stats.rankdata`'s default, without its
    per-call overhead, which dominated the per-step metrics)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # first index of each run of equal values
    counts = np.diff(np.r_[starts, len(x)])
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(starts + (counts + 1) / 2, counts)
    return ranks


def spearman(a, b) -> float:
    """Spearman rank correlation (average ranks for ties); NaN if either input is constant."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


@dataclass(frozen=True)
class PriorFit:
    """Best constant a for a profile: log10(rho) ≈ log10_scale + log10(prior_profile(L, H, alpha))."""

    alpha: float
    log10_scale: float
    rmse_log10: float
    spearman: float
    w1: float


@dataclass(frozen=True, eq=False)  # a generated __eq__ would compare the alphas arrays ambiguously
class ScheduleFit:
    """Best per-layer schedule of a family; ``alphas`` holds a_t for layers 1..H."""

    family: str
    params: dict
    alphas: np.ndarray
    log10_scale: float
    rmse_log10: float
    spearman: float
    w1: float


def _check_fit_input(profile, H) -> tuple:
    log_rho = log10_profile(profile)
    H = _check_depth(H)
    if len(log_rho) < 2 or H < 1:
        raise ValueError(f"fitting needs L >= 2 and H >= 1, got L={len(log_rho)}, H={H}")
    return log_rho, H


def _misfit(log_rho: np.ndarray, prior: np.ndarray) -> float:
    # With the scale free, its optimum is the mean log residual, so the loss is the residual variance.
    return float(np.var(log_rho - log10_profile(prior)))


def _log10_scale(log_rho: np.ndarray, prior: np.ndarray) -> float:
    """The free scale of every fit: the mean log residual, which minimizes the squared log misfit."""
    return float(np.mean(log_rho - log10_profile(prior)))


def _quality(profile, log_rho: np.ndarray, prior: np.ndarray) -> dict:
    resid = log_rho - log10_profile(prior)
    return dict(
        log10_scale=_log10_scale(log_rho, prior),
        rmse_log10=float(resid.std()),
        spearman=spearman(profile, prior),
        w1=w1_distance(profile, prior),
    )


@functools.lru_cache(maxsize=8)
def _cesaro_last_rows(L: int, H: int) -> np.ndarray:
    """Last rows of M^0 .. M^H (Cesàro M), (H+1, L) read-only: the terms of every constant-a prior."""
    rows = np.empty((H + 1, L))
    rows[0] = 0.0
    rows[0, -1] = 1.0
    step = _cesaro_step(L)
    for k in range(H):
        step(rows[k], rows[k + 1])
    rows.flags.writeable = False
    return rows


def fit_alpha(profile, H) -> PriorFit:
    """Constant residual weight a whose prior best fits log10(profile) up to a free scale.

    A 33-point grid over [0, 1] picks the basin (the loss need not be unimodal for measured
    profiles), then a bounded Brent search refines a between the grid neighbours.
    """
    log_rho, H = _check_fit_input(profile, H)
    L = len(log_rho)
    # N^H = sum_r c_r M^r (`_mixture_weights`): with the last rows of M^0..M^H computed once per (L, H),
    # each trial a costs one (H+1)-term combination instead of H passes over the sequence.
    powers = _cesaro_last_rows(L, H)  # (H+1, L)

    def loss(a):
        return _misfit(log_rho, _mixture_weights(np.full(H, a)) @ powers)

    grid = np.linspace(0.0, 1.0, 33)
    priors = _constant_mixture_weights(H, grid) @ powers  # (33, L), the grid's priors at once
    floored = np.maximum(priors, FLOOR_REL * priors.max(axis=1, keepdims=True))  # as log10_profile floors
    losses = np.var(log_rho - np.log10(floored), axis=1)
    k = int(np.argmin(losses))
    res = minimize_scalar(
        loss, bounds=(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]), method="bounded",
        options={"xatol": 1e-10},
    )
    alpha = float(res.x) if res.fun <= losses[k] else float(grid[k])
    return PriorFit(alpha=alpha, **_quality(profile, log_rho, prior_profile(L, H, alpha)))


def fit_alpha_w1(profile, H, candidates=()) -> tuple[float, float]:
    """Constant residual weight a in [0, 1] whose prior is nearest the profile in 1-Wasserstein distance.

    Returns ``(alpha, w1)`` with ``w1 = w1_distance(profile, prior_profile(L, H, alpha))``. Unlike
    `fit_alpha`'s log-space least squares, which weighs each of the L positions alike and so hardly sees
    the prior's delta of ``(1-a)^H`` on the last token, W1 compares the mass itself: this is the a at
    which "the prior's shape is W1 away from the profile" is smallest. W1(a) has a kink at its minimum
    (an absolute value), so a 33-point grid over [0, 1], quadratic in a (spacing 0.001 near 0, where
    the recency weight ``(1-a)^H`` changes fastest, 0.06 near 1), picks the basin and a bounded
    scalar search refines a between the grid neighbours. ``candidates`` are more values of a tried as
    they are (e.g. `fit_alpha`'s a): the result is never farther than any of them.
    """
    log_rho, H = _check_fit_input(profile, H)
    L = len(log_rho)
    rho = np.asarray(profile, dtype=np.float64)
    cdf = np.cumsum(rho / rho.sum())[:-1]  # (L-1,)
    # As in fit_alpha: each trial a is an (H+1)-term combination of the cached last rows of M^r.
    cum_powers = np.cumsum(_cesaro_last_rows(L, H)[:, :-1], axis=1)  # (H+1, L-1), CDFs of the M^r rows

    def loss(a):
        # Every M^r row sums to 1 and so do the weights c_r: the prior's CDF is the mix of the rows' CDFs.
        return float(np.abs(cdf - _mixture_weights(np.full(H, a)) @ cum_powers).sum() / (L - 1))

    grid = np.linspace(0.0, 1.0, 33) ** 2
    losses = np.abs(cdf - _constant_mixture_weights(H, grid) @ cum_powers).sum(axis=1) / (L - 1)  # loss at each a
    k = int(np.argmin(losses))
    res = minimize_scalar(
        loss, bounds=(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]), method="bounded",
        options={"xatol": 1e-10},
    )
    best = [float(res.x) if res.fun <= losses[k] else float(grid[k])]
    best += [float(_weights_01(a, "candidate alpha")) for a in candidates]
    # The reported W1 is w1_distance's own, so it equals what the same a gives anywhere else.
    scored = [(w1_distance(rho, prior_profile(L, H, a)), a) for a in best]
    w1, alpha = min(scored, key=lambda s: s[0])  # the first of equal distances: the search's own a
    return alpha, w1


def anchor_mass(profile) -> float:
    """Share ``rho[L-1] / sum(rho)`` of the last position in a profile (1-D, finite, >= 0, not all 0).

    For the prior ``prior_profile(L, H, a)`` it is ``(1 - a + a/L)^H`` (N is lower triangular, so the
    last entry of its last row is ``N[L, L]^H``): the recency weight ``(1-a)^H``, the delta at x = 1 of
    the continuous limit, plus O(1/L).
    """
    log10_profile(profile)  # validates
    rho = np.asarray(profile, dtype=np.float64)
    return float(rho[-1] / rho.sum())


def scaled_prior(profile, H, alpha: float | None = None) -> tuple[np.ndarray, float]:
    """The prior drawn on a measured profile's scale: ``(prior * 10**log10_scale, alpha)``.

    ``alpha`` None takes `fit_alpha`'s best a. The scale is the one `fit_alpha` fits
    (``PriorFit.log10_scale``): the mean of ``log10 profile - log10 prior``, the least-squares scale in
    log space, so ``scaled_prior(p, H)`` equals ``prior_profile(L, H, fit.alpha) * 10**fit.log10_scale``.
    """
    log_rho, H = _check_fit_input(profile, H)
    alpha = fit_alpha(profile, H).alpha if alpha is None else float(alpha)
    prior = prior_profile(len(log_rho), H, alpha)  # (L,)
    return prior * 10.0 ** _log10_scale(log_rho, prior), alpha


def power_schedule(H, a0: float, p: float) -> np.ndarray:
    """``a_t = a0 · t^-p`` for layers t = 1..H; p > 1 makes the schedule summable."""
    return a0 * np.arange(1, _check_depth(H) + 1, dtype=np.float64) ** -p


def fit_schedule(profile, H, family: str = "constant") -> ScheduleFit:
    """Per-layer residual schedule of a family that best fits log10(profile) up to a free scale.

    Families: ``"constant"`` (a_t = alpha, as `fit_alpha`) and ``"power"`` (a_t = a0 · t^-p with
    a0 in [0, 1], p in [0, 4], t = 1 next to the embeddings: residual weight decaying with depth).
    The layers commute in the Cesàro prior, so only the multiset of a_t is identifiable, not their order.
    The power fit starts bounded Nelder-Mead from the best point of a 20×17 grid.
    """
    if family == "constant":
        fit = fit_alpha(profile, H)
        quality = {k: v for k, v in vars(fit).items() if k != "alpha"}
        return ScheduleFit("constant", {"alpha": fit.alpha}, np.full(H, fit.alpha), **quality)
    if family != "power":
        raise ValueError(f"family must be 'constant' or 'power', got {family!r}")
    log_rho, H = _check_fit_input(profile, H)
    L = len(log_rho)

    def loss(theta):
        return _misfit(log_rho, prior_profile(L, H, power_schedule(H, *theta)))

    grid = [(a0, p) for a0 in np.linspace(0.05, 1.0, 20) for p in np.linspace(0.0, 4.0, 17)]
    start = grid[int(np.argmin([loss(g) for g in grid]))]
    res = minimize(
        loss, start, method="Nelder-Mead", bounds=[(0.0, 1.0), (0.0, 4.0)],
        options={"xatol": 1e-9, "fatol": 1e-15, "maxiter": 2000},
    )
    a0, p = (float(v) for v in (res.x if res.fun <= loss(start) else start))
    alphas = power_schedule(H, a0, p)
    return ScheduleFit(
        "power", {"a0": a0, "p": p}, alphas, **_quality(profile, log_rho, prior_profile(L, H, alphas))
    )
