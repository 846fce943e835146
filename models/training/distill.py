"""Position-to-position distillation: the model's answer with the gold document at its strong position taught
to the same model with the gold at a weak position (Pos2Distill).

What it is for: a debias objective that needs no labels beyond the model's own behaviour. The teacher is the
model with the gold document at its best position (for LoRA: the same weights with adapters disabled, so no
second copy); the student is the same question with the gold at a weak position. Both are run on the same
response tokens (the model's own greedy answer at the strong position), so their next-token distributions
over the response compare token by token. Prompts differ in length, so the caller aligns the response
positions and passes (B, T, V) logits with a (B, T) mask of the response positions.

Reference: Wang et al. 2025, "Position Bias Mitigates Position Bias: Mitigate Position Bias Through
Inter-Position Knowledge Distillation" (Pos2Distill, arXiv 2508.15709, EMNLP 2025), code github.com/AMAP-ML/Pos2Distill,
read at commit ffa97151e46f3f596652434b7ae9ffcb88232cd4 (kd/loss_design.py last changed in 191fc424): class
`AdaptiveKLWeightedKLLoss` of kd/loss_design.py, the loss of the paper's main results: scripts/train_nq.sh and the
README train with kd_coef="0.0,0.0,0.0,1.0" (only that loss on), --perserve 1.0, which kd/customized_kd_trainer.py
builds as AdaptiveKLWeightedKLLoss(batch_norm=True, attention_dillution_coef=perserve), temperature left at 1.0.
Our own implementation of the formulas below; no code is taken from there.

The loss (plain text; i a sample, t its response tokens, n_i their count, T the temperature):

    p_t = softmax(teacher_logits_t / T), q_t = softmax(student_logits_t / T)
    KL_i = (1 / n_i) sum_t sum_v p_t[v] (log p_t[v] - log q_t[v])      forward KL(teacher || student),
                                                                       a mean over the sample's response tokens
    loss = T^2 sum_i w_i KL_i                                          w detached: gradient only through q

The "position-aware" weights are per sample, by the position of the sample's gold DOCUMENT (its gold_idx),
not per response token. With s the strong (teacher's) position, 0 in the reference:

    w_i = preserve                                   if gold_i = s   (same gold position, reshuffled distractors:
                                                                      keeps the strong position's behaviour)
    for the other (weak) positions P = {p_1 .. p_K} present in the batch, G_p the samples with gold at p:
    m_p = mean_{i in G_p} KL_i                        the position's mean KL
    c_p = K softmax_p(m)                              positions far from the teacher get more (mean c_p = 1)
    w_i = (c_p / |G_p|) KL_i / max_{j in G_p} KL_j   within a position, samples in proportion to their KL

So a weak position's samples weigh at most c_p in all, and within it the sample that disagrees most with the
teacher weighs most; the strong-position samples each weigh `preserve` (1.0 in the paper), unnormalised.

Defaults (the reference's): temperature 1.0, preserve ("perserve", "attention_dillution_coef") 1.0, strong
position 0. The other variants in that file, not the paper's main results: the same class with
batch_norm=False (a plain sum of the KL_i; that code path refers to an undefined name and cannot run);
`AdaptiveKLWeightedKLLoss_multi` (MuSiQue, several gold documents): w_i = N KL_i / sum_j (KL_j + 1e-4) over all
N samples, no strong/weak split; `MY_KDLoss` (kd_coef[0], plain KD): the same forward KL per token weighted by
3 * 0.99^t over the response-token index t, a mean over tokens then samples; `MY_topkLoss` (kd_coef[2]): forward KL
over the teacher's top-20 logits; `MY_rankLoss` (margin ranking on the top-k, unused by the trainer); and
`MY_GPTLMLoss` (kd_coef[1], SFT cross-entropy on the response).

Differences from the reference, all at its edges:
- it forms the position groups over the global batch (all ranks' per-sample KLs all-gathered, 8 x 4 = 32 samples;
  each rank then sums its own w_i KL_i and data parallelism averages the gradients, so the effective loss is
  (1/world) sum over the global batch). Here the groups are the samples passed in; to group over ranks, all-gather
  the detached per-sample KLs (`sample_kl`) and gold positions and call `adaptive_weights` on them.
- it took the logits AT the response tokens (labels masked but not shifted: each predicts the token after), the
  same shift for teacher and student; here the caller aligns (ideally the positions whose next token is a
  response token).
- a weak position whose KLs are all 0 (student = teacher there) has 0/0 weights in the reference; here 0. A sample
  with no response tokens is a division by zero there; here it has KL 0 and weight 0 and joins no group.

`guard_kl` is the reference's strong-position term on its own: KL(base || policy) on the strong-position prompts,
the base being the model with adapters off (the reference's frozen teacher copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from models.build import at_least_fp32


@dataclass
class DistillConfig:
    """The hyper-parameters of `position_kd_loss` (its keyword names); defaults are the reference's."""

    temperature: float = 1.0  # both distributions at logits / T; the loss is scaled by T^2 (Hinton et al.)
    preserve: float = 1.0  # the weight of each strong-position sample ("--perserve"; attention_dillution_coef)
    strong_position: int = 0  # the gold position of the teacher's prompt: samples with their gold there are "preserve"

    def validate(self) -> None:
        """Raise ValueError naming the key on a setting the loss cannot use."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"distill.temperature={self.temperature!r} must be a finite number > 0")
        if not (isinstance(self.preserve, (int, float)) and math.isfinite(self.preserve) and self.preserve >= 0):
            raise ValueError(f"distill.preserve={self.preserve!r} must be a finite number >= 0")
        if isinstance(self.strong_position, bool) or not isinstance(self.strong_position, int) or self.strong_position < 0:
            raise ValueError(f"distill.strong_position={self.strong_position!r} must be an int >= 0 (a gold position)")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # float32 at least: a bf16 log-softmax over a 32K+ vocabulary loses the small probabilities the KL sums
    return F.log_softmax(at_least_fp32(logits) / temperature, dim=-1)


def _check(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> None:
    if student.dim() != 3 or student.shape != teacher.shape or mask.shape != student.shape[:2]:
        raise ValueError(f"expected logits (B, T, V) of one shape and a (B, T) mask; got {tuple(student.shape)}, "
                         f"{tuple(teacher.shape)}, {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True on response positions), got {mask.dtype}")


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(teacher || student) of each row of (N, V) logits at temperature T, (N,); the teacher detached."""
    log_q = _log_probs(student_logits, temperature)  # (N, V)
    log_p = _log_probs(teacher_logits.detach(), temperature)  # (N, V)
    return (log_p.exp() * (log_p - log_q)).sum(-1)  # (N,)


