"""Answer scoring for the position-wise probes, and bootstrap confidence intervals.

Which scorer goes with which probe:
- key-value retrieval and needle: `substring_match` (the value / code appears in the output);
- multi-document QA: `best_subspan_em` on `first_line(generation)`, the metric and the answer cut
  of Liu et al. 2023, *Lost in the Middle*, so that numbers are comparable with the paper;
- synthetic IN2 questions, where the model is trained to emit just the answer: `exact_match`.

`whole_word_subspan_em` is a stricter variant of `best_subspan_em` (whole tokens only, empty golds
never match); it is kept for diagnostics and is not comparable with published numbers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

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


def bootstrap_ci(
    outcomes: np.ndarray, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-query outcomes, shape (n_queries,).

    Returns (nan, nan) for no outcomes.
    """
    x = np.asarray(outcomes, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))  # (n_boot, n)
    means = x[idx].mean(axis=1)  # (n_boot,)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def paired_bootstrap_ci(
    a: np.ndarray, b: np.ndarray, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap interval of mean(a - b), where a[i] and b[i] are the same query at two positions.

    Resampling queries (not positions) keeps the pairing, so the query-difficulty variance shared
    by both positions cancels and the interval is narrower than two unpaired ones suggest.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes need equal shapes, got {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, n_boot=n_boot, alpha=alpha, seed=seed)
