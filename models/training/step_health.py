"""Whether a training step may stand: its loss and gradient norm finite, its weights finite, its loss not exploding.

A step whose loss or gradient norm is not finite is skipped (the optimizer does not step), named in the log with
its reason and counted; past `trainer.max_bad_steps` the run stops. Weights that an update made non-finite cannot be
skipped: the run stops before anything is saved from them (`engines.*.nonfinite_weight`). An exploding loss, above
`loss_spike_factor` x the median of the recent finite losses for `loss_spike_steps` steps in a row, is named in
the log once per episode and counted (`train/loss_spikes`), without stopping the run: a user decides.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

SPIKE_HISTORY = 50  # finite losses the running median is taken over
SPIKE_WARMUP = 10  # losses seen before a spike can be called: the first steps of a run fall fast


class TooManyBadSteps(RuntimeError):
    """More skipped steps than `trainer.max_bad_steps`."""


class NonFiniteWeights(RuntimeError):
    """An update made a trainable weight non-finite: nothing after it may be saved."""


def skip_reason(loss: float, grad_norm: float) -> Optional[str]:
    """Why a step's update must not stand (its reason in the log), or None when it may."""
    if not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    if not math.isfinite(grad_norm):
        return f"non-finite gradient norm ({grad_norm}) with a finite loss ({loss:.4g})"
    return None


@dataclass
class StepHealth:
    """The run's bad steps and loss spikes; its `state_dict` goes into every checkpoint (a resume keeps counting)."""

    max_bad_steps: int
    spike_factor: float = 10.0
    spike_steps: int = 3
    bad_steps: int = 0
    loss_spikes: int = 0  # episodes of an exploding loss
    recent: deque = field(default_factory=lambda: deque(maxlen=SPIKE_HISTORY))
    above: int = 0  # consecutive steps above spike_factor x the median

    def bad_step(self) -> None:
        """Count a skipped step; TooManyBadSteps past `max_bad_steps` (the caller names the last good checkpoint)."""
        self.bad_steps += 1
        if self.bad_steps > self.max_bad_steps:
            raise TooManyBadSteps(f"{self.bad_steps} skipped steps (trainer.max_bad_steps={self.max_bad_steps})")

    def exploding(self, loss: float) -> Optional[float]:
        """Record a finite loss; the running median it exceeds when it makes `spike_steps` in a row above
        `spike_factor` x that median (a new episode, counted once), else None."""
        median = float(np.median(self.recent)) if len(self.recent) >= SPIKE_WARMUP else math.nan
        spiking = math.isfinite(median) and loss > self.spike_factor * max(median, 1e-12)
        self.above = self.above + 1 if spiking else 0
        if not spiking:  # a spike's own losses would raise the median it is measured against
            self.recent.append(loss)
        if self.above == self.spike_steps:
            self.loss_spikes += 1
            return median
        return None

    def metrics(self) -> dict[str, float]:
        return {"train/bad_steps": self.bad_steps, "train/loss_spikes": self.loss_spikes}

    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": self.bad_steps, "loss_spikes": self.loss_spikes, "recent": list(self.recent),
                "above": self.above}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_steps, self.loss_spikes = state.get("bad_steps", 0), state.get("loss_spikes", 0)
        self.recent = deque(state.get("recent", []), maxlen=SPIKE_HISTORY)
        self.above = state.get("above", 0)
