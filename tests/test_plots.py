"""Plots: what each figure draws (line data, scales, limits, legends), and that its PNG is written.

The figures are read back from the `*_figure` builders that the `plot_*` functions save.
"""

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from PIL import Image

from analysis.evaluation.result import ProbeResult
from analysis.measure.jacobian import JacobianRecorder, ProfileResult
from analysis.measure.prior import fit_alpha, prior_profile
from analysis.report.figures import (
    MAX_LINES,
    ScatterPanel,
    depth_accuracy_figure,
    depth_intervals_figure,
    evolution_figure,
    heatmap_figure,
    needle_grid,
    needle_grid_figure,
    plot_depth_accuracy,
    plot_depth_intervals,
    plot_evolution,
    plot_heatmap,
    plot_needle_grid,
    plot_position_accuracy,
    plot_predicted_profiles,
    plot_profile_vs_prior,
    plot_valley_accuracy_scatter,
    position_accuracy_figure,
    predicted_profiles_figure,
    prior_figure,
    profile_vs_prior_figure,
    tracking_figure,
    valley_accuracy_scatter_figure,
)

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


def test_profile_vs_prior_draws_rollouts_on_the_profiles_scale(tmp_path):
    profile = prior_profile(L, H, 0.35) * 50.0
    rollout = -prior_profile(L, H, 0.5)  # a diff-attention rollout may be negative: its magnitude is drawn
    raw, anchored = profile_vs_prior_figure(profile, H, rollouts={"measured λ": rollout}).axes
    assert len(raw.lines) == len(anchored.lines) == 3
    drawn = raw.lines[2].get_ydata()
    # On the profile's scale: the mean log10 offset between the two is zero.
    assert np.mean(np.log10(profile) - np.log10(drawn)) == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(drawn / drawn[0], rollout / rollout[0], rtol=1e-12)
    np.testing.assert_allclose(anchored.lines[2].get_ydata(), drawn / drawn[-1], rtol=1e-12)
    assert [t.get_text() for t in raw.get_legend().get_texts()][2] == "rollout, measured λ"
    assert_png(plot_profile_vs_prior(profile, H, tmp_path / "r.png", rollouts={"measured λ": rollout}))


def test_a_rollout_spanning_forty_decades_leaves_the_profile_and_prior_readable():
    # SmolLM2's attention-only rollout at step 0: the attention sink raised to 30 layers, 1e20 at token 0.
    profile = prior_profile(L, H, 0.35) * 50.0
    sink = np.logspace(20, -20, L)
    sink[-1] = 0.0  # no weight at all on the last token: no anchored curve to draw
    raw, anchored = profile_vs_prior_figure(profile, H, rollouts={"attention_only": sink, "measured": profile}).axes
    for ax, shown in ((raw, profile), (anchored, profile / profile[-1])):
        low, high = ax.get_ylim()
        assert np.log10(high) - np.log10(low) < np.ptp(np.log10(shown)) + 2 * 1.0 + 1.0
        assert low <= shown.min() and shown.max() <= high
    labels = [t.get_text() for t in raw.get_legend().get_texts()]
    assert labels[2].startswith("rollout, attention_only (clipped:") and labels[3] == "rollout, measured"
    assert len(anchored.lines) == 3  # measured, prior, the measured rollout


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
    assert ax.get_ylim() == (-0.02, 1.02)  # every value a share: the fixed 0-1 axis
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "4", "9"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A, closed-book", "A"]
    assert_png(plot_position_accuracy({"A": a}, tmp_path / "mdqa.png", "mdqa"))
    # twelve curves (checkpoints x interventions): twelve colours, and the legend beside the axes, off the data
    fig = position_accuracy_figure({f"run {i}": a for i in range(12)}, "mdqa")
    ax = fig.axes[0]
    assert len({tuple(c.lines[0].get_color()) for c in ax.containers}) == 12
    fig.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1


