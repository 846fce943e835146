"""The training batches' answer NLL by gold slot, near free: read where the loss is computed, over a rolling window.

Every IN2 training sample knows its gold depth (`depth`: in the mdqa layout slot / (n_docs − 1)), so the loss the
step computes anyway can be split by slot: `SlotLoss.tap` is handed to `models.training.loss.labelled_nll`, which
gives it the micro-batch's per-token NLL (detached, from the logits it computed; the loss itself is computed as
without it), and pos2distill hands it the student's NLL of its targets beside its KL. Logged every step as
`watch/train/nll@<slot>`: the mean over the last `window` steps' samples of each sample's mean NLL per answer
token, and `watch/train/nll_contrast` (the middle slot's minus the strong slot's: above 0, the middle is harder).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from models.training.objectives.base import sample_sums

PREFIX = "watch/train"


def slot_of(depths: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The gold slot of each depth in [0, 1] on `n_slots` equal slots (mdqa: depth = slot / (n − 1) exactly)."""
    return (depths * (n_slots - 1)).round().long().clamp(0, n_slots - 1)


class SlotLoss:
    """Per-slot training NLL over the last `window` steps (module docstring)."""

    def __init__(self, n_slots: int, window: int, middle: int, strong: int,
                 all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.n_slots, self.middle, self.strong, self.all_sum = n_slots, middle, strong, all_sum
        self.steps: deque[np.ndarray] = deque(maxlen=window)  # per step: (2, n_slots) sum of sample means, count
        self._step = np.zeros((2, n_slots))

    def observe(self, depths: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor,
                mixed: Optional[torch.Tensor] = None) -> None:
        """A micro-batch's samples: their gold depths (S,), summed answer NLL (S,) and answer-token counts (S,);
        `mixed` (S,) bool: rows of debias.needle_mix, which are not the task's and are left out."""
        keep = counts > 0 if mixed is None else (counts > 0) & ~mixed.to(counts.device)
        slots = slot_of(depths.to(sums.device)[keep], self.n_slots)
        means = (sums[keep].double() / counts[keep].double())
        self._step[0] += torch.zeros(self.n_slots, dtype=torch.float64).index_add(0, slots.cpu(), means.cpu()).numpy()
        self._step[1] += np.bincount(slots.cpu().numpy(), minlength=self.n_slots)

    def tap(self, batch: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """What `labelled_nll(tap=...)` calls with the per-token NLL (B, L-1) and targets of `batch`."""
        def record(nll: torch.Tensor, targets: torch.Tensor) -> None:
            depths = batch["depths"]
            sums, counts = sample_sums(nll, targets, batch["sample_ids"].to(nll.device), depths.numel())
            self.observe(depths, sums, counts, batch.get("mixed"))
        return record

    def end_step(self) -> dict[str, float]:
        """Close the step (its samples summed over the ranks) and the window's metrics."""
        step = self.all_sum(torch.from_numpy(self._step)).numpy()
        self.steps.append(step)
        self._step = np.zeros((2, self.n_slots))
        total = np.sum(self.steps, axis=0)
        means = np.where(total[1] > 0, total[0] / np.maximum(total[1], 1), math.nan)
        out = {f"{PREFIX}/nll@{k}": float(v) for k, v in enumerate(means) if math.isfinite(v)}
        contrast = means[self.middle] - means[self.strong]
        if math.isfinite(contrast):
            out[f"{PREFIX}/nll_contrast"] = float(contrast)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [s.tolist() for s in self.steps]}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        self.steps.clear()
        for s in (state or {}).get("steps", []):
            self.steps.append(np.array(s, dtype=np.float64))


def tapped(loss_fn: Callable[..., torch.Tensor], slot_loss: SlotLoss) -> Callable[..., torch.Tensor]:
    """`loss_fn(model, batch, device)` that also hands `slot_loss` the micro-batch's per-sample NLL."""
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None) -> torch.Tensor:
        return loss_fn(model, batch, device, tap=slot_loss.tap(batch))
    return loss


def check_slots(slots: Sequence[int], n_slots: int) -> None:
    if max(slots) >= n_slots:
        raise ValueError(f"watch.slots={list(slots)}: the training data has {n_slots} gold slots")
