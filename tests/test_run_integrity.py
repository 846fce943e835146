"""Issue 66: training never continues or saves on non-finite numbers, and a resume is the same run or is refused.

The start-up refusals (trainer.lr=inf, warmup_steps=-5, a `???` left, a resume past max_steps or with other settings)
are cases of the battery (tests/test_bad_inputs.py); here the same protections are shown inside real tiny runs.
"""
from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch

from models.training.checkpoint import list_checkpoints
from models.training.engines import TorchEngine
from models.training.resume_guard import MAY_CHANGE, ResumeRefused, differences, may_change
from models.training.run_dir import CHECKPOINT_CONFIG
from models.training.step_health import SPIKE_WARMUP, NonFiniteWeights, StepHealth
from tests.conftest import TINY
from tests.test_faults import metric_rows, train_cli
from train import TrainConfig, run


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trainable(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}


def test_a_nonfinite_gradient_norm_skips_the_update_and_says_why(compose_cfg, tmp_path, monkeypatch, caplog):
    """A finite loss whose gradient is not: the weights stay as they were, the step is counted and named."""
    real_backward, real_step, calls, before_after = TorchEngine.forward_backward, TorchEngine.optimizer_step, [], []

    def poisoned_backward(self, batch):
        loss = real_backward(self, batch)
        calls.append(1)
        if len(calls) == 2:
            next(p for p in self.model.parameters() if p.requires_grad).grad.fill_(math.nan)
        return loss

    def watched_step(self, skip=False):
        before = trainable(self)
        norm = real_step(self, skip)
        before_after.append((before, trainable(self), norm))
        return norm

    monkeypatch.setattr(TorchEngine, "forward_backward", poisoned_backward)
    monkeypatch.setattr(TorchEngine, "optimizer_step", watched_step)
    with caplog.at_level(logging.WARNING, logger="train"):
        run(compose_cfg(*TINY, "trainer.max_steps=3"), tmp_path)
    before, after, norm = before_after[1]
    assert not math.isfinite(norm) and all(torch.equal(before[n], after[n]) for n in before)
    assert any(not torch.equal(before_after[0][0][n], before_after[0][1][n]) for n in before)  # a normal step moves
    bad = {r["step"]: r["train/bad_steps"] for r in rows(tmp_path) if "train/bad_steps" in r}
    assert bad == {1: 0, 2: 1, 3: 1}
    assert "step 2 skipped: non-finite gradient norm (nan) with a finite loss" in caplog.text
    assert "- skipped steps: 1 (a non-finite loss" in (tmp_path / "summary.md").read_text()


def test_weights_made_nonfinite_stop_the_run_and_are_never_saved(compose_cfg, tmp_path, monkeypatch):
    """An update that makes a weight NaN (a rate that overflows, say) stops the run at once: the step-2 checkpoint,
    saved before it, is the one named, and nothing after it is written."""
    real_step = TorchEngine.optimizer_step

    def overflowing(self, skip=False):
        norm = real_step(self, skip)
        if self.scheduler.last_epoch == 3:  # the third update
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.requires_grad).mul_(math.inf)
        return norm

    monkeypatch.setattr(TorchEngine, "optimizer_step", overflowing)
    with pytest.raises(NonFiniteWeights, match=r"step 3: the update made .* NaN or infinite .*nothing of it was "
                                               r"saved; the last good checkpoint is .*step-2$"):
        run(compose_cfg(*TINY, "trainer.max_steps=6", "trainer.save_every=2"), tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]


def test_a_checkpoint_is_never_written_from_nonfinite_weights(compose_cfg, tmp_path, monkeypatch):
    """The save itself refuses (whatever made the weights non-finite), and says there is no good checkpoint."""
    calls = []  # the step's own check passes; the save's finds a NaN

    def found_at_save(self):
        calls.append(1)
        return "model.norm.weight" if len(calls) == 2 else None

    monkeypatch.setattr(TorchEngine, "nonfinite_weight", found_at_save)
    with pytest.raises(NonFiniteWeights, match=r"^not saving step 1: model.norm.weight holds NaN or infinity; no "
                                               r"checkpoint was saved under .* before it$"):
        run(compose_cfg(*TINY, "trainer.max_steps=2", "trainer.save_every=1"), tmp_path)
    assert list_checkpoints(tmp_path) == [] and not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_the_loss_spike_detector_counts_an_episode_once():
    health = StepHealth(max_bad_steps=0, spike_factor=10.0, spike_steps=3)
    assert all(health.exploding(1.0) is None for _ in range(SPIKE_WARMUP))
    assert [health.exploding(50.0) for _ in range(5)] == [None, None, 1.0, None, None]
    assert health.exploding(1.0) is None and health.loss_spikes == 1
    assert [health.exploding(50.0) for _ in range(3)] == [None, None, 1.0] and health.loss_spikes == 2
    restored = StepHealth(max_bad_steps=0)
    restored.load_state_dict(health.state_dict())
    assert restored.state_dict() == health.state_dict()


