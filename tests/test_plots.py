"""Plots: every figure is a non-empty PNG that PIL opens, drawn from a recorder-written jacobian.npz."""

import numpy as np
import pytest
from PIL import Image

from analysis.jacobian import JacobianRecorder
from analysis.plots import plot_depth_accuracy, plot_evolution, plot_heatmap, plot_profile_vs_prior
from analysis.prior import prior_profile

H, L = 6, 64


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
    for i, step in enumerate([0, 10, 20, 50]):
        base = prior_profile(L, H, 0.2 + 0.1 * i) * 1e3  # (L,)
        rec.add(step, {name: base * rng.lognormal(0.0, 0.05, (n, L)) for name, n in rec.sets.items()})
    return rec.path


def test_plot_evolution(npz, tmp_path):
    out = plot_evolution(npz, tmp_path / "plots" / "evolution_vanilla.png", "vanilla")
    assert out == tmp_path / "plots" / "evolution_vanilla.png"
    assert_png(out)


def test_plot_evolution_single_step(tmp_path):
    rec = JacobianRecorder(tmp_path / "jacobian.npz", {"chunked": 1}, L)
    rec.add(0, {"chunked": prior_profile(L, H, 0.3)[None]})
    assert_png(plot_evolution(rec.path, tmp_path / "evo.png", "chunked"))


def test_plot_evolution_unknown_set(npz, tmp_path):
    with pytest.raises(KeyError, match="no set 'needle'"):
        plot_evolution(npz, tmp_path / "x.png", "needle")


def test_plot_heatmap(npz, tmp_path):
    assert_png(plot_heatmap(npz, tmp_path / "heat.png", "chunked"))


def test_plot_profile_vs_prior(tmp_path):
    profile = prior_profile(L, H, 0.35) * 50.0 * np.random.default_rng(1).lognormal(0.0, 0.1, L)
    assert_png(plot_profile_vs_prior(profile, H, tmp_path / "prior.png", title="step 0, vanilla"))


def test_plot_depth_accuracy(tmp_path):
    curves = {"step 0": [0.9, 0.5, 0.4, 0.6, 0.95], "step 500": [0.92, 0.8, 0.78, 0.85, 0.96]}
    assert_png(plot_depth_accuracy(curves, tmp_path / "depth.png", title="IN2 accuracy by depth"))
    with pytest.raises(ValueError, match="same number of bins"):
        plot_depth_accuracy({"a": [0.1, 0.2], "b": [0.3]}, tmp_path / "bad.png")
