"""`debias.objective=mean` (default, `debias=none`): the mean next-token NLL over the answer tokens of the
micro-batch, as transformers' causal-LM loss (`models.training.loss.causal_lm_loss`): plain IN2."""
from __future__ import annotations

from typing import Any, Optional

import torch

from models.training.loss import Tap, causal_lm_loss
from models.training.objectives.base import TrainingObjective, register


@register
class Mean(TrainingObjective):
    name = "mean"
    batch_depths = False

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        return causal_lm_loss(model, batch, device, tap=tap)
