"""debias=pos2distill's training split: each kept sample's student and teacher sequences on the model's own answer.

The samples come from a `data.in2.layout=mdqa` build with `data.in2.teacher_slot` (data_builders.in2_mdqa: each has
its `teacher_prompt_ids` and `gold_slot`); the responses are the starting model's greedy answers to those teacher
prompts, kept when correct (analysis.evaluation.distill_responses). A kept sample's target is its response's tokens
then eos, once after the student prompt (`input_ids`, `labels`: the sample's own prompt, the gold at its slot) and
once after the teacher prompt (`teacher_input_ids`, `teacher_labels`); labels are -100 on the prompts. Both
sequences end in the same target tokens, so their next-token distributions compare token by token. A sample keeps
its `prompt_len`, `context_tokens` (`data_builders.build.train_documents` reads the training text from them),
`depth`, `gold_slot` and `id`.

With `debias.distill.targets=gold` the targets are instead each sample's own target (its labelled tokens before eos, a
whole-word alias of the gold: `gold_targets`), every sample kept that fits: no answer is generated.

With a teacher slot chosen per sample (debias=pos2distill_best: `choose_teachers` picks, among a build's
`teacher_candidate_ids`, the prompt where the starting model gives the sample's own target the highest log p), the
split also keeps each sample's `teacher_slot`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
from datasets import Dataset, Features, List, Value

from data_builders.text import best_subspan_em, first_line

IGNORE = -100
WRONG = "wrong"  # the first line does not hold an answer (best_subspan_em 0)
TOO_LONG = "longer_than_context_len"  # prompt + answer + eos exceeds data.context_len (student or teacher)

AnswerFn = Callable[[Sequence[Sequence[int]]], list[list[int]]]  # prompts' token ids -> the answers' token ids
DISTILL_FEATURES = Features({
    "input_ids": List(Value("int32")),  # student prompt + response + eos
    "labels": List(Value("int32")),  # -100 on the prompt, then the response and eos
    "teacher_input_ids": List(Value("int32")),  # teacher prompt + response + eos
    "teacher_labels": List(Value("int32")),
    "prompt_len": Value("int32"),  # the student prompt's tokens
    "context_tokens": Value("int32"),  # the sample's (its student prompt's context comes first, as in the build)
    "depth": Value("float64"),
    "gold_slot": Value("int32"),
    "id": Value("string"),
})
TEACHER_SLOT = "teacher_slot"  # the slot of a sample's own teacher prompt, when chosen per sample
LogprobFn = Callable[[Sequence[tuple[Sequence[int], Sequence[int]]]], list[float]]  # (prompt, target) -> log p


def _check_columns(train: Dataset, columns: set[str], objective: str, setting: str) -> None:
    missing = columns - set(train.column_names)
    if missing:
        raise ValueError(f"the training split has no {', '.join(sorted(missing))}: debias={objective} needs data "
                         f"built with data.in2.{setting} (data.in2.layout=mdqa)")


def check_candidate_columns(train: Dataset) -> None:
    """ValueError, naming the key, when the split holds no candidate teacher prompts."""
    _check_columns(train, {"teacher_candidate_ids", "gold_slot"}, "pos2distill_best", "teacher_candidates")


def sample_targets(train: Dataset) -> list[list[int]]:
    """Each sample's own target tokens: its labelled tokens after the prompt, without the closing eos."""
    return [list(ids[n:-1]) for ids, n in zip(train["input_ids"], train["prompt_len"])]


@dataclass
class TeacherChoice:
    """Which candidate slot teaches each sample: where the starting model's log p of its target is highest."""

    slots: list[int]  # per sample, the chosen slot
    logprobs: list[list[float]]  # per sample, log p of its target at each candidate, in the candidates' order

    def counts(self, candidates: Sequence[int]) -> dict[str, int]:
        """How many samples each candidate slot teaches, by slot."""
        return {str(c): self.slots.count(c) for c in candidates}


def choose_teachers(train: Dataset, candidates: Sequence[int], logprobs: LogprobFn) -> tuple[Dataset, TeacherChoice]:
    """`train` with each sample's teacher prompt (`teacher_prompt_ids`) and its slot (`teacher_slot`): of its
    `teacher_candidate_ids` (at `candidates`), the one where `logprobs` gives the sample's own target the highest
    log p (the first such on a tie)."""
    check_candidate_columns(train)
    prompts, targets = train["teacher_candidate_ids"], sample_targets(train)
    if any(len(p) != len(candidates) for p in prompts):
        raise ValueError(f"a sample holds a different number of candidate prompts than the {len(candidates)} "
                         "candidates: the data was built with other data.in2.teacher_candidates")
    queries = [(list(prompt), target) for per_sample, target in zip(prompts, targets) for prompt in per_sample]
    flat = logprobs(queries)
    if len(flat) != len(queries):
        raise ValueError(f"the log-probability function returned {len(flat)} values for {len(queries)} queries")
    k = len(candidates)
    table = [list(map(float, flat[i * k:(i + 1) * k])) for i in range(len(train))]
    best = [max(range(k), key=lambda j, row=row: row[j]) for row in table]
    chosen = train.add_column("teacher_prompt_ids", [list(prompts[i][j]) for i, j in enumerate(best)])
    slots = [candidates[j] for j in best]
    return chosen.add_column(TEACHER_SLOT, slots), TeacherChoice(slots, table)


