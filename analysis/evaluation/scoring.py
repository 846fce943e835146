"""Answer scoring for the position-wise probes (intervals of the scores: `analysis.stats`).

Which scorer goes with which probe:
- key-value retrieval and needle: `substring_match` (the value / code appears in the output);
- multi-document QA: `best_subspan_em` on `first_line(generation)`, the metric and the answer cut
  of Liu et al. 2023, *Lost in the Middle*, so that numbers are comparable with the paper;
- synthetic IN2 questions, where the model is trained to emit just the answer: `exact_match`;
- VaLProbing (FILM's `VaLProbing/plot.py`, on the whole generation): `word_recall` (document),
  `name_in_output` (code), `label_or_description` (database).

`whole_word_subspan_em` is a stricter variant of `best_subspan_em` (whole tokens only, empty golds
never match); it is kept for diagnostics and is not comparable with published numbers.
"""
from __future__ import annotations

from typing import Sequence

# the mdqa answer cut and metric live with the text normalization (data builders score answers too)
from data_builders.text import best_subspan_em, first_line, normalize_answer  # noqa: F401


def substring_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any non-empty answer occurs in the prediction, ignoring case (no other normalization)."""
    pred = prediction.lower()
    return float(any(a and a.lower() in pred for a in answers))


def whole_word_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any normalized answer is a contiguous run of whole tokens of the normalized prediction.

    Stricter than the published `best_subspan_em`, and not comparable with it: tokens are the
    whitespace-separated words after `normalize_answer`, so "1901" does not match inside "19011",
    and an answer that normalizes to nothing (e.g. "The") never matches.
    """
    pred = normalize_answer(prediction).split()
    for answer in answers:
        gold = normalize_answer(answer).split()
        if gold and any(pred[i : i + len(gold)] == gold for i in range(len(pred) - len(gold) + 1)):
            return 1.0
    return 0.0


def exact_match(prediction: str, answers: Sequence[str], stop: Sequence[str] = ("\n",)) -> float:
    """1.0 if the prediction, cut at the first `stop` string, normalizes to one of the answers.

    The cut drops what a model writes after its answer line. End-of-sequence needs no cut here:
    `greedy_generate` stops at eos and decodes without special tokens. An answer that normalizes to
    nothing never matches, so an empty prediction cannot score.
    """
    for s in stop:
        prediction = prediction.split(s, 1)[0]
    pred = normalize_answer(prediction)
    return float(any(pred == gold for gold in map(normalize_answer, answers) if gold))


def word_recall(prediction: str, answers: Sequence[str]) -> float:
    """FILM's document score: the share of the gold sentence's distinct words found in the answer."""
    gold = set(answers[0].strip().lower().split())
    return len(gold & set(prediction.strip().lower().split())) / len(gold) if gold else 0.0


def name_in_output(prediction: str, answers: Sequence[str]) -> float:
    """FILM's code score: the gold name, dots stripped at its ends, occurs in the answer (case-sensitive)."""
    return float(answers[0].strip(".") in prediction)


def label_or_description(prediction: str, answers: Sequence[str]) -> float:
    """FILM's database score: the label or the description, dots stripped, occurs in the answer (ignoring case)."""
    text = prediction.lower()
    return float(any(a.strip(".").lower() in text for a in answers[:2]))
