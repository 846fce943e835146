"""debias=pos2distill's targets: the starting model's own greedy answers with the gold at its strong slot, kept
when they are correct.

Every training sample's teacher prompt (data_builders.in2_mdqa: its documents and question with the gold moved to
`data.in2.teacher_slot`) is answered greedily by the model with its adapters off (`model_answer_fn`: for LoRA the
starting weights, whatever the adapters hold by then), up to `debias.distill.max_new_tokens` tokens and the end of
the answer's first line (what the metric reads): the token ids the model chose (`greedy_generate_ids`). Each
answer's first line is scored as the mdqa probe scores it (`best_subspan_em` of `first_line`, Liu et al.'s metric)
against the sample's answers. Kept: the correct answers (all of them with `keep_wrong`) whose student and teacher
sequences, prompt + answer + eos, fit `data.context_len`; the others are dropped and counted (`DistillResponses`).

The answers depend only on the starting function and the prompts, so a single-process run stores them under
<POSDEBIAS_CACHE>/distill_responses/<key>.json and a later run with the same key reads them (`cached_answers`):
the key hashes the model's function with its adapters off and how it is computed
(`analysis.evaluation.reuse.computation_key`), the generation settings and every prompt's token ids. The prompts
are answered and stored `CHUNK` at a time: on a CPU the 1,600 answers of `+exp=reads_middle` take hours, and a run
killed while answering continues from its last stored chunk.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.generate import greedy_generate_ids
from analysis.evaluation.reuse import computation_key
from analysis.evaluation.scoring import best_subspan_em, first_line
from data_builders.files import atomic_write_text
from models.peft_setup import adapters_disabled

log = logging.getLogger(__name__)

CACHE_SUBDIR = "distill_responses"
WRONG = "wrong"  # the first line does not hold an answer (best_subspan_em 0)
TOO_LONG = "longer_than_context_len"  # prompt + answer + eos exceeds data.context_len (student or teacher)
CHUNK = 64  # teacher prompts answered and stored together: ~5 min of a 2-core CPU, what a killed run can lose

AnswerFn = Callable[[Sequence[Sequence[int]]], list[list[int]]]  # prompts' token ids -> the answers' token ids


@dataclass
class DistillResponses:
    """The answers to the training samples' teacher prompts, and which of them became targets."""

    targets: list[Optional[list[int]]]  # per sample: the kept answer's token ids (the target before eos), or None
    samples: list[dict[str, Any]]  # per sample: id, gold_slot, answer text, first_line, correct, kept, dropped
    counts: dict[str, int] = field(default_factory=dict)  # samples, correct, kept, dropped and why

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "samples": self.samples}


def model_answer_fn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                    batch_size: int, batch_tokens: Optional[int] = None, progress: bool = True) -> AnswerFn:
    """Greedy answers of `model` with its adapters off (a peft model, or a DeepSpeed engine's module), each up to
    `max_new_tokens` and the end of its first line, as token ids without the stop."""

    def answer(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        with adapters_disabled(model):
            return greedy_generate_ids(model, tokenizer, prompts, max_new_tokens, batch_size, progress,
                                       first_line_only=True, batch_tokens=batch_tokens)

    return answer


def settings_of(tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, batch_size: int,
                batch_tokens: Optional[int]) -> dict[str, Any]:
    """What `model_answer_fn`'s answers depend on beside the weights and prompts (for `answers_key`): the budget,
    the batching (left padding changes float rounding) and the padding and stop tokens."""
    return {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "batch_tokens": batch_tokens,
            "first_line_only": True, "adapters": "off", "pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id}


def answers_key(function: str, prompts: Sequence[Sequence[int]], settings: dict[str, Any]) -> str:
    """The cache key of the answers of a model whose `computation_key(model, adapters=False)` is `function` to
    `prompts` under `settings` (generation and batching)."""
    digest = hashlib.sha256(function.encode())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for prompt in prompts:
        digest.update(json.dumps(list(prompt)).encode())
    return digest.hexdigest()[:32]


def cached_answers(answer: AnswerFn, model: PreTrainedModel, settings: dict[str, Any], cache_dir: Path,
                   chunk: int = CHUNK) -> AnswerFn:
    """`answer` (`model`'s, under `settings`), asked `chunk` prompts at a time in order; each chunk's answers are
    stored under `cache_dir/distill_responses/<key>.json` (`answers_key` of its prompts) as soon as they exist and
    read from there when present."""
    settings = {**settings, "chunk": chunk}  # a chunk's batches, hence its float rounding, depend on its size

    def reused(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        function = computation_key(model, adapters=False)
        out: list[list[int]] = []
        read = 0
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            path = Path(cache_dir) / CACHE_SUBDIR / f"{answers_key(function, part, settings)}.json"
            if path.exists():
                out += json.loads(path.read_text())
                read += len(part)
                continue
            if start:
                log.info("pos2distill: answering teacher prompts %d-%d of %d", start + 1, start + len(part),
                         len(prompts))
            answers = answer(part)
            atomic_write_text(path, json.dumps(answers))
            out += answers
        if read:
            log.info("pos2distill: %d of %d answers reused from %s (the same starting weights were asked the same "
                     "teacher prompts)", read, len(prompts), Path(cache_dir) / CACHE_SUBDIR)
        return out

    return reused


def answer_training_samples(train: Any, answer: AnswerFn, tokenizer: PreTrainedTokenizerBase, context_len: int,
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
