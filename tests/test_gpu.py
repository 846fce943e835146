"""Device-specific paths on a CUDA device, against the CPU (`pytest -m gpu`; scripts/gpu_check.py runs them).

Deselected by default (`-m "not slow and not gpu"`) and skipped where no CUDA device is visible.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from analysis.jacobian import jacobian_profile
from models.diff_attention import convert_to_diff_attention
from tests.conftest import TINY
from train import run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=100)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def ids(length: int = 48) -> torch.Tensor:
    return torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("estimator", ["exact", "hutchinson", "top_prob"])
def test_jacobian_profile_on_cuda_equals_the_cpu_one(estimator):
    model = tiny_model()
    cpu = jacobian_profile(model, ids(), estimator, num_probes=4)
    cuda = jacobian_profile(model.cuda(), ids(), estimator, num_probes=4)  # probes drawn on the CPU, moved
    assert cuda.profile.shape == cpu.profile.shape
    torch.testing.assert_close(torch.from_numpy(cuda.profile), torch.from_numpy(cpu.profile), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_diff_attention_in_bf16_on_cuda_follows_fp32_on_the_cpu(version):
    model = convert_to_diff_attention(tiny_model(), version=version)
    with torch.no_grad():
        reference = model(ids()).logits
        bf16 = model.to("cuda", torch.bfloat16)(ids().cuda()).logits.float().cpu()
    assert torch.isfinite(bf16).all()
    assert (bf16 - reference).abs().max() < 0.05 * reference.abs().max()


def test_two_bf16_steps_on_cuda_train_and_save(compose_cfg, tmp_path):
    run(compose_cfg(*TINY, "trainer=gpu", "trainer.max_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (tmp_path / "checkpoints" / "step-2" / "model.safetensors").is_file()