def sample_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL_i, n_i): each sample's mean forward KL over its masked tokens (0 where it has none), (B,), and the
    token counts (B,). Only masked positions are read, so what lies elsewhere (padding, even inf) cannot leak."""
    _check(student_logits, teacher_logits, mask)
    rows = mask.nonzero()[:, 0]  # (N,) the sample of each response token
    kl_tok = token_kl(student_logits[mask], teacher_logits[mask], temperature)  # (N,)
    counts = mask.sum(1)  # (B,)
    sums = kl_tok.new_zeros(mask.shape[0]).index_add(0, rows, kl_tok)  # (B,)
    return sums / counts.clamp_min(1), counts


@torch.no_grad()
def adaptive_weights(kl: torch.Tensor, gold_positions: Optional[torch.Tensor] = None, preserve: float = 1.0,
                     strong_position: int = 0, strong: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference's per-sample weights w (B,), detached, from the per-sample KLs (B,) and gold positions (B,).

    Strong samples (gold = strong_position) weigh `preserve`; a weak position p's samples weigh
    (K softmax(m)_p / |G_p|) KL_i / max_{G_p} KL, m the positions' mean KLs (module docstring).
    `gold_positions` None: every sample is at one weak position. `strong` (B,) bool: which samples are strong, when
    each has a teacher slot of its own (its gold there), instead of `gold = strong_position`.
    """
    kl = kl.detach().clamp_min(0)  # (B,) rounding can leave an exact-zero KL slightly negative
    if gold_positions is None:
        gold_positions = torch.ones_like(kl, dtype=torch.long) + strong_position  # (B,) one weak position
    gold_positions = gold_positions.to(kl.device)
    if gold_positions.shape != kl.shape:
        raise ValueError(f"gold_positions must be ({kl.shape[0]},), got {tuple(gold_positions.shape)}")
    strong = gold_positions == strong_position if strong is None else strong.to(kl.device)  # (B,)
    weights = torch.where(strong, torch.full_like(kl, preserve), torch.zeros_like(kl))  # (B,)
    if strong.all():
        return weights
    positions, group = torch.unique(gold_positions[~strong], return_inverse=True)  # (K,), (B_weak,)
    weak_kl = kl[~strong]  # (B_weak,)
    n = kl.new_zeros(len(positions)).index_add(0, group, torch.ones_like(weak_kl))  # (K,) samples per position
    mean = kl.new_zeros(len(positions)).index_add(0, group, weak_kl) / n  # (K,)
    top = kl.new_zeros(len(positions)).scatter_reduce(0, group, weak_kl, "amax", include_self=False)  # (K,)
    coef = torch.softmax(mean, 0) * len(positions)  # (K,) mean 1: a position's share grows with its mean KL
    # a position whose KLs are all 0 has nothing to learn: ratio 0 (0/0 in the reference)
    ratio = weak_kl / torch.where(top > 0, top, torch.ones_like(top))[group]  # (B_weak,)
    weights[~strong] = coef[group] / n[group] * ratio
    return weights


