"""The engines without a GPU or a process group: collectives on the engine's device, fp32 master
weights under bf16, the main process building the data before the other ranks."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from hydra.errors import ConfigCompositionException

import models.training.distributed
import train
from models.build import build_model
from models.training.distributed import DistInfo
from models.training.engines import DeepSpeedEngine
from models.training.trainer import build_engine
from tests.conftest import TINY

# No CUDA here: the meta device stands in for the engine's GPU. A CPU tensor handed to a collective
# is what NCCL rejects on the first step of a multi-GPU run.
DEVICE = torch.device("meta")


class Collective(Exception):
    """Raised by the recording stand-in once it has seen a collective's tensor (meta tensors hold no value)."""


@pytest.fixture
def collectives(monkeypatch):
    """A process group of 2 whose collectives record the device of what they are given."""
    devices = []

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device)
        raise Collective

    def broadcast_object_list(objects, src=0, group=None, device=None, **kwargs):
        devices.append(torch.device(device) if device is not None else torch.device("cpu"))
        raise Collective

    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    return devices


def test_the_step_loss_is_reduced_on_the_engine_device(collectives):
    engine = SimpleNamespace(device=DEVICE, forward_backward=lambda batch: torch.tensor(2.0))
    run = SimpleNamespace(engine=engine, cfg=SimpleNamespace(trainer=SimpleNamespace(grad_accum=1)))
    with pytest.raises(Collective):
        train.optimizer_step(run, iter([{"num_tokens": torch.tensor(4)}]), 0)
    assert collectives == [DEVICE]


def test_the_other_collectives_run_on_the_engine_device(collectives):
    """DeepSpeed's non-finite check of every micro-batch, the loop's stop decision, the resume decision."""
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # the call under test needs no DeepSpeed engine
    engine.device = DEVICE
    engine.engine, engine.sp_size = None, 1
    engine.loss_fn = lambda model, batch, device: torch.ones((), device=device)
    with pytest.raises(Collective):
        engine.forward_backward({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    with pytest.raises(Collective):
        models.training.distributed.any_rank(True, DEVICE)
    with pytest.raises(Collective):
        models.training.distributed.broadcast_object("checkpoints/step-2", DEVICE)
    assert collectives == [DEVICE, DEVICE, DEVICE]


def test_bf16_trains_fp32_master_weights_so_a_small_update_survives(compose_cfg):
    """A bf16 model (model.dtype=bfloat16, as pretrained models load) under trainer.precision=bf16: an
    AdamW step of 1e-4 of a weight changes it. On bf16 weights it would round away (bf16 rounds off
    a change below about 2e-3 of a value)."""
    cfg = train.as_train_config(compose_cfg(*TINY, "model.dtype=bfloat16", "trainer.precision=bf16",
                                            "trainer.weight_decay=0", "trainer.warmup_steps=0", "trainer.grad_clip=0"))
    torch.manual_seed(0)
    model = build_model(cfg.model, 400, 0)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16
    index = int(weight.detach().abs().argmax())  # the largest weight: every other update is relatively larger
    before = weight.detach().flatten()[index].item()
    cfg.trainer.lr = 1e-4 * abs(before)  # AdamW's first step moves each weight by lr
    engine = build_engine(model, cfg.trainer, None)
    ids = torch.randint(1, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = engine.forward_backward({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    engine.optimizer_step()
    after = weight.detach().flatten()[index].item()
    assert after != before
    assert abs(after - before) == pytest.approx(cfg.trainer.lr, rel=0.05)
    assert weight.dtype == torch.float32  # the trainable weights are the fp32 masters


def test_fp16_is_rejected_at_composition_naming_the_key_and_the_choices(compose_cfg):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("trainer.precision=fp16")
    message = str(err.value.__cause__ or err.value)
    assert "trainer.precision" in message and "fp16" in message
    assert "fp32, bf16" in message.split("expected one of")[1]


def test_the_main_process_builds_the_data_before_the_other_ranks_load_it(compose_cfg, monkeypatch, tmp_path):
    """Two ranks (threads sharing a barrier): rank 0 builds and caches, then rank 1 finds the cache."""
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    cfg = train.as_train_config(compose_cfg(*TINY))
    monkeypatch.setattr(models.training.distributed, "barrier", threading.Barrier(2, timeout=300).wait)
    events, real = [], train.build_datasets

    def recording(data_cfg, tokenizer=None):
        rank = threading.current_thread().name
        events.append((rank, "start", any((tmp_path / "cache" / "in2").glob("*/build.json"))))
        bundle = real(data_cfg, tokenizer)
        events.append((rank, "end"))
        return bundle

    monkeypatch.setattr(train, "build_datasets", recording)

    def rank(r: int):
        threading.current_thread().name = f"rank{r}"
        return train.load_data(cfg, DistInfo(rank=r, world_size=2, local_rank=r))

    with ThreadPoolExecutor(2) as pool:
        bundles = list(pool.map(rank, [1, 0]))  # rank 1 asks first
    assert events == [("rank0", "start", False), ("rank0", "end"), ("rank1", "start", True), ("rank1", "end")]
    assert bundles[0].stats["digest"] == bundles[1].stats["digest"]
