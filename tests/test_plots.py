"""Plots: what each figure draws (line data, scales, limits, legends), and that its PNG is written.

The figures are read back from the `*_figure` builders that the `plot_*` functions save.
"""

import numpy as np
import pytest
from PIL import Image

from analysis.jacobian import JacobianRecorder, ProfileResult
from analysis.plots import (
    MAX_LINES,
    depth_accuracy_figure,
    evolution_figure,
    heatmap_figure,
    plot_depth_accuracy,
    plot_evolution,
    plot_heatmap,
    plot_position_accuracy,
    plot_profile_vs_prior,
    position_accuracy_figure,
    profile_vs_prior_figure,
)
from analysis.positional_eval import ProbeResult
from analysis.prior import fit_alpha, prior_profile

H, L = 6, 64
STEPS = [0, 10, 20, 50]


def assert_png(path, min_size=(200, 150)) -> None:
    assert path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] >= min_size[0] and im.size[1] >= min_size[1]


@pytest.fixture
def npz(tmp_path):
    """A run whose profile drifts from the prior with a=0.2 towards one with a=0.6 over 4 steps."""
    rng = np.random.default_rng(0)
    rec = JacobianRecorder(tmp_path / "jacobian.npz", {"vanilla": 2, "chunked": 3}, L)
    for i, step in enumerate(STEPS):
        base = prior_profile(L, H, 0.2 + 0.1 * i) * 1e3  # (L,)
        rec.add(step, {name: ProfileResult(base * rng.lognormal(0.0, 0.05, (n, L)), None)
                       for name, n in rec.sets.items()})
    rec.close()
    with np.load(rec.path) as z:
        means = {name: z[name].astype(np.float64).mean(axis=0) for name in rec.sets}  # (S, L)
    return rec.path, means


def test_evolution_draws_each_steps_mean_profile_raw_and_anchored(npz, tmp_path):
    path, means = npz
    raw, anchored, colorbar = evolution_figure(path, "vanilla").axes
    assert len(raw.lines) == len(anchored.lines) == len(STEPS)
    for line, mean in zip(raw.lines, means["vanilla"]):
        np.testing.assert_allclose(line.get_xdata(), np.arange(L) / (L - 1))
        np.testing.assert_allclose(line.get_ydata(), mean, rtol=1e-12)
    for line, mean in zip(anchored.lines, means["vanilla"]):
        np.testing.assert_allclose(line.get_ydata(), mean / mean[-1], rtol=1e-12)
    assert raw.get_yscale() == anchored.get_yscale() == "log"
    assert colorbar.get_ylim() == (0.0, 50.0)  # the colour scale spans the recorded steps

    out = plot_evolution(path, tmp_path / "plots" / "evolution_vanilla.png", "vanilla")
    assert out == tmp_path / "plots" / "evolution_vanilla.png"
    assert_png(out)


def test_evolution_draws_at_most_max_lines_with_first_and_last(tmp_path):
    rec = JacobianRecorder(tmp_path / "jacobian.npz", {"chunked": 1}, 8)
    steps = range(MAX_LINES + 40)
    for step in steps:
        rec.add(step, {"chunked": ProfileResult(np.full((1, 8), step + 1.0), None)})
    raw = evolution_figure(rec.path, "chunked").axes[0]
    firsts = [line.get_ydata()[0] for line in raw.lines]
    assert len(raw.lines) == MAX_LINES and firsts[0] == 1.0 and firsts[-1] == len(steps)


def test_evolution_single_step_and_unknown_set(npz, tmp_path):
    rec = JacobianRecorder(tmp_path / "single" / "jacobian.npz", {"chunked": 1}, L)
    rec.add(0, {"chunked": ProfileResult(prior_profile(L, H, 0.3)[None], None)})
    assert len(evolution_figure(rec.path, "chunked").axes[0].lines) == 1
    with pytest.raises(KeyError, match="no set 'needle'"):
        plot_evolution(npz[0], tmp_path / "x.png", "needle")


