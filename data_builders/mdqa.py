"""Multi-document QA records in the format of Liu et al. 2023 (`qa_data/*_gold_at_<K>.jsonl.gz`).

A record is a NaturalQuestions-Open question with `answers` and `ctxs`: n_docs passages (`title`,
`text`, `hasanswer`, `isgold`), exactly one of them the gold passage, at index K. The reference built
its distractors from Contriever retrieval over Wikipedia: the top-ranked passages that do not contain
an answer, in retrieval order, with the gold inserted at K. Here the same recipe runs over any
passage pool with BM25 (`bm25s`, a lexical retriever from PyPI), so distractors are on the question's
topic, which is what makes the task hard; `random` distractors (other questions' passages) are the
easy, not comparable variant.

`write_jsonl_gz` writes byte-identical files for the same records (no timestamp in the gzip header),
so a build is reproducible; `python -m scripts.build_mdqa` is its CLI.
"""
from __future__ import annotations

import copy
import gzip
import json
import random
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import bm25s
import numpy as np

from data_builders.files import atomic_file
from data_builders.text import normalize_answer


class Distractors(StrEnum):
    retrieved = "retrieved"  # top BM25 passages for the question without an answer, by score (the reference's recipe)
    random = "random"  # other questions' passages drawn at random (easier; not comparable with published curves)


