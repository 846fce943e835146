"""The streamed Hutchinson estimator (jacobian.window): probes pooled over recent steps against the exact Jacobian
of a model that does not move, its standard error's calibration, its bookkeeping, and a training run that logs and
resumes it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import Qwen2Config, Qwen2ForCausalLM

from analysis.measure.jacobian import (
    JacobianConfig,
    ProbeWindow,
    hutchinson_squares,
    jacobian_profile,
    measure_window,
    step_generator,
)
from models.training.distributed import DistInfo
from tests.conftest import TINY
from train import as_train_config, run, validate

L = 24


def tiny_model(heads: int = 2, layers: int = 2, vocab: int = 50) -> Qwen2ForCausalLM:
    """A random float64 Qwen2 of hidden size 16 (the same weights at every call)."""
    config = Qwen2Config(hidden_size=16, intermediate_size=32, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, num_hidden_layers=layers, vocab_size=vocab)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).double().eval()


def ids(n: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (n, L), generator=torch.Generator().manual_seed(1))


def test_the_window_pools_the_probes_of_its_last_steps():
    window = ProbeWindow(steps=3)
    assert window.probes_for("v", 2) == 6  # the first step fills the window
    rng = np.random.default_rng(0)
    steps = [rng.random((6 if s == 0 else 2, 1, 5)) for s in range(5)]
    for step, q in enumerate(steps):
        window.add("v", q, step)
    kept = np.concatenate(steps[-3:])  # the last 3 steps' 6 probes
    est = window.estimate("v")
    np.testing.assert_allclose(est.profile, np.sqrt(kept.mean(0)), rtol=1e-12)
    np.testing.assert_allclose(est.stderr, kept.std(0, ddof=1) / np.sqrt(6) / (2 * np.sqrt(kept.mean(0))),
                               rtol=1e-9)
    assert window.probes("v") == 6 and window.probes_for("v", 2) == 2
    again = ProbeWindow(steps=3)
    again.load_state_dict(json.loads(json.dumps(window.state_dict())))  # as trainer_state.json holds it
    np.testing.assert_array_equal(again.estimate("v").profile, est.profile)
    window.add("v", steps[3] * 2, 3)  # step 3 again (a resumed run): it replaces steps 3 and 4, step 2 stays
    np.testing.assert_allclose(window.estimate("v").profile,
                               np.sqrt(np.concatenate([steps[2], steps[3] * 2]).mean(0)), rtol=1e-12)


def test_each_step_draws_its_own_probes_and_the_same_step_the_same():
    a, b = (torch.randn(3, generator=step_generator(0, s)) for s in (5, 6))
    assert not torch.equal(a, b)
    assert torch.equal(torch.randn(3, generator=step_generator(0, 5)), a)


def test_measure_window_gives_each_set_its_own_and_the_pooled_estimate():
    model, seqs = tiny_model(), {"vanilla": ids(1), "chunked": ids(2)[1:]}
    cfg = JacobianConfig(num_probes=2, window=3, seq_len=L)
    window = ProbeWindow(cfg.window)
    first = measure_window(model, seqs, cfg, 0, window)
    assert first["vanilla"].probes == 6 and first["chunked"].probes == 6
    np.testing.assert_allclose(first["vanilla"].window.profile, first["vanilla"].step.profile, rtol=1e-12)
    q = hutchinson_squares(model, torch.cat(list(seqs.values())), 6, generator=step_generator(0, 0))
    np.testing.assert_allclose(first["chunked"].step.profile, np.sqrt(q[:, 1:].mean(0)), rtol=1e-12)
    later = measure_window(model, seqs, cfg, 1, window)
    assert later["vanilla"].probes == 8 and later["vanilla"].step.stderr is not None


def test_hutchinson_squares_are_the_terms_of_the_hutchinson_profile():
    model, x = tiny_model(), ids(2)
    q = hutchinson_squares(model, x, 5, generator=torch.Generator().manual_seed(3))
    profile = jacobian_profile(model, x, "hutchinson", 5, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(np.sqrt(q.mean(0)), profile.profile, rtol=1e-12)
    one = hutchinson_squares(model, x, 1, generator=torch.Generator().manual_seed(3))  # a plain backward, no vmap
    np.testing.assert_allclose(one[0], q[0], rtol=1e-12)  # the same first probe


@pytest.fixture(scope="module")
def replicates():
    """400 windows of 8 steps of 1 probe on a model that does not move (its probes drawn in one batched backward and
    fed to the windows step by step), and its exact profile."""
    model, x = tiny_model(), ids(1)
    exact = jacobian_profile(model, x, "exact").profile[0]  # (L,)
    steps, runs = 8, 400
    q = hutchinson_squares(model, x, steps * runs, chunk=400, generator=torch.Generator().manual_seed(5))
    estimates, errors = [], []
    for r in range(runs):
        window = ProbeWindow(steps)
        window.add("vanilla", q[:1] * 0, 0)  # a first step that the window then drops: the 8 later steps count
        for s in range(steps):
            window.add("vanilla", q[r * steps + s: r * steps + s + 1], s + 1)
        res = window.estimate("vanilla")
        estimates.append(res.profile[0])
        errors.append(res.stderr[0])
    return exact, np.array(estimates), np.array(errors), steps


def test_the_streamed_estimator_is_unbiased_for_the_exact_profile(replicates):
    exact, estimates, _, _ = replicates
    squares = estimates ** 2  # rho^2 is what the probes estimate without bias
    z = (squares.mean(0) - exact ** 2) / (squares.std(0, ddof=1) / np.sqrt(len(squares)))  # (L,)
    assert np.abs(z).max() < 4.0, z  # 24 positions: |z| < 4 at every one unless biased
    assert abs(z.mean()) < 4.0 / np.sqrt(len(z))


def test_its_standard_error_covers_the_exact_value_at_the_stated_rate(replicates):
    """The interval rho ± t(0.975, n - 1) x stderr, n the pooled probes (docs/REFERENCE.md, "Metric names"), covers the exact
    rho 95% ± 3 points of the time over 400 windows x 24 positions; and the standard error is the spread it claims
    (its root mean square within 10% of the replicates' spread)."""
    exact, estimates, errors, n = replicates
    covered = np.abs(estimates - exact) <= stats.t.ppf(0.975, n - 1) * errors
    assert 0.92 <= covered.mean() <= 0.98, covered.mean()
    ratio = np.sqrt((errors ** 2).mean(0)) / estimates.std(0, ddof=1)  # (L,)
    assert 0.9 < np.median(ratio) < 1.1, ratio


STREAMED = [*TINY, "jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.n_vanilla=1",
            "jacobian.n_chunked=1", "jacobian.num_probes=1", "jacobian.window=4", "jacobian.rollout=false"]


def _jacobian_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(("valley/", "step/", "jacobian/"))
                        and k != "jacobian/wall_s"} for r in rows if "valley/vanilla/middle_mass" in r}


