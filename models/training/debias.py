"""Position-targeted training objectives: `debias.objective` (and the `debias` config group, conf/debias/).

Chowdhury 2026 ("Lost in the Middle at Birth") shows that the optimizer's effective per-position
learning rate follows the positional prior, eta(x) ∝ rho_H(x), and asks whether targeted loss
weighting, middle-context curricula or over-sampled retrieval data close the gap. The options:

- `mean` (default): the mean next-token NLL over the answer tokens of the micro-batch (plain IN2).
- `depth_weight`: each sample's answer tokens weighted by w(d) ∝ p(d)^(-beta), beta = `debias.prior_power`, p the
  closed-form prior at the sample's gold depth d (`data_builders.depth_prior.depth_prior`, at the model's H layers,
  with `debias.prior_alpha` or the alpha fitted to the latest measured Jacobian profile), normalised to mean 1 over
  the samples of the micro-batch and clipped at `debias.max_weight` (`mean_one_clipped`).
  loss = sum_t w_s(t) nll_t / N, so beta = 0 is exactly the mean objective. `data.in2.depth_law=valley` draws
  training golds by the same law with the same names (`data.in2.prior_alpha`, `data.in2.prior_power`).
- `group_dro`: Group DRO over K equal-width gold-depth bins (Sagawa et al. 2020, "Distributionally Robust
  Neural Networks", Algorithm 1 with its online weights): per micro-batch, loss_k = mean NLL over the
  answer tokens of the samples in bin k (0 for a bin with none), q_k <- q_k exp(eta loss_k) renormalised
  over all K bins, loss = sum_k q_k loss_k over all K bins, an absent bin contributing 0: Sagawa's
  `LossComputer.compute_robust_loss` (github.com/kohpangwei/group_DRO, loss.py). A bin's samples thus
  weigh q_k whenever the bin is present, and q_k times its presence rate in expectation; with one sample
  per micro-batch the step is q of its bin times the plain one. (Until 2026-12-01 the loss was divided by
  sum_k q_k over the bins present, which with few samples per bin cancels q; docs/DEBIAS_STUDY.md.) Under
  data parallelism loss_k is the mean over every rank's samples of bin k, so q is the same on every rank;
  it is saved in checkpoints and resumes exactly.
- `loss_weight`: weights from the measured loss by depth instead of the prior's shape (docs/DEBIAS_STUDY.md, "What
  to try next"; no prior, no Jacobian). Per gold-depth bin k (group_dro's `bins` and bins) an exponential moving
  average m_k of the per-sample loss l_s (a sample's mean NLL over its answer tokens): m_k <- (1 - r) m_k + r l_k,
  r = `debias.loss_ema`, l_k the micro-batch's mean of l_s over bin k's samples (a bin's first l_k sets m_k).
  A sample of bin k weighs w ∝ (m_k / mean_seen m)^gamma, gamma = `debias.loss_power`, normalised to mean 1 over
  the samples of the micro-batch and clipped at `debias.max_weight` (`mean_one_clipped`), and
  loss = sum_t w_s(t) nll_t / N as depth_weight's, so gamma = 0 is the plain loss. The weights are detached and
  come from earlier micro-batches only (the averages are updated after weighting): a sample never weights
  itself; a bin not seen yet counts as the mean of the seen ones (ratio 1), and the first micro-batch, with
  none seen, is the plain loss. As group_dro's loss_k, l_k is over every data-parallel rank's samples, so the
  averages are the same on every rank; they are logged (debias/bin_loss@<bin>, the bins seen so far), saved in
  checkpoints and resume exactly.
- `pos2distill`: the model's answers at its strong gold slot distilled into its weak slots (Pos2Distill, Wang et al.
  2025; the loss and its reference: models.training.distill). Data: mdqa-layout samples (`data.in2.layout=mdqa`) with
  a teacher prompt each, the same documents with the gold moved to `data.in2.teacher_slot` (the strong slot). Target:
  the starting model's own greedy answer to the teacher prompt, kept when correct (train.py, before the first step;
  data_builders.distill_data), then eos. Per micro-batch: the teacher's logits on the teacher prompt + target with
  the LoRA adapters off (the base function: no second copy of the weights), without gradient; the student's on the
  sample's own prompt + target with them on; both at the positions that predict a target token, aligned token by
  token; loss = `position_kd_loss` (T^2 sum_i w_i KL_i, the reference's adaptive weights over the gold slots of the
  micro-batch, the strong slot's samples weighing `debias.distill.preserve`) + `debias.distill.guard` x `guard_kl`
  (KL(base || policy) on the teacher sequences: one more forward and backward pass; 0 = off). It needs peft=lora,
  unpacked batches and one rank a sequence; the NLL weightings above (`prior_*`, `max_weight`, `bins`, `eta`,
  `loss_*`) and debias.needle_mix's rows (no teacher prompt) do not combine with it (`validate_pos2distill`).

Depth sampling (a middle-heavy gold-depth law, `data.in2.depth_law=valley|beta`, `debias=depth_sampling` and
`debias=middle_ramp`) is a data setting (data_builders.in2), over-sampled retrieval data (`debias.needle_mix`) a
batching one (data_builders.needle_mix), and differential attention retrofitted into the model
(`debias=diff_retrofit`) a model one (models.attention.diff_attention); all live in this group's presets so arms
combine: `debias=[depth_sampling,group_dro]`.
"""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch.nn import functional as F

