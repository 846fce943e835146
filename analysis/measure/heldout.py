"""Held-out text for Jacobian measurements outside training: documents of a checkpoint's own tokens.

`analysis.compare` measures the profiles of a checkpoint whose run recorded none, and `analysis.rollout_study`
the profiles it compares with the rollouts, on these documents: NQ long answers when a data folder has them,
else synthetic documents with other names than the default training data.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from data_builders.probes import NQ_FILE, nq_filler
from data_builders.synthetic import generate_documents
from data_builders.tokenizer import encode_pieces
from data_builders.windows import join_documents

HELDOUT_SEED = 7919  # synthetic documents for measured profiles: other names than the default training data


class HeldoutError(ValueError):
    """The held-out text gives fewer documents than asked; the message says how many of what size."""


def _synthetic_texts() -> Iterator[str]:
    """Endless synthetic documents, in batches with successive seeds."""
    for seed in itertools.count(HELDOUT_SEED):
        # The prefix names the documents' entities: "compare", where they were first drawn, keeps them the same.
        yield from (doc.text for doc in generate_documents(1000, seed, prefix="compare"))


def heldout_documents(
    tokenizer: PreTrainedTokenizerBase, data_dir: str | Path | None, doc_len: int, n_docs: int
) -> tuple[list[list[int]], str]:
    """`n_docs` documents of `doc_len` tokens (consecutive passages joined by newlines) and their source.

    Raises HeldoutError when the text runs out first.
    """
    nq = Path(data_dir) / NQ_FILE if data_dir is not None else None
    if nq is not None and nq.is_file():
        texts, source = iter(nq_filler(nq)), "NQ long answers"
    else:
        texts, source = _synthetic_texts(), "synthetic documents"
    separator = encode_pieces(tokenizer, ["\n"])[0]
    # Tokenize in batches of 256 passages, only as many as the documents need.
    passages = itertools.chain.from_iterable(
        encode_pieces(tokenizer, batch) for batch in iter(lambda: list(itertools.islice(texts, 256)), [])
    )
    docs = [d[:doc_len] for d in itertools.islice(join_documents(passages, doc_len, separator), n_docs)]
    if len(docs) == n_docs:
        return docs, source
    raise HeldoutError(f"{source} give {len(docs)} documents of {doc_len} tokens, {n_docs} are needed")
