"""`debias.objective=pos2distill`: the model's answers at its strong gold slot distilled into its weak slots
(Pos2Distill, Wang et al. 2025; the loss and its reference: models.training.distill).

Data: mdqa-layout samples (`data.in2.layout=mdqa`) with a teacher prompt each, the same documents with the gold moved
to `data.in2.teacher_slot` (the strong slot). Targets (`prepare`, before the first step): the starting model's own
greedy answer to each teacher prompt, kept when correct (data_builders.distill_data), then eos; every answer, kept or
not, in `<run>/distill_responses.json`. With `debias.distill.targets=gold`, each sample's own target (its gold alias)
then eos instead: every sample a target, no answer generated. Per micro-batch: the teacher's logits on the teacher
prompt + target with the LoRA adapters off (the base function: no second copy of the weights), without gradient; the
student's on the sample's own prompt + target with them on; both at the positions that predict a target token,
aligned token by token; loss = `position_kd_loss` (T^2 sum_i w_i KL_i, the reference's adaptive weights over the gold
slots of the micro-batch, the strong slot's samples weighing `debias.distill.preserve`) + `debias.distill.guard` x
`guard_kl` (KL(base || policy) on the teacher sequences: one more forward and backward pass; 0 = off). It needs
peft=lora, unpacked batches and one rank a sequence; debias.needle_mix's rows (no teacher prompt) do not combine with
it.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
from contextlib import contextmanager
from dataclasses import asdict, fields
from typing import Any, Iterator, Optional

import torch

from data_builders.config import DataFormat, In2Layout
from data_builders.distill_data import (
    answer_training_samples,
    check_teacher_columns,
    distill_split,
    gold_targets,
)
from data_builders.files import atomic_write_text
from models.build import Attention, at_least_fp32
from models.peft_setup import PeftMethod, adapters_disabled
from models.training.debias import DistillTargets, Pos2DistillConfig
from models.training.distill import guard_kl, position_kd_loss
from models.training.loss import IGNORE, Tap, labelled_logits
from models.training.objectives.base import Preparation, StartUp, TrainingObjective, register
from models.training.run_dir import RunDir

log = logging.getLogger(__name__)


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


def teacher_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher: the logits (B, T, V) that predict each teacher sequence's target tokens and their mask (B, T),
    with the adapters off (the starting model), without gradient, in eval mode."""
    with torch.no_grad(), adapters_disabled(model), _eval_mode(model):
        return labelled_logits(model, batch["teacher_input_ids"], batch["teacher_attention_mask"],
                               batch["teacher_labels"], device)


def student_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The student: the logits (B, T, V) that predict each sample's target tokens after its own prompt and their
    mask (B, T), with the adapters on and gradient."""
    return labelled_logits(model, batch["input_ids"], batch["attention_mask"], batch["labels"], device)


def policy_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None
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
        nll = torch.nn.functional.cross_entropy(at_least_fp32(logits.detach()).flatten(0, 1), tokens.flatten(),
                                                reduction="none").view(mask.shape)  # (B, T)
        full = nll.new_zeros(targets.shape)
        full[labelled] = nll[mask]
        tap(full, targets)


def check_distill_settings(start: StartUp, what: str) -> None:
    """The checks every pos2distill objective shares (`what` names the objective in the errors): LoRA on standard
    attention, mdqa-layout data, the loss's settings, unpacked batches without mixed rows."""
    cfg, data, built = start.debias, start.data, start.built
    if start.peft != PeftMethod.lora:
        raise ValueError(f"{what} needs peft=lora (got peft.method={start.peft}): its teacher is the starting "
                         "model, the same weights with the adapters off; a full fine-tune keeps no copy of them")
    if start.attention != Attention.standard:
        raise ValueError(f"{what} with model.attention={start.attention}: the diff layers' lambda ramp changes "
                         "the model with its adapters off too, so the teacher would not stay the starting model")
    if built.format != DataFormat.in2 or built.in2.layout != In2Layout.mdqa:
        raise ValueError(f"{what} moves the gold among whole documents: it needs data.in2.layout=mdqa "
                         "(data=in2_nq_mdqa)")
    try:
        cfg.distill.loss_config(0).validate()
    except ValueError as err:  # its keys are those of the debias.distill section
        raise ValueError(f"debias.{err}") from None
    if not (math.isfinite(cfg.distill.guard) and cfg.distill.guard >= 0):
        raise ValueError(f"debias.distill.guard={cfg.distill.guard} must be a finite number >= 0 (0 = off)")
    if cfg.distill.max_new_tokens < 1:
        raise ValueError(f"debias.distill.max_new_tokens={cfg.distill.max_new_tokens} must be >= 1")
    if cfg.distill.targets == DistillTargets.gold and cfg.distill.keep_wrong:
        raise ValueError("debias.distill.keep_wrong=true with debias.distill.targets=gold: gold targets generate no "
                         "answer to keep or drop; leave keep_wrong false")
    if data.packing:
        raise ValueError(f"{what} with data.packing=true: its student and teacher sequences are batched padded, "
                         "row by row; set data.packing=false")
    if cfg.needle_mix.share:
        raise ValueError(f"{what} with debias.needle_mix.share={cfg.needle_mix.share}: the mixed retrieval rows "
                         "have no teacher prompt; set it to 0")


