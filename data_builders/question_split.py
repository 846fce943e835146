"""Which NaturalQuestions questions are evaluation questions: one rule for the training data and the mdqa probe.

A question is an evaluation question when the first 8 bytes of sha256(salt + "\\0" + its normalized text,
UTF-8), read big-endian as a fraction of 2^64, fall below `share`. Normalized = `normalize_answer` (lower case,
no punctuation or articles, single spaces), so case and punctuation variants of one question land on one side.
The decision reads the question alone: not the file's order, its other records, the data seed or
PYTHONHASHSEED, so the IN2 source (`data.source=nq`, `data.nq_split`) and the mdqa probe
(`eval.mdqa.questions=heldout`, `eval.mdqa.split`) agree question by question, also when the probe reads
another file of the same questions (the reference's `*_gold_at_K` files). The evaluation questions and their
gold passages never reach training.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterable, Optional, Sequence

from data_builders.text import normalize_answer

RULE = 'sha256(salt + "\\0" + normalize_answer(question))[:8] / 2^64 < share'
DEV_SUFFIX = "/dev"  # the salt suffix of the dev/test rule inside the evaluation questions
DEV_SHARE = 0.45  # expected share of the evaluation questions in the dev part (~175 of 390; ~215 test)


class EvaluationPart(StrEnum):
    """A part of the evaluation questions: settings are chosen on `dev`, results reported on `test`."""

    dev = "dev"
    test = "test"


@dataclass
class QuestionSplit:
    """The rule's settings: the same settings give the same evaluation questions everywhere."""

    share: float = 0.15  # expected share of evaluation questions (390 of NQ-open's 2,655)
    salt: str = "posdebias-nq"  # another salt draws another set of evaluation questions


def check_split(split: QuestionSplit, key: str) -> None:
    """Fail at start-up, naming `key` (`data.nq_split`, `eval.mdqa.split`), on a share outside (0, 1)."""
    if not 0 < split.share < 1:
        raise ValueError(f"{key}.share={split.share} must be in (0, 1): a share of the questions held out")


def _fraction(question: str, split: QuestionSplit) -> float:
    digest = hashlib.sha256(f"{split.salt}\0{normalize_answer(question)}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_evaluation_question(question: str, split: QuestionSplit) -> bool:
    """Whether `question` is asked only in evaluation (never trained on) under `split`."""
    return _fraction(question, split) < split.share


def evaluation_part(question: str, split: QuestionSplit, dev_share: float = DEV_SHARE) -> EvaluationPart:
    """The part of an evaluation question: `dev` when the same rule with the salt + DEV_SUFFIX falls below
    `dev_share`, else `test`. Independent of `share`, so widening the evaluation set keeps each question's part."""
    dev = QuestionSplit(share=dev_share, salt=split.salt + DEV_SUFFIX)
    return EvaluationPart.dev if _fraction(question, dev) < dev_share else EvaluationPart.test


def split_card(questions: Iterable[str], split: QuestionSplit) -> dict[str, Any]:
    """The split of `questions` for the dataset card: rule, settings, counts per side and a fingerprint.

    fingerprint = sha256 of the evaluation questions' distinct normalized texts, sorted, one a line: a reader
    recomputes it from the data file with `is_evaluation_question`.
    """
    questions = list(questions)
    chosen = [q for q in questions if is_evaluation_question(q, split)]
    texts = "\n".join(sorted({normalize_answer(q) for q in chosen}))
    return {
        "rule": RULE,
        "share": split.share,
        "salt": split.salt,
        "questions": {"evaluation": len(chosen), "training": len(questions) - len(chosen)},
        "fingerprint": hashlib.sha256(texts.encode("utf-8")).hexdigest(),
    }


@dataclass
class NearDuplicates:
    """What else the question split keeps out of training besides the evaluation questions' exact gold passages
    (`data.near_duplicates`; issue 65). A passage is a near duplicate of an evaluation gold passage when the Jaccard
    similarity of their word `ngram`-gram sets (lower case, whitespace normalized) is at least `passage_jaccard`;
    a training question is a twin of an evaluation question when they share a normalized answer and the Jaccard
    similarity of their word sets (`normalize_answer`) is at least `question_jaccard`. Either drops the training
    record and its passages from training, as gold and as distractor. None: off (the exact rule alone, as every
    build before issue 65 made its data)."""

    passage_jaccard: Optional[float] = None  # e.g. 0.5
    question_jaccard: Optional[float] = None  # e.g. 0.8
    ngram: int = 5

    @property
    def on(self) -> bool:
        return self.passage_jaccard is not None or self.question_jaccard is not None


def check_near_duplicates(cfg: NearDuplicates, key: str = "data.near_duplicates") -> None:
    for name in ("passage_jaccard", "question_jaccard"):
        value = getattr(cfg, name)
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"{key}.{name}={value} must be in (0, 1] (a Jaccard similarity), or null for off")
    if cfg.ngram < 1:
        raise ValueError(f"{key}.ngram={cfg.ngram} must be >= 1")


def shingles(text: str, n: int) -> frozenset[tuple[str, ...]]:
    """The word n-grams of `text`, lower case, whitespace normalized (a text shorter than n: its words as one)."""
    words = text.lower().split()
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def near_duplicate_passages(passages: Sequence[str], evaluation: Sequence[str], threshold: float, n: int
                            ) -> dict[int, float]:
    """Index -> Jaccard of every passage of `passages` whose word n-grams overlap some passage of `evaluation` at or
    above `threshold`. Exact (the same numbers as comparing every pair); an inverted index of the evaluation passages'
    n-grams limits the pairs compared to those sharing one."""
    index: dict[tuple[str, ...], list[int]] = {}
    evaluation_grams = [shingles(e, n) for e in evaluation]
    for k, grams in enumerate(evaluation_grams):
        for g in grams:
            index.setdefault(g, []).append(k)
    found: dict[int, float] = {}
    for i, text in enumerate(passages):
        grams = shingles(text, n)
        candidates = {k for g in grams for k in index.get(g, ())}
        best = max((jaccard(grams, evaluation_grams[k]) for k in candidates), default=0.0)
        if best >= threshold:
            found[i] = best
    return found


def question_twins(questions: Sequence[tuple[str, Sequence[str]]], evaluation: Sequence[tuple[str, Sequence[str]]],
                   threshold: float) -> set[int]:
    """Indices of `questions` (text, answers) that share a normalized answer with an evaluation question and whose
    word set (`normalize_answer`) overlaps that question's at or above `threshold` (Jaccard)."""
    by_answer: dict[str, list[frozenset[str]]] = {}
    for text, answers in evaluation:
        words = frozenset(normalize_answer(text).split())
        for a in {normalize_answer(a) for a in answers if normalize_answer(a)}:
            by_answer.setdefault(a, []).append(words)
    twins = set()
    for i, (text, answers) in enumerate(questions):
        words = frozenset(normalize_answer(text).split())
        others = [w for a in {normalize_answer(a) for a in answers} for w in by_answer.get(a, ())]
        if any(jaccard(words, w) >= threshold for w in others):
            twins.add(i)
    return twins
