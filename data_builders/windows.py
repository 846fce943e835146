"""Language-modelling windows over long documents (the micro-training experiment's data).

The source's passages, in order, are tokenized once and joined into documents of at least
`data.windows.doc_len` tokens. Training samples are random contiguous `data.context_len`-token windows
of random documents in `data.windows.train_docs` (a [first, last) range); held-out documents
`data.windows.eval_docs` give the eval-loss windows and the Jacobian sequences, so no measured token
is ever trained on.
"""
from __future__ import annotations

import random
from typing import Any, Iterable, Iterator

import numpy as np
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from data_builders.config import DataConfig, config_dict
from data_builders.sources import load_source
from data_builders.tokenizer import default_cache_dir, encode_pieces, train_bpe_tokenizer


def join_documents(passages: Iterable[list[int]], doc_len: int, separator: list[int]) -> Iterator[list[int]]:
    """Consecutive passages joined (with `separator`) until each document has >= doc_len tokens."""
    current: list[int] = []
    for ids in passages:
        current += ids + separator
        if len(current) >= doc_len:
            yield current
            current = []


def sample_windows(docs: list[np.ndarray], n: int, length: int, seed: int) -> list[dict[str, Any]]:
    """`n` windows: a uniformly drawn document, then a uniformly drawn start inside it."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        doc = docs[rng.randrange(len(docs))]
        start = rng.randrange(len(doc) - length + 1)
        ids = doc[start : start + length].tolist()
        rows.append({"input_ids": ids, "labels": ids, "id": f"window-{k}"})
    return rows


def build_windows(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[Dataset, Dataset, list[list[int]], PreTrainedTokenizerBase, dict[str, Any]]:
    """Train windows, held-out windows, held-out documents (Jacobian), the tokenizer, and build stats.

    Without a tokenizer, a BPE is trained on the source's passages.
    """
    source = load_source(cfg, default_cache_dir() / "hf", with_integration=False)  # windows ask no questions
    texts = source.train.passages + source.heldout.passages
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(texts, cfg.vocab_size)
    w = cfg.windows
    separator = encode_pieces(tokenizer, ["\n\n"])[0]
    docs = [np.asarray(d, dtype=np.int64) for d in join_documents(encode_pieces(tokenizer, texts), w.doc_len, separator)]
    (t0, t1), (e0, e1) = w.train_docs, w.eval_docs
    if max(t1, e1) > len(docs):
        raise ValueError(
            f"data.windows.train_docs={list(w.train_docs)} and data.windows.eval_docs={list(w.eval_docs)} must lie "
            f"within the {len(docs)} documents of >= {w.doc_len} tokens that data.source={cfg.source} gives"
        )
    train_docs, eval_docs = docs[t0:t1], docs[e0:e1]
    return (
        Dataset.from_list(sample_windows(train_docs, cfg.num_train, cfg.context_len, cfg.seed)),
        Dataset.from_list(sample_windows(eval_docs, cfg.num_eval, cfg.context_len, cfg.seed + 1)),
        [d.tolist() for d in eval_docs],
        tokenizer,
        {"documents": len(docs), "attribution": source.attribution, "config": config_dict(cfg)},
    )
