"""`debias.objective=loss_weight`: weights from the measured loss by depth instead of the prior's shape
(docs/DEBIAS_STUDY.md, "What to try next"; no prior, no Jacobian). Per gold-depth bin k (group_dro's `debias.bins`
and bins) an exponential moving average m_k of the per-sample loss l_s (a sample's mean NLL over its answer tokens):
m_k <- (1 - r) m_k + r l_k, r = `debias.loss_ema`, l_k the micro-batch's mean of l_s over bin k's samples (a bin's
first l_k sets m_k). A sample of bin k weighs w ∝ (m_k / mean_seen m)^gamma, gamma = `debias.loss_power`, normalised
to mean 1 over the samples of the micro-batch and clipped at `debias.max_weight` (`mean_one_clipped`), and
loss = sum_t w_s(t) nll_t / N as depth_weight's, so gamma = 0 is the plain loss. The weights are detached and come
from earlier micro-batches only (the averages are updated after weighting): a sample never weights itself; a bin not
seen yet counts as the mean of the seen ones (ratio 1), and the first micro-batch, with none seen, is the plain loss.
As group_dro's loss_k, l_k is over every data-parallel rank's samples, so the averages are the same on every rank;
they are logged (`debias/bin_loss@<bin>`, the bins seen so far), saved in checkpoints and resume exactly.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from data_builders.probes import bin_label
from models.training.loss import Tap
from models.training.objectives.base import (
    StartUp,
    TrainingObjective,
    check_max_weight,
    mean_one_clipped,
    per_sample_nll,
    register,
)
from models.training.objectives.group_dro import bin_of


class BinLossWeights:
    """The moving averages of the per-sample loss over `bins` gold-depth bins, and the weights they give."""

    def __init__(self, bins: int, rate: float, power: float, cap: float):
        self.bins, self.rate, self.power, self.cap = bins, rate, power, cap
        self.average = torch.zeros(bins, dtype=torch.float64)
        self.seen = torch.zeros(bins, dtype=torch.bool)

    def weights(self, bins: torch.Tensor) -> torch.Tensor:
        """(S,) float64: (m_k / mean_seen m)^power for each sample's bin k, an unseen bin's ratio 1 (every one
        while no bin is seen), normalised to mean 1 and clipped at `cap`."""
        ratio = torch.ones(self.bins, dtype=torch.float64)
        if self.seen.any():
            ratio = torch.where(self.seen, self.average / self.average[self.seen].mean(), ratio)
        return mean_one_clipped(ratio[bins.cpu()].pow(self.power), self.cap)

    def update(self, bin_means: torch.Tensor, present: torch.Tensor) -> None:
        """m_k <- (1 - rate) m_k + rate l_k for every present bin k; a bin's first l_k sets m_k."""
        moved = torch.where(self.seen, (1 - self.rate) * self.average + self.rate * bin_means, bin_means)
        self.average = torch.where(present, moved, self.average)
        self.seen = self.seen | present

    def step(self, sums: torch.Tensor, counts: torch.Tensor, depths: torch.Tensor,
             all_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This micro-batch's sample weights (from the averages so far), then the averages updated with its
        per-sample losses, summed over data-parallel ranks by `all_sum` (so every rank holds the same ones)."""
        K = self.bins
        bins = bin_of(depths, K)
        w = self.weights(bins)
        labelled = (counts > 0).double()  # a sample with no answer token left has no loss to average
        per_sample = sums.detach().double() / counts.clamp(min=1)  # (S,) mean NLL over each sample's answer tokens
        total = all_sum(torch.cat([per_sample.new_zeros(K).index_add(0, bins, per_sample * labelled),
                                   per_sample.new_zeros(K).index_add(0, bins, labelled)])).cpu()
        if total.isfinite().all():  # a non-finite loss skips the step (train.py): it must not stay in the averages
            self.update(total[:K] / total[K:].clamp(min=1), total[K:] > 0)
        return w

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average.tolist(), "seen": self.seen.tolist()}  # JSON floats round-trip exactly

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        average = torch.tensor(state["average"], dtype=torch.float64)
        if average.shape != (self.bins,):
            raise ValueError(f"the checkpoint's loss_weight state has {average.numel()} bins, debias.bins={self.bins}")
        self.average, self.seen = average, torch.tensor(state["seen"], dtype=torch.bool)


@register
class LossWeight(TrainingObjective):
    name = "loss_weight"
    owns = ("bins", "loss_power", "loss_ema", "max_weight")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.bin_loss = BinLossWeights(cfg.bins, cfg.loss_ema, cfg.loss_power, cfg.max_weight)
        self._last: dict[str, float] = {}

    @classmethod
    def validate(cls, start: StartUp) -> None:
        cfg = start.debias
        check_max_weight(cfg)
        if cfg.bins < 1 or cfg.loss_power < 0:
            raise ValueError(f"debias.bins={cfg.bins} must be >= 1 and debias.loss_power={cfg.loss_power} >= 0")
        if not 0 < cfg.loss_ema <= 1:
            raise ValueError(f"debias.loss_ema={cfg.loss_ema} must be in (0, 1]")

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        sums, counts, depths, count = per_sample_nll(model, batch, device, tap)
        w = self.bin_loss.step(sums, counts, depths, self.ctx.all_sum)
        self._last = {"debias/weight_max": float(w.max()), "debias/weight_min": float(w.min())}
        return (w.to(sums.device, sums.dtype) * sums).sum() / count

    def metrics(self) -> dict[str, float]:
        averages = {f"debias/bin_loss@{bin_label(k, self.bin_loss.bins)}": float(v)
                    for k, v in enumerate(self.bin_loss.average) if self.bin_loss.seen[k]}
        return {**self._last, **averages}

    def state_dict(self) -> dict[str, Any]:
        return {"loss_weight": self.bin_loss.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "loss_weight" not in state:
            raise ValueError("the checkpoint holds no loss_weight state (trained with another debias.objective)")
        self.bin_loss.load_state_dict(state["loss_weight"])