from data_builders.config import DataConfig, DataFormat, In2Layout
from data_builders.depth_prior import depth_prior
from data_builders.needle_mix import NeedleMixConfig
from data_builders.probes import bin_label, depth_bin
from models.build import Attention
from models.peft_setup import PeftMethod, adapters_disabled
from models.training.distill import DistillConfig, guard_kl, position_kd_loss
from models.training.loss import IGNORE, Tap, at_least_fp32, labelled_logits, labelled_nll

ALPHA_KEYS = ("prior/vanilla/alpha", "prior/chunked/alpha")  # the fitted alpha depth_weight follows, first found


class Objective(StrEnum):
    mean = "mean"
    depth_weight = "depth_weight"
    group_dro = "group_dro"
    loss_weight = "loss_weight"
    pos2distill = "pos2distill"


@dataclass
class Pos2DistillConfig(DistillConfig):
    """`debias.distill.*`: pos2distill's loss (DistillConfig's keys: temperature, preserve) and its guard, and how
    the target answers are made."""

    strong_position: Optional[int] = None  # the teacher's gold slot: None = data.in2.teacher_slot's (must equal it)
    guard: float = 0.0  # weight of guard_kl on the teacher sequences (one more forward and backward); 0 = off
    max_new_tokens: int = 100  # greedy budget of the answers at the strong slot (the mdqa probe's)
    # train on the answers scored wrong too (only the strong slot's behaviour is distilled, not its accuracy): for
    # ablations and for models that answer nothing right (the tiny smoke-test models)
    keep_wrong: bool = False

    def loss_config(self, strong_position: int) -> DistillConfig:
        """The keywords of `position_kd_loss`, the strong slot resolved."""
        return DistillConfig(self.temperature, self.preserve, strong_position)


@dataclass
class DebiasConfig:
    """`debias.*`: how per-sample losses combine, and the retrieval-data mix (conf/debias/ presets)."""

    objective: Objective = Objective.mean
    prior_power: float = 1.0  # depth_weight: w(d) ∝ p(d)^(-prior_power)
    prior_alpha: Optional[float] = None  # depth_weight: the prior's residual weight; None = fitted (prior/<set>/alpha)
    max_weight: float = 5.0  # depth_weight, loss_weight: weights are clipped here (>= 1: their mean is 1)
    bins: int = 10  # group_dro, loss_weight: equal-width gold-depth bins
    eta: float = 0.01  # group_dro: step size of the exponentiated-gradient update of q
    loss_power: float = 1.0  # loss_weight: w ∝ (bin loss average / their mean)^loss_power
    loss_ema: float = 0.1  # loss_weight: the share of a micro-batch's bin loss in the bin's moving average
    needle_mix: NeedleMixConfig = field(default_factory=NeedleMixConfig)
    distill: Pos2DistillConfig = field(default_factory=Pos2DistillConfig)  # pos2distill
    # Filled by the conf/debias/ options that choose an objective, one key each: dicts merge where `objective`
    # would be silently replaced, so debias=[group_dro,pos2distill] names both and is refused (one at a time).
    objective_options: dict[str, bool] = field(default_factory=dict)

    @property
    def needs_depths(self) -> bool:
        return self.objective != Objective.mean


