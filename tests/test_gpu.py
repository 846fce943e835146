"""Device-specific paths on a CUDA device, against the CPU (`pytest -m gpu`; scripts/gpu_check.py runs them).

Deselected by default (`-m "not slow and not gpu"`) and skipped where no CUDA device is visible.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from analysis.measure.jacobian import JacobianConfig, ProbeWindow, jacobian_profile
from analysis.measure.step import measure_step
from models.attention.diff_attention import convert_to_diff_attention
from models.build import build_model
from models.training.distributed import all_mean
from models.training.trainer import build_engine
from tests.conftest import TINY
from train import as_train_config, run

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


@pytest.mark.parametrize("window", [1, 3])
def test_a_measured_step_on_cuda_equals_the_cpu_one(window):
    """analysis.measure.step on the device: probes drawn on the CPU and moved, squares and rollouts brought back."""
    cfg = JacobianConfig(num_probes=2, window=window, seq_len=48)
    seqs = {"vanilla": ids()[:1], "chunked": ids()[1:]}
    results = []
    for device in ("cpu", "cuda"):
        pooled = ProbeWindow(window) if window > 1 else None
        model = tiny_model().to(device)
        results.append(measure_step(model, {k: v.to(device) for k, v in seqs.items()}, cfg, 0, pooled))
    cpu, cuda = results
    for name in seqs:
        torch.testing.assert_close(torch.from_numpy(cuda.profiles[name].profile),
                                   torch.from_numpy(cpu.profiles[name].profile), rtol=1e-3, atol=1e-7)
        for variant, rows in cpu.rollouts[name].items():
            torch.testing.assert_close(torch.from_numpy(cuda.rollouts[name][variant]), torch.from_numpy(rows),
                                       rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_diff_attention_in_bf16_on_cuda_follows_fp32_on_the_cpu(version):
    model = convert_to_diff_attention(tiny_model(), version=version)
    with torch.no_grad():
        reference = model(ids()).logits
        bf16 = model.to("cuda", torch.bfloat16)(ids().cuda()).logits.float().cpu()
    assert torch.isfinite(bf16).all()
    assert (bf16 - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize("kernel", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_diff_attention_trains_on_every_cuda_kernel_like_sdpa(kernel, version):
    """Loss and gradients of a bf16 diff model under flash / flex attention follow sdpa's."""
    if kernel == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed on this machine")
    results = {}
    for impl in ("sdpa", kernel):
        model = convert_to_diff_attention(tiny_model(), version=version).to("cuda", torch.bfloat16).train()
        model.set_attn_implementation(impl)
        batch = ids().cuda()
        loss = model(batch, labels=batch).loss
        loss.backward()
        results[impl] = (loss.float().item(), model.model.layers[0].self_attn.q2_proj.weight.grad.float().norm().item())
    (loss_sdpa, grad_sdpa), (loss_k, grad_k) = results["sdpa"], results[kernel]
    assert loss_k == pytest.approx(loss_sdpa, rel=2e-2) and grad_k == pytest.approx(grad_sdpa, rel=5e-2)


@pytest.mark.parametrize("kernel", ["flash_attention_2", "sdpa_packed"])
def test_packed_rows_on_cuda_give_each_sample_its_unpacked_loss(kernel):
    """A packed row through flash's varlen kernel or `sdpa_packed`: every sample's loss is what it
    gets alone (bf16, so to bf16 accuracy)."""
    if kernel == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed on this machine")
    from data_builders.collate import collate, collate_packed
    from models.attention.packed import SDPA_PACKED

    model = tiny_model().to("cuda", torch.bfloat16)
    model.set_attn_implementation(SDPA_PACKED if kernel == "sdpa_packed" else kernel)
    gen = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(0, 100, (n,), generator=gen).tolist()} for n in (17, 30, 9)]
    packed = collate_packed([rows], 64, pad_id=0)

    def token_nll(batch):
        inputs = {k: batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:].cuda(),
                                                 reduction="none")  # (B, L-1)

    nll, start = token_nll(packed)[0], 0
    for row in rows:
        n = len(row["input_ids"])
        alone = token_nll(collate([row], pad_id=0))[0]
        torch.testing.assert_close(nll[start:start + n - 1], alone, rtol=0.05, atol=0.05)
        start += n


def test_two_bf16_steps_on_cuda_train_and_save(compose_cfg, tmp_path):
    run(compose_cfg(*TINY, "trainer=gpu", "trainer.max_steps=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert (tmp_path / "checkpoints" / "step-2" / "model.safetensors").is_file()


def test_all_mean_runs_under_nccl_on_the_device(tmp_path):
    """The loss reduction of every step, through a real NCCL group (one rank): NCCL refuses CPU tensors."""
    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        assert all_mean(3.5, torch.device("cuda", 0)) == 3.5
    finally:
        torch.distributed.destroy_process_group()


def test_bf16_on_cuda_trains_fp32_masters_so_a_small_update_survives(compose_cfg):
    cfg = as_train_config(compose_cfg(*TINY, "model.dtype=bfloat16", "trainer=gpu", "trainer.weight_decay=0",
                                      "trainer.warmup_steps=0", "trainer.grad_clip=0"))
    torch.manual_seed(0)
    model = build_model(cfg.model, 400, 0)
    weight = model.model.layers[0].mlp.down_proj.weight
    index = int(weight.detach().abs().argmax())
    before = weight.detach().flatten()[index].item()
    cfg.trainer.lr = 1e-4 * abs(before)  # AdamW's first step moves each weight by lr
    engine = build_engine(model, cfg.trainer, None)
    ids = torch.randint(1, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    engine.forward_backward({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    engine.optimizer_step()
    after = weight.detach().flatten()[index].item()
    assert weight.device.type == "cuda" and weight.dtype == torch.float32
    assert abs(after - before) == pytest.approx(cfg.trainer.lr, rel=0.05)
