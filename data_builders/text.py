"""Text normalization shared by building (answers vs distractors) and scoring (answers vs outputs)."""
from __future__ import annotations

import string

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
