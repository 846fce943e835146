"""The data entry point: `build_datasets(cfg.data, tokenizer)` -> DataBundle, whatever the format.

It validates the config, then loads a prebuilt folder (`data.prebuilt`), or builds the format's
splits: IN2 samples (data_builders.in2) or language-model windows (data_builders.windows). A
finished IN2 build is cached under default_cache_dir()/in2/<fingerprint>, in the prebuilt-folder
format that scripts/build_dataset.py writes: save_to_disk splits, tokenizer/, HELDOUT_FILE, BUILD_FILE. BUILD_FILE
records the size of every other file, so a folder cut short (a full disk, a copy killed half-way) is found: a cached
build is then built again (logged), a `data.prebuilt` folder fails naming the file.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
from datasets import Dataset, DatasetDict, DatasetInfo, load_from_disk
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from data_builders.config import (
    DataConfig,
    DataFormat,
    In2Config,
    In2Layout,
    as_data_config,
    config_dict,
    ignored_settings,
    validate_data,
)
from data_builders.files import atomic_dir
from data_builders.in2 import build_in2, make_format
from data_builders.in2_mdqa import build_in2_mdqa, record_features
from data_builders.pools import tokenizer_digest
from data_builders.sources import file_identity
from data_builders.tokenizer import CACHE_ADVICE, default_cache_dir
from data_builders.windows import build_windows

log = logging.getLogger(__name__)
BUILD_FILE = "build.json"
HELDOUT_FILE = "heldout_docs.json"
# The code an IN2 build's bytes depend on: a change in any of these files gives a new fingerprint.
_CODE = ("in2.py", "pools.py", "question_split.py", "sources.py", "synthetic.py", "text.py", "tokenizer.py")
# ... and, for data.in2.layout=mdqa, the probe's renderer, retriever and template too
_MDQA_CODE = ("in2_mdqa.py", "mdqa.py", "probes.py", "templates/mdqa.txt")


@dataclass
class DataBundle:
    train: Dataset
    eval: Dataset
    heldout_docs: list[list[int]]  # token ids of long held-out documents (Jacobian sequences)
    tokenizer: PreTrainedTokenizerBase
    stats: dict[str, Any] = field(default_factory=dict)  # counts, skips, fingerprints (the dataset card)


def train_documents(bundle: DataBundle, min_len: int, n: int) -> list[np.ndarray]:
    """Up to `n` training texts of >= `min_len` tokens, in split order (`jacobian.chunked_source=train`).

    A bundle keeps its training samples, not the documents they were cut from, so a training text is
    the part of one sample that is training-document tokens: a language-model window whole (a
    contiguous excerpt of one training document), or an IN2 sample's context (training-pool segments
    in the order the model reads them; the chat prefix, question, answer and eos are left out).
    """
    ds = bundle.train
    in2 = "context_tokens" in ds.column_names
    start = len(_chat_prefix(bundle)) if in2 else 0  # the same prefix opens every IN2 sample
    found: list[np.ndarray] = []
    for batch in ds.select_columns(["input_ids", "context_tokens"] if in2 else ["input_ids"]).iter(batch_size=256):
        lengths = batch["context_tokens"] if in2 else [len(ids) for ids in batch["input_ids"]]
        found += [np.asarray(ids[start:start + c], np.int64) for ids, c in zip(batch["input_ids"], lengths)
                  if c >= min_len]
        if len(found) >= n:
            break
    return found[:n]


def _chat_prefix(bundle: DataBundle) -> np.ndarray:
    """The chat-template tokens before an IN2 sample's context, from the settings the bundle was built with."""
    chat = bundle.stats.get("config", {}).get("in2", {}).get("chat_template")
    if chat is None:
        raise ValueError(f"training text of IN2 samples: the bundle has no build settings ({BUILD_FILE} of a "
                         "prebuilt folder), which say whether a chat prefix opens each sample")
    # The prefix depends on the tokenizer and data.in2.chat_template only.
    return make_format(bundle.tokenizer, DataConfig(in2=In2Config(chat_template=chat))).prefix


