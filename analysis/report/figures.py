"""Every PNG figure of the project: a run's Jacobian profile evolution, fit to the prior, heatmap and accuracy by
depth/position; the reports' profiles of several PATHs (analysis.compare), arms by gold depth (analysis.study),
rollouts against the measured profile (analysis.rollout_study), the closed-form prior (analysis.prior) and
VaLProbing's bins (analysis.evaluation.valprobing).

Figures are built on ``matplotlib.figure.Figure`` (Agg canvas), not pyplot, so plotting from the
training loop touches no global backend or figure state. Each ``plot_*`` function writes one PNG and
returns its path; the ``*_figure`` function of the same name builds that Figure (what tests inspect).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, Normalize
from matplotlib.figure import Figure
from matplotlib.image import AxesImage

from analysis.measure.jacobian import read_jacobian
from analysis.measure.prior import fit_alpha, log10_profile, scaled_prior
from analysis.stats import ACCURACY, Score

if TYPE_CHECKING:
    from analysis.evaluation.result import ProbeResult
    from analysis.evaluation.valprobing import Summary

MAX_LINES = 128  # evolution plots draw at most this many steps, evenly spaced, first and last included
RHO_LABEL = r"$\rho(j) = \|\partial\, \mathrm{target} / \partial e_j\|$"
X_LABEL = "relative position x = (j-1)/(L-1)"


def _save(fig: Figure, out_png: str | os.PathLike, dpi: int = 120) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def _rel_x(L: int) -> np.ndarray:
    return np.arange(L) / max(L - 1, 1)  # (L,)


def _interval_series(
    ax: Axes, x: np.ndarray, y: np.ndarray, ci: np.ndarray, i: int, n: int, spread: float, colour: Any, label: str
) -> None:
    """Series `i` of `n`: points `y` (k,) at `x` (k,) with their intervals `ci` (k, 2), moved sideways by
    `spread` per series, so that overlapping intervals of different series stay apart."""
    err = np.abs(np.asarray(ci).reshape(-1, 2).T - y)  # (2, k): below, above
    ax.errorbar(x + spread * (i - (n - 1) / 2), y, yerr=err, marker="o", capsize=3, color=colour, label=label)


def _load_set(npz_path: str | os.PathLike, set_name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Steps (S,), the mean-over-sequences profiles (S, L) and the sequence count of one set."""
    steps, arrays = read_jacobian(npz_path)
    if set_name not in arrays:
        raise KeyError(f"{npz_path} has no set {set_name!r}; it holds {sorted(arrays)}")
    profiles = arrays[set_name].astype(np.float64)  # (n_seq, S, L)
    if len(steps) == 0:
        raise ValueError(f"{npz_path} holds no measured step yet")
    return steps, profiles.mean(axis=0), profiles.shape[0]  # (S,), (S, L), n_seq


def _step_norm(steps: np.ndarray) -> Normalize:
    return Normalize(vmin=float(steps.min()), vmax=float(max(steps.max(), steps.min() + 1)))


def evolution_figure(npz_path: str | os.PathLike, set_name: str) -> Figure:
    """Mean profile per measured step, raw and anchored at x=1 (divided by rho(L)), coloured by step."""
    steps, mean, n_seq = _load_set(npz_path, set_name)  # (S,), (S, L)
    x = _rel_x(mean.shape[1])
    shown = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), MAX_LINES)).round().astype(int))
    norm, cmap = _step_norm(steps), colormaps["viridis"]

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    raw, anchored = fig.subplots(1, 2)
    for i in shown:
        colour = cmap(norm(steps[i]))
        raw.plot(x, mean[i], color=colour, lw=0.8)
        anchored.plot(x, mean[i] / mean[i, -1], color=colour, lw=0.8)
    raw.set(yscale="log", xlabel=X_LABEL, ylabel=RHO_LABEL, title="raw")
    anchored.set(yscale="log", xlabel=X_LABEL, ylabel=r"$\rho(j) / \rho(L)$", title="anchored at x = 1")
    for ax in (raw, anchored):
        ax.grid(True, which="major", alpha=0.3)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=[raw, anchored], label="training step")
    fig.suptitle(f"Jacobian profile evolution, {set_name}: mean of {n_seq} sequences, L = {mean.shape[1]}, "
                 f"{len(steps)} steps")
    return fig


