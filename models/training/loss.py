"""The training loss without the full logits tensor: vocabulary logits only where a label is.

An IN2 sample's loss covers its answer and eos tokens, a few dozen of up to 32K positions, yet a plain
`model(**batch).loss` projects every position onto the vocabulary: (B, L, V) fp32 logits, ~4 GiB per
32K sample with a 32K vocabulary. `causal_lm_loss` computes the same number (the mean next-token
cross-entropy over labelled tokens, as transformers' causal-LM loss) in one of two ways:

- sparse labels (IN2, probes): transformers' `logits_to_keep` with the positions whose next token is
  labelled in some row of the batch, so the LM head runs only there;
- dense labels (language-model windows, every token labelled): the model's last hidden states are
  projected and scored `LOSS_CHUNK` positions at a time, each chunk under activation checkpointing,
  so at most one chunk's logits exist at once, in the forward and in the backward.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from models.build import at_least_fp32, unwrap

IGNORE = -100
# what a loss hands the per-token NLL of a micro-batch: (nll (B, L), targets (B, L)), detached (slot_loss.SlotLoss)
Tap = Callable[[torch.Tensor, torch.Tensor], None]
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
LOSS_CHUNK = 1024  # positions per chunk of the dense path: (LOSS_CHUNK, V) fp32 logits at a time
# Above this share of positions kept, keeping them saves little and the chunked path saves more.
DENSE_SHARE = 0.5


def _chunk_nll(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "sum"
               ) -> torch.Tensor:
    return F.cross_entropy(at_least_fp32(head(hidden)), targets, ignore_index=IGNORE, reduction=reduction)


def labelled_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device | str | None = None,
                 chunk: int = LOSS_CHUNK, per_token: bool = False, tap: Optional[Tap] = None
                 ) -> tuple[torch.Tensor, int]:
    """(summed next-token NLL over the labelled tokens, their count) of one batch.

    `per_token`: the NLL of every position instead of the sum, shaped like the shifted labels ((B, L-1),
    or (B, L) with shift_labels), 0 where no label is: what a per-sample objective (models.training.objectives) weights.

    `model`: what the caller runs forward (an HF causal LM, or a peft model / DeepSpeed engine around
    one). `batch`: input_ids, labels (B, L) (IGNORE where no loss is) and attention_mask (padded) or
    position_ids (packed, see `data_builders.collate`); moved to
    `device` after the labels were counted where they are (on the host: no device sync).
    `tap(nll, targets)`: also handed the per-token NLL (detached, shaped like the shifted labels) from the same
    logits, the loss itself computed as without it (models.training.slot_loss); sparse labels only.
    """
    # position p predicts token p + 1: `labels` shifted here, or `shift_labels` shifted before a sequence
    # was cut into sequence-parallel slices (the last position of a slice predicts the next slice's first)
    shifted = "shift_labels" in batch
    targets = batch["shift_labels"] if shifted else batch["labels"][:, 1:]  # (B, L) or (B, L-1)
    labelled = targets != IGNORE
    count = int(labelled.sum())
    positions = labelled.any(dim=0).nonzero().squeeze(1)  # (K,) positions where some row has a label
    batch = {k: v.to(device) for k, v in batch.items()} if device is not None else batch
    targets = batch["shift_labels"] if shifted else batch["labels"][:, 1:]
    # the model's inputs only (a batch also carries `num_tokens`); no KV cache: with one, transformers
    # would not read packed sequences' boundaries from `position_ids`
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch} | {"use_cache": False}
    if positions.numel() <= DENSE_SHARE * targets.shape[1]:
        positions = positions.to(targets.device)
        # the same positions for every row (what `logits_to_keep` takes in every transformers version)
        logits = model(**inputs, logits_to_keep=positions).logits  # (B, K, V)
        kept = targets[:, positions]  # (B, K)
        nll = F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), kept.flatten(), ignore_index=IGNORE,
                              reduction="none" if per_token else "sum")
        if tap is not None:
            with torch.no_grad():
                each = nll.detach() if per_token else F.cross_entropy(
                    at_least_fp32(logits.detach().flatten(0, 1)), kept.flatten(), ignore_index=IGNORE, reduction="none")
                tap(scattered(each.view(kept.shape), positions, targets.shape), targets)
        if per_token:  # back to every position: zeros where nothing was kept
            return scattered(nll.view(kept.shape), positions, targets.shape), count
        return nll, count
    # Through the model's own forward (a DeepSpeed engine hooks it), with no logits kept; transformers
    # gives the last (normed) hidden states as hidden_states[-1].
    out = model(**inputs, logits_to_keep=positions[:0].to(targets.device), output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :targets.shape[1]]  # (B, L-1, H), or (B, L) with shift_labels
    shape = targets.shape
    hidden, targets = hidden.flatten(0, 1), targets.flatten()  # (N, H), (N,)
    head = unwrap(model).get_output_embeddings()
    chunks = _num_chunks(hidden.shape[0], chunk, hidden.device)
    pieces = [checkpoint(_chunk_nll, head, piece, piece_targets, "none" if per_token else "sum", use_reentrant=False)
              for piece, piece_targets in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks))]
    if per_token:
        return torch.cat(pieces).view(shape), count
    nll = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for piece in pieces:
        nll = nll + piece
    return nll, count


def scattered(kept_nll: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(B, K) values at the kept positions back to every position (B, L): zeros where nothing was kept."""
    full = kept_nll.new_zeros(shape)
    full[:, positions] = kept_nll
    return full