def _hash_array(h, array: pa.Array) -> None:
    if pa.types.is_list(array.type):
        h.update(array.value_lengths().to_numpy(zero_copy_only=False).tobytes())
        _hash_array(h, array.flatten())
    elif pa.types.is_string(array.type):
        h.update("\0".join(array.to_pylist()).encode())
    else:
        h.update(array.to_numpy(zero_copy_only=False).tobytes())


def dataset_digest(ds: Dataset) -> str:
    """Hash of a dataset's content (column names, types and values), independent of its Arrow chunking."""
    h = hashlib.sha256()
    table = ds.data.table if ds._indices is None else ds.flatten_indices().data.table
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        h.update(f"{name}:{column.type}".encode())
        _hash_array(h, column)
    return h.hexdigest()[:16]


def build_key(cfg: DataConfig, tokenizer: Optional[PreTrainedTokenizerBase]) -> str:
    """Fingerprint of an IN2 build: config, input files, tokenizer and the builder code itself."""
    skip = ("cache", "num_proc", "prebuilt", "format", "windows", "packing", "pack_len")  # no effect on the bytes
    settings = {k: v for k, v in config_dict(cfg).items() if k not in skip}
    mdqa = cfg.in2.layout == In2Layout.mdqa
    if not mdqa:  # the segment layout's bytes do not depend on them: its fingerprints stay those of before them
        settings["in2"] = {k: v for k, v in settings["in2"].items() if k not in ("layout", "n_docs")}
    if cfg.in2.teacher_slot_index is None:  # off: builds keep the fingerprints of before the setting
        settings["in2"].pop("teacher_slot", None)
    else:  # -1 and n_docs - 1 are the same slot, the same bytes
        settings["in2"]["teacher_slot"] = cfg.in2.teacher_slot_index
    if cfg.in2.teacher_candidates:
        settings["in2"]["teacher_candidates"] = cfg.in2.teacher_candidate_indices
    else:
        settings["in2"].pop("teacher_candidates", None)
    here = Path(__file__).resolve().parent
    code = [(here / name).read_bytes() for name in _CODE + (_MDQA_CODE if mdqa else ())]
    return Hasher.hash([
        settings, file_identity(cfg.path), file_identity(cfg.filler_path),
        tokenizer_digest(tokenizer) if tokenizer is not None else "bpe", code,
    ])


def _build_in2(cfg: DataConfig, tokenizer: Optional[PreTrainedTokenizerBase], key: str) -> DataBundle:
    build = build_in2_mdqa if cfg.in2.layout == In2Layout.mdqa else build_in2
    tables, heldout, tokenizer, stats = build(cfg, tokenizer)
    splits = {
        name: Dataset(InMemoryTable(table), info=DatasetInfo(features=record_features(cfg)),
                      fingerprint=Hasher.hash([key, name]))
        for name, table in tables.items()
    }
    stats = {"fingerprint": key, **stats, "digest": {s: dataset_digest(ds) for s, ds in splits.items()}}
    return DataBundle(splits["train"], splits["eval"], heldout, tokenizer, stats)


def save_built(bundle: DataBundle, folder: Path, replace: bool = False) -> None:
    """Write a bundle as a prebuilt folder: save_to_disk splits, tokenizer/, heldout docs, build.json.

    The folder appears whole or not at all (data_builders.files.atomic_dir); an existing one is kept
    unless `replace`, so a concurrent writer's identical build stands.
    """
    with atomic_dir(Path(folder), replace=replace, advice=CACHE_ADVICE) as tmp:
        DatasetDict({"train": bundle.train, "eval": bundle.eval}).save_to_disk(str(tmp))
        bundle.tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / HELDOUT_FILE).write_text(json.dumps(bundle.heldout_docs))
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / BUILD_FILE).write_text(json.dumps({**bundle.stats, "files": files}, indent=1, sort_keys=True))


class DamagedBuild(ValueError):
    """A built dataset folder with a file missing, cut short or unreadable; the message names it."""