def plot_evolution(npz_path: str | os.PathLike, out_png: str | os.PathLike, set_name: str) -> Path:
    """`evolution_figure` as a PNG."""
    return _save(evolution_figure(npz_path, set_name), out_png)


def profile_vs_prior_figure(
    profile: np.ndarray, H: int, title: str = "", rollouts: Mapping[str, np.ndarray] | None = None
) -> Figure:
    """A profile (L,) against its best-fitting Cesàro prior with a free scale, raw and anchored.

    `rollouts` (name -> (L,)): attention rollouts from the model (`analysis.measure.rollout`), drawn like the
    prior, each on the profile's scale by its own least-squares log10 offset.
    """
    profile = np.asarray(profile, dtype=np.float64)
    fit = fit_alpha(profile, H)
    prior, _ = scaled_prior(profile, H, fit.alpha)  # (L,)
    x = _rel_x(len(profile))
    prior_label = (f"prior, H = {H}, a = {fit.alpha:.3f} "
                   f"(Spearman {fit.spearman:.3f}, RMSE {fit.rmse_log10:.3f} dex)")

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    raw, anchored = fig.subplots(1, 2)
    raw.plot(x, profile, lw=1.0, label="measured")
    raw.plot(x, prior, lw=1.0, ls="--", color="k", label=prior_label)
    anchored.plot(x, profile / profile[-1], lw=1.0, label="measured")
    anchored.plot(x, prior / prior[-1], lw=1.0, ls="--", color="k", label="prior")
    # The y-range is the measured profile's and the prior's: a trained model's attention-only rollout spans
    # ~40 decades (its attention sink raised to H layers) and would flatten them into a line at the bottom.
    raw_range = log_range(profile, prior)
    anchored_range = log_range(profile / profile[-1], prior / prior[-1])
    for k, (name, curve) in enumerate((rollouts or {}).items()):
        curve = np.abs(np.asarray(curve, dtype=np.float64))
        scaled = curve * 10.0 ** np.mean(log10_profile(profile) - log10_profile(curve))  # (L,)
        style = {"lw": 0.9, "ls": "-.", "color": f"C{k + 1}"}
        raw.plot(x, scaled, label=f"rollout, {name}{off_scale_note(scaled, raw_range)}", **style)
        if scaled[-1] > 0:  # an attention-only rollout can give the last token no weight at all
            anchored_curve = scaled / scaled[-1]
            anchored.plot(x, anchored_curve, label=f"rollout, {name}{off_scale_note(anchored_curve, anchored_range)}",
                          **style)
    raw.set(yscale="log", xlabel=X_LABEL, ylabel=RHO_LABEL, title="raw (prior and rollouts scaled by their fit)",
            ylim=raw_range)
    anchored.set(yscale="log", xlabel=X_LABEL, ylabel=r"$\rho(j) / \rho(L)$", title="anchored at x = 1",
                 ylim=anchored_range)
    for ax in (raw, anchored):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Jacobian profile vs. Cesàro prior")
    return fig


def log_range(*curves: np.ndarray, margin_decades: float = 1.0) -> tuple[float, float]:
    """Log-axis limits spanning the positive values of `curves`, `margin_decades` wider at each end."""
    values = np.concatenate([np.asarray(c, dtype=np.float64).ravel() for c in curves])
    logs = np.log10(values[np.isfinite(values) & (values > 0)])
    return 10.0 ** (logs.min() - margin_decades), 10.0 ** (logs.max() + margin_decades)


def off_scale_note(curve: np.ndarray, limits: tuple[float, float]) -> str:
    """' (clipped: 1e-20 to 1e+20)' when part of the curve lies outside `limits`, else ''."""
    shown = curve[np.isfinite(curve) & (curve > 0)]
    if shown.size == 0 or (shown.min() >= limits[0] and shown.max() <= limits[1]):
        return ""
    return f" (clipped: {shown.min():.0e} to {shown.max():.0e})"


def plot_profile_vs_prior(
    profile: np.ndarray, H: int, out_png: str | os.PathLike, title: str = "",
    rollouts: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """`profile_vs_prior_figure` as a PNG."""
    return _save(profile_vs_prior_figure(profile, H, title, rollouts), out_png)


def _edges(centres: np.ndarray) -> np.ndarray:
    """Cell edges around (possibly uneven) centres, for pcolormesh."""
    c = np.asarray(centres, dtype=np.float64)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[2 * c[0] - mid[0]], mid, [2 * c[-1] - mid[-1]]])