def test_position_accuracy_axis_fits_a_score_outside_0_1():
    nats = ProbeResult("mdqa", [{"id": f"q{q}@{pos}", "query": f"q{q}", "position": pos, "label": str(pos),
                                 "prediction": "", "answers": ["x"], "correct": -3.0 - 0.5 * q - pos, "extra": {}}
                                for pos in (0, 4) for q in range(5)])  # a log-likelihood in nats, not a share
    low, high = position_accuracy_figure({"A": nats}).axes[0].get_ylim()
    assert low < -8.0 and -4.0 < high < 0.0  # around the means -4 and -8, not -0.02 to 1.02


def needle_result(cells: dict[tuple[int, float], list[float]]) -> ProbeResult:
    """A needle ProbeResult with the given correctness per (context_len, depth) cell, one item per value."""
    depths = sorted({depth for _, depth in cells})
    return ProbeResult("needle", [
        {"id": f"needle-{e}-{length}@{depths.index(depth)}", "query": f"needle-{e}-{length}",
         "position": depths.index(depth), "label": str(depth), "prediction": "", "answers": ["12345"],
         "correct": c, "extra": {"example": e, "context_len": length, "depth": depth}}
        for (length, depth), column in cells.items() for e, c in enumerate(column)
    ])


DEPTHS = [0.0, 0.5, 1.0]
# Length 256 is right only at depth 0, 512 everywhere; (256, 1.0) holds no item, (256, 0.5) averages 4.
FIRST = needle_result({(256, 0.0): [1, 1], (256, 0.5): [0, 0, 0, 0], (512, 0.0): [1, 1],
                       (512, 0.5): [1, 1], (512, 1.0): [1, 1]})
# A wider grid (an extra depth 0.25 and length 1024) with its own pattern, for the union of axes.
SECOND = needle_result({(256, 0.0): [1, 0], (256, 0.25): [1, 1], (256, 0.5): [1, 0, 1, 1], (256, 1.0): [1, 1],
                        (512, 0.5): [0, 0], (1024, 1.0): [0, 1]})


def image_data(ax) -> np.ndarray:
    (image,) = ax.images
    return np.ma.filled(np.ma.asarray(image.get_array(), dtype=np.float64), np.nan)


def panels(fig) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.axes if ax.images}