def validate_objective_choice(cfg: DebiasConfig) -> None:
    """Fail at start-up when the debias= options name more than one objective, or another than debias.objective."""
    named = sorted(cfg.objective_options)
    if len(named) > 1:
        raise ValueError(f"debias=[...] names {len(named)} objectives ({', '.join(named)}): the last would replace "
                         "the others; one objective at a time (combine it with depth_sampling, middle_ramp, "
                         "needle_mix or diff_retrofit)")
    if named and cfg.objective != named[0]:
        raise ValueError(f"debias.objective={cfg.objective} with debias={named[0]}, whose objective is {named[0]}: "
                         "choose one")


def validate_debias(cfg: DebiasConfig, jacobian_every: int, sequence_parallel: int, has_depths: bool) -> None:
    """Fail at start-up, naming the key, on a debias setting that cannot run."""
    if cfg.objective not in [o.value for o in Objective]:
        raise ValueError(f"debias.objective={cfg.objective!r} is not known (known: {', '.join(Objective)})")
    if cfg.needs_depths and not has_depths:
        raise ValueError(f"debias.objective={cfg.objective} weights samples by their gold depth: it needs IN2 "
                         "data (data.format=in2)")
    if cfg.needs_depths and sequence_parallel > 1:
        raise ValueError(f"debias.objective={cfg.objective} with trainer.sequence_parallel={sequence_parallel}: "
                         "per-sample losses over sequence slices are not implemented; use one of them")
    if cfg.objective in (Objective.depth_weight, Objective.loss_weight) and cfg.max_weight < 1:
        raise ValueError(f"debias.max_weight={cfg.max_weight} must be >= 1 (the weights average 1)")
    if cfg.objective == Objective.depth_weight:
        if cfg.prior_alpha is None and jacobian_every < 1:
            raise ValueError("debias.objective=depth_weight with debias.prior_alpha=null follows the alpha fitted to "
                             "the measured Jacobian, which is off (jacobian.every=0): set debias.prior_alpha (e.g. 0.5)")
        if cfg.prior_alpha is not None and not 0 < cfg.prior_alpha < 1:
            raise ValueError(f"debias.prior_alpha={cfg.prior_alpha} must be in (0, 1)")
    if cfg.objective == Objective.group_dro and (cfg.bins < 1 or cfg.eta < 0):
        raise ValueError(f"debias.bins={cfg.bins} must be >= 1 and debias.eta={cfg.eta} >= 0")
    if cfg.objective == Objective.loss_weight:
        if cfg.bins < 1 or cfg.loss_power < 0:
            raise ValueError(f"debias.bins={cfg.bins} must be >= 1 and debias.loss_power={cfg.loss_power} >= 0")
        if not 0 < cfg.loss_ema <= 1:
            raise ValueError(f"debias.loss_ema={cfg.loss_ema} must be in (0, 1]")


# The settings of the NLL weightings (depth_weight, group_dro, loss_weight): they weight answer-token NLL, which
# pos2distill's KL has none of.
NLL_WEIGHTING = ("prior_power", "prior_alpha", "max_weight", "bins", "eta", "loss_power", "loss_ema")