@register
class Pos2Distill(TrainingObjective):
    name = "pos2distill"
    batch_teacher = True
    teacher_pass = True
    owns = tuple(f"distill.{f.name}" for f in fields(Pos2DistillConfig))
    owns_data = ("in2.teacher_slot",)

    def __init__(self, ctx):
        super().__init__(ctx)
        slot = ctx.built.in2.teacher_slot_index
        if slot is None:
            raise ValueError("debias.objective=pos2distill needs the strong slot (data.in2.teacher_slot)")
        self.loss_config = ctx.cfg.distill.loss_config(slot)
        self._stats: list[dict[str, float]] = []  # each micro-batch's since the last metrics()

    @classmethod
    def validate(cls, start: StartUp) -> None:
        cfg, built, what = start.debias, start.built, "debias.objective=pos2distill"
        check_distill_settings(start, what)
        slot = built.in2.teacher_slot_index
        if slot is None:
            raise ValueError(f"{what} needs data.in2.teacher_slot, the strong slot its teacher prompts put the gold "
                             "in (e.g. -1: the last document)")
        if cfg.distill.strong_position is not None and cfg.distill.strong_position != slot:
            raise ValueError(f"debias.distill.strong_position={cfg.distill.strong_position} must be the data's "
                             f"teacher slot, data.in2.teacher_slot={built.in2.teacher_slot} (slot {slot}), or null")

    def prepare(self, prep: Preparation) -> Optional[Any]:
        """The training split on the starting model's correct answers at the strong slot, or on each sample's own
        target (`debias.distill.targets=gold`; module docstring)."""
        c, built = self.ctx.cfg.distill, self.ctx.built
        check_teacher_columns(prep.train)
        gold = c.targets == DistillTargets.gold
        responses = (gold_targets(prep.train, prep.tokenizer, built.context_len) if gold else
                     answer_training_samples(prep.train, prep.answers(c.max_new_tokens), prep.tokenizer,
                                             built.context_len, c.keep_wrong))
        responses = prep.share(responses)  # every rank keeps the main process's answers
        n, where = responses.counts, RunDir(prep.run_dir).distill_responses
        if prep.is_main:
            atomic_write_text(where, json.dumps(responses.to_json(), indent=1))
            if gold:
                log.info("%s: the teacher (the gold at %s) read along each sample's own target; %d of %d kept, "
                         "dropped %d longer than data.context_len=%d (%s)", self.name, self.teacher_slots(),
                         n["kept"], n["samples"], n["dropped_longer_than_context_len"], built.context_len, where)
            else:
                log.info("%s: with the gold at %s the starting model answered %d of %d training questions "
                         "correctly; %d kept as targets, dropped %d wrong and %d longer than data.context_len=%d (%s)",
                         self.name, self.teacher_slots(), n["correct"], n["samples"], n["kept"], n["dropped_wrong"],
                         n["dropped_longer_than_context_len"], built.context_len, where)
        if n["kept"] < prep.micro_batch_size * prep.data_parallel:
            what = ("samples that fit data.context_len" if gold else
                    "the starting model's correct answers at the strong slot")
            advice = "" if gold else " (or debias.distill.keep_wrong=true to keep wrong answers too)"
            raise ValueError(f"debias.objective={self.name} kept {n['kept']} of {n['samples']} training samples "
                             f"({what}), fewer than one global micro-batch of {prep.micro_batch_size} x "
                             f"{prep.data_parallel}: raise data.num_train{advice}; {where} has the targets")
        return distill_split(prep.train, responses.targets, prep.tokenizer.eos_token_id)

    def teacher_slots(self) -> str:
        """Where the teacher prompts put the gold, for the log."""
        return f"slot {self.ctx.built.in2.teacher_slot_index}"

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        """position_kd_loss(student, teacher) + guard x guard_kl(policy, teacher) of one micro-batch (module
        docstring); its diagnostics go to `metrics`."""
        targets = (batch["labels"][:, 1:] != IGNORE).sum(1)  # (B,) on the host
        if not torch.equal(targets, (batch["teacher_labels"][:, 1:] != IGNORE).sum(1)):
            raise ValueError(f"{self.name}: a sample's student and teacher sequences have targets of different "
                             "lengths")
        teacher, mask = teacher_logits(model, batch, device)  # (B, T, V), (B, T)
        student, _ = student_logits(model, batch, device)  # (B, T, V): token t of both predicts target token t
        if tap is not None:
            tap_target_nll(tap, student, mask, batch["labels"])
        loss, stats = position_kd_loss(student, teacher, mask, batch["gold_slots"], **asdict(self.loss_config),
                                       strong=self.strong_samples(batch))
        guard = self.ctx.cfg.distill.guard
        if guard:
            policy, _ = policy_logits(model, batch, device)  # (B, T, V)
            kl = guard_kl(policy, teacher, mask, self.loss_config.temperature)
            loss = loss + guard * kl
            stats["guard_kl"] = kl.item()
        self._stats.append(stats)
        return loss

    def strong_samples(self, batch: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Which samples are preserve samples, (B,) bool; None: those whose gold is at the one strong slot."""
        return None

    def metrics(self) -> dict[str, float]:
        """The KL, weights and guard over the micro-batches since the last call (`debias/kl_mean`, `kl_max`,
        `weight_mean`, `weight_max`, `tokens`, `strong`, `guard_kl`): means of the means, maxima of the maxima, sums
        of the counts."""
        stats, self._stats = self._stats, []
        if not stats:
            return {}
        out = {}
        for key in stats[0]:
            values = [s[key] for s in stats]
            reduce = max if key.endswith("_max") else sum if key in ("tokens", "strong") else statistics.fmean
            out[f"debias/{key}"] = float(reduce(values))
        return out