def heatmap_figure(npz_path: str | os.PathLike, set_name: str) -> Figure:
    """Step x position heatmap of log10 of the mean profile normalized to sum 1 at each step."""
    steps, mean, n_seq = _load_set(npz_path, set_name)  # (S,), (S, L)
    share = mean / mean.sum(axis=1, keepdims=True)  # (S, L)
    with np.errstate(divide="ignore"):
        log_share = np.log10(share)  # (S, L); exact zeros become -inf and are drawn blank
    L = mean.shape[1]

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    mesh = ax.pcolormesh(_edges(_rel_x(L)), _edges(steps), np.ma.masked_invalid(log_share), cmap="magma")
    ax.set(xlabel=X_LABEL, ylabel="training step",
           title=f"log10 normalized Jacobian profile, {set_name}: mean of {n_seq} sequences, L = {L}")
    fig.colorbar(mesh, ax=ax, label=r"$\log_{10}\,(\rho(j)\, /\, \Sigma_i\, \rho(i))$")
    return fig


def plot_heatmap(npz_path: str | os.PathLike, out_png: str | os.PathLike, set_name: str) -> Path:
    """`heatmap_figure` as a PNG."""
    return _save(heatmap_figure(npz_path, set_name), out_png)


def depth_accuracy_figure(
    curves: Mapping[str, Sequence[float]], title: str = "", xlabel: str = "gold depth bin"
) -> Figure:
    """Accuracy per gold-depth bin, one line per label (e.g. 'step 0', 'step 500'); bins split [0, 1]."""
    if not curves:
        raise ValueError("no curves to plot")
    n_bins = {len(acc) for acc in curves.values()}
    if len(n_bins) != 1:
        raise ValueError(f"every curve needs the same number of bins, got {sorted(n_bins)}")
    n = n_bins.pop()
    x = np.arange(n)

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, acc in curves.items():
        ax.plot(x, np.asarray(acc, dtype=np.float64), marker="o", label=label)
    ax.set_xticks(x, [f"{100 * i / n:.0f}-{100 * (i + 1) / n:.0f}%" for i in range(n)],
                  rotation=45 if n > 6 else 0)
    ax.set(xlabel=xlabel, ylabel="accuracy", ylim=(0.0, 1.02), title=title or "Accuracy by gold depth")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_depth_accuracy(
    curves: Mapping[str, Sequence[float]],
    out_png: str | os.PathLike,
    title: str = "",
    xlabel: str = "gold depth bin",
) -> Path:
    """`depth_accuracy_figure` as a PNG."""
    return _save(depth_accuracy_figure(curves, title, xlabel), out_png)