def validate_pos2distill(cfg: DebiasConfig, data: DataConfig, built: DataConfig, peft: str, attention: str) -> None:
    """Fail at start-up, naming the key, on what pos2distill cannot run with, or its settings without it.

    `data`: the run's data settings; `built`: those its data is built with (a prebuilt folder's, else `data`).
    """
    if cfg.objective != Objective.pos2distill:
        changed = [f"debias.distill.{k}={v}" for k, v in vars(cfg.distill).items() if v != getattr(Pos2DistillConfig(), k)]
        if data.in2.teacher_slot is not None:
            changed.append(f"data.in2.teacher_slot={data.in2.teacher_slot}")
        if changed:
            raise ValueError(f"{', '.join(changed)} set with debias.objective={cfg.objective}: they are "
                             "pos2distill's (debias=pos2distill); one objective at a time")
        return
    what = "debias.objective=pos2distill"
    if peft != PeftMethod.lora:
        raise ValueError(f"{what} needs peft=lora (got peft.method={peft}): its teacher is the starting model, the "
                         "same weights with the adapters off; a full fine-tune keeps no copy of them")
    if attention != Attention.standard:
        raise ValueError(f"{what} with model.attention={attention}: the diff layers' lambda ramp changes the model "
                         "with its adapters off too, so the teacher would not stay the starting model")
    if built.format != DataFormat.in2 or built.in2.layout != In2Layout.mdqa:
        raise ValueError(f"{what} moves the gold among whole documents: it needs data.in2.layout=mdqa (data=in2_nq_mdqa)")
    slot = built.in2.teacher_slot_index
    if slot is None:
        raise ValueError(f"{what} needs data.in2.teacher_slot, the strong slot its teacher prompts put the gold in "
                         "(e.g. -1: the last document)")
    if cfg.distill.strong_position is not None and cfg.distill.strong_position != slot:
        raise ValueError(f"debias.distill.strong_position={cfg.distill.strong_position} must be the data's teacher "
                         f"slot, data.in2.teacher_slot={built.in2.teacher_slot} (slot {slot}), or null")
    try:
        cfg.distill.loss_config(slot).validate()
    except ValueError as err:  # its keys are those of the debias.distill section
        raise ValueError(f"debias.{err}") from None
    if not (math.isfinite(cfg.distill.guard) and cfg.distill.guard >= 0):
        raise ValueError(f"debias.distill.guard={cfg.distill.guard} must be a finite number >= 0 (0 = off)")
    if cfg.distill.max_new_tokens < 1:
        raise ValueError(f"debias.distill.max_new_tokens={cfg.distill.max_new_tokens} must be >= 1")
    if data.packing:
        raise ValueError(f"{what} with data.packing=true: its student and teacher sequences are batched padded, "
                         "row by row; set data.packing=false")
    if cfg.needle_mix.share:
        raise ValueError(f"{what} with debias.needle_mix.share={cfg.needle_mix.share}: the mixed retrieval rows "
                         "have no teacher prompt; set it to 0")
    default = DebiasConfig()
    weighting = [f"debias.{k}={getattr(cfg, k)}" for k in NLL_WEIGHTING if getattr(cfg, k) != getattr(default, k)]
    if weighting:
        raise ValueError(f"{what} with {', '.join(weighting)}: these weight the answer-token NLL of depth_weight, "
                         "group_dro and loss_weight, which pos2distill's KL does not combine with (its samples' "
                         "weights are its own); leave them at their defaults")