def position_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                     gold_positions: Optional[torch.Tensor] = None, *, temperature: float = 1.0, preserve: float = 1.0,
                     strong_position: int = 0, strong: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Pos2Distill's loss T^2 sum_i w_i KL_i and detached diagnostics (module docstring for the formulas).

    student_logits, teacher_logits: (B, T, V), aligned on the response positions (any dtype; log-softmax runs in
    float32 at least and so does the loss). mask: (B, T) bool, True on response positions. gold_positions: (B,)
    the student's gold-document position per sample (the reference's gold_idx), samples at `strong_position` are
    preserve samples; None = all at one weak position. `strong` (B,) bool: the preserve samples instead, when each
    sample has a teacher slot of its own (debias=pos2distill_best: its gold there). The teacher is detached and so
    are the weights: the gradient flows through the student's log-probabilities only. Keyword names are
    DistillConfig's fields (`position_kd_loss(s, t, m, g, **dataclasses.asdict(cfg))`).

    Diagnostics: kl_mean / kl_max over the samples with response tokens (at temperature T, without T^2),
    weight_mean / weight_max over the same, tokens (the response tokens), strong (the preserve samples).
    """
    DistillConfig(temperature, preserve, strong_position).validate()
    kl, counts = sample_kl(student_logits, teacher_logits, mask, temperature)  # (B,), (B,)
    present = counts > 0  # (B,) a sample with no response tokens joins no position group
    weights = torch.zeros_like(kl)  # (B,)
    gold = None if gold_positions is None else gold_positions.to(kl.device)[present]  # (B_present,)
    strong_present = None if strong is None else strong.to(kl.device)[present]  # (B_present,)
    weights[present] = adaptive_weights(kl[present], gold, preserve, strong_position, strong_present)
    loss = temperature ** 2 * (weights.detach() * kl).sum()
    kl_d, w_d = kl.detach()[present], weights[present]  # (B_present,)
    n_strong = (0 if gold is None else int((gold == strong_position).sum()) if strong_present is None
                else int(strong_present.sum()))
    stats = {"kl_mean": kl_d.mean().item() if kl_d.numel() else 0.0, "kl_max": kl_d.max().item() if kl_d.numel() else 0.0,
             "weight_mean": w_d.mean().item() if w_d.numel() else 0.0,
             "weight_max": w_d.max().item() if w_d.numel() else 0.0,
             "tokens": float(counts.sum()), "strong": float(n_strong)}
    return loss, stats


def guard_kl(policy_logits: torch.Tensor, base_logits: torch.Tensor, mask: torch.Tensor,
             temperature: float = 1.0) -> torch.Tensor:
    """KL(base || policy) on the strong-position prompts: a plain mean over the masked tokens, times T^2.

    The guard that keeps the strong position's answers while the weak positions are taught: base = the model
    with adapters off (base_logits are detached), policy = with adapters on, both on the strong-position prompt
    and its response. Forward KL, the direction of the reference's own strong-position term (its gold_idx = 0
    samples go through the same KL(teacher || student) with weight `preserve`): the base's distribution is the
    target, the expectation is under it, and its gradient is the cross-entropy's against the base's soft labels,
    so the policy is pulled to keep mass on every token the base puts mass on (mass-covering) rather than
    being free, as under reverse KL, to drop the base's alternatives as long as it stays inside its support.
    The reference weighs each strong sample's token-mean KL by `preserve` and sums over samples; this is the
    token mean over the batch (a sum of per-sample means would be `sample_kl(...)[0].sum()`).
    Returns 0 (with a graph) when no token is masked.
    """
    DistillConfig(temperature=temperature).validate()
    _check(policy_logits, base_logits, mask)
    kl_tok = token_kl(policy_logits[mask], base_logits[mask], temperature)  # (N,)
    if kl_tok.numel() == 0:
        return kl_tok.sum()
    return temperature ** 2 * kl_tok.mean()