def position_accuracy_figure(
    results: Mapping[str, "ProbeResult"], title: str = "", xlabel: str = "gold position", score: Score = ACCURACY
) -> Figure:
    """A score (accuracy by default) by gold position with 95% bootstrap intervals, one curve per label;
    closed-book dashed.

    Past ten curves the colours come from a 20-colour map (no two curves share one up to 20); past four, the
    legend sits beside the axes, so it never hides a curve. The y axis is 0-1 when every value drawn lies in
    [0, 1] (accuracy), else automatic (a score such as log-likelihood in nats)."""
    labels: dict[int, str] = {}
    for result in results.values():
        labels.update(result.labels())
    positions = sorted(p for p in labels if p >= 0)
    beside = len(results) > 4
    fig = Figure(figsize=(11.5 if beside else 7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    palette = colormaps["tab20"] if len(results) > 10 else None
    drawn: list[float] = []
    for i, (name, result) in enumerate(results.items()):
        colour = palette(i % 20) if palette is not None else f"C{i % 10}"
        acc, ci = result.accuracy_by_position(score), result.ci_by_position(score=score)
        shown = [p for p in positions if p in acc]
        _interval_series(ax, np.array([positions.index(p) for p in shown]), np.array([acc[p] for p in shown]),
                         np.array([ci[p] for p in shown]), i, len(results), 0.08, colour, name)
        drawn += [acc[p] for p in shown] + [end for p in shown for end in ci[p]]
        if -1 in acc:
            drawn.append(acc[-1])
            ax.axhline(acc[-1], ls="--", lw=1, color=colour, label=f"{name}, closed-book")
    ax.set_xticks(range(len(positions)), [labels[p] for p in positions])
    ax.set(xlabel=xlabel, ylabel=score.label, title=title or f"{score.label.capitalize()} by gold position")
    values = np.array(drawn)  # (k,) every point, interval end and closed-book level; nan ones are not drawn
    if np.all(~np.isfinite(values) | ((values >= 0) & (values <= 1))):
        ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    if beside:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    return fig


def plot_position_accuracy(
    results: Mapping[str, "ProbeResult"], out_png: str | Path, title: str = "", xlabel: str = "gold position",
    score: Score = ACCURACY,
) -> Path:
    """`position_accuracy_figure` as a PNG."""
    return _save(position_accuracy_figure(results, title, xlabel, score), out_png)


def needle_grid(result: "ProbeResult") -> tuple[list[int], list[float], np.ndarray, np.ndarray]:
    """Needle accuracy by requested context length x depth.

    Returns the sorted distinct lengths (n_len,), the sorted distinct depths (n_depth,), the mean
    correctness per cell (n_len, n_depth) float64 with NaN where no item, and the item count per cell
    (n_len, n_depth) int. Outcomes without extra["context_len"] and extra["depth"] are skipped.
    """
    cells = [(int(o["extra"]["context_len"]), float(o["extra"]["depth"]), float(o["correct"]))
             for o in result.outcomes
             if "context_len" in (o.get("extra") or {}) and "depth" in (o.get("extra") or {})]
    if not cells:
        raise ValueError(f"probe {result.probe!r} has no outcome with extra['context_len'] and extra['depth']; "
                         f"the needle grid needs a needle-probe result")
    lengths = sorted({length for length, _, _ in cells})
    depths = sorted({depth for _, depth, _ in cells})
    row = {length: i for i, length in enumerate(lengths)}
    col = {depth: j for j, depth in enumerate(depths)}
    total = np.zeros((len(lengths), len(depths)), dtype=np.float64)
    counts = np.zeros((len(lengths), len(depths)), dtype=int)
    for length, depth, correct in cells:
        total[row[length], col[depth]] += correct
        counts[row[length], col[depth]] += 1
    with np.errstate(invalid="ignore"):
        accuracy = total / counts  # (n_len, n_depth); 0/0 leaves NaN in empty cells
    return lengths, depths, accuracy, counts


def _on_axes(
    grid: tuple[list[int], list[float], np.ndarray, np.ndarray], lengths: list[int], depths: list[float]
) -> np.ndarray:
    """A needle grid's accuracy (n_len, n_depth) placed on the given (wider) length and depth axes."""
    own_lengths, own_depths, accuracy, _ = grid
    out = np.full((len(lengths), len(depths)), np.nan)
    rows = [lengths.index(length) for length in own_lengths]
    cols = [depths.index(depth) for depth in own_depths]
    out[np.ix_(rows, cols)] = accuracy
    return out


def _annotated_grid(ax: Axes, values: np.ndarray, cmap: Colormap, norm: Normalize, fmt: str) -> AxesImage:
    """Draw a (n_len, n_depth) grid as an image, smallest length at the bottom, each cell labelled."""
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, origin="lower", aspect="auto",
                      interpolation="nearest")
    for (i, j), v in np.ndenumerate(values):
        if np.isnan(v):
            ax.text(j, i, "–", ha="center", va="center", fontsize=8, color="k")
            continue
        r, g, b, _ = cmap(norm(v))
        ink = "w" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "k"  # legible on dark and light cells
        ax.text(j, i, format(v, fmt).replace("-", "−"), ha="center", va="center", fontsize=8, color=ink)
    return image


def needle_grid_figure(results: Mapping[str, "ProbeResult"], title: str = "") -> Figure:
    """Needle accuracy heatmaps (context length x depth), one panel per label, on a fixed 0..1 scale.

    With 2+ results a second row draws, under each later result, its difference from the first
    ("<label> − <first label>", fixed −1..1 diverging scale). All panels share the union of the
    results' lengths and depths; cells a result lacks are blank ("–").
    """
    if not results:
        raise ValueError("no results to plot")
    grids = {label: needle_grid(result) for label, result in results.items()}
    lengths = sorted({length for grid in grids.values() for length in grid[0]})
    depths = sorted({depth for grid in grids.values() for depth in grid[1]})
    accuracy = {label: _on_axes(grid, lengths, depths) for label, grid in grids.items()}  # (n_len, n_depth)
    labels = list(results)
    n_cols, n_rows = len(labels), 1 if len(labels) == 1 else 2

    panel_w = max(3.5, 1.3 + 0.6 * len(depths))
    panel_h = max(2.8, 1.1 + 0.45 * len(lengths))
    fig = Figure(figsize=(n_cols * panel_w + 1.3, n_rows * panel_h + 0.6), layout="constrained")
    gs = fig.add_gridspec(n_rows, n_cols)
    acc_cmap = colormaps["viridis"].with_extremes(bad="0.85")
    diff_cmap = colormaps["RdBu"].with_extremes(bad="0.85")
    acc_norm, diff_norm = Normalize(0.0, 1.0), Normalize(-1.0, 1.0)

    acc_axes, diff_axes = [], []
    for k, label in enumerate(labels):
        ax = fig.add_subplot(gs[0, k])
        _annotated_grid(ax, accuracy[label], acc_cmap, acc_norm, ".2f")
        ax.set_title(label)
        acc_axes.append(ax)
    first = labels[0]
    for k, label in enumerate(labels[1:], start=1):
        ax = fig.add_subplot(gs[1, k])
        _annotated_grid(ax, accuracy[label] - accuracy[first], diff_cmap, diff_norm, "+.2f")
        ax.set_title(f"{label} − {first}")
        diff_axes.append(ax)

    depth_ticks = [f"{100 * d:g}%" for d in depths]
    for ax in acc_axes + diff_axes:
        ax.set_xticks(range(len(depths)), depth_ticks, rotation=45 if len(depths) > 12 else 0)
        ax.set_yticks(range(len(lengths)), [str(length) for length in lengths])
        ax.set(xlabel="needle depth", ylabel="context length (tokens)")
    fig.colorbar(ScalarMappable(norm=acc_norm, cmap=acc_cmap), ax=acc_axes, label="accuracy")
    if diff_axes:
        fig.colorbar(ScalarMappable(norm=diff_norm, cmap=diff_cmap), ax=diff_axes, label="accuracy difference")
    fig.suptitle(title or "Needle in a haystack: accuracy by context length and depth")
    return fig


def plot_needle_grid(results: Mapping[str, "ProbeResult"], out_png: str | os.PathLike, title: str = "") -> Path:
    """`needle_grid_figure` as a PNG."""
    return _save(needle_grid_figure(results, title), out_png)


@dataclass(frozen=True)
class PathProfile:
    """One PATH's curves of one Jacobian set, as `profiles_figure` draws them."""

    label: str  # the PATH's label
    step: int | None  # the checkpoint's training step, None when unknown
    layers: int  # H of its fitted prior
    profile: np.ndarray  # (L,) the checkpoint's mean profile
    initial: np.ndarray | None = None  # (L,) step 0 of its run
    rollout: np.ndarray | None = None  # (L,) its attention rollout with measured residual shares


def profiles_figure(paths: Sequence[PathProfile | None], set_name: str) -> Figure:
    """One set's profile of every PATH, its fitted prior (dashed), step 0 (dotted) and rollout (dash-dot); raw
    and anchored. None stands for a PATH without this set: nothing is drawn, and the later PATHs keep their colours.
    """
    fig = Figure(figsize=(13, 5), layout="constrained")
    raw, anchored = fig.subplots(1, 2)
    for i, path in enumerate(paths):
        if path is None:
            continue
        label, profile, x = path.label, path.profile, _rel_x(len(path.profile))
        prior, alpha = scaled_prior(profile, path.layers)  # (L,), the best-fitting a
        step = f"step {path.step}" if path.step is not None else "checkpoint"
        curves = [(f"{label} ({step})", profile, {"lw": 1.2}),
                  (f"{label} prior, H={path.layers}, a={alpha:.3f}", prior, {"lw": 0.9, "ls": "--"})]
        if path.initial is not None:
            curves.append((f"{label} (step 0)", path.initial, {"lw": 0.9, "ls": ":"}))
        if path.rollout is not None:  # on the profile's scale, by its mean log10 offset
            scaled = path.rollout * 10.0 ** np.mean(log10_profile(profile) - log10_profile(path.rollout))
            curves.append((f"{label} rollout, measured λ", scaled, {"lw": 0.9, "ls": "-."}))
        for text, curve, style in curves:
            raw.plot(x, curve, color=f"C{i % 10}", label=text, **style)
            anchored.plot(x, curve / curve[-1], color=f"C{i % 10}", label=text, **style)
    raw.set(yscale="log", xlabel=X_LABEL, ylabel=r"$\rho(j)$", title="raw (prior scaled by its fit)")
    anchored.set(yscale="log", xlabel=X_LABEL, ylabel=r"$\rho(j) / \rho(L)$", title="anchored at x = 1")
    for ax in (raw, anchored):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Jacobian profiles, {set_name}: mean over sequences")
    return fig


def plot_profiles(paths: Sequence[PathProfile | None], set_name: str, out_png: str | os.PathLike) -> Path:
    """`profiles_figure` as a PNG."""
    return _save(profiles_figure(paths, set_name), out_png)


def depth_intervals_figure(
    arms: Mapping[str, tuple[Sequence[float], Sequence[Sequence[float]]]],
    start: Sequence[float],
    start_label: str,
    title: str,
) -> Figure:
    """Accuracy by gold-depth bin with 95% bootstrap intervals, one series per arm (name -> (accuracy (B,),
    interval (B, 2))), at the centres of B equal bins of [0, 1]; dashed grey: `start` (B,), where the arms began."""
    n_bins = len(start)
    x = np.arange(n_bins) / n_bins + 0.5 / n_bins  # bin centres: lower edge + half a bin
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(x, np.asarray(start, dtype=np.float64), ls="--", lw=1.2, color="grey", marker=".", label=start_label)
    for i, (arm, (acc, ci)) in enumerate(arms.items()):
        _interval_series(ax, x, np.asarray(acc, dtype=np.float64), np.asarray(ci, dtype=np.float64), i, len(arms),
                         0.12 / n_bins, f"C{i % 10}", arm)
    ax.set(xlabel="gold depth (bin centre)", ylabel="accuracy", xlim=(0.0, 1.0), ylim=(-0.02, 1.02), title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_depth_intervals(
    arms: Mapping[str, tuple[Sequence[float], Sequence[Sequence[float]]]],
    start: Sequence[float],
    start_label: str,
    title: str,
    out_png: str | os.PathLike,
) -> Path:
    """`depth_intervals_figure` as a PNG."""
    return _save(depth_intervals_figure(arms, start, start_label, title), out_png)


@dataclass(frozen=True)
class ScatterPanel:
    """One panel of `valley_accuracy_scatter_figure`: its title, x label and points by arm."""

    title: str
    xlabel: str
    points: Mapping[str, tuple[Sequence[float], Sequence[float]]]  # arm -> (x (k,), y (k,))


def valley_accuracy_scatter_figure(
    panels: Sequence[Sequence[ScatterPanel]], arms: Sequence[str], ylabel: str, title: str
) -> Figure:
    """A grid of scatter panels (rows of equal length), points coloured by arm: arm i of `arms` is C<i> in every
    panel (as in `depth_intervals_figure`), named once in the figure's legend; grey lines at x = 0 and y = 0."""
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    fig = Figure(figsize=(3.8 * len(panels[0]) + 1.5, 3.4 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), len(panels[0]), squeeze=False)
    named: set[str] = set()
    for ax, panel in zip(axes.flat, [panel for row in panels for panel in row]):
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.axvline(0.0, color="grey", lw=0.8)
        for arm, (x, y) in panel.points.items():
            ax.scatter(x, y, s=20, color=colours[arm], label=None if arm in named else arm)
            named.add(arm)
        ax.set(xlabel=panel.xlabel, ylabel=ylabel)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(True, alpha=0.3)
    if named:
        fig.legend(loc="outside right upper", fontsize=8)
    fig.suptitle(title)
    return fig


def plot_valley_accuracy_scatter(
    panels: Sequence[Sequence[ScatterPanel]], arms: Sequence[str], ylabel: str, title: str,
    out_png: str | os.PathLike,
) -> Path:
    """`valley_accuracy_scatter_figure` as a PNG."""
    return _save(valley_accuracy_scatter_figure(panels, arms, ylabel, title), out_png)


def predicted_profiles_figure(
    curves: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]], measured: str, priors: Collection[str]
) -> Figure:
    """A measured profile and its predictions, each scaled to sum 1: a row of panels per model, a column per set.

    `curves[model][set]`: name -> (L,); the curve named `measured` is drawn thick and black, those named in
    `priors` dotted, and every other one is a rollout. The y-range follows the measured curve and the priors:
    a trained model's attention-only rollout can span tens of decades (its attention sink raised to every
    layer), so a rollout beyond that range is clipped and its legend entry gives its span.
    """
    models, sets = list(curves), list(dict.fromkeys(s for by_set in curves.values() for s in by_set))
    fig = Figure(figsize=(6.5 * len(sets), 4.5 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), len(sets), squeeze=False)  # rows: models, columns: sets
    for ax, (model, set_name) in zip(axes.flat, [(m, s) for m in models for s in sets]):
        shares = {name: curve / curve.sum() for name, curve in curves[model][set_name].items()}
        limits = log_range(*(c for name, c in shares.items() if name == measured or name in priors))
        for k, (name, share) in enumerate(shares.items()):
            label = name if name == measured or name in priors else f"rollout, {name}{off_scale_note(share, limits)}"
            ax.plot(_rel_x(len(share)), share, lw=2.0 if name == measured else 1.0,
                    color="k" if name == measured else f"C{k}", ls=":" if name in priors else "-", label=label)
        ax.set(yscale="log", ylim=limits, xlabel=X_LABEL, ylabel="share of influence", title=f"{model}, {set_name}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def plot_predicted_profiles(
    curves: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]], out_png: str | os.PathLike, measured: str,
    priors: Collection[str],
) -> Path:
    """`predicted_profiles_figure` as a PNG."""
    return _save(predicted_profiles_figure(curves, measured, priors), out_png, dpi=110)