def test_a_run_logs_the_window_and_each_step_and_resumes_them_exactly(compose_cfg, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_cfg("+exp=in2", *STREAMED, "trainer.max_steps=5", "trainer.save_every=0"), full)
    logged = _jacobian_rows(full)
    assert sorted(logged) == [0, 1, 2, 3, 4, 5]
    assert logged[0]["jacobian/vanilla/probes"] == 4 and logged[5]["jacobian/vanilla/probes"] == 4
    assert {"step/valley/vanilla/middle_mass", "step/valley/chunked/peak_to_trough_log10",
            "jacobian/chunked/rel_stderr"} <= set(logged[3])
    run(compose_cfg("+exp=in2", *STREAMED, "trainer.max_steps=5", "trainer.save_every=3"), part)
    shutil.rmtree(part / "checkpoints" / "step-5")  # as if killed after step 3's checkpoint
    run(compose_cfg("+exp=in2", *STREAMED, "trainer.max_steps=5", "trainer.save_every=3",
                    "trainer.resume_from=latest"), part)
    assert _jacobian_rows(part) == logged


@pytest.mark.parametrize("overrides, message", [
    (["jacobian=hutchinson", "jacobian.window=0"], "jacobian.window=0 must be >= 1"),
    (["jacobian=hutchinson", "jacobian.num_probes=1", "jacobian.window=1"], "hutchinson needs 2 probes a step"),
    (["jacobian=exact", "jacobian.window=4"], "jacobian.window=4 pools hutchinson probes"),
])
def test_window_settings_that_cannot_run_are_refused_by_name(compose_cfg, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(as_train_config(compose_cfg("+exp=in2", *TINY, *overrides)), DistInfo())
