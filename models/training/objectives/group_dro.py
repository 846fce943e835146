"""`debias.objective=group_dro`: Group DRO over K = `debias.bins` equal-width gold-depth bins (Sagawa et al. 2020,
"Distributionally Robust Neural Networks", Algorithm 1 with its online weights): per micro-batch, loss_k = mean NLL
over the answer tokens of the samples in bin k (0 for a bin with none), q_k <- q_k exp(eta loss_k) renormalised over
all K bins (eta = `debias.eta`), loss = sum_k q_k loss_k over all K bins, an absent bin contributing 0: Sagawa's
`LossComputer.compute_robust_loss` (github.com/kohpangwei/group_DRO, loss.py). A bin's samples thus weigh q_k whenever
the bin is present, and q_k times its presence rate in expectation; with one sample per micro-batch the step is q of
its bin times the plain one. (Until 2026-12-01 the loss was divided by sum_k q_k over the bins present, which with few
samples per bin cancels q; docs/DEBIAS_STUDY.md.) Under data parallelism loss_k is the mean over every rank's
samples of bin k, so q is the same on every rank; it is logged (`debias/q@<bin>`), saved in checkpoints and resumes
exactly.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch

from data_builders.probes import bin_label, depth_bin
from models.training.loss import Tap
from models.training.objectives.base import StartUp, TrainingObjective, per_sample_nll, register


def bin_of(depths: torch.Tensor, bins: int) -> torch.Tensor:
    """The depth bin of each sample (`data_builders.probes.depth_bin`, the bins of the accuracy curve)."""
    return torch.tensor([depth_bin(d, bins) for d in depths.tolist()], dtype=torch.long,
                        device=depths.device)  # a micro-batch's few samples


class GroupDRO:
    """Online Group DRO weights q over `bins` gold-depth bins (Sagawa et al. 2020)."""

    def __init__(self, bins: int, eta: float):
        self.bins, self.eta = bins, eta
        self.q = torch.full((bins,), 1.0 / bins, dtype=torch.float64)

    def update(self, bin_losses: torch.Tensor) -> torch.Tensor:
        """q_k <- q_k exp(eta loss_k), renormalised over all bins; `bin_losses` (K,) detached (0 for an empty
        bin, whose q so only shrinks relatively): Sagawa's `adv_probs` update."""
        q = self.q * torch.exp(self.eta * bin_losses.detach().double().cpu())
        self.q = q / q.sum()
        return self.q

    def loss(self, sums: torch.Tensor, counts: torch.Tensor, depths: torch.Tensor,
             all_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This rank's part of Sagawa's robust loss sum_k q_k loss_k (after the q update), from each sample's
        (summed NLL, labelled-token count) and gold depth; `all_sum` sums a tensor over data-parallel ranks.

        loss_k is the data-parallel micro-batch's mean NLL over the answer tokens of bin k, Sagawa's
        sum / (count + (count == 0)): 0 for a bin no rank has. No normalisation: q sums to 1, so with every
        bin present the loss is on the scale of the mean loss, as in the reference (dividing by the realised
        sum of q over the present bins cancels q when bins hold one sample each; by K would only rescale the
        learning rate). Each rank returns its samples' share of every bin's global mean times the number of
        ranks, because DeepSpeed averages gradients over the data-parallel ranks (and train.py `train/loss`).
        """
        K = self.bins
        bins = bin_of(depths, K)
        bin_sums = sums.new_zeros(K).index_add(0, bins, sums)
        bin_counts = counts.new_zeros(K).index_add(0, bins, counts)
        # one collective: every rank's bin sums and counts, and the number of ranks (the summed ones)
        total = all_sum(torch.cat([bin_sums.detach().double(), bin_counts.double(), counts.new_ones(1).double()]))
        global_counts, ranks = total[K:2 * K], total[2 * K]
        q = self.update(total[:K] / global_counts.clamp(min=1))
        if not global_counts.any():  # no labelled token on any rank: NaN, as causal_lm_loss (the step is skipped)
            return sums.sum() * math.nan
        share = bin_sums * (ranks / global_counts.clamp(min=1)).to(bin_sums.device, bin_sums.dtype)
        return (q.to(share.device, share.dtype) * share).sum()

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.tolist()}  # JSON floats round-trip exactly

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        q = torch.tensor(state["q"], dtype=torch.float64)
        if q.shape != (self.bins,):
            raise ValueError(f"the checkpoint's group_dro state has {q.numel()} bins, debias.bins={self.bins}")
        self.q = q


@register
class GroupDROObjective(TrainingObjective):
    name = "group_dro"
    owns = ("bins", "eta")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.dro = GroupDRO(ctx.cfg.bins, ctx.cfg.eta)

    @classmethod
    def validate(cls, start: StartUp) -> None:
        if start.debias.bins < 1 or start.debias.eta < 0:
            raise ValueError(f"debias.bins={start.debias.bins} must be >= 1 and debias.eta={start.debias.eta} >= 0")

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        sums, counts, depths, _ = per_sample_nll(model, batch, device, tap)
        return self.dro.loss(sums, counts, depths, self.ctx.all_sum)

    def metrics(self) -> dict[str, float]:
        return {f"debias/q@{bin_label(k, self.dro.bins)}": float(v) for k, v in enumerate(self.dro.q)}

    def state_dict(self) -> dict[str, Any]:
        return {"group_dro": self.dro.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "group_dro" not in state:
            raise ValueError("the checkpoint holds no group_dro state (trained with another debias.objective)")
        self.dro.load_state_dict(state["group_dro"])
