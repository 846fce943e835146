"""Run logging: the typed logger config, metrics.jsonl, and the wandb profile charts against the prior."""

import json
import re

import numpy as np
import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from analysis.measure.prior import log10_profile, prior_profile, scaled_prior
from analysis.report.metrics_log import (
    CHART_POINTS,
    LoggerConfig,
    LoggerMode,
    MetricsLogger,
    accuracy_chart,
    log_report,
    profile_charts,
    read_metrics,
    resolve_mode,
    run_names,
)
from models.training.run_dir import WANDB_RUN

H = 6


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
    """wandb's own settings, cache and data folders go to the test's temporary folder, never $HOME."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def offline_runs(folder) -> list[str]:
    """The run ids of the offline wandb runs under `folder`, oldest first: `wandb/offline-run-<time>-<id>`, and
    `-<id>-1` for a second folder of the same id within the same second."""
    names = sorted((p.name for p in (folder / "wandb").glob("offline-run-*")), key=lambda n: (len(n), n))
    return [re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(-\d+)?", n).group(1) for n in names]


def test_logger_config_is_typed_and_its_defaults_are_fresh():
    cfg = OmegaConf.structured(LoggerConfig)
    assert OmegaConf.to_object(cfg).mode is None  # the environment's WANDB_MODE, else offline
    assert OmegaConf.to_object(OmegaConf.merge(cfg, {"mode": "disabled"})).mode is LoggerMode.disabled
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
    assert read_metrics(tmp_path) == [{"step": 3, "train/loss": 1.5, "bad": None}]
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


def test_profile_charts_add_each_rollout_on_the_profiles_scale():
    rho, rollout = prior_profile(100, H, 0.4) * 30.0, prior_profile(100, H, 0.7)  # <= CHART_POINTS: all drawn
    charts = profile_charts({"vanilla": rho}, {"vanilla": 0.4}, H, step=1,
                            rollouts={"vanilla": {"measured": rollout, "attention_only": rollout ** 2}})
    rows = charts["jacobian/vanilla/profile"].table.data
    assert list(dict.fromkeys(r[1] for r in rows))[2:] == ["rollout, measured", "rollout, attention_only"]
    drawn = np.array([r[2] for r in rows if r[1] == "rollout, measured"])  # log10
    assert np.mean(log10_profile(rho) - drawn) == pytest.approx(0.0, abs=1e-12)  # scaled onto the profile
    np.testing.assert_allclose(drawn - drawn[0], log10_profile(rollout) - log10_profile(rollout)[0], atol=1e-12)


def test_environment_wandb_mode_wins_over_the_default_and_an_explicit_mode_over_both(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = MetricsLogger(LoggerConfig(), tmp_path / "env", {})
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert logger.wandb_run is None and logger.run_id is None
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == ["metrics.jsonl"]  # no wandb/, no wandb_run.json
    # wandb itself lets mode= beat WANDB_MODE: an explicit logger.mode still logs offline.
    logger = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path / "explicit", {})
    logger.close()
    assert offline_runs(tmp_path / "explicit") == [logger.run_id]
    assert resolve_mode(None, {}) is LoggerMode.offline
    assert resolve_mode(None, {"WANDB_MODE": "online"}) is LoggerMode.online
    assert resolve_mode(None, {"WANDB_MODE": "dryrun"}) is LoggerMode.offline  # wandb's older spelling
    assert resolve_mode("disabled", {"WANDB_MODE": "online"}) is LoggerMode.disabled
    with pytest.raises(ValueError, match="WANDB_MODE='ofline' is not one of offline, online, disabled"):
        resolve_mode(None, {"WANDB_MODE": "ofline"})


def test_a_new_logger_continues_the_stored_wandb_run(tmp_path):
    first = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path / "a", {})
    first.log({"train/loss": 2.0}, step=1)
    first.close()
    run_id = first.run_id
    assert re.fullmatch(r"[a-z0-9]{8}", run_id) and offline_runs(tmp_path / "a") == [run_id]
    assert json.loads((tmp_path / "a" / WANDB_RUN).read_text())["id"] == run_id
    # A checkpoint's id, given to a logger of another run directory (resume into a new directory) ...
    moved = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path / "b", {}, run_id=run_id)
    moved.close()
    assert moved.run_id == run_id and offline_runs(tmp_path / "b") == [run_id]
    # ... and the directory's own wandb_run.json (continued in place) continue the same run.
    again = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path / "a", {})
    again.close()
    assert offline_runs(tmp_path / "a") == [run_id, run_id]
    fresh = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path / "c", {})
    fresh.close()
    assert fresh.run_id != run_id
    # A disabled logger writes no wandb file but hands the id on (to its checkpoints).
    quiet = MetricsLogger(LoggerConfig(mode=LoggerMode.disabled), tmp_path / "d", {}, run_id=run_id)
    quiet.close()
    assert quiet.run_id == run_id and not (tmp_path / "d" / "wandb").exists()


def test_run_names_from_experiment_overrides_and_sweep():
    assert run_names("in2", []) == ("in2", "in2")
    assert run_names("in2", "") == ("in2", "in2")
    overrides = ["+exp=in2", "trainer.lr=0.001", "model=qwen2_0.5b", "trainer.resume_from=auto", "logger.mode=online",
                 "hydra.run.dir=/tmp/x", "exp_name=in2", "data.path=../shared/data/nq-open-oracle.jsonl.gz", "++seed=3",
                 "~peft"]
    name, group = run_names("in2", overrides, "outputs/in2/multirun_2026-01-02_03-04-05/")
    assert name == "in2 trainer.lr=0.001,model=qwen2_0.5b,data.path=nq-open-oracle.jsonl.gz,seed=3,~peft"
    assert group == "in2/multirun_2026-01-02_03-04-05"
    # Hydra's override_dirname string: commas inside a list stay with their value.
    assert run_names("in2", "eval.probes=[kv,needle],trainer.lr=0.001")[0] == "in2 eval.probes=[kv,needle],trainer.lr=0.001"
    long_name, _ = run_names("micro100", [f"model.init.key_{i}={i}" for i in range(40)], max_len=64)
    assert len(long_name) == 64 and long_name.startswith("micro100 model.init.key_0=0,") and long_name.endswith("…")


def test_summaries_keep_best_accuracy_lowest_loss_and_last_valley_depth(tmp_path):
    logger = MetricsLogger(LoggerConfig(mode=LoggerMode.offline), tmp_path, {})
    rows = [(0.2, 3.0, 1.5), (0.8, 2.0, 1.1), (0.5, 2.5, 1.3), (0.4, 2.8, 0.9)]
    for step, (acc, loss, depth) in enumerate(rows):
        logger.log({"eval/in2/acc_mean": acc, "eval/needle/acc_mean": 1 - acc, "eval/in2/acc@0.0": acc,
                    "train/loss": loss, "valley/vanilla/peak_to_trough_log10": depth,
                    "valley/vanilla/trough_x": depth / 2}, step=step)
    logger.log({"train/lr": 1e-3}, step=len(rows))  # wandb commits a step's row when the next step begins
    summary = logger.wandb_run.summary
    assert summary["eval/in2/acc_mean"]["max"] == 0.8 and summary["eval/in2/acc_mean"]["last"] == 0.4
    assert summary["eval/needle/acc_mean"]["max"] == 0.8
    assert summary["train/loss"]["min"] == 2.0 and summary["train/loss"]["last"] == 2.8
    assert summary["valley/vanilla/peak_to_trough_log10"]["last"] == 0.9
    assert summary["valley/vanilla/peak_to_trough_log10"]["min"] == 0.9
    assert summary["valley/vanilla/trough_x"] == 0.45 and summary["eval/in2/acc@0.0"] == 0.4  # plain last values
    logger.close()


def test_accuracy_chart_tables_position_and_accuracy_without_closed_book():
    chart = accuracy_chart({-1: 0.1, 0: 0.9, 4: 0.5, 9: 0.7}, {-1: "closedbook", 0: "0", 4: "4", 9: "9"}, "mdqa")
    assert chart.table.columns == ["position", "label", "accuracy"]
    assert chart.table.data == [[0, "0", 0.9], [4, "4", 0.5], [9, "9", 0.7]]


def test_log_report_logs_pngs_and_tables_offline(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 48), "white").save(tmp_path / "accuracy_kv.png")
    tables = {"compare/accuracy_by_position": (["path", "probe", "position", "accuracy"], [["runA", "kv", 0, 0.5]])}
    images = {"compare/accuracy_kv": tmp_path / "accuracy_kv.png"}
    run_id = log_report(LoggerConfig(mode=LoggerMode.offline), tmp_path, images, tables)
    assert offline_runs(tmp_path) == [run_id]
    files = next((tmp_path / "wandb").glob("offline-run-*")) / "files" / "media"
    assert len(list(files.glob("images/compare/accuracy_kv_*.png"))) == 1
    (table,) = files.glob("table/compare/accuracy_by_position_*.table.json")
    assert json.loads(table.read_text())["data"] == [["runA", "kv", 0, 0.5]]
    assert log_report(LoggerConfig(mode=LoggerMode.disabled), tmp_path / "off", {}, {}) is None
    assert not (tmp_path / "off").exists()
