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

from data_builders.text import normalize_answer


def substring_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any non-empty answer occurs in the prediction, ignoring case (no other normalization)."""
    pred = prediction.lower()
    return float(any(a and a.lower() in pred for a in answers))


def first_line(prediction: str) -> str:
    """The reference's answer cut for multi-document QA: the first line of the stripped generation.

    Liu et al.'s Llama-2 script strips the generated text and their QA evaluation then keeps
    `answer.split("\\n")[0].strip()`, so a model cannot score by copying the context after its
    answer line. Leading blank lines are skipped (stripped first); only "\\n" ends a line.
    """
    return prediction.strip().split("\n")[0].strip()


def best_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    """The multi-document QA metric of Liu et al. 2023 (*Lost in the Middle*), reproduced exactly.

    1.0 if for some gold answer, `normalize_answer(gold).lower()` is a substring (characters, not
    tokens) of `normalize_answer(prediction).lower()`, else 0.0. Quirks kept on purpose, to stay
    comparable with the published numbers:
    - character substring: "1901" matches inside "19011", "cat" inside "concatenate";
    - a gold that normalizes to the empty string (e.g. "The", "A", "...") always scores 1.0, even
      against an empty prediction.
    Apply it to `first_line(generation)`, as the reference evaluation does.
    """
    pred = normalize_answer(prediction).lower()
    return float(any(normalize_answer(answer).lower() in pred for answer in answers))


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
