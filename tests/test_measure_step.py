"""analysis.measure.step: the Jacobian profile and the rollouts of a measured step from one forward pass equal the
separate measurements (jacobian_profile / measure_window, measure_rollouts), for a plain, a LoRA-wrapped and a
differential-attention model and both targets. The models are float64, but transformers' eager attention takes its
softmax in float32, so the one pass agrees with the separate profile (SDPA, float64 throughout) to ~1e-7, not 1e-15."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from analysis.measure.jacobian import JacobianConfig, ProbeWindow, jacobian_profile, measure_window
from analysis.measure.rollout import measure_rollouts
from analysis.measure.step import measure_step
from models.attention.diff_attention import convert_to_diff_attention
from tests.test_jacobian_window import tiny_model as window_tiny_model

L = 20


def tiny_model():
    return window_tiny_model(heads=4, layers=3, vocab=40)


def lora(model):
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=p.dtype))
    return wrapped


MODELS = {"plain": tiny_model, "lora": lambda: lora(tiny_model()),
          "diff_v1": lambda: convert_to_diff_attention(tiny_model(), version="v1").double()}


def sets() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 40, (3, L), generator=torch.Generator().manual_seed(1))
    return {"vanilla": ids[:1], "chunked": ids[1:]}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("target", ["last_hidden", "pre_norm"])
def test_one_pass_equals_the_separate_profile_and_rollouts(name, target):
    model, seqs = MODELS[name](), sets()
    cfg = JacobianConfig(num_probes=3, seq_len=L, target=target, seed=4)
    step = measure_step(model, seqs, cfg, step=7)
    both = jacobian_profile(model, torch.cat(list(seqs.values())), "hutchinson", 3, target,
                            generator=torch.Generator().manual_seed(4))
    rolls = measure_rollouts(model, seqs)
    for k, set_name in enumerate(seqs):
        rows = slice(0, 1) if k == 0 else slice(1, 3)
        np.testing.assert_allclose(step.profiles[set_name].profile, both.profile[rows], rtol=1e-6)
        np.testing.assert_allclose(step.profiles[set_name].stderr, both.stderr[rows], rtol=1e-5)
        assert set(step.rollouts[set_name]) == set(rolls[set_name])
        for variant, expected in rolls[set_name].items():
            np.testing.assert_allclose(step.rollouts[set_name][variant], expected, rtol=1e-5, atol=1e-12)
    assert step.pooled is None
    assert model.config._attn_implementation != "eager" or name == "diff_v1"  # restored after the pass


def test_with_a_window_it_pools_as_measure_window_does():
    model, seqs = tiny_model(), sets()
    cfg = JacobianConfig(num_probes=1, window=3, seq_len=L)
    fused, separate = ProbeWindow(cfg.window), ProbeWindow(cfg.window)
    for s in range(4):
        ours = measure_step(model, seqs, cfg, s, fused, with_rollouts=False)
        theirs = measure_window(model, seqs, cfg, s, separate)
        assert ours.rollouts == {}
        for name in seqs:
            np.testing.assert_allclose(ours.profiles[name].profile, theirs[name].window.profile, rtol=1e-6)
            np.testing.assert_allclose(ours.pooled[name].step.profile, theirs[name].step.profile, rtol=1e-6)
            assert ours.pooled[name].probes == theirs[name].probes


def test_the_measurement_leaves_no_gradient_and_no_hook_behind():
    model, seqs = tiny_model(), sets()

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    measure_step(model, seqs, JacobianConfig(num_probes=2, seq_len=L), step=0)
    after_one = hooks()  # transformers adds its own output-recording hooks at the first pass and keeps them
    measure_step(model, seqs, JacobianConfig(num_probes=2, seq_len=L), step=1)
    assert hooks() == after_one
    assert all(p.grad is None for p in model.parameters())


def test_a_single_probe_needs_a_window():
    with pytest.raises(ValueError, match="num_probes=1 without a window"):
        measure_step(tiny_model(), sets(), JacobianConfig(num_probes=1, seq_len=L), step=0)
