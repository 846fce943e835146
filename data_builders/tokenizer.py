"""Tokenizers: the pretrained model's own, or a byte-level BPE trained on the training corpus.

The offline tiny models have no hub tokenizer, so we train one with the `tokenizers` library on
the run's corpus. Training is deterministic for a given corpus and vocabulary size, and cached
by a hash of both, so every run on the same data reuses the same file.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from data_builders.files import atomic_dir

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def default_cache_dir() -> Path:
    """Where built tokenizers and datasets are cached (`POSDEBIAS_CACHE`, else ~/.cache/posdebias)."""
    return Path(os.environ.get("POSDEBIAS_CACHE", Path.home() / ".cache" / "posdebias"))


def train_bpe_tokenizer(texts: list[str], vocab_size: int, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """Train (or load from cache) a byte-level BPE on `texts`."""
    digest = hashlib.sha256(f"bpe-v1|{vocab_size}|".encode())
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    folder = (cache_dir or default_cache_dir()) / "tokenizers" / digest.hexdigest()[:16]
    if (folder / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(folder)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    # Concurrent runs never read a half-written folder; when two train the same one, the first stands
    # (training is deterministic, so both are identical).
    with atomic_dir(folder) as tmp:
        wrapped.save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(folder)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A pretrained model's tokenizer (hub id or local folder), with a pad token set."""
    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_pieces(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens, so pieces can be concatenated as ids."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