def test_needle_grid_means_counts_and_empty_cells():
    lengths, depths, acc, counts = needle_grid(FIRST)
    assert lengths == [256, 512] and depths == DEPTHS
    np.testing.assert_array_equal(acc, [[1.0, 0.0, np.nan], [1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(counts, [[2, 4, 0], [2, 2, 2]])
    assert acc.dtype == np.float64 and counts.dtype.kind == "i"

    lengths, depths, acc, counts = needle_grid(SECOND)
    assert lengths == [256, 512, 1024] and depths == [0.0, 0.25, 0.5, 1.0]
    assert acc[0, 2] == 0.75 and counts[0, 2] == 4  # mean over several examples of one cell
    assert acc[2, 3] == 0.5 and np.isnan(acc[1, 0]) and counts[1, 0] == 0


def test_needle_grid_rejects_a_result_without_lengths_and_depths(tmp_path):
    mdqa = ProbeResult("mdqa", [{"id": "q0@0", "query": "q0", "position": 0, "label": "0", "prediction": "",
                                 "answers": ["x"], "correct": 1.0, "extra": {}}])
    with pytest.raises(ValueError, match="'mdqa' has no outcome with extra\\['context_len'\\]"):
        needle_grid(mdqa)
    with pytest.raises(ValueError, match="needle-probe result"):
        plot_needle_grid({"A": FIRST, "B": mdqa}, tmp_path / "bad.png")
    with pytest.raises(ValueError, match="no results"):
        needle_grid_figure({})


def test_needle_grid_figure_single_result_draws_the_grid_with_labelled_axes():
    fig = needle_grid_figure({"step 0": FIRST}, title="needle")
    (ax,) = panels(fig).values()
    assert ax.get_title() == "step 0" and fig.get_suptitle() == "needle"
    np.testing.assert_array_equal(image_data(ax), needle_grid(FIRST)[2])
    assert ax.images[0].get_clim() == (0.0, 1.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0%", "50%", "100%"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["256", "512"]
    assert "depth" in ax.get_xlabel() and "context length" in ax.get_ylabel()
    # Cell (row i, column j) is annotated at (x=j, y=i); the empty cell shows a dash.
    texts = {t.get_position(): t.get_text() for t in ax.texts}
    assert texts == {(0, 0): "1.00", (1, 0): "0.00", (2, 0): "–", (0, 1): "1.00", (1, 1): "1.00", (2, 1): "1.00"}
    assert len(fig.axes) == 2  # the panel and its colorbar


def test_needle_grid_figure_difference_panel_on_the_union_of_axes(tmp_path):
    fig = needle_grid_figure({"base": FIRST, "tuned": SECOND})
    shown = panels(fig)
    assert list(shown) == ["base", "tuned", "tuned − base"]
    nan = np.nan
    base = [[1.0, nan, 0.0, nan], [1.0, nan, 1.0, 1.0], [nan, nan, nan, nan]]  # on lengths 256/512/1024
    tuned = [[0.5, 1.0, 0.75, 1.0], [nan, nan, 0.0, nan], [nan, nan, nan, 0.5]]  # x depths 0/25/50/100%
    np.testing.assert_array_equal(image_data(shown["base"]), base)
    np.testing.assert_array_equal(image_data(shown["tuned"]), tuned)
    np.testing.assert_array_equal(image_data(shown["tuned − base"]), np.subtract(tuned, base))
    assert shown["tuned − base"].images[0].get_clim() == (-1.0, 1.0)
    for ax in shown.values():
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0%", "25%", "50%", "100%"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["256", "512", "1024"]
    diff_texts = {t.get_position(): t.get_text() for t in shown["tuned − base"].texts}
    assert diff_texts[(0, 0)] == "−0.50" and diff_texts[(2, 0)] == "+0.75" and diff_texts[(2, 1)] == "−1.00"
    assert diff_texts[(1, 0)] == "–"
    # Three panels and two colorbars: accuracy (0..1, shared) and difference (-1..1).
    colorbars = [ax for ax in fig.axes if not ax.images]
    assert sorted(cb.get_ylim() for cb in colorbars) == [(-1.0, 1.0), (0.0, 1.0)]

    out = plot_needle_grid({"base": FIRST, "tuned": SECOND}, tmp_path / "plots" / "needle.png", "needle")
    assert out == tmp_path / "plots" / "needle.png"
    assert_png(out)


def test_needle_grid_figure_size_grows_with_the_grid_and_panels():
    big = needle_result({(1024 * 2**i, d / 10): [1.0] for i in range(8) for d in range(11)})
    one = needle_grid_figure({"a": big}).get_size_inches()
    three = needle_grid_figure({"a": big, "b": big, "c": big}).get_size_inches()
    small = needle_grid_figure({"a": FIRST}).get_size_inches()
    assert one[0] >= 7 and one[1] >= 4  # about 0.6 x 0.45 inch per cell for 8 lengths x 11 depths
    assert three[0] > 2.5 * one[0] - 3 and three[1] > 1.8 * one[1] - 1
    assert small[0] < one[0] and small[1] < one[1]


def test_depth_intervals_sets_the_arms_apart_around_the_bin_centres(tmp_path):
    arms = {"none": ([0.5, 0.25, 1.0, 0.75], [[0.4, 0.6], [0.1, 0.3], [0.9, 1.0], [0.7, 0.8]]),
            "group_dro": ([0.6, 0.7, 0.8, 0.9], [[0.5, 0.7], [0.6, 0.8], [0.7, 0.9], [0.8, 1.0]])}
    start = [0.2, 0.1, 0.1, 0.3]
    ax = depth_intervals_figure(arms, start, "none, step 0 (start)", "by depth").axes[0]
    centres = np.array([0.125, 0.375, 0.625, 0.875])
    (start_line,) = [line for line in ax.lines if line.get_label() == "none, step 0 (start)"]
    np.testing.assert_allclose(start_line.get_xdata(), centres)
    np.testing.assert_array_equal(start_line.get_ydata(), start)
    assert start_line.get_linestyle() == "--" and start_line.get_color() == "grey"
    for container, shift, (acc, ci) in zip(ax.containers, (-0.015, 0.015), arms.values()):
        points, _, (bars,) = container.lines  # data line, caps, interval segments
        np.testing.assert_allclose(points.get_xdata(), centres + shift)  # 0.12 / 4 bins between the two arms
        np.testing.assert_array_equal(points.get_ydata(), acc)
        np.testing.assert_allclose([seg[:, 1] for seg in bars.get_segments()], ci)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["none, step 0 (start)", "none", "group_dro"]
    assert ax.get_title() == "by depth" and ax.get_xlim() == (0.0, 1.0)
    assert_png(plot_depth_intervals(arms, start, "start", "by depth", tmp_path / "depth.png"))


def test_valley_accuracy_scatter_a_panel_per_predictor_points_coloured_by_arm(tmp_path):
    arms = ["none", "group_dro", "needle_mix"]
    first = ScatterPanel("valley/vanilla/middle_mass\nρ +0.500 [-0.100, +0.800], 4 jobs", "Δ middle_mass",
                         {"none": ([0.1, 0.2], [0.0, 0.05]), "needle_mix": ([-0.3], [0.2])})
    second = ScatterPanel("rollout/vanilla/measured/w1\nn/a: 2 jobs with points, fewer than 3", "Δ measured/w1",
                          {"group_dro": ([0.4], [-0.1]), "none": ([0.0], [0.1])})
    fig = valley_accuracy_scatter_figure([[first, second]], arms, "Δ(middle − ends accuracy)", "title")
    assert [ax.get_title() for ax in fig.axes] == [first.title, second.title]
    assert [ax.get_xlabel() for ax in fig.axes] == ["Δ middle_mass", "Δ measured/w1"]
    for ax, panel in zip(fig.axes, (first, second)):
        assert len(ax.collections) == len(panel.points)
        for dots, (arm, (x, y)) in zip(ax.collections, panel.points.items()):
            np.testing.assert_array_equal(dots.get_offsets(), np.column_stack([x, y]))
            np.testing.assert_allclose(dots.get_facecolor()[0], to_rgba(f"C{arms.index(arm)}"))  # by arm, not panel
        horizontal, vertical = ax.lines
        assert list(horizontal.get_ydata()) == [0, 0] and list(vertical.get_xdata()) == [0, 0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["none", "needle_mix", "group_dro"]  # each once
    assert_png(plot_valley_accuracy_scatter([[first], [second]], arms, "y", "title", tmp_path / "scatter.png"))


def test_predicted_profiles_one_panel_per_model_and_set_each_curve_summing_to_one(tmp_path):
    rho, prior = prior_profile(L, H, 0.3) * 50.0, prior_profile(L, H, 0.5)
    curves = {model: {name: {"measured profile": rho * k, "measured": rho, "prior": prior}
                      for name in ("vanilla", "chunked")} for k, model in ((1, "trained"), (3, "random init"))}
    fig = predicted_profiles_figure(curves, "measured profile", ("prior",))
    assert [ax.get_title() for ax in fig.axes] == ["trained, vanilla", "trained, chunked", "random init, vanilla",
                                                   "random init, chunked"]
    measured, rollout, fitted = fig.axes[0].lines
    for line in (measured, rollout, fitted):
        assert line.get_ydata().sum() == pytest.approx(1.0)
        np.testing.assert_allclose(line.get_xdata(), np.arange(L) / (L - 1))
    assert measured.get_color() == "k" and measured.get_linewidth() == 2.0 and fitted.get_linestyle() == ":"
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["measured profile", "rollout, measured",
                                                                            "prior"]
    assert_png(plot_predicted_profiles(curves, tmp_path / "rollout_study.png", "measured profile", ("prior",)))


def test_predicted_profiles_range_follows_the_measured_curve_and_priors_not_a_sink_rollout():
    """A trained model's attention-only rollout spans ~40 decades (its sink raised to every layer): the y-range
    stays on the measured curve and the priors, and the clipped rollout's legend gives its span."""
    rho, prior = prior_profile(L, H, 0.3), prior_profile(L, H, 0.5)
    sink = np.full(L, 1e-20)
    sink[0] = 1.0
    curves = {"trained": {"vanilla": {"measured profile": rho, "attention_only": sink, "prior": prior,
                                      "prior w1": prior_profile(L, H, 0.2)}}}
    ax = predicted_profiles_figure(curves, "measured profile", ("prior", "prior w1")).axes[0]
    low, high = ax.get_ylim()
    shares = [c / c.sum() for c in (rho, prior, prior_profile(L, H, 0.2))]
    assert low <= min(s.min() for s in shares) and high >= max(s.max() for s in shares) and low > 1e-12
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[1].startswith("rollout, attention_only (clipped: 1e-") and labels[2:] == ["prior", "prior w1"]
    assert [line.get_linestyle() for line in ax.lines][2:] == [":", ":"]


def test_prior_figure_raw_and_anchored_at_the_last_position():
    p = prior_profile(L, H, 0.3)
    x = np.linspace(0.0, 1.0, L)
    raw, anchored = prior_figure(x, p, "Cesàro prior").axes
    np.testing.assert_array_equal(raw.lines[0].get_ydata(), p)
    np.testing.assert_array_equal(anchored.lines[0].get_ydata(), p / p[-1])
    assert raw.get_yscale() == anchored.get_yscale() == "log"


def test_tracking_figure_wraps_the_signals_best_first_and_draws_few_followers_per_run():
    """19 signals in rows of 4, the best-ranked first (an undefined rho last); a run's panel: the dev contrast, the
    step (dashed) and the `followers` best signals, not every signal."""
    across = [{"signal": f"s{k}", "runs": [2, 3, 4], "changes": [0.0, 1.0, float(k)], "test_changes": [0.1, 0.2, 0.3],
               "rho": k / 20, "p_value": 0.5} for k in range(18)]
    across.append({"signal": "flat", "runs": [2, 3, 4], "changes": [1.0] * 3, "test_changes": [0.1, 0.2, 0.3],
                   "rho": float("nan"), "p_value": float("nan")})
    steps = [0, 25, 50]
    within = [{"run": 3, "signal": "clock", "steps": steps, "values": steps, "dev": [0.0, 1.0, 0.5], "rho": 0.5}]
    within += [{"run": 3, "signal": f"w{k}", "steps": steps, "values": [0.0, k, 1.0], "dev": [0.0, 1.0, 0.5],
                "rho": k / 10} for k in range(6)]
    fig = tracking_figure(across, within, followers=2, columns=4, clock="clock")
    upper, lower = fig.subfigs
    titles = [ax.get_title().split("\n")[0] for ax in upper.axes]
    assert len(upper.axes) == 19 and titles[:2] == ["s17", "s16"] and titles[-1] == "flat"
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in upper.axes} == {(5, 4)}
    (run,) = lower.axes
    labels = [line.get_label() for line in run.get_lines()]
    assert labels == ["dev contrast", "clock (+0.50)", "w5 (+0.50)", "w4 (+0.40)"]
    assert run.get_lines()[1].get_linestyle() == "--"
    assert fig.get_size_inches()[0] == pytest.approx(3.4 * 4)
