"""Run logging: the typed logger config, metrics.jsonl, and the wandb profile charts against the prior."""

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from analysis.metrics_log import (
    CHART_POINTS,
    LoggerConfig,
    LoggerMode,
    MetricsLogger,
    profile_charts,
    read_metrics,
)
from analysis.prior import log10_profile, prior_profile, scaled_prior

H = 6


def test_logger_config_is_typed_and_its_defaults_are_fresh():
    cfg = OmegaConf.structured(LoggerConfig)
    assert OmegaConf.to_object(cfg).mode is LoggerMode.offline
    with pytest.raises(ValidationError, match="Invalid value 'ofline', expected one of"):
        OmegaConf.merge(cfg, {"mode": "ofline"})
    a, b = LoggerConfig(), LoggerConfig()
    a.tags.append("x")
    assert b.tags == []


def test_disabled_logger_writes_metrics_jsonl_only(tmp_path):
    logger = MetricsLogger(LoggerConfig(mode=LoggerMode.disabled), tmp_path, {})
    logger.log({"train/loss": 1.5, "bad": float("nan")}, step=3)
    logger.close()
    assert logger.wandb_run is None and not (tmp_path / "wandb").exists()
    assert read_metrics(tmp_path) == [{"step": 3, "train/loss": 1.5, "bad": "nan"}]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 3


def test_profile_charts_plot_log10_profile_and_scaled_prior_ends_kept():
    rng = np.random.default_rng(2)
    long, short = (prior_profile(n, H, 0.4) * rng.lognormal(0.0, 0.1, n) for n in (1000, 50))
    charts = profile_charts({"vanilla": long, "chunked": short}, {"vanilla": 0.4, "chunked": 0.5}, H, step=7)
    assert set(charts) == {"jacobian/vanilla/profile", "jacobian/chunked/profile"}
    for name, rho, alpha in (("vanilla", long, 0.4), ("chunked", short, 0.5)):
        table = charts[f"jacobian/{name}/profile"].table
        rows = table.data  # (x, series name, y) per point
        keys = list(dict.fromkeys(r[1] for r in rows))
        assert keys == ["measured", f"prior fit (a={alpha:.3f})"]
        x = np.array([r[0] for r in rows if r[1] == keys[0]])
        n = min(len(rho), CHART_POINTS)
        assert len(x) == n and x[0] == 0.0 and x[-1] == 1.0  # down-sampled, both ends kept
        shown = np.rint(x * (len(rho) - 1)).astype(int)
        prior, _ = scaled_prior(rho, H, alpha)
        np.testing.assert_allclose([r[2] for r in rows if r[1] == keys[0]], log10_profile(rho)[shown], rtol=1e-12)
        np.testing.assert_allclose([r[2] for r in rows if r[1] == keys[1]], log10_profile(prior)[shown], rtol=1e-12)
