"""Synthetic retrieval samples for `debias.needle_mix`: needle, key-value and multi-document questions at
uniform depth.

Built with the probe generators of `data_builders.probes` (same templates, same formats) from a seed of
their own, each sample a training row: the prompt, then the answer and eos as the only labelled tokens,
within `data.context_len`. A sample whose answer or key is one of the evaluation probe items' is
dropped, so training never sees an evaluation item. `data_builders.collate.BatchStream` puts them into
each micro-batch (`mix_rows`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable, Optional, Sequence

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from data_builders.probes import (
    NEEDLE_WORDS,
    ProbeItem,
    _synthetic_kv,
    document_lines,
    format_kv_records,
    load_template,
    needle_probe,
    synthetic_filler,
)
from data_builders.synthetic import Document, generate_documents

IGNORE = -100
KV_MAX_PAIRS = 16  # the most pairs a kv sample starts from; fewer when the budget holds fewer
MDQA_MAX_DOCS = 20  # the most documents an mdqa sample starts from (the reference's 20); fewer when they do not fit
MDQA_POOL = 2000  # synthetic entity documents an mdqa sample draws its gold and distractors from
MDQA_FACTS = 1  # sentences per mdqa document: ~6 one-fact documents fit a tiny model's 256-token contexts


class MixKind(StrEnum):
    needle = "needle"  # "The secret code of <word> is <number>." in filler sentences (data_builders.probes)
    kv = "kv"  # one UUID key's value among UUID pairs (Liu et al.'s probe)
    mdqa = "mdqa"  # a question about an invented person among documents about others (the mdqa prompt)


@dataclass
class NeedleMixConfig:
    share: float = 0.0  # of each micro-batch's rows replaced by synthetic retrieval samples; 0 = off
    kinds: list[MixKind] = field(default_factory=lambda: [MixKind.needle, MixKind.kv])  # drawn alternately
    pool: int = 4000  # distinct retrieval samples generated (seeded), read in turn
    seed: int = 1  # generator seed; samples equal to an evaluation probe item are dropped
    # pairs of a kv sample, the gold pair at a uniform slot among them: None = as many as fit (up to 16); the kv
    # probe's count (kv.n_pairs=10) trains the shape it asks
    kv_pairs: Optional[int] = None


def mixed_rows(share: float, micro_batch_size: int) -> int:
    """Rows of each micro-batch that a mix of `share` replaces with retrieval samples."""
    return round(share * micro_batch_size)


def check_mix_rows(rows: int, micro_batch_size: int, packing: bool) -> None:
    """Mixed rows replace the tail of padded micro-batches and must leave at least one row of each kind."""
    if packing:
        raise ValueError("debias.needle_mix replaces rows of padded micro-batches: set data.packing=false")
    if not 1 <= rows < micro_batch_size:
        raise ValueError(f"debias.needle_mix.share of trainer.micro_batch_size={micro_batch_size} rows gives {rows} "
                         "mixed rows: it must leave at least one of each kind")


def validate_needle_mix(cfg: NeedleMixConfig, micro_batch_size: int, packing: bool) -> None:
    """Every check of `debias.needle_mix`, at start-up; errors name the key."""
    if not 0 <= cfg.share < 1:
        raise ValueError(f"debias.needle_mix.share={cfg.share} must be in [0, 1)")
    if not cfg.share:
        return
    if not cfg.kinds or cfg.pool < 1:
        raise ValueError("debias.needle_mix needs at least one of debias.needle_mix.kinds and pool >= 1")
    if cfg.kv_pairs is not None and not 2 <= cfg.kv_pairs <= KV_MAX_PAIRS:
        raise ValueError(f"debias.needle_mix.kv_pairs={cfg.kv_pairs} must be in [2, {KV_MAX_PAIRS}] (null: as many "
                         "as fit)")
    check_mix_rows(mixed_rows(cfg.share, micro_batch_size), micro_batch_size, packing)


def training_mix(cfg: NeedleMixConfig, tokenizer: PreTrainedTokenizerBase, context_len: int, seed: int,
                 evaluation_items: Iterable[ProbeItem], chat_template: bool = False) -> list[dict[str, Any]]:
    """`debias.needle_mix`'s retrieval samples (`cfg.pool` of them, seeded), never one of `evaluation_items`; with
    `chat_template`, each prompt in the tokenizer's chat template as the training data's (data.in2.chat_template)."""
    return retrieval_samples(tokenizer, cfg.pool, context_len, [str(k) for k in cfg.kinds], seed + cfg.seed,
                             protected_strings(evaluation_items), chat_template, cfg.kv_pairs)


def protected_strings(items: Iterable[ProbeItem]) -> set[str]:
    """Answers and keys of evaluation items: a training sample holding one of them is dropped."""
    found: set[str] = set()
    for item in items:
        found.update(item.answers)
        if "key" in item.extra:
            found.add(item.extra["key"])
    return found


@dataclass(frozen=True)
class RowEncoder:
    """A retrieval sample as a training row: the prompt, then the answer and eos as the only labelled tokens. With
    `chat`, the prompt is the user turn of the tokenizer's chat template and the answer opens the reply, as
    scripts.eval_checkpoint asks a probe with chat_template=true; else a space opens the answer."""

    tokenizer: PreTrainedTokenizerBase
    chat: bool = False

    def __call__(self, prompt: str, answer: str, depth: float, budget: int) -> dict[str, Any] | None:
        tok = self.tokenizer
        if self.chat:
            prompt_ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                      return_dict=False))
        else:
            prompt_ids = tok.encode(prompt, add_special_tokens=False)
        answer_ids = tok.encode(answer if self.chat else " " + answer, add_special_tokens=False) + [tok.eos_token_id]
        if len(prompt_ids) + len(answer_ids) > budget:
            return None
        return {"input_ids": prompt_ids + answer_ids, "labels": [IGNORE] * len(prompt_ids) + answer_ids,
                "depth": depth, "answer": answer}


def _needle_overhead(tokenizer: PreTrainedTokenizerBase, chat: bool) -> int:
    """Tokens a needle sample spends outside its context: the question on the longest word, a code, eos."""
    question = load_template("needle").format(context="", word=max(NEEDLE_WORDS, key=len))
    if chat:
        return len(RowEncoder(tokenizer, chat)(question, "99999", 0.0, 10 ** 9)["input_ids"])
    return len(tokenizer.encode(question, add_special_tokens=False)) + len(tokenizer.encode(" 99999")) + 1


def _needle(encode: RowEncoder, filler: Sequence[str], budget: int, overhead: int, rng: random.Random
            ) -> dict[str, Any] | None:
    depth = rng.random()
    (item,) = needle_probe(filler, [depth], [budget - overhead], encode.tokenizer, n_examples=1,
                           seed=rng.getrandbits(32))
    return encode(item.prompt, item.answers[0], item.extra["realised_depth"], budget)


def _kv(encode: RowEncoder, budget: int, rng: random.Random, pairs: Optional[int] = None) -> dict[str, Any] | None:
    """A key's value among `pairs` UUID pairs (None: the most that fit, up to KV_MAX_PAIRS), the gold pair at a
    uniform slot."""
    template = load_template("kv_retrieval")
    drawn, key, value = _synthetic_kv(pairs or KV_MAX_PAIRS, rng)
    others = [p for p in drawn if p[0] != key]
    for n in (pairs,) if pairs else range(KV_MAX_PAIRS, 1, -1):  # the most pairs that fit
        pos = rng.randrange(n)
        chosen = others[: n - 1]
        prompt = template.format(kv_records=format_kv_records(chosen[:pos] + [(key, value)] + chosen[pos:]), key=key)
        row = encode(prompt, value, pos / (n - 1), budget)
        if row is not None:
            row["key"] = key
            return row
    return None


def _mdqa(encode: RowEncoder, documents: Sequence[Document], budget: int, rng: random.Random) -> dict[str, Any] | None:
    """A question about one invented person over one-fact documents about others, in the reference's mdqa prompt
    (titles: the persons' names); as many documents as fit (up to 20), none stating the answer."""
    gold = rng.choice(documents)
    qa = rng.choice(gold.qa)
    others = [d for d in rng.sample(documents, MDQA_MAX_DOCS + 10) if d is not gold and qa.answers[0] not in d.text]
    template = load_template("mdqa")
    for n in range(MDQA_MAX_DOCS, 1, -1):
        pos = rng.randrange(n)
        docs = others[: n - 1]
        docs = [{"title": d.entity, "text": d.text} for d in docs[:pos] + [gold] + docs[pos:]]
        prompt = template.format(documents="\n".join(document_lines(docs)), question=qa.question)
        row = encode(prompt, qa.answers[0], pos / (n - 1), budget)
        if row is not None:
            return row
    return None


def retrieval_samples(tokenizer: PreTrainedTokenizerBase, n: int, budget: int, kinds: Sequence[str], seed: int,
                      protected: set[str] = frozenset(), chat_template: bool = False,
                      kv_pairs: Optional[int] = None) -> list[dict[str, Any]]:
    """`n` training rows (input_ids, labels, depth), kinds in turn, each within `budget` tokens (`RowEncoder`:
    `chat_template`; `_kv`: `kv_pairs`).

    Fails when the budget cannot hold a sample of some kind (a context too short for any filler or pair).
    """
    rng, encode = random.Random(seed), RowEncoder(tokenizer, chat_template)
    filler, overhead = synthetic_filler(seed=seed), _needle_overhead(tokenizer, chat_template)
    documents = generate_documents(MDQA_POOL, seed, prefix="mix", facts=MDQA_FACTS) if "mdqa" in kinds else []
    if overhead >= budget:
        raise ValueError(f"debias.needle_mix: a needle question alone takes {overhead} tokens, data.context_len="
                         f"{budget}")
    rows: list[dict[str, Any]] = []
    misses = 0
    with tqdm(total=n, desc="needle_mix samples", leave=False) as bar:
        while len(rows) < n:
            kind = kinds[len(rows) % len(kinds)]
            if kind == "needle":
                row = _needle(encode, filler, budget, overhead, rng)
            else:
                row = _kv(encode, budget, rng, kv_pairs) if kind == "kv" else _mdqa(encode, documents, budget, rng)
            if row is None or row["answer"] in protected or row.get("key") in protected:
                misses += 1
                if misses > 10 * n + 100:
                    raise ValueError(f"debias.needle_mix.kinds has {kind}, but no {kind} sample fits data.context_len="
                                     f"{budget} tokens with this tokenizer (kv needs two UUID pairs, mdqa two "
                                     "documents): raise data.context_len or drop the kind")
                continue
            rows.append({k: row[k] for k in ("input_ids", "labels", "depth")})
            bar.update()
    return rows
