"""Text normalization shared by building (answers vs distractors) and scoring (answers vs outputs)."""
from __future__ import annotations

import re
import string

_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop ASCII punctuation and the articles a/an/the, squeeze spaces.

    Also the data builders' normalization (answers vs distractor passages), so it has to be fast.
    """
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_DROP_PUNCTUATION)).split())
