"""What kind of text each answer is: a span of the gold document, of a distractor, of nothing, or empty.

Why: the multi-document QA accuracy (`scoring.best_subspan_em` on the first line) credits any first line that
*contains* the answer, so a model that copies a long sentence out of the gold document scores like one that
answers in two words, and a fine-tune that only changes the answer format (long copied sentences -> short
answers) moves accuracy without any change in which position the model reads. Beside accuracy we keep, for
every answer, where its first line comes from (`answer_kind`), how long it is, and stricter short-answer scores
(`describe_answer`), and their shares and means over a set of answers (`summarize`).

The documents are the texts of the prompt's segments (`segment_texts`: mdqa documents with their
"Document [k](Title: ...)" header, or kv `"key": "value"` pairs); the gold is the segment at
`gold_segment_index` (`extra["final_position"]` after an inference-time reordering, else the item's position).
Everything is compared after `normalize_answer` (SQuAD normalization), word by word.

A kv answer's kind is read on the whole answer instead (`value_kind`): which pair's value it names. Its accuracy
reads the whole answer too, and an instruct model often opens with a line that repeats the key ("The value
corresponding to the key ... is:") and gives the value in a JSON block below, so its first line is the kind of no
answer at all.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from analysis.evaluation.scoring import exact_match, first_line, substring_match, whole_word_subspan_em
from data_builders.text import normalize_answer

KINDS = ("gold", "distractor", "none", "empty")
COPY_WORDS = 4  # a run of this many normalized words shared with the gold counts as copying from it


def segment_texts(prompt: str, segments: Sequence[Sequence[int]] | None) -> list[str]:
    """The texts of the character spans [start, end) of `prompt`, in order (no segments, e.g. closed-book: [])."""
    if not isinstance(prompt, str):
        raise TypeError(f"segments index a text prompt, got {type(prompt).__name__} (token ids?)")
    texts = []
    for start, end in segments or ():
        # A span outside the prompt means the spans belong to another prompt: fail rather than slice quietly.
        if not 0 <= start <= end <= len(prompt):
            raise ValueError(f"segment [{start}, {end}) is not a span of a prompt of {len(prompt)} characters")
        texts.append(prompt[start:end])
    return texts


def gold_segment_index(position: int, extra: Mapping[str, Any] | None = None) -> int | None:
    """Index of the gold among the prompt's segments: `extra["final_position"]` when present (mdqa documents
    reordered or truncated at inference time), else `position`; None when there is none (-1: closed-book, or
    the gold truncated away)."""
    index = (extra or {}).get("final_position", position)
    return index if index >= 0 else None


def _padded(words: str) -> str:
    # Normalized text has single spaces between words, so with a space at both ends a substring test on it is a
    # test for a contiguous run of whole words: " cat " is not in " concatenate ".
    return f" {words} "


def _is_run(line: str, document: str) -> bool:
    """Whether padded normalized `line` is a contiguous run of whole words of padded normalized `document`."""
    return line in document


def _gold_of(documents: Sequence[str], gold_index: int | None) -> int | None:
    # Out of range (negative included: -1 must not mean the last document) is the same as no gold.
    return gold_index if gold_index is not None and 0 <= gold_index < len(documents) else None


def _kind(line: str, documents: Sequence[str], gold: int | None, gold_text: str | None) -> str:
    """`answer_kind` on the padded normalized first line; `gold_text` is the padded normalized gold document,
    the others are normalized here, one at a time, only until one matches."""
    if not line.strip():
        return "empty"
    if gold is not None and _is_run(line, gold_text):
        return "gold"
    if any(_is_run(line, _padded(normalize_answer(doc))) for k, doc in enumerate(documents) if k != gold):
        return "distractor"
    return "none"


def answer_kind(prediction: str, documents: Sequence[str], gold_index: int | None) -> str:
    """Where the answer's first line (`scoring.first_line`) comes from: "gold", "distractor", "none" or "empty".

    What is matched: the first line and each document go through `normalize_answer` (lowercase, ASCII
    punctuation deleted, the articles a/an/the dropped, whitespace collapsed) and are compared as word lists.
    The line is a span of a document when its normalized words are a contiguous run of whole normalized words
    of that document: "Cat" is a span of "the cat sat", "cat" is not a span of "concatenate".

    - "empty": the first line normalizes to nothing (blank, only punctuation, only articles);
    - "gold": a span of `documents[gold_index]`. The gold wins when the line is also in a distractor (a date or
      a name shared by several documents);
    - "distractor": a span of some other document;
    - "none": a span of no single document.

    The whole line must be contained in one document. A long sentence copied out of a document is still a span
    of it, whatever its length; a line made of pieces of two documents, or a copied span with the model's own
    framing ("The answer is Paris." where the document says "Paris"), is "none". Whether such a line holds
    the answer is for the scores of `describe_answer`, not for the kind.

    Closed-book (`gold_index` None, negative or not an index of `documents`): no document is the gold, so only
    "distractor" (a span of some document), "none" and "empty" occur; with no documents, only "none" and
    "empty".
    """
    line = _padded(normalize_answer(first_line(prediction)))
    gold = _gold_of(documents, gold_index)
    gold_text = _padded(normalize_answer(documents[gold])) if gold is not None else None
    return _kind(line, documents, gold, gold_text)


def kv_values(pairs: Sequence[str]) -> list[str]:
    """The value of each kv segment text (`"key": "value"`, a member of a JSON object); ValueError naming the text
    when one is not such a pair."""
    values = []
    for text in pairs:
        try:
            (value,) = json.loads("{" + text + "}").values()
        except (json.JSONDecodeError, ValueError) as err:
            raise ValueError(f"not a kv pair (\"key\": \"value\"): {text[:80]!r}") from err
        values.append(str(value))
    return values


def value_kind(prediction: str, values: Sequence[str], gold_index: int | None) -> str:
    """Which pair's value the whole answer names (kv), as `answer_kind`'s kinds: "gold" when the gold pair's value
    occurs in it (it wins over the others, as accuracy credits it), "distractor" when only another pair's value
    does, "none" when no value does (a value cut short, or one made up), "empty" for a blank answer. Values are
    matched as they are, ignoring case (UUIDs: `scoring.substring_match`, the kv accuracy's own test)."""
    if not prediction.strip():
        return "empty"
    gold = _gold_of(values, gold_index)
    if gold is not None and substring_match(prediction, [values[gold]]):
        return "gold"
    if substring_match(prediction, [value for k, value in enumerate(values) if k != gold]):
        return "distractor"
    return "none"


def _copies(line_words: Sequence[str], gold_text: str, n: int = COPY_WORDS) -> bool:
    """Whether `n` consecutive normalized words of the line also occur consecutively in the padded gold."""
    return any(_is_run(_padded(" ".join(line_words[i : i + n])), gold_text) for i in range(len(line_words) - n + 1))


def describe_answer(
    prediction: str, answers: Sequence[str], documents: Sequence[str], gold_index: int | None,
    values: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The kind and the short-answer scores of one answer, all read on its first line (`scoring.first_line`), but
    the kind of a kv answer: with `values` (the value each document holds, `kv_values`) it is read on the whole
    answer.

    Keys:
    - kind: `answer_kind` (str), or `value_kind` with `values`;
    - first_line_words: number of whitespace-separated words of the first line as generated (int);
    - short_em: 1.0 if the first line normalizes to a gold answer (`scoring.exact_match`), else 0.0;
    - whole_word: 1.0 if a normalized gold answer is a run of whole words of the first line
      (`scoring.whole_word_subspan_em`), else 0.0;
    - copies_gold: 1.0 if `COPY_WORDS` (4) consecutive normalized words of the first line also occur
      consecutively in the normalized gold document, else 0.0 (a line of fewer normalized words: 0.0; articles
      and punctuation do not count as words); None without a gold (closed-book, see `answer_kind`).

    A long sentence copied from the gold that contains the answer reads kind "gold", short_em 0, whole_word 1,
    copies_gold 1: the accuracy of `best_subspan_em` counts it, the short-answer score does not.
    """
    line = first_line(prediction)
    words = normalize_answer(line)
    gold = _gold_of(documents, gold_index)
    # Each document is normalized at most once: the gold here, shared by the kind and the copy test.
    gold_text = _padded(normalize_answer(documents[gold])) if gold is not None else None
    return {
        "kind": _kind(_padded(words), documents, gold, gold_text) if values is None
        else value_kind(prediction, values, gold_index),
        "first_line_words": len(line.split()),
        "short_em": exact_match(line, answers),
        "whole_word": whole_word_subspan_em(line, answers),
        "copies_gold": None if gold_text is None else float(_copies(words.split(), gold_text)),
    }


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def summarize(descriptions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Shares and means over `describe_answer` outputs.

    Keys: n (number of descriptions); share_<kind> for every kind of `KINDS` (they sum to 1), None where the
    answers' documents were not known (an IN2 prompt of token ids: no kind); median_first_line_words; short_em
    and whole_word (means); copies_gold (mean over the descriptions where it is not None) and n_copies_gold (how
    many those are). A statistic of nothing (no descriptions, or no gold anywhere for copies_gold) is None, not
    nan, so the summary stays strict JSON.
    """
    n = len(descriptions)
    kinds = [d["kind"] for d in descriptions if "kind" in d]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown answer kinds {unknown}: expected one of {KINDS}")
    copies = [d["copies_gold"] for d in descriptions if d.get("copies_gold") is not None]
    return {
        "n": n,
        **{f"share_{kind}": (kinds.count(kind) / len(kinds) if kinds else None) for kind in KINDS},
        "median_first_line_words": float(np.median([d["first_line_words"] for d in descriptions])) if n else None,
        "short_em": _mean([d["short_em"] for d in descriptions]),
        "whole_word": _mean([d["whole_word"] for d in descriptions]),
        "copies_gold": _mean(copies),
        "n_copies_gold": len(copies),
    }
