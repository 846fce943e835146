"""Training engines: the one place that knows how a step is executed (plain torch or DeepSpeed).

`train.py` drives every engine through the same four calls (`forward_backward`, `optimizer_step`,
`save`, `load`), so single-process and multi-process runs share one loop. Ranks and collectives are
`models.training.distributed`.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from models.training import sequence_parallel
from models.training.checkpoint import load_model_weights
from models.training.distributed import all_finite, dist_info
from models.training.loss import causal_lm_loss, labelled_nll


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"  # fp32 master weights, bf16 compute: autocast single-process, DeepSpeed's bf16 mode under DeepSpeed


# The training loss of a micro-batch: (model, batch, device) -> scalar (models.training.loss.causal_lm_loss, or a
# models.training.objectives objective)
LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor], torch.device], torch.Tensor]


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """The name of the first tensor holding a NaN or infinity, or None."""
    return next((name for name, tensor in named if not bool(torch.isfinite(tensor.detach()).all())), None)


class TorchEngine:
    """Single-process training: fp32 master weights, autocast, accumulation by loss scaling, clipping, AdamW.

    The update rule of DeepSpeed's bf16 mode: every trainable parameter is kept (and updated by
    AdamW) in fp32, whatever `model.dtype` loaded it as, and `precision=bf16` runs the forward and
    backward under bf16 autocast. Updating bf16 weights directly would round away every step smaller
    than about 2^-9 of a weight (a 1e-5 learning rate on a weight of 0.01, say). Frozen weights (the
    base of LoRA) stay in `model.dtype`. Memory: 16 bytes per trainable parameter (fp32 weight 4,
    fp32 gradient 4, AdamW m and v 8) where AdamW on bf16 weights took 8; a full fine-tune of
    Qwen2-0.5B (494M parameters) holds 7.4 GiB before activations instead of 3.7 GiB. Checkpoints
    hold the fp32 weights (the exact resume state); load one with `model.dtype=bfloat16` to halve it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        make_scheduler: Callable[[torch.optim.Optimizer], Any],
        device: torch.device,
        precision: Precision,
        grad_accum: int,
        grad_clip: float,
        loss_fn: LossFn = causal_lm_loss,
    ):
        self.model, self.device, self.loss_fn = model.to(device), device, loss_fn
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.dtype != torch.float32:
                p.data = p.data.float()  # the master copy, in place: the module keeps using it
        self.optimizer = make_optimizer(params)
        self.scheduler = make_scheduler(self.optimizer)
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
        with self._autocast:
            loss = self.loss_fn(self.model, batch, self.device)
        if torch.isfinite(loss):
            (loss / self.grad_accum).backward()
        return loss.detach()

    def optimizer_step(self, skip: bool = False) -> float:
        """Clip, step and zero the gradients; the gradient norm. With `skip` (a non-finite loss), or when the norm
        is not finite, only zero them: no update, and the schedule does not advance."""
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            return math.nan
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf))
        if math.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def nonfinite_weight(self) -> Optional[str]:
        """The name of the first trainable weight holding a NaN or infinity, or None."""
        return first_nonfinite((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

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


def deepspeed_config(
    base: Mapping[str, Any], precision: Precision, micro_batch_size: int, grad_accum: int, grad_clip: float,
    world_size: int, sequence_parallel: int = 1,
) -> dict[str, Any]:
    """The complete DeepSpeed config: `trainer.deepspeed` with the keys the loop's settings own filled in.

    Micro-batch, accumulation, clipping, bf16 and the sequence-parallel degree come from the trainer
    settings, so the two never disagree (a global batch counts sequences, each shared by
    `sequence_parallel` ranks); the rest of `base` is passed as is. One config serves both users: `zero3_load_context`
    (partitioning at load) and `DeepSpeedEngine`.
    """
    config = copy.deepcopy(dict(base))
    config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=grad_accum,
        gradient_clipping=grad_clip,
        bf16={"enabled": Precision(precision) == Precision.bf16},
        train_batch_size=micro_batch_size * grad_accum * world_size // sequence_parallel,
    )
    if sequence_parallel > 1:
        config["sequence_parallel_size"] = sequence_parallel
    config.setdefault("steps_per_print", 10**9)  # the loop logs; keep DeepSpeed quiet
    config.setdefault("zero_allow_untested_optimizer", True)
    return config


def zero_stage(config: Optional[Mapping[str, Any]]) -> int:
    return int(((config or {}).get("zero_optimization") or {}).get("stage", 0))


def zero3_load_context(config: Optional[Mapping[str, Any]]) -> Any:
    """Under ZeRO-3: the object that makes `from_pretrained` / `from_config` partition at load, else None.

    While the returned `HfDeepSpeedConfig` is alive, transformers builds every model inside
    `deepspeed.zero.Init`, so no rank ever holds the full weights; keep it for the whole run (drop
    it to end that). It needs the joined process group and the complete config (`deepspeed_config`).
    """
    if zero_stage(config) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(copy.deepcopy(dict(config)))


def partitioned_count(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter tensors partitioned by ZeRO-3, all parameter tensors) of `module`."""
    params = list(module.parameters())
    return sum(hasattr(p, "ds_id") for p in params), len(params)


@contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """`module`'s ZeRO-3-partitioned parameters whole on every rank inside the block, read-only.

    A collective: every rank enters it. A no-op for a module without partitioned parameters.
    """
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


class DeepSpeedEngine:
    """Multi-process training with a DeepSpeed engine (ZeRO-2/3, offload), same calls as `TorchEngine`.

    `config` is the complete one of `deepspeed_config`. The optimizer is torch AdamW and the schedule
    the loop's LambdaLR, so a DeepSpeed run follows exactly the single-process update rule (bf16:
    fp32 master weights in the optimizer, bf16 compute). The process group must be joined first
    (`init_distributed`), as the model under ZeRO-3 was already partitioned at load.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        make_scheduler: Callable[[torch.optim.Optimizer], Any],
        config: dict[str, Any],
        pad_id: int = 0,
        loss_fn: LossFn = causal_lm_loss,
    ):
        import deepspeed

        self.info, self.loss_fn = dist_info(), loss_fn
        # Ulysses sequence parallelism (models.training.sequence_parallel): groups of consecutive ranks share each sequence
        self.sp_size, self.pad_id, self.sp_group, mpu = config.get("sequence_parallel_size", 1), pad_id, None, None
        if self.sp_size > 1:
            mpu = sequence_parallel.enable(model, self.sp_size, config["train_micro_batch_size_per_gpu"])
            self.sp_group = mpu.get_sequence_parallel_group()
        self.sp_grad_factor = sequence_parallel.grad_factor(self.sp_size, zero_stage(config))
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
            mpu=mpu,
        )
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.sp_size > 1:
            return self._forward_backward_sharded(batch)
        loss = self.loss_fn(self.engine, batch, self.device)
        # Every rank must take part in the backward collectives, so a non-finite loss anywhere
        # skips the micro-step on all ranks.
        if all_finite(loss.detach(), self.device):
            self.engine.backward(loss)
            self.engine.step()
        return loss.detach()

    def _forward_backward_sharded(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's slice of the sequences; the loss is the group's token-weighted mean (see
        models.training.sequence_parallel): each rank backpropagates its summed NLL / the group's label count, times
        what undoes DeepSpeed's reduction over the group (`sequence_parallel.grad_factor`)."""
        rank = self.info.rank % self.sp_size
        nll, count = labelled_nll(self.engine, sequence_parallel.shard(batch, rank, self.sp_size, self.pad_id),
                                  self.device)
        totals = torch.stack([nll.detach().float(), torch.tensor(float(count), device=self.device)])
        torch.distributed.all_reduce(totals, group=self.sp_group)
        loss = totals[0] / totals[1]  # the sequence's mean over its labelled tokens (NaN without any)
        if all_finite(loss, self.device):
            self.engine.backward(nll * self.sp_grad_factor / totals[1])
            self.engine.step()
        return loss

    def optimizer_step(self, skip: bool = False) -> float:
        """DeepSpeed steps inside `forward_backward` at the accumulation boundary; report the norm. A non-finite
        norm may have been applied already: `nonfinite_weight` tells."""
        norm = self.engine.get_global_grad_norm()
        return math.nan if skip or norm is None else float(norm)

    def nonfinite_weight(self) -> Optional[str]:
        """The first trainable weight holding a NaN or infinity on any rank (under ZeRO-3 each rank looks at its own
        partition), or None; every rank must call it."""
        local = first_nonfinite((n, getattr(p, "ds_tensor", p)) for n, p in self.module.named_parameters()
                                if p.requires_grad)
        found = [None] * self.info.world_size
        torch.distributed.all_gather_object(found, local)
        return next((name for name in found if name is not None), None)

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
