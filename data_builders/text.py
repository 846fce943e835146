"""Text normalization shared by building (answers vs distractors) and scoring (answers vs outputs)."""
from __future__ import annotations

import string
from typing import Sequence

import regex

_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
# The third-party `regex` module, not the stdlib `re`: the two disagree on `\b` next to combining
# marks (decomposed accents). `regex` counts a mark as a word character, `re` does not, so for
# "a\u0300 la carte" (NFD of "à la carte") `re` would delete the "a" and leave the bare accent.
_ARTICLES = regex.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The SQuAD v1.1 answer normalization, as in the reference code of Liu et al. 2023 (*Lost in the Middle*).

    Lowercase, delete every character of `string.punctuation` (ASCII only: curly quotes, « » and
    the ellipsis character stay), replace the whole-word articles a/an/the with a space, then split
    on whitespace and join with single spaces. The articles are matched with the `regex` module, as
    the reference does, because its `\\b` differs from the stdlib `re` one around combining marks.

    Also the data builders' normalization (answers vs distractor passages), so it has to be fast:
    precompiled pattern and `str.translate` (equivalent to the reference's per-character filter).
    """
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_DROP_PUNCTUATION)).split())


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
