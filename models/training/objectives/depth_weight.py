"""`debias.objective=depth_weight`: each sample's answer tokens weighted by w(d) ∝ p(d)^(-beta), beta =
`debias.prior_power`, p the closed-form prior at the sample's gold depth d (`data_builders.depth_prior.depth_prior`,
at the model's H layers, with `debias.prior_alpha` or the alpha fitted to the latest measured Jacobian profile),
normalised to mean 1 over the samples of the micro-batch and clipped at `debias.max_weight` (`mean_one_clipped`).
loss = sum_t w_s(t) nll_t / N, so beta = 0 is exactly the mean objective. `data.in2.depth_law=valley` draws training
golds by the same law with the same names (`data.in2.prior_alpha`, `data.in2.prior_power`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from data_builders.depth_prior import depth_prior
from models.training.loss import Tap
from models.training.objectives.base import (
    StartUp,
    TrainingObjective,
    check_max_weight,
    mean_one_clipped,
    per_sample_nll,
    register,
)

ALPHA_KEYS = ("prior/vanilla/alpha", "prior/chunked/alpha")  # the fitted alpha it follows, the first found


def depth_weights(depths: torch.Tensor, layers: int, alpha: float, beta: float, cap: float) -> torch.Tensor:
    """The per-sample weights: p(d)^(-beta) normalised to mean 1 and clipped at `cap`."""
    prior = torch.from_numpy(depth_prior(depths.double().cpu().numpy(), layers, alpha))
    return mean_one_clipped(prior.pow(-beta), cap).to(depths.device)


@register
class DepthWeight(TrainingObjective):
    name = "depth_weight"
    owns = ("prior_power", "prior_alpha", "max_weight")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.alpha = ctx.cfg.prior_alpha  # fixed, or the latest fitted one (`observe`)
        self._last: dict[str, float] = {}

    @classmethod
    def validate(cls, start: StartUp) -> None:
        cfg = start.debias
        check_max_weight(cfg)
        if cfg.prior_alpha is None and start.jacobian_every < 1:
            raise ValueError("debias.objective=depth_weight with debias.prior_alpha=null follows the alpha fitted to "
                             "the measured Jacobian, which is off (jacobian.every=0): set debias.prior_alpha (e.g. 0.5)")
        if cfg.prior_alpha is not None and not 0 < cfg.prior_alpha < 1:
            raise ValueError(f"debias.prior_alpha={cfg.prior_alpha} must be in (0, 1)")

    def observe(self, metrics: Mapping[str, float]) -> None:
        """Follow the alpha fitted to the latest measured Jacobian profile (with debias.prior_alpha=null)."""
        if self.ctx.cfg.prior_alpha is not None:
            return
        fitted = next((metrics[k] for k in ALPHA_KEYS if k in metrics), None)
        if fitted is not None and math.isfinite(fitted) and 0 < fitted < 1:
            self.alpha = float(fitted)

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        cfg = self.ctx.cfg
        sums, _, depths, count = per_sample_nll(model, batch, device, tap)
        if self.alpha is None:
            raise RuntimeError("depth_weight has no alpha yet: the Jacobian is measured before the first update")
        w = depth_weights(depths, self.ctx.layers, self.alpha, cfg.prior_power, cfg.max_weight)
        self._last = {"debias/alpha": self.alpha, "debias/weight_max": float(w.max()),
                      "debias/weight_min": float(w.min())}
        return (w.to(sums.device, sums.dtype) * sums).sum() / count

    def metrics(self) -> dict[str, float]:
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alpha = state.get("alpha", self.alpha)