def check_teacher_columns(train: Dataset) -> None:
    """ValueError, naming the key, when the split holds no teacher prompts."""
    _check_columns(train, {"teacher_prompt_ids", "gold_slot"}, "pos2distill", "teacher_slot")


def student_prompts(train: Dataset) -> list[list[int]]:
    """Each sample's own prompt: its input_ids before the target."""
    return [ids[:n] for ids, n in zip(train["input_ids"], train["prompt_len"])]


def with_target(prompt: Sequence[int], target: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of `prompt` then `target`, the labels -100 on the prompt."""
    ids = np.asarray([*prompt, *target], np.int32)
    labels = ids.copy()
    labels[:len(prompt)] = IGNORE
    return ids, labels


def distill_split(train: Dataset, responses: Sequence[Optional[Sequence[int]]], eos: int) -> Dataset:
    """The samples of `train` with a response (None: dropped), in the split's order, as student and teacher
    sequences whose target is the response's token ids then `eos` (DISTILL_FEATURES)."""
    if len(responses) != len(train):
        raise ValueError(f"{len(responses)} responses for {len(train)} training samples")
    check_teacher_columns(train)
    features, kept_columns = DISTILL_FEATURES, ["context_tokens", "depth", "gold_slot", "id"]
    if TEACHER_SLOT in train.column_names:
        features, kept_columns = Features({**DISTILL_FEATURES, TEACHER_SLOT: Value("int32")}), [*kept_columns, TEACHER_SLOT]
    rows: dict[str, list] = {name: [] for name in features}
    kept = [i for i, r in enumerate(responses) if r is not None]
    samples = train.select(kept)
    for prompt, sample, i in zip(student_prompts(samples), samples, kept):
        target = [*responses[i], eos]
        ids, labels = with_target(prompt, target)
        teacher_ids, teacher_labels = with_target(sample["teacher_prompt_ids"], target)
        row = {"input_ids": ids, "labels": labels, "teacher_input_ids": teacher_ids, "teacher_labels": teacher_labels,
               "prompt_len": len(prompt), **{key: sample[key] for key in kept_columns}}
        for name in features:
            rows[name].append(row[name])
    return Dataset.from_dict(rows, features=features)


@dataclass
class DistillResponses:
    """The answers to the training samples' teacher prompts, and which of them became targets."""

    targets: list[Optional[list[int]]]  # per sample: the kept answer's token ids (the target before eos), or None
    samples: list[dict[str, Any]]  # per sample: id, gold_slot, answer text, first_line, correct, kept, dropped
    counts: dict[str, int] = field(default_factory=dict)  # samples, correct, kept, dropped and why

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "samples": self.samples}


def answer_training_samples(train: Any, answer: AnswerFn, tokenizer: Any, context_len: int,
                            keep_wrong: bool = False) -> DistillResponses:
    """Answer every sample's teacher prompt (`train`: a split with prompt_len, teacher_prompt_ids, gold_slot, answers
    and id), score each answer's first line, and keep the correct ones that fit (module docstring)."""
    teacher_prompts = [list(p) for p in train["teacher_prompt_ids"]]
    answers = answer(teacher_prompts)
    if len(answers) != len(teacher_prompts):
        raise ValueError(f"the answer function returned {len(answers)} answers for {len(teacher_prompts)} prompts")
    prompt_lens = [max(s, len(t)) for s, t in zip(train["prompt_len"], teacher_prompts)]  # the longer of the two
    targets: list[Optional[list[int]]] = []
    samples = []
    counts = {"samples": len(answers), "correct": 0, "kept": 0, f"dropped_{WRONG}": 0, f"dropped_{TOO_LONG}": 0}
    for ids, prompt_len, sample_id, slot, gold in zip(answers, prompt_lens, train["id"], train["gold_slot"],
                                                      train["answers"]):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        correct = best_subspan_em(first_line(text), gold) == 1.0
        dropped = (WRONG if not (correct or keep_wrong) else
                   TOO_LONG if prompt_len + len(ids) + 1 > context_len else None)
        targets.append(None if dropped else list(ids))
        samples.append({"id": sample_id, "gold_slot": slot, "answer": text, "first_line": first_line(text),
                        "answers": list(gold), "tokens": len(ids), "correct": correct, "kept": dropped is None,
                        "dropped": dropped})
        counts["correct"] += correct
        counts["kept" if dropped is None else f"dropped_{dropped}"] += 1
    return DistillResponses(targets, samples, counts)


def gold_targets(train: Any, tokenizer: Any, context_len: int) -> DistillResponses:
    """Each sample's own target as its distillation target (`debias.distill.targets=gold`), kept when the longer of
    its student and teacher prompts, the target and eos fit `context_len`; `train` as for `answer_training_samples`."""
    targets: list[Optional[list[int]]] = []
    samples = []
    counts = {"samples": len(train), "kept": 0, f"dropped_{TOO_LONG}": 0}
    for ids, prompt_len, teacher, sample_id, slot in zip(sample_targets(train), train["prompt_len"],
                                                         train["teacher_prompt_ids"], train["id"], train["gold_slot"]):
        dropped = TOO_LONG if max(prompt_len, len(teacher)) + len(ids) + 1 > context_len else None
        targets.append(None if dropped else ids)
        samples.append({"id": sample_id, "gold_slot": slot, "target": tokenizer.decode(ids, skip_special_tokens=True),
                        "tokens": len(ids), "kept": dropped is None, "dropped": dropped})
        counts["kept" if dropped is None else f"dropped_{dropped}"] += 1
    return DistillResponses(targets, samples, counts)
