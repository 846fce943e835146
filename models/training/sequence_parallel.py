"""Ulysses sequence parallelism (DeepSpeed's ALST) for contexts that do not fit one GPU.

With `trainer.sequence_parallel=N`, N consecutive ranks share each training sequence: rank r of the
group holds the r-th contiguous slice of every sequence, and DeepSpeed's `UlyssesSPAttentionHF` swaps
the slices for attention heads with an all-to-all around every attention call (each rank attends over
the whole sequence with H/N heads). Everything that is not attention is per token, so it runs on the
slice. The groups are data-parallel with each other: the data stream is sharded over world/N groups.

What this module adds around DeepSpeed's pieces:

- `shard`: the slice of a padded micro-batch, with `position_ids` and with the labels shifted before
  slicing (`shift_labels`), so the last position of a slice predicts the next slice's first token.
- `enable`: registers the Ulysses attention, but only for training forwards. Evaluation (generation
  with padded prompts, the held-out loss, the Jacobian) runs in eval mode on whole sequences with the
  original attention and its masks on every rank; Ulysses itself would drop the padding masks.
- The loss is the group's token-weighted mean: every rank backpropagates its own share, its summed NLL
  over the group's label count, times `grad_factor`, so that the update is exactly that of the
  unsharded mean: same losses and gradient norms as one process (tests/test_distributed.py; with AdamW
  and clipping, a gradient N times too large leaves the losses unchanged and shows only in the norm).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from models.training.loss import IGNORE


def shard(batch: dict[str, torch.Tensor], rank: int, size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The `rank`-th of `size` contiguous slices of every sequence of a padded micro-batch.

    Sequences are right-padded to a multiple of `size` (pad tokens, IGNORE labels; causal attention
    keeps them from affecting real tokens). No attention mask travels: Ulysses works from
    `position_ids`, and right padding needs none under causal attention.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    width = -(-ids.shape[1] // size) * size
    ids = F.pad(ids, (0, width - ids.shape[1]), value=pad_id)
    labels = F.pad(labels, (0, width - labels.shape[1]), value=IGNORE)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # (B, W): position p's target is token p + 1
    position_ids = torch.arange(width).expand_as(ids)
    part = slice(rank * width // size, (rank + 1) * width // size)
    return {"input_ids": ids[:, part], "position_ids": position_ids[:, part], "shift_labels": shift_labels[:, part],
            "num_tokens": batch["num_tokens"]}


def enable(model: torch.nn.Module, size: int, micro_batch_size: int) -> Any:
    """Register Ulysses attention for `model`'s attention implementation (training forwards only);
    returns DeepSpeed's parallel-state object (`mpu`) for `deepspeed.initialize`. Needs the process
    group joined."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = model.config._attn_implementation
    whole = ALL_ATTENTION_FUNCTIONS[core]
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core, size, micro_batch_size,
                                                          seq_length_is_variable=True)
    sharded = ALL_ATTENTION_FUNCTIONS[core]

    def attention(module: torch.nn.Module, *args, **kwargs):
        return (sharded if module.training else whole)(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[core] = attention
    return mpu


def grad_factor(size: int, zero_stage: int) -> int:
    """What a rank's share of the loss is multiplied by for DeepSpeed's gradient reduction to give the
    gradient of the whole-sequence mean.

    Measured with DeepSpeed 0.19.8 (the full gradients, `safe_get_full_grad`, of 2 ranks against one
    process): ZeRO-1/2 sum the gradients of a sequence-parallel group's ranks, ZeRO-3 averages them.
    tests/test_distributed.py checks both, so a DeepSpeed release that changes this fails there.
    """
    return size if zero_stage == 3 else 1
