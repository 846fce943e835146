"""The `trainer` section: its settings (`TrainerConfig`) and their start-up checks, and the pieces of the update
rule train.py's loop runs: the seed, the warm-up-cosine schedule, the engine (torch or DeepSpeed, one AdamW and one
schedule for both) and the stop request a signal leaves."""
from __future__ import annotations

import math
import random
import signal
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from models.build import Attention, AttnImplementation, ModelConfig
from models.training.distributed import Device, resolve_device
from models.training.engines import DeepSpeedEngine, Precision, TorchEngine
from models.training.loss import causal_lm_loss


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps
    lr: float = 1e-3  # peak learning rate (AdamW); the model's recipe (conf/recipe/) sets it per kind of model
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warm-up
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    micro_batch_size: int = 8  # samples per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: Precision = Precision.fp32  # fp32 | bf16 (autocast; the trained weights stay fp32 masters)
    # Padded training batches' width rounded up to a multiple (1: the longest row). Under bf16 on a CPU every new
    # width builds and keeps new oneDNN kernels, so memory grows and steps slow over a run of varied lengths;
    # 64 bounds the widths (docs/READS_MIDDLE.md, "bf16 twin"). Packed rows are data.pack_len wide already.
    pad_to_multiple_of: int = 1
    device: Device = Device.cpu  # cpu | cuda | auto
    # A checkpoint folder; `latest`: the newest of this run directory; `auto`: the newest of any run
    # of this experiment (the sibling run directories), or a fresh start when there is none.
    resume_from: Optional[str] = None
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last_n: int = 2  # checkpoints kept; 0 = all
    max_bad_steps: int = 10  # steps skipped for a non-finite loss or gradient norm before the run stops
    # An exploding loss, above loss_spike_factor x the running median for loss_spike_steps steps in a row, is named
    # in the log and counted (train/loss_spikes, the summary); it does not stop the run.
    loss_spike_factor: float = 10.0
    loss_spike_steps: int = 3
    deepspeed: Optional[dict[str, Any]] = None  # DeepSpeed config block (trainer=zero2/zero3/...)
    collective_timeout_s: float = 1800.0  # a collective (or joining the group) that takes longer fails
    # ranks sharing each sequence (DeepSpeed Ulysses, models/sequence_parallel.py); data-parallel over world/N
    sequence_parallel: int = 1


def validate_numbers(t: TrainerConfig) -> None:
    """The trainer's real numbers: finite, and in the range that makes an update rule (an infinite or negative
    rate, or a warm-up that starts the schedule partway down its cosine, trains silently wrong)."""
    for key in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "loss_spike_factor"):
        if not math.isfinite(getattr(t, key)):
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be a finite number")
    if t.lr <= 0:
        raise ValueError(f"trainer.lr={t.lr} must be > 0")
    for key in ("warmup_steps", "weight_decay", "grad_clip", "max_bad_steps", "save_every", "keep_last_n"):
        if getattr(t, key) < 0:
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be >= 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ValueError(f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (the cosine's floor, a share of lr)")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ValueError(f"trainer.betas={list(t.betas)} must be two numbers in [0, 1) (AdamW's)")
    if t.loss_spike_factor <= 1:
        raise ValueError(f"trainer.loss_spike_factor={t.loss_spike_factor} must be > 1 (a multiple of the running "
                         "median loss)")


def validate_trainer(t: TrainerConfig, world_size: int, model: ModelConfig, packing: bool) -> None:
    """Every check of the trainer section, before anything is built (`model`, `packing`: what it trains on which
    rows); errors name the key."""
    for key in ("max_steps", "micro_batch_size", "grad_accum", "pad_to_multiple_of", "loss_spike_steps"):
        if getattr(t, key) < 1:
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be >= 1")
    validate_numbers(t)
    if t.pad_to_multiple_of > 1 and packing:
        raise ValueError(f"trainer.pad_to_multiple_of={t.pad_to_multiple_of} with data.packing=true: packed rows are "
                         "data.pack_len wide already; set one of them")
    if world_size > 1 and not t.deepspeed:
        raise ValueError(f"{world_size} processes need a DeepSpeed trainer (trainer=zero2|zero3|zero3_offload)")
    validate_sequence_parallel(t, world_size, model, packing)
    if model.attn_implementation == AttnImplementation.flex_attention and t.device != Device.cuda and (
            t.device == Device.cpu or not torch.cuda.is_available()):
        raise ValueError(f"model.attn_implementation=flex_attention has no backward on the CPU (torch "
                         f"{torch.__version__}): train with sdpa here, or on a CUDA device")


def validate_sequence_parallel(t: TrainerConfig, world_size: int, model: ModelConfig, packing: bool) -> None:
    """What `trainer.sequence_parallel=N` (Ulysses) can run on, checked before anything is built."""
    sp = t.sequence_parallel
    if sp < 1:
        raise ValueError(f"trainer.sequence_parallel={sp} must be >= 1")
    if sp == 1:
        return
    if not t.deepspeed:
        raise ValueError(f"trainer.sequence_parallel={sp} runs under DeepSpeed (trainer=zero2|zero3|zero3_offload)")
    if world_size % sp:
        raise ValueError(f"trainer.sequence_parallel={sp} must divide the {world_size} processes")
    if model.attention != Attention.standard:
        raise ValueError(f"trainer.sequence_parallel={sp} with model.attention={model.attention}: Ulysses splits "
                         "the model's attention heads, a diff layer computes two maps per head; use one of them")
    if model.attn_implementation not in (AttnImplementation.sdpa, AttnImplementation.flash_attention_2):
        raise ValueError(f"trainer.sequence_parallel={sp} needs model.attn_implementation=sdpa or flash_attention_2 "
                         f"(got {model.attn_implementation})")
    if packing and model.attn_implementation != AttnImplementation.flash_attention_2:
        raise ValueError(f"trainer.sequence_parallel={sp} with data.packing=true needs "
                         "model.attn_implementation=flash_attention_2: with sdpa, samples of a packed row "
                         "would attend to each other")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StopRequest:
    """SIGTERM/SIGINT/SIGUSR1 set a flag; the loop finishes its step, saves and exits cleanly.

    SIGUSR1 is SLURM's warning before a time limit or pre-emption (`sbatch --signal=USR1@120`).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def build_engine(model: torch.nn.Module, t: TrainerConfig, ds_config: Optional[dict[str, Any]], pad_id: int = 0,
                 loss_fn: Any = causal_lm_loss) -> TorchEngine | DeepSpeedEngine:
    """Single-process torch or DeepSpeed (`ds_config` of `deepspeed_config`), one AdamW and one schedule for both;
    `loss_fn(model, batch, device)` is the micro-batch loss (debias.objective's)."""

    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))

    if ds_config is not None:
        return DeepSpeedEngine(model, make_optimizer, make_scheduler, ds_config, pad_id, loss_fn)
    return TorchEngine(model, make_optimizer, make_scheduler, resolve_device(t.device), t.precision, t.grad_accum,
                       t.grad_clip, loss_fn)