def prior_figure(x: np.ndarray, p: np.ndarray, title: str) -> Figure:
    """The closed-form prior p (L,) at relative positions x (L,), log scale: raw, and anchored at x = 1."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    raw, anchored = fig.subplots(1, 2)
    raw.semilogy(x, p)
    raw.set(title="raw p(j)", xlabel="x = (j-1)/(L-1)", ylabel="p(j)")
    anchored.semilogy(x, p / p[-1])
    anchored.set(title="anchored at x = 1", xlabel="x = (j-1)/(L-1)", ylabel="p(j) / p(L)")
    fig.suptitle(title)
    return fig


def plot_prior(x: np.ndarray, p: np.ndarray, out_png: str | os.PathLike, title: str) -> Path:
    """`prior_figure` as a PNG."""
    return _save(prior_figure(x, p, title), out_png)


def valprobing_figure(summaries: Mapping[str, Sequence["Summary"]], title: str = "") -> Figure:
    """VaLProbing as FILM draws it: one panel per task, bins on x, each model's bin means with the spread over
    sets as error bars, the models overlaid (`analysis.evaluation.valprobing.Summary` of each model and task)."""
    tasks = list(dict.fromkeys(s.task for row in summaries.values() for s in row))
    fig = Figure(figsize=(4.2 * len(tasks), 3.6), layout="constrained")
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        shown = [(model, s) for model, row in summaries.items() for s in row if s.task == task]
        for i, (model, s) in enumerate(shown):
            x = np.arange(len(s.labels))
            ax.errorbar(x + 0.1 * (i - (len(shown) - 1) / 2), s.by_bin, yerr=s.spread, marker="o", capsize=3,
                        label=f"{model}: Avg {s.avg.value:.2f}, Gap {s.gap:.2f}")
            ax.set_xticks(x, s.labels, rotation=90 if len(x) > 10 else 0, fontsize=7)
            ax.set_ylabel(s.score.label)
            if s.score.rate:
                ax.set_ylim(-0.02, 1.02)
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("bin (its first piece's position)")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_valprobing(summaries: Mapping[str, Sequence["Summary"]], out_png: str | os.PathLike, title: str = "") -> Path:
    return _save(valprobing_figure(summaries, title), out_png)


def arm_curves_figure(estimates: Mapping[str, Any], title: str = "", score: Score = ACCURACY) -> Figure:
    """A score by gold position for the starting model and each arm (mean over its seeds), each with its interval
    (`analysis.probe_study.position_estimates`: the arms' crossed-design t intervals, the starting model's bootstrap
    over questions); the closed-book levels dashed."""
    positions = [p for p in estimates["positions"] if p >= 0]
    curves = {"starting model": estimates["base"], **estimates["arms"]}
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, (name, rows) in enumerate(curves.items()):
        colour = "black" if i == 0 else f"C{(i - 1) % 10}"
        values = [rows[str(p)]["value"] for p in positions]
        _interval_series(ax, np.arange(len(positions)), np.array([v["value"] for v in values]),
                         np.array([(v["low"], v["high"]) for v in values]), i, len(curves), 0.08, colour, name)
        if "-1" in rows:
            ax.axhline(rows["-1"]["value"]["value"], ls="--", lw=1, color=colour, label=f"{name}, closed-book")
    ax.set_xticks(range(len(positions)), [str(p) for p in positions])
    ax.set(xlabel="gold position", ylabel=score.label, title=title or f"{score.label.capitalize()} by gold position")
    if score.rate:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_arm_curves(estimates: Mapping[str, Any], out_png: str | os.PathLike, title: str = "",
                    score: Score = ACCURACY) -> Path:
    """`arm_curves_figure` as a PNG."""
    return _save(arm_curves_figure(estimates, title, score), out_png)


def tracking_figure(across: Sequence[Mapping[str, Any]], within: Sequence[Mapping[str, Any]],
                    followers: int = 4, columns: int = 4, clock: str | None = None) -> Figure:
    """Does a watched signal track the test curve (scripts.watch_tracking)? Upper panels, `columns` a row, the
    signals that rank the runs best first (by |rho|; `across`'s order breaks ties): each signal's change over a run
    against the run's test contrast change, one point a run, rho in the title. Lower panels, one a run: the dev
    contrast over the checkpoints (black) and the `followers` signals that follow it best, each rescaled to [0, 1];
    `clock` names the row of the step itself, drawn dashed as the line to beat."""
    def strength(row: Mapping[str, Any]) -> float:
        return abs(row["rho"]) if math.isfinite(row["rho"]) else -1.0

    across = sorted((a for a in across if a["changes"]), key=strength, reverse=True)
    runs = sorted({w["run"] for w in within if len(w["steps"]) >= 2})  # a curve needs two checkpoints
    rows_across = -(-len(across) // columns) if across else 0
    fig = Figure(figsize=(3.4 * columns, 3.0 * (rows_across + (1 if runs else 0)) + 0.4), layout="constrained")
    upper, lower = fig.subfigures(2, 1, height_ratios=[max(rows_across, 1e-3), 1 if runs else 1e-3])
    for k, a in enumerate(across):
        ax = upper.add_subplot(rows_across, columns, k + 1)
        ax.scatter(a["changes"], a["test_changes"], color="C0")
        for x, y, n in zip(a["changes"], a["test_changes"], a["runs"]):
            ax.annotate(str(n), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{_wrapped(a['signal'])}\nrho {a['rho']:+.2f}, p {a['p_value']:.3f}", fontsize=7)
        ax.set_xlabel("change over the run", fontsize=7)
        ax.set_ylabel("test contrast change (nats)", fontsize=7)
        ax.tick_params(labelsize=6)

    def scaled(values: Sequence[float]) -> np.ndarray:
        v = np.asarray(values, dtype=float)
        return (v - v.min()) / (np.ptp(v) or 1.0)

    for k, n in enumerate(runs):
        ax = lower.add_subplot(1, max(len(runs), 2), k + 1)
        curves = [w for w in within if w["run"] == n and len(w["steps"]) >= 2]
        ax.plot(curves[0]["steps"], scaled(curves[0]["dev"]), color="black", linewidth=2.5, label="dev contrast")
        for w in curves:
            if w["signal"] == clock:
                ax.plot(w["steps"], scaled(w["values"]), color="grey", linestyle="--",
                        label=f"{_wrapped(w['signal'], 60)} ({w['rho']:+.2f})")
        best = sorted((w for w in curves if w["signal"] != clock), key=strength, reverse=True)[:followers]
        for c, w in enumerate(best):
            ax.plot(w["steps"], scaled(w["values"]), color=f"C{c % 10}",
                    label=f"{_wrapped(w['signal'], 60)} ({w['rho']:+.2f})")
        ax.set_title(f"run {n}: the dev contrast and the signals that follow it best (rescaled)", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    return fig


def _wrapped(text: str, width: int = 38) -> str:
    """A long signal name over several lines, broken at its spaces and slashes."""
    lines, line = [], ""
    for piece in re.split(r"(?<=[ /])", text):
        if line and len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
    return "\n".join([*lines, line.rstrip()])


def plot_tracking(across: Sequence[Mapping[str, Any]], within: Sequence[Mapping[str, Any]],
                  out_png: str | os.PathLike, clock: str | None = None) -> Path:
    """`tracking_figure` as a PNG."""
    return _save(tracking_figure(across, within, clock=clock), out_png)