def _load_built(folder: Path, tokenizer: Optional[PreTrainedTokenizerBase]) -> DataBundle:
    """The bundle of a built folder; DamagedBuild naming the file that is missing, of another size than BUILD_FILE
    recorded, or unreadable."""
    try:
        stats = json.loads((folder / BUILD_FILE).read_text()) if (folder / BUILD_FILE).exists() else {}
        for name, size in stats.get("files", {}).items():
            path = folder / name
            if not path.is_file():
                raise DamagedBuild(f"{path} is missing")
            if path.stat().st_size != size:
                raise DamagedBuild(f"{path} has {path.stat().st_size} bytes, {size} were written")
        splits = load_from_disk(str(folder))
        saved = AutoTokenizer.from_pretrained(folder / "tokenizer")
        heldout = json.loads((folder / HELDOUT_FILE).read_text())
    except (OSError, ValueError) as err:  # pyarrow reports a stream cut short as an OSError or ArrowInvalid
        if isinstance(err, DamagedBuild):
            raise
        raise DamagedBuild(f"{folder} is unreadable ({err})") from err
    if tokenizer is not None and tokenizer.get_vocab() != saved.get_vocab():
        raise ValueError(f"data.prebuilt={folder} was built with another tokenizer than the model's")
    return DataBundle(splits["train"], splits["eval"], heldout, tokenizer or saved, stats)


def load_prebuilt(folder: str | Path, tokenizer: Optional[PreTrainedTokenizerBase] = None) -> DataBundle:
    """A bundle from a prebuilt folder; a given tokenizer must have the vocabulary it was built with."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"data.prebuilt: no such folder: {folder}")
    for name in ("dataset_dict.json", "tokenizer", HELDOUT_FILE):
        if not (folder / name).exists():
            raise FileNotFoundError(f"data.prebuilt: {folder / name} is missing (not a built dataset folder)")
    try:
        return _load_built(folder, tokenizer)
    except DamagedBuild as err:
        raise ValueError(f"data.prebuilt: {err}: the folder is damaged or cut short; build it again "
                         "(python -m scripts.build_dataset) or copy it again") from None


def built_with(cfg: DataConfig) -> DataConfig:
    """The settings the data of `cfg` is built with: a prebuilt folder's (its build.json), else `cfg` itself
    (also for a folder without build.json, whose settings are unknown)."""
    card = Path(cfg.prebuilt) / BUILD_FILE if cfg.prebuilt else None
    if card is None or not card.is_file():
        return cfg
    return as_data_config(json.loads(card.read_text())["config"])


def build_datasets(cfg: Any, tokenizer: Optional[PreTrainedTokenizerBase] = None) -> DataBundle:
    """Train and held-out splits of `cfg` (a DataConfig, or the `data` node of a composed config).

    Without a tokenizer, a BPE is trained on the training corpus. With `cfg.prebuilt` the folder is
    loaded instead. With `cfg.cache` a finished IN2 build is stored under default_cache_dir()/in2/<fingerprint>
    and an identical later call loads it.
    """
    cfg = as_data_config(cfg)
    validate_data(cfg)
    if ignored := ignored_settings(cfg):  # said once per build instead of silently ignored
        log.warning("data.format=%s data.source=%s does not use these settings: %s", cfg.format, cfg.source,
                    ", ".join(ignored))
    if cfg.prebuilt:
        return load_prebuilt(cfg.prebuilt, tokenizer)
    if cfg.format == DataFormat.lm_windows:
        return DataBundle(*build_windows(cfg, tokenizer))
    key = build_key(cfg, tokenizer)
    folder = default_cache_dir() / "in2" / key
    damaged = False
    if cfg.cache and (folder / BUILD_FILE).exists():
        try:
            return _load_built(folder, tokenizer)
        except DamagedBuild as err:
            log.warning("the dataset cache %s is damaged (%s): building it again", folder, err)
            damaged = True
    bundle = _build_in2(cfg, tokenizer, key)
    if not cfg.cache:
        return bundle
    save_built(bundle, folder, replace=damaged)
    return load_prebuilt(folder, bundle.tokenizer if tokenizer is None else tokenizer)
