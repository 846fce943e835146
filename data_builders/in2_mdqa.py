"""IN2 samples in the mdqa probe's own format (`data.in2.layout=mdqa`): training prompts that read as the
evaluation's.

A sample is the mdqa probe's prompt, rendered by the probe's own renderer (`data_builders.probes.mdqa_prompt`):
Liu et al.'s instruction, `data.in2.n_docs` whole documents `Document [k](Title: T) text`, the question and
`Answer:`; with `data.in2.chat_template` it is wrapped in the tokenizer's chat template and tokenized whole, as
the probe's prompts are with `eval.chat_template`. The target and eos follow, the only labelled tokens. Per
question of a split (the nq source, split by question in data_builders.sources: held-out questions are the
evaluation questions, whose passages never reach the training split):

- distractors: the n_docs - 1 passages BM25 ranks highest for the question among the split's own passages
  (`data_builders.mdqa.PassageRetriever`, the probe's retriever), never the gold and never a passage holding an
  answer alias (normalized, whole words), in rank order as the reference orders them;
- target: the first answer alias, in the record's order, that the gold document (title and text) holds as whole
  normalized words; a question without one is dropped and counted (`no_answer_alias_in_gold`), so the target
  is always in the gold;
- gold slot: uniform over the n_docs slots (seeded), the gold inserted there among the ranked distractors
  (`data_builders.mdqa.place_gold`, the probe's placement); depth = slot / (n_docs - 1), so accuracy and loss
  bin by slot as other IN2 samples bin by depth (with 10 documents and 10 bins: one slot a bin).

With `data.in2.teacher_slot` (debias=pos2distill) each record also holds its teacher prompt, `teacher_prompt_ids`:
the same question and documents with the gold moved to the teacher slot, the distractors in their order (the
probe's placement of the same ranked distractors), tokenized as the sample's prompt; and its gold slot, `gold_slot`
(TEACHER_FEATURES). A sample whose gold is at the teacher slot has its own prompt as its teacher prompt. With
`data.in2.teacher_candidates` (debias=pos2distill_best) it holds such a prompt for each candidate slot instead,
`teacher_candidate_ids` (CANDIDATE_FEATURES), for the objective to pick one per sample. Nothing else changes: the
same questions, slots and bytes as without them.

Questions are read in a seeded shuffled order, shuffled again for each further pass when a split asks for more
samples than it has questions. A sample longer than data.context_len is dropped and counted
(`longer_than_context_len`), and the next question takes its place. Records have IN2's schema
(`data_builders.in2.RECORD_FEATURES`); `context_tokens` counts the tokens from the user turn's first (the
instruction) to the last document's last. Same config and seed, same bytes.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
from datasets import Features, List, Value
from transformers import PreTrainedTokenizerBase

from data_builders.config import DataConfig, config_dict
from data_builders.in2 import (
    RECORD_FEATURES,
    PromptFormat,
    _counts_of,
    _list_array,
    depth_histogram,
    heldout_documents,
    make_format,
)
from data_builders.mdqa import PassageRetriever, contains_answer, place_gold
from data_builders.pools import build_pool, encode, pool_stats, tokenizer_digest
from data_builders.probes import load_template, mdqa_prompt
from data_builders.sources import SourceData, SourceSplit, load_source
from data_builders.text import normalize_answer
from data_builders.tokenizer import default_cache_dir, train_bpe_tokenizer

log = logging.getLogger(__name__)
TITLE_SEPARATOR = "\n"  # data_builders.sources writes a titled passage as f"{title}\n{text}"
NO_ALIAS = "no_answer_alias_in_gold"  # no answer alias is whole words of the gold document
TOO_LONG = "longer_than_context_len"  # the rendered sample exceeds data.context_len
# RECORD_FEATURES and, with data.in2.teacher_slot, each sample's teacher prompt and gold slot
TEACHER_FEATURES = Features({
    **RECORD_FEATURES,
    "teacher_prompt_ids": List(Value("int32")),  # the prompt with the gold at the teacher slot (no answer, no eos)
    "gold_slot": Value("int32"),  # the gold document's slot, 0 .. n_docs - 1 (depth = slot / (n_docs - 1))
})
# RECORD_FEATURES and, with data.in2.teacher_candidates, each sample's prompt at every candidate slot and gold slot
CANDIDATE_FEATURES = Features({
    **RECORD_FEATURES,
    "teacher_candidate_ids": List(List(Value("int32"))),  # the prompt with the gold at each candidate, in their order
    "gold_slot": Value("int32"),
})


def record_features(cfg: DataConfig) -> Features:
    """The features of the records a build of `cfg` makes."""
    if cfg.in2.teacher_candidates:
        return CANDIDATE_FEATURES
    return TEACHER_FEATURES if cfg.in2.teacher_slot_index is not None else RECORD_FEATURES


def titled(passage: str) -> dict[str, str]:
    """A source passage as the probe's document: {"title", "text"} (the source joined them with a line break)."""
    title, sep, text = passage.partition(TITLE_SEPARATOR)
    if not sep:
        raise ValueError(f"passage {passage[:60]!r} has no title line: data.in2.layout=mdqa needs titled passages "
                         "(data.source=nq)")
    return {"title": title, "text": text}