def gold_passage(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record's only passage flagged `isgold`, or its only passage when none is flagged (an oracle record)."""
    ctxs = record.get("ctxs") or []
    golds = [c for c in ctxs if c.get("isgold") is True]
    if golds:
        return golds[0]
    return ctxs[0] if len(ctxs) == 1 and "isgold" not in ctxs[0] else None


def passage_pool(records: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Distinct (title, text) passages of the records, in file order: every ctx, or the record itself
    when it has `title` and `text` (a plain passage file)."""
    seen: set[tuple[str, str]] = set()
    pool = []
    for rec in records:
        for p in rec["ctxs"] if "ctxs" in rec else [rec]:
            key = (p["title"], p["text"])
            if key not in seen:
                seen.add(key)
                pool.append({"title": p["title"], "text": p["text"]})
    return pool


def contains_answer(normalized_passage: str, answers: Sequence[str]) -> bool:
    """Whether a normalized answer is a run of whole words of the normalized passage.

    Whole words, as the reference's `hasanswer` (DPR's token-level match) decided it: a one-letter
    answer such as "S" would otherwise be found in every passage.
    """
    padded = f" {normalized_passage} "
    return any(f" {a} " in padded for a in answers)


def _answers(record: Mapping[str, Any]) -> list[str]:
    # An answer that normalizes to nothing would be "contained" in every passage.
    return [a for a in map(normalize_answer, record["answers"]) if a]


class PassageRetriever:
    """BM25 over a passage pool (title and text), English stopwords removed; ties broken by pool order."""

    def __init__(self, pool: Sequence[Mapping[str, str]]) -> None:
        if not pool:
            raise ValueError("the passage pool is empty")
        self.pool = pool
        self.normalized = [normalize_answer(f"{p['title']} {p['text']}") for p in pool]
        self._bm25 = bm25s.BM25()
        corpus = [f"{p['title']}\n{p['text']}" for p in pool]
        self._bm25.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False)

    def ranking(self, question: str) -> tuple[np.ndarray, np.ndarray]:
        """Pool indices by descending score (stable: equal scores keep pool order) and their scores."""
        query = bm25s.tokenize([question], stopwords="en", return_ids=False, show_progress=False)[0]
        scores = self._bm25.get_scores(query).astype(np.float64)  # (n_pool,)
        order = np.argsort(-scores, kind="stable")
        return order, scores[order]

    def distractors(self, record: Mapping[str, Any], k: int) -> list[dict[str, Any]]:
        """The k best-ranked passages for the record's question that are not its gold passage and contain
        none of its normalized answers, in ranking order, flagged as the reference flags them."""
        answers, gold = _answers(record), gold_passage(record)
        order, scores = self.ranking(record["question"])
        chosen = []
        for rank, (i, score) in enumerate(zip(order.tolist(), scores.tolist())):
            if len(chosen) == k:
                break
            p = self.pool[i]
            if (gold is not None and p["text"] == gold["text"]) or contains_answer(self.normalized[i], answers):
                continue
            chosen.append({"title": p["title"], "text": p["text"], "score": round(score, 4), "hasanswer": False,
                           "isgold": False, "original_retrieval_index": rank})
        if len(chosen) < k:
            raise ValueError(f"question {record['question']!r}: only {len(chosen)} of the {len(self.pool)} pool "
                             f"passages are answer-free, {k} are needed")
        return chosen


def random_distractors(
    records: Sequence[Mapping[str, Any]], chosen: Sequence[int], k: int, seed: int
) -> list[list[dict[str, Any]]]:
    """For each chosen record, k other records' gold passages drawn with a seeded RNG: from another
    Wikipedia article than its gold (the same article may state the answer in other words), answer-free."""
    rng = random.Random(seed)
    passages = [gold_passage(r) for r in records]
    normalized = [normalize_answer(f"{p['title']} {p['text']}") for p in passages]
    out = []
    for i in chosen:
        gold, answers = passages[i], _answers(records[i])
        picked: list[dict[str, Any]] = []
        seen = {gold["text"]}
        # Rejection sampling: answers are rare in random passages, so a few draws per slot suffice.
        for _ in range(100 * (k + 1)):
            if len(picked) == k:
                break
            j = rng.randrange(len(records))
            p = passages[j]
            if p["text"] in seen or p["title"] == gold["title"] or contains_answer(normalized[j], answers):
                continue
            seen.add(p["text"])
            picked.append({"title": p["title"], "text": p["text"], "hasanswer": False, "isgold": False})
        if len(picked) < k:
            raise ValueError(f"found only {len(picked)} answer-free distractors for record {i}")
        out.append(picked)
    return out


def place_gold(record: Mapping[str, Any], distractors: Sequence[Mapping[str, Any]], gold_index: int) -> dict[str, Any]:
    """A copy of `record` whose ctxs are the distractors with its gold passage inserted at `gold_index`."""
    gold = dict(gold_passage(record), hasanswer=True, isgold=True)
    ctxs = [dict(d) for d in distractors]
    ctxs.insert(gold_index, gold)
    out = copy.deepcopy(dict(record))
    out["ctxs"] = ctxs
    return out


def build_mdqa_records(
    records: Sequence[Mapping[str, Any]],
    n_docs: int,
    gold_indices: Sequence[int],
    distractors: Distractors | str = Distractors.retrieved,
    pool: Sequence[Mapping[str, str]] | None = None,
    chosen: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[int, list[dict[str, Any]]]:
    """{gold index: records in the reference format} for the chosen oracle records (all when None).

    One set of n_docs-1 distractors per question, in one order, serves every gold index (a paired design).
    `pool`: passages to retrieve from (`passage_pool`); None = the records' own gold passages.
    """
    bad = [k for k in gold_indices if not 0 <= k < n_docs]
    if n_docs < 2 or bad:
        raise ValueError(f"n_docs={n_docs} needs >= 2 documents and gold indices in 0..{n_docs - 1} (got {bad})")
    chosen = list(range(len(records))) if chosen is None else list(chosen)
    for i in chosen:
        if gold_passage(records[i]) is None:
            raise ValueError(f"record {i} has no gold passage (one ctx, or one flagged isgold)")
    if Distractors(distractors) == Distractors.retrieved:
        retriever = PassageRetriever(passage_pool(records) if pool is None else pool)
        per_record = [retriever.distractors(records[i], n_docs - 1) for i in chosen]
    else:
        per_record = random_distractors(records, chosen, n_docs - 1, seed)
    return {k: [place_gold(records[i], d, k) for i, d in zip(chosen, per_record)] for k in gold_indices}


def write_jsonl_gz(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """JSON lines, gzipped with no name or timestamp in the header: the same records give the same bytes."""
    path = Path(path)
    with atomic_file(path) as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        for rec in records:
            f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    return path
