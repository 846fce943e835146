"""Segment pools: every passage tokenized once and cut into segments of at most `segment_len` tokens.

Each passage is tokenized whole (`datasets.map`, batched, several processes for large sources) and
cut at token boundaries that close a sentence where possible, so a segment's ids are exactly the ids
of that stretch of the passage. The result is cached as Arrow under
`default_cache_dir()/pools/<fingerprint>`, keyed by the passages' datasets fingerprint, the
tokenizer and the segment length: a second build reads it back instead of tokenizing again (a cached file that
cannot be read, cut short by a full disk or a kill, is made again, logged). Assembly then works on flat arrays: a
segment is a slice of one int32 array.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from datasets import Dataset, Features, List, Value
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from data_builders.text import normalize_answer as normalize

log = logging.getLogger(__name__)
POOL_FEATURES = Features(
    {
        "ids": List(Value("int32")),  # token ids of the segment
        "text": Value("string"),  # its characters in the passage
        "norm": Value("string"),  # normalize(text), for answer checks
        "passage": Value("int32"),  # index of the passage it was cut from
    }
)
# A sentence ends after . ! ? (and closing quotes or brackets) followed by white space, or at a line break.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s)|\n")
_PASSAGES_PER_PROCESS = 20_000


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of everything that decides a tokenizer's ids: model, pre-tokenizer, specials, chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    specials = (tokenizer.eos_token_id, tokenizer.pad_token_id, getattr(tokenizer, "chat_template", None))
    h.update(repr(specials).encode())
    return h.hexdigest()[:16]


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens: `tokenizer(texts)` minus the Python-side conversion."""
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def cut_points(ends: np.ndarray, text: str, segment_len: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of at most `segment_len` tokens covering a passage.

    `ends[t]` is the character offset where token t ends. A cut goes after the last sentence end that
    fits; a sentence longer than `segment_len` is cut hard.
    """
    n = len(ends)
    if n <= segment_len:
        return [(0, n)] if n else []
    sentence_ends = np.fromiter((m.end() for m in _SENTENCE_END.finditer(text)), dtype=np.int64)
    allowed = np.flatnonzero(np.isin(ends[:-1], sentence_ends)) + 1  # cut before these tokens
    ranges, start = [], 0
    while n - start > segment_len:
        j = np.searchsorted(allowed, start + segment_len, side="right") - 1
        stop = int(allowed[j]) if j >= 0 and allowed[j] > start else start + segment_len
        ranges.append((start, stop))
        start = stop
    ranges.append((start, n))
    return ranges


def _segment_batch(
    batch: dict[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase, segment_len: int
) -> dict[str, list]:
    """datasets.map function: passages -> one row per segment (more rows out than in)."""
    # The Rust tokenizer directly: the same ids as tokenizer(...), without converting offsets in Python.
    encodings = tokenizer.backend_tokenizer.encode_batch(batch["text"], add_special_tokens=False)
    out: dict[str, list] = {"ids": [], "text": [], "norm": [], "passage": []}
    for text, enc, p in zip(batch["text"], encodings, indices):
        ids = enc.ids
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)  # (n_tokens, 2) character spans
        for start, stop in cut_points(offsets[:, 1], text, segment_len):
            chunk = text[offsets[start, 0] : offsets[stop - 1, 1]]
            out["ids"].append(ids[start:stop])
            out["text"].append(chunk)
            out["norm"].append(normalize(chunk))
            out["passage"].append(p)
    return out


@dataclass
class Pool:
    """The segments of one split as flat arrays; unit s = segment s followed by the separator.

    Unit s is `units[offsets[s]:offsets[s + 1]]`; its first `seg_len[s]` ids are the segment.
    Segments of passage p are `first[p]:first[p + 1]` (a passage's segments are contiguous).
    """

    units: np.ndarray  # (total,) int32
    offsets: np.ndarray  # (P + 1,) int64
    seg_len: np.ndarray  # (P,) int64
    passage: list[int]  # (P,) passage of each segment
    text: list[str]  # (P,) raw text of each segment
    norm: list[str]  # (P,) normalized text of each segment
    first: np.ndarray  # (n_passages + 1,) int64
    fingerprint: str  # datasets fingerprint of the segment table

    def __post_init__(self) -> None:
        # Python-int copies: assembly reads them one element at a time, where numpy scalars are slow.
        self.start_list: list[int] = self.offsets[:-1].tolist()
        self.unit_len: list[int] = np.diff(self.offsets).tolist()
        self.seg_len_list: list[int] = self.seg_len.tolist()

    def __len__(self) -> int:
        return len(self.seg_len)

    def segments_of(self, passage: int) -> range:
        return range(int(self.first[passage]), int(self.first[passage + 1]))

    def segment_ids(self, s: int) -> np.ndarray:
        return self.units[self.offsets[s] : self.offsets[s] + self.seg_len[s]]


def _num_proc(n_passages: int, requested: Optional[int]) -> Optional[int]:
    n = requested if requested is not None else min(os.cpu_count() or 1, n_passages // _PASSAGES_PER_PROCESS)
    return n if n and n > 1 else None


def build_pool(
    passages: list[str],
    tokenizer: PreTrainedTokenizerBase,
    segment_len: int,
    separator: list[int],
    cache_dir: Optional[Path],
    num_proc: Optional[int] = None,
    desc: str = "segment passages",
) -> Pool:
    """Tokenize and cut `passages` once; with a `cache_dir`, reuse an identical earlier pool."""
    if not passages:
        raise ValueError("no passages to cut into segments")
    source = Dataset.from_dict({"text": passages})
    key = Hasher.hash([source._fingerprint, tokenizer_digest(tokenizer), segment_len, "pool-v1"])
    cache_file, cached = None, []
    if cache_dir is not None:
        (cache_dir / "pools").mkdir(parents=True, exist_ok=True)
        cache_file = str(cache_dir / "pools" / f"{key}.arrow")
        cached = sorted((cache_dir / "pools").glob(f"{key}*.arrow"))  # one file, or one a process

    def segment() -> Dataset:
        return source.map(
            _segment_batch,
            batched=True,
            with_indices=True,
            remove_columns=["text"],
            fn_kwargs={"tokenizer": tokenizer, "segment_len": segment_len},
            features=POOL_FEATURES,
            num_proc=_num_proc(len(passages), num_proc),
            cache_file_name=cache_file,
            new_fingerprint=key,
            desc=desc,
        )

    try:
        segments = segment()
    except (OSError, ValueError) as err:  # pyarrow reads a file cut short as an OSError or ArrowInvalid
        if not cached:
            raise
        log.warning("the segment pool cache %s is damaged (%s): building it again", ", ".join(map(str, cached)), err)
        for path in cached:
            path.unlink(missing_ok=True)
        segments = segment()
    return pool_from_table(segments, len(passages), separator)


def pool_from_table(segments: Dataset, n_passages: int, separator: list[int]) -> Pool:
    """Flat arrays of a segment table (POOL_FEATURES), each segment followed by `separator`."""
    column = segments.data.column("ids").combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    seg_len = column.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    k = len(separator)
    offsets = np.concatenate([[0], np.cumsum(seg_len + k)]).astype(np.int64)
    seg_start = np.concatenate([[0], np.cumsum(seg_len)[:-1]]).astype(np.int64)
    units = np.empty(int(offsets[-1]), dtype=np.int32)
    units[np.repeat(offsets[:-1] - seg_start, seg_len) + np.arange(len(flat))] = flat
    for j, tok in enumerate(separator):
        units[offsets[:-1] + seg_len + j] = tok
    table = segments.data
    passage = table.column("passage").to_pylist()
    first = np.searchsorted(np.asarray(passage, dtype=np.int64), np.arange(n_passages + 1), side="left")
    return Pool(
        units, offsets, seg_len, passage, table.column("text").to_pylist(), table.column("norm").to_pylist(),
        first, segments._fingerprint,
    )


def pool_stats(pool: Pool) -> dict[str, Any]:
    """Counts for the dataset card."""
    return {
        "segments": len(pool),
        "tokens": int(pool.seg_len.sum()),
        "mean_segment_len": float(pool.seg_len.mean()) if len(pool) else 0.0,
        "passages": len(pool.first) - 1,
    }
