"""`debias.objective=pos2distill_best`: pos2distill with each question's teacher at its own best slot, not always the
last (issue 65's middle-targeted distillation).

Data: mdqa-layout samples built with `data.in2.teacher_candidates` (each holds its prompt with the gold at every
candidate slot). Before the first step (`prepare`) the starting model scores each sample's own target (a whole-word
alias of the gold, the answer the data trains) at every candidate: the candidate where its log p is highest becomes
the sample's teacher slot (`data_builders.distill_data.choose_teachers`; the choice per sample and every log p in
`<run>/teacher_choice.json`, the log p cached like the answers). Then as pos2distill: the targets are the starting
model's correct greedy answers at each chosen teacher prompt, or with `debias.distill.targets=gold` (this arm's
preset) each sample's own target, the one its teacher slot was chosen by; the student (the sample's own prompt,
adapters on) learns the teacher's distribution along them by Pos2Distill's adaptive position KL, whose per-slot
weights follow the student's current KL at each slot. A sample whose gold already sits at its teacher slot is a
preserve sample (weight `debias.distill.preserve`), whichever slot that is.

Compared with pos2distill's fixed last slot, a question the model reads best at the start is taught from the start.
Gold targets give every question a target: the starting model answers ~1 in 3 training questions right at its
strong slot (issue 39: 33% with the gold last), so answers kept when correct would leave ~700 distinct targets of
the ~2,200 questions, and no greedy answer is generated (~3.5 h of the teacher pass on a 2-core CPU).
"""
from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import Any, Optional

import torch

from data_builders.distill_data import check_candidate_columns, choose_teachers
from data_builders.files import atomic_write_text
from models.training.debias import Pos2DistillConfig
from models.training.objectives.base import Preparation, StartUp, TrainingObjective, register
from models.training.objectives.pos2distill import Pos2Distill, check_distill_settings
from models.training.run_dir import RunDir

log = logging.getLogger(__name__)


@register
class Pos2DistillBest(Pos2Distill):
    name = "pos2distill_best"
    owns = tuple(f"distill.{f.name}" for f in fields(Pos2DistillConfig))
    owns_data = ("in2.teacher_candidates",)

    def __init__(self, ctx):
        TrainingObjective.__init__(self, ctx)  # not pos2distill's: it needs one teacher slot
        self.candidates = ctx.built.in2.teacher_candidate_indices
        if not self.candidates:
            raise ValueError("debias.objective=pos2distill_best needs data.in2.teacher_candidates")
        self.loss_config = ctx.cfg.distill.loss_config(self.candidates[0])  # strong samples come per sample
        self._stats: list[dict[str, float]] = []

    @classmethod
    def validate(cls, start: StartUp) -> None:
        what, built = "debias.objective=pos2distill_best", start.built
        check_distill_settings(start, what)
        if not built.in2.teacher_candidates:
            raise ValueError(f"{what} chooses each sample's teacher among the slots of data.in2.teacher_candidates "
                             "(e.g. [0,-1]: the first and the last document); set them")
        if len(built.in2.teacher_candidates) < 2:
            raise ValueError(f"{what} with data.in2.teacher_candidates={list(built.in2.teacher_candidates)}: one "
                             "candidate is debias=pos2distill with data.in2.teacher_slot; give two or more")
        if start.debias.distill.strong_position is not None:
            raise ValueError(f"debias.distill.strong_position={start.debias.distill.strong_position}: "
                             f"{what} takes each sample's strong slot from its own teacher; leave it null")

    def prepare(self, prep: Preparation) -> Optional[Any]:
        """Each sample's teacher slot, then pos2distill's targets from the teachers so chosen (module docstring)."""
        if prep.logprobs is None:
            raise ValueError("debias.objective=pos2distill_best needs the starting model's log p of targets "
                             "(Preparation.logprobs)")
        check_candidate_columns(prep.train)
        chosen, choice = choose_teachers(prep.train, self.candidates, prep.logprobs)
        choice = prep.share(choice)
        if prep.is_main:
            where = RunDir(prep.run_dir).teacher_choice
            atomic_write_text(where, json.dumps({"candidates": self.candidates, "counts": choice.counts(self.candidates),
                                                 "samples": [{"id": i, "teacher_slot": s, "logprobs": lp}
                                                             for i, s, lp in zip(prep.train["id"], choice.slots,
                                                                                 choice.logprobs)]}, indent=1))
            log.info("pos2distill_best: teacher slots chosen by the starting model's log p of each target, samples "
                     "per slot %s (%s)", choice.counts(self.candidates), where)
        return super().prepare(Preparation(**{**vars(prep), "train": chosen}))

    def teacher_slots(self) -> str:
        return f"each sample's best of slots {self.candidates}"

    def strong_samples(self, batch: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The samples whose gold sits at their own teacher slot, (B,) bool."""
        return batch["gold_slots"] == batch["teacher_slots"]