def mean_one_clipped(raw: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(c raw, cap) with c chosen so that mean(w) = 1 (cap >= 1); float64.

    Proportional to `raw` below the cap: each round rescales the unclipped weights to make up the mean,
    and clips those that rise above it; at most len(raw) rounds.
    """
    raw = raw.double()
    clipped = torch.zeros_like(raw, dtype=torch.bool)
    w = raw
    for _ in range(raw.numel()):
        free_total = raw[~clipped].sum()
        scale = (raw.numel() - cap * clipped.sum()) / free_total if free_total > 0 else 0.0
        w = torch.where(clipped, torch.full_like(raw, cap), raw * scale)
        over = (w > cap) & ~clipped
        if not over.any():
            break
        clipped |= over
    return w


def depth_weights(depths: torch.Tensor, layers: int, alpha: float, beta: float, cap: float) -> torch.Tensor:
    """depth_weight's per-sample weights: p(d)^(-beta) normalised to mean 1 and clipped at `cap`."""
    prior = torch.from_numpy(depth_prior(depths.double().cpu().numpy(), layers, alpha))
    return mean_one_clipped(prior.pow(-beta), cap).to(depths.device)


def sample_sums(nll: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor, n_samples: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL, labelled-token count) per sample, from per-position NLL (`labelled_nll(per_token=True)`).

    `sample_ids` (B, L): the sample each token belongs to (-1: padding); a position's loss is its next
    token's, so it counts towards that token's sample.
    """
    owner = sample_ids[:, -targets.shape[1]:].flatten()  # (N,) owner of each target token
    labelled = (targets.flatten() != -100) & (owner >= 0)
    slot = torch.where(labelled, owner, torch.full_like(owner, n_samples))  # the rest into a spare slot
    sums = nll.new_zeros(n_samples + 1).index_add(0, slot, nll.flatten())
    counts = torch.zeros(n_samples + 1, dtype=torch.float64, device=nll.device).index_add(
        0, slot, labelled.double())
    return sums[:n_samples], counts[:n_samples]


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


class BinLossWeights:
    """loss_weight's moving averages of the per-sample loss over `bins` gold-depth bins, and the weights they give."""

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


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """No dropout inside (the teacher is one fixed function); the previous mode after. On the module a DeepSpeed
    engine runs, whose own mode it does not keep."""
    module = getattr(model, "module", model)
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def teacher_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """pos2distill's teacher: the logits (B, T, V) that predict each teacher sequence's target tokens and their
    mask (B, T), with the adapters off (the starting model), without gradient, in eval mode."""
    with torch.no_grad(), adapters_disabled(model), _eval_mode(model):
        return labelled_logits(model, batch["teacher_input_ids"], batch["teacher_attention_mask"],
                               batch["teacher_labels"], device)


def student_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """pos2distill's student: the logits (B, T, V) that predict each sample's target tokens after its own prompt
    and their mask (B, T), with the adapters on and gradient."""
    return labelled_logits(model, batch["input_ids"], batch["attention_mask"], batch["labels"], device)


def policy_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The guard's policy: the teacher sequences with the adapters on and gradient, (B, T, V) and (B, T)."""
    return labelled_logits(model, batch["teacher_input_ids"], batch["teacher_attention_mask"],
                           batch["teacher_labels"], device)


def tap_target_nll(tap: Tap, logits: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> None:
    """Hand `tap` the NLL of each row's labelled tokens under `logits` (B, T, V), row by row in order (as
    `labelled_logits` gives them; `mask` (B, T)), at the labels' own positions (B, L-1)."""
    with torch.no_grad():
        targets = labels[:, 1:].to(logits.device)  # (B, L-1)
        labelled = targets != IGNORE
        tokens = torch.zeros_like(mask, dtype=torch.long)
        tokens[mask] = targets[labelled]
        nll = F.cross_entropy(at_least_fp32(logits.detach()).flatten(0, 1), tokens.flatten(),
                              reduction="none").view(mask.shape)  # (B, T)
        full = nll.new_zeros(targets.shape)
        full[labelled] = nll[mask]
        tap(full, targets)


class DebiasObjective:
    """The training loss of `debias.objective`: called by the engine on each micro-batch like
    `models.training.loss.causal_lm_loss(model, batch, device)`; batches carry `sample_ids` and `depths` (and
    pos2distill's their teacher sequences and gold slots, `data_builders.collate`). `strong_slot`: pos2distill's
    teacher slot (the data's data.in2.teacher_slot, resolved)."""

    def __init__(self, cfg: DebiasConfig, layers: int, all_sum: Callable[[torch.Tensor], torch.Tensor],
                 strong_slot: Optional[int] = None):
        self.cfg, self.layers, self.all_sum = cfg, layers, all_sum
        self.alpha = cfg.prior_alpha  # depth_weight: fixed, or the latest fitted one (`observe`)
        self.dro = GroupDRO(cfg.bins, cfg.eta) if cfg.objective == Objective.group_dro else None
        self.bin_loss = (BinLossWeights(cfg.bins, cfg.loss_ema, cfg.loss_power, cfg.max_weight)
                         if cfg.objective == Objective.loss_weight else None)
        self.distill: Optional[DistillConfig] = None
        if cfg.objective == Objective.pos2distill:
            if strong_slot is None:
                raise ValueError("debias.objective=pos2distill needs the strong slot (data.in2.teacher_slot)")
            self.distill = cfg.distill.loss_config(strong_slot)
        self._last: dict[str, float] = {}
        self._distill_stats: list[dict[str, float]] = []  # pos2distill: each micro-batch's since the last metrics()

    def observe(self, metrics: Mapping[str, float]) -> None:
        """Follow the alpha fitted to the latest measured Jacobian profile (with debias.prior_alpha=null)."""
        if self.cfg.prior_alpha is not None:
            return
        fitted = next((metrics[k] for k in ALPHA_KEYS if k in metrics), None)
        if fitted is not None and math.isfinite(fitted) and 0 < fitted < 1:
            self.alpha = float(fitted)

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                 device: torch.device | str | None = None, tap: Optional[Tap] = None) -> torch.Tensor:
        """The micro-batch's loss; `tap` (models.training.loss.Tap) is handed the per-token NLL of the answer tokens:
        the loss's own, or pos2distill's student's NLL of its targets."""
        if self.distill is not None:
            return self.pos2distill(model, batch, device, tap)
        nll, count = labelled_nll(model, batch, device, per_token=True, tap=tap)
        targets = batch["labels"][:, 1:].to(nll.device)
        depths = batch["depths"].to(nll.device)
        sums, counts = sample_sums(nll, targets, batch["sample_ids"].to(nll.device), depths.numel())
        if self.cfg.objective == Objective.depth_weight:
            if self.alpha is None:
                raise RuntimeError("depth_weight has no alpha yet: the Jacobian is measured before the first update")
            w = depth_weights(depths, self.layers, self.alpha, self.cfg.prior_power, self.cfg.max_weight)
            self._last = {"debias/alpha": self.alpha}
        elif self.bin_loss is not None:
            w = self.bin_loss.step(sums, counts, depths, self.all_sum)
        else:
            return self.dro.loss(sums, counts, depths, self.all_sum)
        self._last.update({"debias/weight_max": float(w.max()), "debias/weight_min": float(w.min())})
        return (w.to(sums.device, sums.dtype) * sums).sum() / count

    def pos2distill(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    device: torch.device | str | None = None, tap: Optional[Tap] = None) -> torch.Tensor:
        """position_kd_loss(student, teacher) + guard x guard_kl(policy, teacher) of one micro-batch (module
        docstring); its diagnostics go to `metrics`."""
        targets = (batch["labels"][:, 1:] != IGNORE).sum(1)  # (B,) on the host
        if not torch.equal(targets, (batch["teacher_labels"][:, 1:] != IGNORE).sum(1)):
            raise ValueError("pos2distill: a sample's student and teacher sequences have targets of different lengths")
        teacher, mask = teacher_logits(model, batch, device)  # (B, T, V), (B, T)
        student, _ = student_logits(model, batch, device)  # (B, T, V): token t of both predicts target token t
        if tap is not None:
            tap_target_nll(tap, student, mask, batch["labels"])
        loss, stats = position_kd_loss(student, teacher, mask, batch["gold_slots"], **asdict(self.distill))
        if self.cfg.distill.guard:
            policy, _ = policy_logits(model, batch, device)  # (B, T, V)
            guard = guard_kl(policy, teacher, mask, self.distill.temperature)
            loss = loss + self.cfg.distill.guard * guard
            stats["guard_kl"] = guard.item()
        self._distill_stats.append(stats)
        return loss

    def _distill_metrics(self) -> dict[str, float]:
        """pos2distill's diagnostics over the micro-batches since the last call: means of the means, maxima of the
        maxima, sums of the counts (tokens, strong samples)."""
        stats, self._distill_stats = self._distill_stats, []
        if not stats:
            return {}
        out = {}
        for key in stats[0]:
            values = [s[key] for s in stats]
            reduce = max if key.endswith("_max") else sum if key in ("tokens", "strong") else statistics.fmean
            out[f"debias/{key}"] = float(reduce(values))
        return out

    def metrics(self) -> dict[str, float]:
        """Logged every step: depth_weight's alpha and weight range, loss_weight's weight range and average loss
        per bin seen so far, group_dro's q per bin, or pos2distill's KL, weights and guard over the step's
        micro-batches (`debias/kl_mean`, `kl_max`, `weight_mean`, `weight_max`, `tokens`, `strong`, `guard_kl`)."""
        if self.distill is not None:
            return self._distill_metrics()
        if self.dro is not None:
            return {f"debias/q@{bin_label(k, self.dro.bins)}": float(v) for k, v in enumerate(self.dro.q)}
        averages = {}
        if self.bin_loss is not None:
            averages = {f"debias/bin_loss@{bin_label(k, self.bin_loss.bins)}": float(v)
                        for k, v in enumerate(self.bin_loss.average) if self.bin_loss.seen[k]}
        return {**self._last, **averages}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"alpha": self.alpha}
        if self.dro is not None:
            state["group_dro"] = self.dro.state_dict()
        if self.bin_loss is not None:
            state["loss_weight"] = self.bin_loss.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alpha = state.get("alpha", self.alpha)
        if self.dro is not None:
            if "group_dro" not in state:
                raise ValueError("the checkpoint holds no group_dro state (trained with another debias.objective)")
            self.dro.load_state_dict(state["group_dro"])
        if self.bin_loss is not None:
            if "loss_weight" not in state:
                raise ValueError("the checkpoint holds no loss_weight state (trained with another debias.objective)")
            self.bin_loss.load_state_dict(state["loss_weight"])
