"""Position-controlled probes: the same query with its gold placed at each chosen position.

Every builder returns `ProbeItem`s. A query appears once per position (a paired design: the
positions differ only in where the gold sits), so accuracy differences between positions can be
tested query by query. Prompt wording lives in `templates/*.txt`; the key-value and multi-document
QA wording is that of Liu et al. 2023, *Lost in the Middle* (github.com/nelson-liu/lost-in-the-middle,
MIT; the NaturalQuestions passages are CC BY-SA 3.0, Kwiatkowski et al. 2019).

Scorers: kv and needle use `analysis.scoring.substring_match`, mdqa `best_subspan_em`, in2 `exact_match`.
"""
from __future__ import annotations

import gzip
import json
import random
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from data_builders.text import normalize_answer

TEMPLATES = Path(__file__).resolve().parent / "templates"
KV_FILE = "kv-retrieval-75_keys.jsonl.gz"
NQ_FILE = "nq-open-oracle.jsonl.gz"

# Needle keys never occur in the synthetic filler, so the question has exactly one answer in context.
NEEDLE_WORDS = (
    "lantern", "walrus", "quiver", "saffron", "glacier", "trombone", "marmalade", "obsidian", "pelican",
    "kettle", "zeppelin", "juniper", "cobalt", "harpoon", "meadowlark", "tapestry", "sundial", "velvet",
    "anchor", "bramble", "compass", "dynamo", "ember", "falcon", "gondola", "hemlock", "indigo", "jasper",
)
_FILLER_SUBJECTS = ("farmer", "river", "teacher", "village", "merchant", "forest", "sailor", "council")
_FILLER_VERBS = ("watched", "crossed", "described", "visited", "followed", "painted", "measured")
_FILLER_OBJECTS = (
    "the old bridge", "a quiet harbor", "the northern hills", "an empty market", "the long road",
    "a small orchard", "the stone tower", "a winter storm", "the evening bells",
)
_FILLER_TAILS = (
    "before the rain began", "during the festival", "while the town slept", "after a long silence",
    "as the seasons changed", "without saying a word", "for many years",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class ProbeItem:
    """One query with its gold at one position."""

    id: str
    prompt: str | list[int]  # text, or token ids for already tokenized records (IN2)
    answers: list[str]
    position: int  # gold index among the positions; -1 = no context (closed-book baseline)
    n_positions: int
    probe: str  # kv, mdqa, needle, in2
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-serializable details kept with the outcome
    label: str | None = None  # name of the position in metric keys; None = str(position)
    query: str | None = None  # shared by one query's items at all positions (pairs them); None = id

    def __post_init__(self) -> None:
        if self.label is None:
            self.label = str(self.position)
        if self.query is None:
            self.query = self.id


def load_template(name: str) -> str:
    """Prompt template `templates/<name>.txt`, with `str.format` fields."""
    return (TEMPLATES / f"{name}.txt").read_text(encoding="utf-8").rstrip("\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file, gzipped when the name ends in .gz."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _choose(n_total: int, n: int | None, rng: random.Random) -> list[int]:
    """Indices of a seeded sample of n records (all when n is None), in file order."""
    if n is None or n >= n_total:
        return list(range(n_total))
    return sorted(rng.sample(range(n_total), n))


def _check_positions(positions: Sequence[int], n_slots: int) -> None:
    bad = [p for p in positions if not 0 <= p < n_slots]
    if bad:
        raise ValueError(f"positions {bad} are outside 0..{n_slots - 1}")


def format_kv_records(pairs: Sequence[Sequence[str]]) -> str:
    """The pairs as a JSON object, one pair a line (the layout of Liu et al.)."""
    return "{" + ",\n ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"


def _synthetic_kv(n_pairs: int, rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    def uid() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    pairs = [(uid(), uid()) for _ in range(n_pairs)]
    key, value = pairs[rng.randrange(n_pairs)]
    return pairs, key, value


def kv_probe(
    path: str | Path | None = None,
    n_pairs: int = 75,
    positions: Sequence[int] = (0, 24, 49, 74),
    n_examples: int | None = None,
    seed: int = 0,
) -> list[ProbeItem]:
    """Key-value retrieval: find the value of one UUID key among `n_pairs` UUID pairs.

    Reads records with `ordered_kv_records`, `key`, `value` from `path`, or synthesizes UUID pairs
    when `path` is None. n_examples=None takes every record (500 when synthesizing, the published
    size); otherwise a seeded sample. The gold pair is moved to each of `positions`; the other pairs
    keep their order (the first n_pairs-1 of them).
    """
    _check_positions(positions, n_pairs)
    rng = random.Random(seed)
    if path is None:
        n = 500 if n_examples is None else n_examples
        examples = [(i, *_synthetic_kv(n_pairs, rng)) for i in range(n)]
    else:
        records = read_jsonl(path)
        examples = [
            (i, records[i]["ordered_kv_records"], records[i]["key"], records[i]["value"])
            for i in _choose(len(records), n_examples, rng)
        ]
    template = load_template("kv_retrieval")
    items = []
    for i, pairs, key, value in examples:
        others = [tuple(p) for p in pairs if p[0] != key][: n_pairs - 1]
        if len(others) < n_pairs - 1:
            raise ValueError(f"kv example {i} has {len(others) + 1} pairs, fewer than n_pairs={n_pairs}")
        for pos in positions:
            kv = format_kv_records(others[:pos] + [(key, value)] + others[pos:])
            items.append(
                ProbeItem(
                    id=f"kv-{i}@{pos}",
                    prompt=template.format(kv_records=kv, key=key),
                    answers=[value],
                    position=pos,
                    n_positions=n_pairs,
                    probe="kv",
                    extra={"example": i, "key": key},
                    query=f"kv-{i}",
                )
            )
    return items


def _format_documents(docs: Sequence[Mapping[str, str]]) -> str:
    return "\n".join(f"Document [{k + 1}](Title: {d['title']}) {d['text']}" for k, d in enumerate(docs))


def mdqa_probe(
    path: str | Path,
    n_docs: int = 10,
    positions: Sequence[int] = (0, 4, 9),
    n_examples: int | None = None,
    seed: int = 0,
    closed_book: bool = True,
) -> list[ProbeItem]:
    """Multi-document QA: a question, its gold passage and n_docs-1 distractor passages.

    Reads NaturalQuestions-Open oracle records (`question`, `answers`, `ctxs[0]` = gold passage).
    Distractors are other questions' gold passages, drawn with a seeded RNG, from another Wikipedia
    article than the gold (the same article may state the answer in other words) and whose
    normalized title and text contain none of the normalized answers as a substring. One set of
    distractors per question, in one order, serves every gold position. `closed_book` adds a
    question-only item (position -1, label "closedbook"), the no-context baseline.
    """
    _check_positions(positions, n_docs)
    rng = random.Random(seed)
    records = read_jsonl(path)
    passages = [r["ctxs"][0] for r in records]
    normalized = [normalize_answer(f"{p['title']} {p['text']}") for p in passages]
    qa_template, cb_template = load_template("mdqa"), load_template("closedbook_qa")
    items = []
    for i in _choose(len(records), n_examples, rng):
        rec, gold = records[i], passages[i]
        answers = [a for a in map(normalize_answer, rec["answers"]) if a]
        distractors: list[Mapping[str, str]] = []
        seen = {gold["text"]}
        # Rejection sampling: answers are rare in random passages, so a few draws per slot suffice.
        for _ in range(100 * n_docs):
            if len(distractors) == n_docs - 1:
                break
            p = passages[j := rng.randrange(len(records))]
            if p["text"] in seen or p["title"] == gold["title"] or any(a in normalized[j] for a in answers):
                continue
            seen.add(p["text"])
            distractors.append({"title": p["title"], "text": p["text"]})
        if len(distractors) < n_docs - 1:
            raise ValueError(f"found only {len(distractors)} answer-free distractors for question {i}")
        extra = {"example": i, "question": rec["question"]}
        for pos in positions:
            docs = distractors[:pos] + [gold] + distractors[pos:]
            items.append(
                ProbeItem(
                    id=f"mdqa-{i}@{pos}",
                    prompt=qa_template.format(documents=_format_documents(docs), question=rec["question"]),
                    answers=list(rec["answers"]),
                    position=pos,
                    n_positions=n_docs,
                    probe="mdqa",
                    extra=dict(extra),
                    query=f"mdqa-{i}",
                )
            )
        if closed_book:
            items.append(
                ProbeItem(
                    id=f"mdqa-{i}@closedbook",
                    prompt=cb_template.format(question=rec["question"]),
                    answers=list(rec["answers"]),
                    position=-1,
                    n_positions=n_docs,
                    probe="mdqa",
                    extra=dict(extra),
                    label="closedbook",
                    query=f"mdqa-{i}",
                )
            )
    return items


def synthetic_filler(n_sentences: int = 2000, seed: int = 0) -> list[str]:
    """Bland generated sentences, a filler that needs no data file (holds no digits, no needle word)."""
    rng = random.Random(seed)
    return [
        f"The {rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_VERBS)} {rng.choice(_FILLER_OBJECTS)} "
        f"{rng.choice(_FILLER_TAILS)}."
        for _ in range(n_sentences)
    ]


def nq_filler(path: str | Path) -> list[str]:
    """Real English filler: the annotated long-answer paragraphs of the NQ-Open oracle file."""
    return [r["nq_annotated_gold"]["long_answer"] for r in read_jsonl(path)]


def needle_probe(
    filler_texts: Sequence[str],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    context_lens: Sequence[int] = (256, 512, 1024),
    tokenizer: PreTrainedTokenizerBase | None = None,
    n_examples: int = 5,
    seed: int = 0,
) -> list[ProbeItem]:
    """Needle in a haystack: "The secret code of <word> is <5-digit number>." inside filler text.

    Lengths are in tokens of `tokenizer` when one is given, else in characters. For each example and
    length, whole filler sentences (cycling through `filler_texts` from a seeded start) are taken
    while the filler plus needle fits the length, and the needle goes to the sentence boundary
    nearest each depth (0 = first, 1 = last). Token lengths add per-sentence counts, so they can be
    off by a few tokens where a tokenizer merges across sentence boundaries. position = depth index;
    extra holds context_len (the requested length, the heatmap axis), depth, and the realised
    relative depth and length.
    """
    sentences = [s for t in filler_texts for s in _SENTENCE_END.split(t.strip()) if s]
    if not sentences:
        raise ValueError("needle_probe needs non-empty filler_texts")
    sizes: dict[int, int] = {}

    def size(text: str) -> int:
        # The space is the joiner in front of every sentence of the context; a sentence takes at
        # least one unit, so the filling loop below ends.
        n = len(tokenizer.encode(" " + text, add_special_tokens=False)) if tokenizer else len(text) + 1
        return max(n, 1)

    def sentence_size(k: int) -> int:
        if k not in sizes:  # tokenize lazily: a long filler is mostly never used
            sizes[k] = size(sentences[k])
        return sizes[k]

    rng = random.Random(seed)
    template = load_template("needle")
    haystack = "\n".join(sentences)
    items = []
    for e in range(n_examples):
        word, start = rng.choice(NEEDLE_WORDS), rng.randrange(len(sentences))
        code = str(rng.randrange(10_000, 100_000))
        while code in haystack:  # the code must be the only answer in the context
            code = str(rng.randrange(10_000, 100_000))
        needle = f"The secret code of {word} is {code}."
        for length in context_lens:
            budget, chosen, bounds = length - size(needle), [], [0]
            k = start
            while bounds[-1] + sentence_size(k) <= budget:
                chosen.append(sentences[k])
                bounds.append(bounds[-1] + sentence_size(k))
                k = (k + 1) % len(sentences)
            if not chosen:
                raise ValueError(f"context_len={length} leaves no room for a filler sentence")
            total = bounds[-1]
            for d_idx, depth in enumerate(depths):
                cut = min(range(len(bounds)), key=lambda b: abs(bounds[b] - depth * total))
                context = " ".join(chosen[:cut] + [needle] + chosen[cut:])
                items.append(
                    ProbeItem(
                        id=f"needle-{e}-{length}@{d_idx}",
                        prompt=template.format(context=context, word=word),
                        answers=[code],
                        position=d_idx,
                        n_positions=len(depths),
                        probe="needle",
                        extra={
                            "example": e,
                            "context_len": length,
                            "depth": float(depth),
                            "realised_depth": bounds[cut] / total,
                            "realised_len": total + size(needle),
                        },
                        label=str(float(depth)),
                        query=f"needle-{e}-{length}",
                    )
                )
    return items


def depth_bin(depth: float, bins: int) -> int:
    """Index of the equal-width depth bin holding `depth` in [0, 1]; depth 1 falls in the last bin."""
    return min(max(int(depth * bins), 0), bins - 1)


def bin_label(index: int, bins: int) -> str:
    """Lower edge of a depth bin as a metric-key label: 0.0, 0.1, ..., 0.9 for 10 bins."""
    return str(round(index / bins, 4))


def in2_probe(records: Iterable[Mapping[str, Any]], bins: int = 10) -> list[ProbeItem]:
    """Held-out IN2 records as items binned by gold depth (position = bin of record["depth"]).

    The prompt is the record's own token ids before the answer, `input_ids[:prompt_len]`, so
    generation sees exactly the tokens that training saw.
    """
    items = []
    for rec in records:
        b = depth_bin(rec["depth"], bins)
        items.append(
            ProbeItem(
                id=str(rec["id"]),
                prompt=list(rec["input_ids"][: rec["prompt_len"]]),
                answers=list(rec["answers"]),
                position=b,
                n_positions=bins,
                probe="in2",
                extra={k: rec[k] for k in ("depth", "context_tokens", "task", "source") if k in rec},
                label=bin_label(b, bins),
            )
        )
    return items
