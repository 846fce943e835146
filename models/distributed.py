"""Training engines: the one place that knows how a step is executed (plain torch or DeepSpeed).

`train.py` drives every engine through the same four calls (`forward_backward`, `optimizer_step`,
`save`, `load`), so single-process and multi-process runs share one loop. This is the only module
that imports deepspeed or torch.distributed.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

import torch

from models.checkpoint import load_model_weights


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast on the single-process path; DeepSpeed's bf16 mode under DeepSpeed


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"  # the local CUDA device when there is one, else the CPU


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Rank and world size from the launcher's environment (deepspeed / torchrun), else one process."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` picks the local CUDA device when there is one, else the CPU."""
    name = Device(name)
    if name == Device.auto:
        name = Device.cuda if torch.cuda.is_available() else Device.cpu
    if name == Device.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible (use trainer=cpu)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(timeout_s: float) -> None:
    """Join the launcher's process group; a rank that cannot reach the others fails, naming itself.

    The timeout also bounds every later collective (gloo and nccl honour it), so a hung rank ends
    the run with an error instead of a silent hang.
    """
    import deepspeed

    info = dist_info()
    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RuntimeError(
            f"rank {info.rank} of {info.world_size}: could not join the process group within "
            f"{timeout_s:.0f} s (trainer.collective_timeout_s): {exc}"
        ) from exc


class TorchEngine:
    """Single-process training: autocast, gradient accumulation by loss scaling, clipping, AdamW."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        device: torch.device,
        precision: Precision,
        grad_accum: int,
        grad_clip: float,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device = device
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self._autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if Precision(precision) == Precision.bf16
            else nullcontext()
        )

    @property
    def module(self) -> torch.nn.Module:
        """The model to measure and save (for DeepSpeed: the wrapped module)."""
        return self.model

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of one micro-batch (unscaled, detached); its gradient is accumulated."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self._autocast:
            loss = self.model(**batch).loss
        if torch.isfinite(loss):
            (loss / self.grad_accum).backward()
        return loss.detach()

    def optimizer_step(self, skip: bool = False) -> float:
        """Clip, step and zero the gradients; with `skip` (a non-finite loss) only zero them."""
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            return math.nan
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, folder: Path, tokenizer) -> None:
        """HF `save_pretrained` (adapters only under LoRA) + tokenizer + optimizer and scheduler."""
        self.model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def load(self, folder: Path) -> None:
        load_model_weights(self.model, folder)
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))


class DeepSpeedEngine:
    """Multi-process training with a DeepSpeed engine (ZeRO-2/3, offload), same calls as `TorchEngine`.

    The loop's settings fill the DeepSpeed config keys they own (micro-batch, accumulation,
    clipping, bf16), so the two never disagree; the rest of `trainer.deepspeed` is passed as is.
    The optimizer is torch AdamW and the schedule the loop's LambdaLR, so a DeepSpeed run follows
    exactly the single-process update rule.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        make_scheduler: Callable[[torch.optim.Optimizer], Any],
        ds_config: dict[str, Any],
        precision: Precision,
        micro_batch_size: int,
        grad_accum: int,
        grad_clip: float,
        collective_timeout_s: float,
    ):
        import deepspeed

        init_distributed(collective_timeout_s)
        self.info = dist_info()
        config = dict(ds_config)
        config.update(
            train_micro_batch_size_per_gpu=micro_batch_size,
            gradient_accumulation_steps=grad_accum,
            gradient_clipping=grad_clip,
            bf16={"enabled": precision == "bf16"},
            train_batch_size=micro_batch_size * grad_accum * self.info.world_size,
        )
        config.setdefault("steps_per_print", 10**9)  # the loop logs; keep DeepSpeed quiet
        config.setdefault("zero_allow_untested_optimizer", True)
        params = [p for p in model.parameters() if p.requires_grad]
        if config.get("zero_optimization", {}).get("offload_optimizer"):
            # Offloaded optimizer states live in CPU RAM, where DeepSpeed requires its own CPU Adam.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            reference = make_optimizer(params).defaults
            make_optimizer = lambda ps: DeepSpeedCPUAdam(  # noqa: E731
                ps, lr=reference["lr"], betas=reference["betas"], weight_decay=reference["weight_decay"]
            )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=make_optimizer(params),
            lr_scheduler=make_scheduler,
            config=config,
        )
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        loss = self.engine(**batch).loss
        # Every rank must take part in the backward collectives, so a non-finite loss anywhere
        # skips the micro-step on all ranks.
        finite = torch.isfinite(loss.detach()).float()
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if finite.item() == 1.0:
            self.engine.backward(loss)
            self.engine.step()
        return loss.detach()

    def optimizer_step(self, skip: bool = False) -> float:
        """DeepSpeed steps inside `forward_backward` at the accumulation boundary; report the norm."""
        norm = self.engine.get_global_grad_norm()
        return math.nan if skip or norm is None else float(norm)

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, folder: Path, tokenizer) -> None:
        """DeepSpeed's own checkpoint (every rank's partitions, for exact resume) + a consolidated HF export."""
        self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state")
        state = None
        if self.engine.zero_optimization_stage() == 3:
            # Partitioned weights: gather them (a collective). LoRA saves adapters only, so frozen
            # base weights are not gathered into rank 0's memory at all.
            state = self.engine._zero3_consolidated_16bit_state_dict(
                exclude_frozen_parameters=hasattr(self.module, "peft_config")
            )
        if self.info.is_main_process:
            self.module.save_pretrained(folder, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(folder)

    def load(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state")
        if path is None:
            raise FileNotFoundError(f"{folder / 'deepspeed'}: no DeepSpeed checkpoint to resume from")


def all_mean(value: float) -> float:
    """Mean of a scalar over ranks (the value itself in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
