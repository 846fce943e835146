"""The starting model's greedy answers to prompts, for an objective that distils them (pos2distill's teacher pass:
models.training.objectives.pos2distill, which scores and keeps them with data_builders.distill_data).

`model_answer_fn` answers with the adapters off (for LoRA the starting weights, whatever the adapters hold by then),
up to a budget and the end of the answer's first line (what the metric reads): the token ids the model chose
(`greedy_generate_ids`). The answers depend only on the starting function and the prompts, so a single-process run
stores them under <POSDEBIAS_CACHE>/distill_responses/<key>.json and a later run with the same key reads them
(`cached_answers`; the starting model's log p of targets, for choosing a teacher slot, alike with `model_logprob_fn`):
the key hashes the model's function with its adapters off and how it is computed
(`analysis.evaluation.reuse.computation_key`), the generation settings and every prompt's token ids. The prompts
are answered and stored `CHUNK` at a time: on a CPU the 1,600 answers of `+exp=reads_middle` take hours, and a run
killed while answering continues from its last stored chunk.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.generate import greedy_generate_ids
from analysis.evaluation.loglik import sequence_logprobs
from analysis.evaluation.reuse import computation_key
from data_builders.distill_data import AnswerFn, LogprobFn
from data_builders.files import atomic_write_text
from models.peft_setup import adapters_disabled

log = logging.getLogger(__name__)

CACHE_SUBDIR = "distill_responses"
CHUNK = 64  # teacher prompts answered and stored together: ~5 min of a 2-core CPU, what a killed run can lose


def model_answer_fn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                    batch_size: int, batch_tokens: Optional[int] = None, progress: bool = True) -> AnswerFn:
    """Greedy answers of `model` with its adapters off (a peft model, or a DeepSpeed engine's module), each up to
    `max_new_tokens` and the end of its first line, as token ids without the stop."""

    def answer(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        with adapters_disabled(model):
            return greedy_generate_ids(model, tokenizer, prompts, max_new_tokens, batch_size, progress,
                                       first_line_only=True, batch_tokens=batch_tokens)

    return answer


def model_logprob_fn(model: PreTrainedModel, progress: bool = True) -> LogprobFn:
    """log p(target | prompt) of `model` with its adapters off, summed over the target's tokens, for (prompt, target)
    pairs of token ids (pos2distill_best's choice of teacher slot); one prompt pass each, in eval mode."""

    def score(queries: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
        module = getattr(model, "module", model)
        was_training = module.training
        module.eval()
        try:
            with adapters_disabled(model):
                return [sequence_logprobs(model, prompt, [target])[0]
                        for prompt, target in tqdm(queries, desc="teacher log p", disable=not progress, leave=False)]
        finally:
            module.train(was_training)

    return score


LOGPROB_SETTINGS = {"kind": "target_logprob", "adapters": "off"}  # `cached_answers` keys the scores apart


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


def _frozen(prompt: Any) -> Any:
    """A prompt (token ids, or a (prompt, target) pair of them) as nested tuples: a dict key."""
    return tuple(map(_frozen, prompt)) if isinstance(prompt, (list, tuple)) else prompt


def cached_answers(answer: AnswerFn, model: PreTrainedModel, settings: dict[str, Any], cache_dir: Path,
                   chunk: int = CHUNK) -> AnswerFn:
    """`answer` (`model`'s, under `settings`), asked each distinct prompt once (a build with more samples than
    questions repeats a question's teacher prompt), `chunk` of them at a time in order; each chunk's answers are
    stored under `cache_dir/distill_responses/<key>.json` (`answers_key` of its prompts) as soon as they exist and
    read from there when present. Answers come back in the order of `prompts`, a repeated prompt's repeated."""
    settings = {**settings, "chunk": chunk}  # a chunk's batches, hence its float rounding, depend on its size

    def reused(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        keys = [_frozen(prompt) for prompt in prompts]
        index: dict[Any, int] = {}  # a distinct prompt -> where it first comes
        firsts = []
        for key, prompt in zip(keys, prompts):
            if index.setdefault(key, len(firsts)) == len(firsts):
                firsts.append(prompt)
        if len(firsts) < len(prompts):
            log.info("pos2distill: %d of %d teacher prompts repeat an earlier one and are asked once",
                     len(prompts) - len(firsts), len(prompts))
        answers = distinct(firsts)
        return [answers[index[key]] for key in keys]

    def distinct(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
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
