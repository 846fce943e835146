"""The `debias` config group (conf/debias/): the training objective and the settings it reads, and the
retrieval-data mix.

Chowdhury 2026 ("Lost in the Middle at Birth") shows that the optimizer's effective per-position
learning rate follows the positional prior, eta(x) ∝ rho_H(x), and asks whether targeted loss
weighting, middle-context curricula or over-sampled retrieval data close the gap. The objectives
(`debias.objective`: mean, depth_weight, group_dro, loss_weight, pos2distill) are plug-ins, each a module of
models/training/objectives with its formulas and sources; the settings below are theirs (each objective names the
ones it reads: `TrainingObjective.owns`).

Depth sampling (a middle-heavy gold-depth law, `data.in2.depth_law=valley|beta`, `debias=depth_sampling` and
`debias=middle_ramp`) is a data setting (data_builders.in2), over-sampled retrieval data (`debias.needle_mix`) a
batching one (data_builders.needle_mix), and differential attention retrofitted into the model
(`debias=diff_retrofit`) a model one (models.attention.diff_attention); all live in this group's presets so arms
combine: `debias=[depth_sampling,group_dro]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from data_builders.needle_mix import NeedleMixConfig
from models.training.distill import DistillConfig


class DistillTargets(StrEnum):
    """`debias.distill.targets`: what pos2distill's teacher is read along."""

    answers = "answers"  # its own greedy answer at the strong slot, kept when correct (Pos2Distill's)
    # each sample's own target (a whole-word alias of its gold), teacher-forced: every question gives a target and no
    # answer is generated (word-level distillation on the reference answer)
    gold = "gold"


@dataclass
class Pos2DistillConfig(DistillConfig):
    """`debias.distill.*`: pos2distill's loss (DistillConfig's keys: temperature, preserve) and its guard, and how
    the target answers are made."""

    strong_position: Optional[int] = None  # the teacher's gold slot: None = data.in2.teacher_slot's (must equal it)
    guard: float = 0.0  # weight of guard_kl on the teacher sequences (one more forward and backward); 0 = off
    targets: DistillTargets = DistillTargets.answers  # what the teacher is read along (DistillTargets)
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

    objective: str = "mean"  # a registered objective (models.training.objectives): mean, depth_weight, ...
    prior_power: float = 1.0  # depth_weight: w(d) ∝ p(d)^(-prior_power)
    prior_alpha: Optional[float] = None  # depth_weight: the prior's residual weight; None = fitted (prior/<set>/alpha)
    max_weight: float = 5.0  # depth_weight, loss_weight: weights are clipped here (>= 1: their mean is 1)
    bins: int = 10  # group_dro, loss_weight: equal-width gold-depth bins
    eta: float = 0.01  # group_dro: step size of the exponentiated-gradient update of q
    loss_power: float = 1.0  # loss_weight: w ∝ (bin loss average / their mean)^loss_power
    loss_ema: float = 0.1  # loss_weight: the share of a micro-batch's bin loss in the bin's moving average
    needle_mix: NeedleMixConfig = field(default_factory=NeedleMixConfig)
    distill: Pos2DistillConfig = field(default_factory=Pos2DistillConfig)  # pos2distill
    # the settings of an objective that keeps its own (its `Settings` dataclass: one module and one YAML add one)
    settings: dict[str, Any] = field(default_factory=dict)
    # Filled by the conf/debias/ options that choose an objective, one key each: dicts merge where `objective`
    # would be silently replaced, so debias=[group_dro,pos2distill] names both and is refused (one at a time).
    objective_options: dict[str, bool] = field(default_factory=dict)


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