def target_alias(answers: Sequence[str], normalized_gold: str) -> Optional[str]:
    """The first answer that the normalized gold document holds as whole normalized words, else None."""
    for answer in answers:
        norm = normalize_answer(answer)
        if norm and contains_answer(normalized_gold, [norm]):
            return answer
    return None


@dataclass(frozen=True)
class MdqaQuestion:
    """A question ready to render: its target is whole words of its gold passage."""

    question: str
    answers: tuple[str, ...]  # every alias (the scorers accept any)
    target: str  # the labelled answer
    gold: int  # index of the gold passage in the split's passages


@dataclass
class MdqaSample:
    """One sample before tokenization: the probe's documents with the gold at `slot`, and its prompt text."""

    question: MdqaQuestion
    slot: int
    docs: list[dict[str, Any]]  # the probe's ctxs (title, text, ...), in prompt order
    prompt: str  # mdqa_prompt(question, docs): the probe's text prompt, before any chat template
    spans: list[tuple[int, int]]  # character span of each document line in `prompt`


class MdqaSplit:
    """One split's questions, passages and BM25 retriever; `sample` renders a question with its gold at a slot."""

    def __init__(self, split: SourceSplit, n_docs: int, skipped: dict[str, int]):
        if len(split.passages) < n_docs:
            raise ValueError(f"data.in2.n_docs={n_docs} documents a sample, but the split holds "
                             f"{len(split.passages)} passages")
        self.n_docs = n_docs
        self.passages = [titled(p) for p in split.passages]
        self.retriever = PassageRetriever(self.passages)
        self.questions: list[MdqaQuestion] = []
        for q in split.questions:
            gold = q.evidence[0]  # nq questions have one evidence passage (fine_grained)
            target = target_alias(q.answers, self.retriever.normalized[gold])
            if target is None:
                skipped[NO_ALIAS] = skipped.get(NO_ALIAS, 0) + 1
                continue
            self.questions.append(MdqaQuestion(q.question, q.answers, target, gold))
        self._distractors: dict[int, list[dict[str, Any]]] = {}

    def record(self, k: int) -> dict[str, Any]:
        """Question k as an oracle record (the probe's input): question, answers, its gold passage as ctxs."""
        q = self.questions[k]
        return {"question": q.question, "answers": list(q.answers), "ctxs": [dict(self.passages[q.gold])]}

    def distractors(self, k: int) -> list[dict[str, Any]]:
        """Question k's n_docs - 1 BM25 distractors in rank order (computed once)."""
        if k not in self._distractors:
            self._distractors[k] = self.retriever.distractors(self.record(k), self.n_docs - 1)
        return self._distractors[k]

    def sample(self, k: int, slot: int) -> MdqaSample:
        docs = place_gold(self.record(k), self.distractors(k), slot)["ctxs"]
        prompt, spans = mdqa_prompt(self.questions[k].question, docs)
        return MdqaSample(self.questions[k], slot, docs, prompt, spans)