def test_an_exploding_loss_is_named_in_the_log_and_the_summary(compose_cfg, tmp_path, monkeypatch, caplog):
    real, calls = TorchEngine.forward_backward, []

    def exploding(self, batch):
        calls.append(1)
        loss = real(self, batch)
        return loss * 1000 if len(calls) > SPIKE_WARMUP + 2 else loss

    monkeypatch.setattr(TorchEngine, "forward_backward", exploding)
    with caplog.at_level(logging.WARNING, logger="train"):
        run(compose_cfg(*TINY, f"trainer.max_steps={SPIKE_WARMUP + 6}"), tmp_path)
    assert f"step {SPIKE_WARMUP + 5}: the loss is exploding" in caplog.text
    assert [r["train/loss_spikes"] for r in rows(tmp_path) if "train/loss_spikes" in r][-1] == 1
    assert "; loss spikes: 1 (an exploding loss" in (tmp_path / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------- resumes


def test_what_a_resume_may_change_is_only_length_cadence_and_logging():
    saved = {"trainer": {"max_steps": 4, "lr": 1e-3}, "data": {"context_len": 128}, "logger": {"mode": "offline"}}
    assert differences(saved, {"trainer": {"max_steps": 8, "lr": 1e-3}, "data": {"context_len": 128},
                               "logger": {"mode": "disabled"}}) == []
    assert differences(saved, {"trainer": {"max_steps": 4, "lr": 2e-3}, "data": {"context_len": 256},
                               "logger": {"mode": "offline"}}) == [("data.context_len", 128, 256),
                                                                   ("trainer.lr", 1e-3, 2e-3)]
    # a setting added since the checkpoint was written is compared with its default; one the schema dropped is not
    assert differences(saved, {**saved, "watch": {"every": 0}}, {"watch": {"every": 1}}) == [("watch.every", 1, 0)]
    assert differences(saved, {**saved, "watch": {"every": 1}}, {"watch": {"every": 1}}) == []
    assert differences({**saved, "gone": 1}, saved) == []
    keys = {f"{section}.{key}" for section, node in TrainConfig().__dict__.items() if hasattr(node, "__dict__")
            for key in node.__dict__}
    assert not [k for k in MAY_CHANGE if not k.endswith(".") and "." in k and k not in keys], "a key TrainConfig lacks"
    assert not may_change("model.init.hidden_size") and not may_change("data.context_len") and may_change("logger.x")


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """`python train.py` (its own process) for 2 steps, saving at 1 and 2."""
    run_dir = tmp_path_factory.mktemp("two_steps") / "run"
    first = train_cli(run_dir, "trainer.max_steps=2", "trainer.save_every=1", "trainer.keep_last_n=0")
    assert first.returncode == 0, first.stderr[-2000:]
    return run_dir


def test_every_checkpoint_holds_the_config_it_was_trained_with(two_step_run):
    saved = json.loads((two_step_run / "checkpoints" / "step-2" / CHECKPOINT_CONFIG).read_text())
    assert saved["trainer"]["max_steps"] == 2 and saved["data"]["context_len"] == 128


def test_a_resume_with_other_settings_is_refused_and_writes_nothing(tmp_path, two_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    hydra_before = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    out = train_cli(run_dir, "trainer.max_steps=4", "trainer.resume_from=latest", "data.context_len=256",
                    "model.init.hidden_size=64")
    assert out.returncode == 1
    said = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "was trained with other settings (another architecture): data.context_len (128 there, " \
        "256 now), model.init.hidden_size (32 there, 64 now); a resume continues the same run" in said[0], out.stderr
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before


def test_a_resume_that_may_go_on_keeps_the_first_config(tmp_path, two_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    first = (run_dir / ".hydra" / "config.yaml").read_text()
    out = train_cli(run_dir, "trainer.max_steps=3", "trainer.resume_from=latest", "trainer.save_every=1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (run_dir / ".hydra" / "first" / "config.yaml").read_text() == first
    assert "max_steps: 3" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert [r["step"] for r in rows(run_dir) if "train/loss" in r] == [1, 2, 3]


def test_a_resume_from_the_final_checkpoint_repeats_the_end_rows_exactly(tmp_path, two_step_run):
    """The final checkpoint is written after the end measurements; it keeps the parts' states from before them (the
    watch's step-to-step SD, the Jacobian window), so that measuring the end again logs the same numbers."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_step_run, run_dir)
    before = metric_rows(run_dir)
    assert any(k.startswith("watch/sd/") for k in before[-2]) or any(k.startswith("watch/sd/") for k in before[-1])
    out = train_cli(run_dir, "trainer.max_steps=2", "trainer.resume_from=latest")
    assert out.returncode == 0, out.stderr[-2000:]
    assert metric_rows(run_dir) == before


def test_a_resume_from_another_runs_checkpoint_is_checked_in_process_too(compose_cfg, tmp_path, two_step_run):
    """`run()` (scripts, sweeps' jobs) checks before anything is built: nothing is written into the new directory."""
    with pytest.raises(ResumeRefused, match=r"step-1 was trained with other settings: trainer.lr \(0.003 there, "
                                            r"0.002 now\); a resume"):
        run(compose_cfg(*TINY, "trainer.max_steps=4", "trainer.lr=2e-3",
                        f"trainer.resume_from={two_step_run / 'checkpoints' / 'step-1'}"), tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ResumeRefused, match=r"is step 2, past trainer.max_steps=1: give trainer.max_steps >= 2"):
        run(compose_cfg(*TINY, "trainer.max_steps=1", "trainer.save_every=1",
                        f"trainer.resume_from={two_step_run / 'checkpoints' / 'step-2'}"), tmp_path / "new")