def test_heatmap_cells_are_log10_shares(npz, tmp_path):
    path, means = npz
    ax = heatmap_figure(path, "chunked").axes[0]
    (mesh,) = ax.collections
    share = means["chunked"] / means["chunked"].sum(axis=1, keepdims=True)  # (S, L)
    np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(len(STEPS), L), np.log10(share), rtol=1e-12)
    lo, hi = ax.get_ylim()
    assert lo < STEPS[0] and hi > STEPS[-1]  # every step has its row
    assert_png(plot_heatmap(path, tmp_path / "heat.png", "chunked"))


def test_profile_vs_prior_draws_the_profile_and_its_scaled_fit(tmp_path):
    profile = prior_profile(L, H, 0.35) * 50.0 * np.random.default_rng(1).lognormal(0.0, 0.1, L)
    raw, anchored = profile_vs_prior_figure(profile, H, title="step 0, vanilla").axes
    fit = fit_alpha(profile, H)
    prior = prior_profile(L, H, fit.alpha) * 10**fit.log10_scale
    measured_line, prior_line = raw.lines
    np.testing.assert_array_equal(measured_line.get_ydata(), profile)
    np.testing.assert_allclose(prior_line.get_ydata(), prior, rtol=1e-12)
    np.testing.assert_allclose(anchored.lines[1].get_ydata(), prior / prior[-1], rtol=1e-12)
    assert anchored.lines[0].get_ydata()[-1] == anchored.lines[1].get_ydata()[-1] == 1.0
    assert abs(fit.alpha - 0.35) < 0.05
    labels = [t.get_text() for t in raw.get_legend().get_texts()]
    assert labels[0] == "measured" and labels[1].startswith(f"prior, H = {H}, a = {fit.alpha:.3f}")
    assert raw.get_yscale() == anchored.get_yscale() == "log"
    assert_png(plot_profile_vs_prior(profile, H, tmp_path / "prior.png", title="step 0, vanilla"))


def test_depth_accuracy_draws_each_curve_in_its_bins(tmp_path):
    curves = {"step 0": [0.9, 0.5, 0.4, 0.6, 0.95], "step 500": [0.92, 0.8, 0.78, 0.85, 0.96]}
    ax = depth_accuracy_figure(curves, title="IN2 accuracy by depth").axes[0]
    for line, acc in zip(ax.lines, curves.values()):
        np.testing.assert_array_equal(line.get_xdata(), np.arange(5))
        np.testing.assert_array_equal(line.get_ydata(), acc)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0-20%", "20-40%", "40-60%", "60-80%", "80-100%"]
    assert ax.get_ylim() == (0.0, 1.02)
    assert_png(plot_depth_accuracy(curves, tmp_path / "depth.png", title="IN2 accuracy by depth"))
    with pytest.raises(ValueError, match="same number of bins"):
        plot_depth_accuracy({"a": [0.1, 0.2], "b": [0.3]}, tmp_path / "bad.png")


def test_position_accuracy_points_intervals_and_closed_book_line(tmp_path):
    def result(correct_at: dict[int, list[float]]) -> ProbeResult:
        return ProbeResult("mdqa", [
            {"id": f"q{q}@{pos}", "query": f"q{q}", "position": pos, "label": "closedbook" if pos < 0 else str(pos),
             "prediction": "", "answers": ["x"], "correct": c, "extra": {}}
            for pos, column in correct_at.items() for q, c in enumerate(column)
        ])

    a = result({0: [1, 1, 1, 0], 4: [0, 0, 1, 0], 9: [1, 1, 1, 1], -1: [0, 0, 0, 1]})
    ax = position_accuracy_figure({"A": a}, "mdqa").axes[0]
    (errorbar,) = ax.containers
    points, _, (bars,) = errorbar.lines  # data line, caps, interval segments
    np.testing.assert_array_equal(points.get_xdata(), [0, 1, 2])
    np.testing.assert_array_equal(points.get_ydata(), [0.75, 0.25, 1.0])
    ci = a.ci_by_position()
    np.testing.assert_allclose([seg[:, 1] for seg in bars.get_segments()], [ci[0], ci[4], ci[9]])
    np.testing.assert_array_equal(ax.lines[-1].get_ydata(), [0.25, 0.25])  # closed-book accuracy
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "4", "9"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A, closed-book", "A"]
    assert_png(plot_position_accuracy({"A": a}, tmp_path / "mdqa.png", "mdqa"))