class _Tokens:
    """A sample's token ids: the prompt tokenized whole as the probe's is (`encode_prompt` of
    analysis.evaluation.generate), then the target and eos (IN2's answer piece, `PromptFormat.answer_text`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat):
        self.tokenizer, self.fmt = tokenizer, fmt

    def text(self, prompt: str) -> tuple[str, int]:
        """The text the model reads and the character offset of `prompt` in it."""
        if not self.fmt.chat:
            return prompt, 0
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        at = text.find(prompt)
        if at < 0:
            raise ValueError("the tokenizer's chat template changes the user turn's text: the mdqa prompt is not "
                             "in the rendered conversation")
        return text, at

    def __call__(self, sample: MdqaSample) -> tuple[np.ndarray, int, list[int], int]:
        """(input_ids, prompt_len, gold token span, context_tokens) of a sample."""
        text, at = self.text(sample.prompt)
        # as encode_prompt: apply_chat_template tokenizes without special tokens; a plain prompt gets the tokenizer's
        enc = self.tokenizer(text, add_special_tokens=not self.fmt.chat, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        real = ends > starts  # special tokens have empty spans

        def covering(lo: int, hi: int) -> list[int]:
            idx = np.flatnonzero(real & (ends > at + lo) & (starts < at + hi))
            return [int(idx[0]), int(idx[-1]) + 1]

        gold = covering(*sample.spans[sample.slot])
        head = int(np.flatnonzero(real & (ends > at))[0])
        docs_end = covering(sample.spans[0][0], sample.spans[-1][1])[1]
        answer = encode(self.tokenizer, [self.fmt.answer_text(sample.question.target)])[0]
        ids = np.asarray(list(enc["input_ids"]) + answer + [self.fmt.eos], np.int32)
        return ids, len(enc["input_ids"]), gold, docs_end - head


def assemble_mdqa(split: MdqaSplit, tokens: _Tokens, n: int, cfg: DataConfig, seed: int, name: str,
                  skipped: dict[str, int]) -> tuple[pa.Table, list[int]]:
    """`n` records (`record_features(cfg)`) of `split` and the number of samples at each gold slot."""
    if not split.questions:
        raise ValueError(f"the {name} split has no question whose gold holds an answer alias as whole words")
    rng = random.Random(seed)
    teacher_slot, candidates = cfg.in2.teacher_slot_index, cfg.in2.teacher_candidate_indices
    features = record_features(cfg)
    rows: dict[str, list] = {key: [] for key in features}
    slots = [0] * split.n_docs
    order: list[int] = []
    since_kept = 0  # questions drawn in a row without a sample that fits
    while len(rows["id"]) < n:
        if not order:
            order = list(range(len(split.questions)))
            rng.shuffle(order)
            order.reverse()  # popped from the end: the shuffled order
        k, slot = order.pop(), rng.randrange(split.n_docs)
        sample = split.sample(k, slot)
        ids, prompt_len, gold, context_tokens = tokens(sample)
        if len(ids) > cfg.context_len:
            skipped[TOO_LONG] = skipped.get(TOO_LONG, 0) + 1
            since_kept += 1
            if since_kept > len(split.questions):
                raise ValueError(f"no {name} question's {split.n_docs} documents fit data.context_len="
                                 f"{cfg.context_len} tokens: raise data.context_len or lower data.in2.n_docs")
            continue
        since_kept = 0
        labels = ids.copy()
        labels[:prompt_len] = -100
        depth = slot / (split.n_docs - 1)
        record = {
            "input_ids": ids, "labels": labels, "prompt_len": prompt_len, "gold_spans": [gold], "depth": depth,
            "depths": [depth], "context_tokens": context_tokens, "task": "fine_grained",
            "answers": list(sample.question.answers), "source": cfg.source, "id": f"{name}-{len(rows['id'])}",
        }
        if teacher_slot is not None:  # the same documents, the gold moved: the prompt's tokens only
            teacher_ids, teacher_prompt_len = tokens(split.sample(k, teacher_slot))[:2]
            record |= {"teacher_prompt_ids": teacher_ids[:teacher_prompt_len], "gold_slot": slot}
        if candidates:
            prompts = [tokens(split.sample(k, c))[:2] for c in candidates]
            record |= {"teacher_candidate_ids": [ids[:n] for ids, n in prompts], "gold_slot": slot}
        for key, value in record.items():
            rows[key].append(value)
        slots[slot] += 1
    return pa.Table.from_batches([_record_batch(rows, features)], schema=features.arrow_schema), slots


def _record_batch(rows: dict[str, list], features: Features) -> pa.RecordBatch:
    """The rows as one Arrow batch of `features` (data_builders.in2's, with the teacher prompts' column too)."""
    schema = features.arrow_schema
    columns = [_list_array(rows[name], np.int32) if name in ("input_ids", "labels", "teacher_prompt_ids")
               else pa.array(rows[name], type=schema.field(name).type) for name in schema.names]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def corpus_texts(data: SourceData) -> list[str]:
    """Every string a training sample can contain, for training a tokenizer when the model has none."""
    return list(data.train.passages) + [load_template("mdqa")] + [q.question for q in data.train.questions]


def build_in2_mdqa(
    cfg: DataConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[dict[str, pa.Table], list[list[int]], PreTrainedTokenizerBase, dict[str, Any]]:
    """Train and held-out records in the mdqa probe's format, long held-out documents (the Jacobian's), the
    tokenizer and the build's stats (the dataset card's counts); as data_builders.in2.build_in2 returns them."""
    cache_root = default_cache_dir()
    data = load_source(cfg, cache_root / "hf", with_integration=False)
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(corpus_texts(data), cfg.vocab_size)
    if not tokenizer.is_fast:
        raise ValueError("data.in2.layout=mdqa needs a fast tokenizer (character offsets of the gold document)")
    fmt = make_format(tokenizer, cfg)
    tokens = _Tokens(tokenizer, fmt)
    skipped: dict[str, dict[str, int]] = {"train": {}, "eval": {}}
    splits = {name: MdqaSplit(part, cfg.in2.n_docs, skipped[name])
              for name, part in (("train", data.train), ("eval", data.heldout))}
    tables, slots = {}, {}
    for name, n, seed in (("train", cfg.num_train, cfg.seed), ("eval", cfg.num_eval, cfg.seed + 1)):
        tables[name], slots[name] = assemble_mdqa(splits[name], tokens, n, cfg, seed, name, skipped[name])
    for name, counts in skipped.items():
        if counts:
            log.info("data.in2.layout=mdqa, %s split: left out %s (%d questions kept)", name,
                     ", ".join(f"{n} {why}" for why, n in counts.items()), len(splits[name].questions))
    # the held-out passages, cut and joined as IN2's are, for the Jacobian's held-out sequences
    pool = build_pool(data.heldout.passages, tokenizer, cfg.in2.segment_len, fmt.separator,
                      cache_root if cfg.cache else None, cfg.num_proc, desc="segment eval passages")
    stats = {
        "source": data.name,
        "attribution": data.attribution,
        "config": config_dict(cfg),
        "tokenizer": tokenizer_digest(tokenizer),
        "skipped": {"source": data.skipped, **skipped},
        "questions": {name: {"fine_grained": len(s.questions)} for name, s in splits.items()},
        "tasks": {name: _counts_of(t.column("task").to_pylist()) for name, t in tables.items()},
        "depth_histogram": {name: depth_histogram(t.column("depth").to_numpy()) for name, t in tables.items()},
        "gold_slots": slots,  # samples with the gold in each of the n_docs slots
        "targets": {name: _target_counts(s.questions) for name, s in splits.items()},
        "pool": {"train": {"passages": len(splits["train"].passages)},
                 "eval": {"passages": len(splits["eval"].passages), **pool_stats(pool)}},
    }
    if data.split is not None:
        stats["split"] = data.split
    return tables, heldout_documents(pool, cfg.in2.heldout_doc_len), tokenizer, stats


def _target_counts(questions: Sequence[MdqaQuestion]) -> Mapping[str, int]:
    """How many targets are the first answer alias, and how many a later one the gold holds instead."""
    first = sum(q.target == q.answers[0] for q in questions)
    return {"first_alias": first, "later_alias": len(questions) - first}