def labelled_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    labels: torch.Tensor, device: torch.device | str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict each row's labelled tokens, row by row in order: (B, T, V) and their mask (B, T).

    [i, t] holds the logits at the position before row i's t-th labelled token (the one that predicts it); T is
    the most labelled tokens of a row, a row with fewer is masked (zero logits) after its own. Right-padded rows
    (`attention_mask`), whose labelled positions differ: the LM head runs only where some row has a label next
    (`logits_to_keep`, as `labelled_nll`), and each row's positions are gathered from those. The positions are
    found where `labels` are (on the host: no device sync), then everything moves to `device`.
    """
    labelled = labels[:, 1:] != IGNORE  # (B, L-1) position p predicts token p + 1
    positions = labelled.any(dim=0).nonzero().squeeze(1)  # (K,) where some row has a label next
    kept = labelled[:, positions]  # (B, K)
    counts = kept.sum(1)  # (B,)
    rows, cols = kept.nonzero(as_tuple=True)  # (N,), (N,) row-major: each row's positions in order
    order = (kept.cumsum(1) - 1)[rows, cols]  # (N,) each one's index among its row's labelled positions
    width = int(counts.max()) if counts.numel() else 0
    mask = torch.arange(width) < counts[:, None]  # (B, T)

    def to(t: torch.Tensor) -> torch.Tensor:
        return t if device is None else t.to(device)

    logits = model(input_ids=to(input_ids), attention_mask=to(attention_mask), logits_to_keep=to(positions),
                   use_cache=False).logits  # (B, K, V), K <= B T: transient, only the gathered (B, T, V) is kept
    rows, cols, order = to(rows), to(cols), to(order)
    out = logits.new_zeros(logits.shape[0], width, logits.shape[-1])  # (B, T, V)
    out = out.index_put((rows, order), logits[rows, cols])  # (B, T, V)
    return out, to(mask)


def _num_chunks(n: int, chunk: int, device: torch.device) -> int:
    """ceil(n / chunk), the same on every rank of a distributed run: under ZeRO-3 each call of the head
    gathers its weight collectively, so every rank must call it equally often (micro-batches differ in length)."""
    chunks = torch.tensor(max(1, math.ceil(n / chunk)), device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(chunks, op=torch.distributed.ReduceOp.MAX)
    return int(chunks)


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device | str | None = None,
                   chunk: int = LOSS_CHUNK, tap: Optional[Tap] = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens (transformers' causal-LM loss), without the
    full logits tensor; NaN for a batch without labels. Arguments as in `labelled_nll`."""
    nll, count = labelled_nll(model, batch, device, chunk, tap=tap)
    return nll / count  # 0 / 0 = NaN
