"""The `data` config section: typed, nested by format, checked once by `validate_data` before any work.

Keys both formats read sit at the top (`data.context_len`, `data.source`, ...); keys of one format
live in its own section: `data.in2.*` (In2Config, IN2 assembly) and `data.windows.*` (WindowsConfig,
language-model windows). `data.context_len` is a sample's whole token budget in both: for IN2,
context + question + answer (with the chat template's pieces and eos); for lm_windows, the window.
A default is written once, here; the presets in conf/data/ hold only what differs from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from data_builders.question_split import NearDuplicates, QuestionSplit, check_near_duplicates, check_split

# Data files a `datasets` builder reads, by suffix (after any compression suffix is dropped).
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst"}


class DataSource(StrEnum):
    synthetic = "synthetic"  # embedded invented-entity documents (data_builders.synthetic), no download
    nq = "nq"  # NaturalQuestions-Open in the lost-in-the-middle JSON-lines format (data.path)
    hf = "hf"  # any `datasets`-readable file, or a hub dataset name, read through data.fields


class DataFormat(StrEnum):
    in2 = "in2"  # IN2 question samples (data_builders.in2)
    lm_windows = "lm_windows"  # language-model windows of long documents (data_builders.windows)


class In2Layout(StrEnum):
    """How an IN2 sample lays out its context (`data.in2.layout`)."""

    segments = "segments"  # IN2's: token-budget contexts of passage segments, the gold at any token offset
    # the mdqa probe's own prompt (data_builders.in2_mdqa): data.in2.n_docs whole titled documents
    # `Document [k](Title: T) text` with BM25 distractors, Liu et al.'s instruction, the question and `Answer:`;
    # the gold in one of the n_docs slots (data.source=nq only)
    mdqa = "mdqa"


class DepthLaw(StrEnum):
    """Where a training gold may start among a context's F free tokens (offset p in {0..F}, depth p / F)."""

    uniform = "uniform"  # every offset alike (IN2's law)
    ends = "ends"  # the first or last `depth_ends` share of the offsets only: ordinary data's U (FILM's story)
    beta = "beta"  # p / F ~ Beta(a, b) (`depth_beta`): Beta(0.5, 0.5) favours the ends, Beta(2, 2) the middle
    # density ∝ p(d)^(-prior_power), p the closed-form prior at depth d (data_builders.depth_prior) of a
    # model with `prior_layers` layers and residual weight `prior_alpha`: most golds where the prior is lowest
    valley = "valley"


@dataclass
class TaskMix:
    """Share of each IN2 task among the samples (normalized to sum to 1)."""

    fine_grained: float = 1.0  # one answer-bearing segment in a long context
    integration: float = 0.0  # two or three segments, each placed independently
    short_qa: float = 0.0  # the question with its evidence only (keeps short-context skills)


@dataclass
class FieldMap:
    """Where each item lives in a record of an `hf` source; dotted paths reach nested fields (ctxs.0.text)."""

    question: str = "question"
    answers: str = "answers"  # a string or a list of strings
    evidence: str = "evidence"  # a passage, or a list of passages (two or more: an integration question)
    title: Optional[str] = None  # title(s) written on the line before the evidence passage(s)
    filler: Optional[str] = None  # distractor passage(s) carried by each record


@dataclass
class In2Config:
    """`data.in2.*`: what only IN2 assembly (and the loss on its samples) reads."""

    segment_len: int = 64  # longest segment in tokens; longer passages are cut at sentence ends
    # when set, budgets are uniform in [context_len_min, data.context_len]; a chat template's own tokens come on top
    # of the minimum
    context_len_min: Optional[int] = None
    context_lens: list[int] = field(default_factory=list)  # when set, each budget is drawn from these lengths
    # Short contexts first: over the first `curriculum` share of the training split the largest budget
    # grows (quadratically) from context_len_min to data.context_len; training reads it in order (eval unchanged).
    curriculum: float = 0.0
    tasks: TaskMix = field(default_factory=TaskMix)  # task mix (the eval split leaves short_qa out)
    instruction: Optional[str] = None  # FILM-style instruction line between the context and the question
    chat_template: bool = False  # wrap context + question in the tokenizer's chat template (user turn)
    # Cloze prompts (synthetic facts only, no chat template): the prompt ends with the fact's opening words
    # ("Answer: Kamir works as a"), so retrieval is an in-context copy a random-init model, which cannot
    # read yet, learns in minutes. Models that read want plain "Answer:" prompts, as in IN2 and the probes;
    # the model's recipe (conf/recipe/) sets it.
    answer_lead: bool = False
    label_context: bool = False  # train with LM loss on every token, not only the answer (random-init models)
    # Where training golds go; held-out samples stay uniform, so accuracy by depth compares across runs.
    depth_law: DepthLaw = DepthLaw.uniform
    depth_ends: float = 0.2  # ends: the share of the offsets at each end that golds may take, in (0, 0.5]
    depth_beta: list[float] = field(default_factory=lambda: [0.5, 0.5])  # beta: its (a, b), both > 0
    prior_layers: Optional[int] = None  # valley: the model's layer count H (required)
    prior_alpha: float = 0.5  # valley: the prior's residual weight a
    prior_power: float = 1.0  # valley: the exponent beta of p(d)^(-beta)
    # The law ramps in from uniform over this share of the training split (a sample i in stored order follows
    # it with probability min(1, i / (depth_ramp * num_train))); training then reads the split in that order.
    depth_ramp: float = 0.0
    heldout_doc_len: int = 2048  # held-out documents are concatenated up to this length for the Jacobian
    # segments: IN2's contexts; mdqa: each sample is the mdqa probe's prompt over `n_docs` whole documents, the gold
    # in a uniformly drawn slot (depth = slot / (n_docs - 1)), distractors the passages BM25 ranks highest among
    # the split's own passages (none holding an answer), the target an answer alias the gold holds as whole words
    layout: In2Layout = In2Layout.segments
    n_docs: int = 10  # layout=mdqa: documents per sample (the evaluation's 10 by default)
    # layout=mdqa: also record each sample's teacher prompt (`teacher_prompt_ids`): the same documents and question
    # with the gold moved to this slot, the distractors in their order (debias=pos2distill's teacher); and the
    # sample's gold slot (`gold_slot`). None = off; -1 = the last slot (n_docs - 1)
    teacher_slot: Optional[int] = None
    # layout=mdqa: also record each sample's prompt with the gold moved to each of these slots
    # (`teacher_candidate_ids`, in this order; -1 = the last), among which debias=pos2distill_best takes the teacher
    # where the starting model's gold log p is highest; and the sample's gold slot. [] = off
    teacher_candidates: list[int] = field(default_factory=list)

    @property
    def teacher_slot_index(self) -> Optional[int]:
        """`teacher_slot` as a slot index in [0, n_docs) (-1 = the last), None when off."""
        if self.teacher_slot is None:
            return None
        return self.n_docs - 1 if self.teacher_slot == -1 else self.teacher_slot

    @property
    def teacher_candidate_indices(self) -> list[int]:
        """`teacher_candidates` as slot indices in [0, n_docs) (-1 = the last)."""
        return [self.n_docs - 1 if slot == -1 else slot for slot in self.teacher_candidates]


@dataclass
class WindowsConfig:
    """`data.windows.*`: documents and their split for language-model windows (data.format=lm_windows)."""

    doc_len: int = 4096  # passages joined into documents of at least this many tokens
    train_docs: list[int] = field(default_factory=lambda: [0, 50])  # [first, last) documents windows train on
    eval_docs: list[int] = field(default_factory=lambda: [50, 60])  # [first, last) held-out ones (eval, Jacobian)


@dataclass
class DataConfig:
    """`data.*`: the source, sizes and caching both formats share; each format's own keys in its section."""

    name: str = "in2_synthetic"
    source: DataSource = DataSource.synthetic
    format: DataFormat = DataFormat.in2
    path: Optional[str] = None  # data file of a file-based source (hub dataset name for hf)
    context_len: int = 256  # a sample's total token budget (in2: context + question + answer, the largest if drawn)
    num_train: int = 20000  # training samples
    num_eval: int = 200  # held-out samples (eval loss, and accuracy by depth for in2)
    num_train_docs: int = 4000  # source documents (evidence passages) in the training part
    num_eval_docs: int = 400  # held-out source documents (eval samples, Jacobian sequences)
    vocab_size: int = 1024  # BPE vocabulary when the model has no tokenizer of its own
    seed: int = 0
    prebuilt: Optional[str] = None  # folder written by scripts/build_dataset.py: load it instead of building
    cache: bool = True  # reuse pools and finished builds under default_cache_dir()
    num_proc: Optional[int] = None  # tokenization processes; None = one per 20k passages, up to the CPUs
    fields: FieldMap = field(default_factory=FieldMap)  # record fields of an hf source
    hf_config: Optional[str] = None  # configuration name of an hf hub dataset
    hf_split: str = "train"  # split of an hf hub dataset
    filler_path: Optional[str] = None  # extra distractor text: a .txt file, or a data file with filler_field
    filler_field: str = "text"  # text column of a non-.txt filler_path
    # data.source=nq: which questions are evaluation questions (data_builders.question_split); they and their
    # gold passages are held out (up to num_eval_docs passages) and never trained on
    nq_split: QuestionSplit = field(default_factory=QuestionSplit)
    # data.source=nq: training records kept out for being near an evaluation question (a near-identical passage, or
    # the same answer to a near-identical question); off by default (data_builders.question_split.NearDuplicates)
    near_duplicates: NearDuplicates = field(default_factory=NearDuplicates)
    # Batching, not building: samples packed end to end into rows of pack_len tokens (None = context_len),
    # no attention across samples (data_builders.collate); trainer.micro_batch_size counts rows.
    packing: bool = False
    pack_len: Optional[int] = None
    in2: In2Config = field(default_factory=In2Config)
    windows: WindowsConfig = field(default_factory=WindowsConfig)


# data.in2 keys of run configs saved before the prior's weight had one name set (debias.prior_alpha/prior_power too).
RENAMED_IN2_KEYS = {"valley_layers": "prior_layers", "valley_alpha": "prior_alpha", "valley_power": "prior_power"}


def as_data_config(cfg: Any) -> DataConfig:
    """A typed DataConfig from a DataConfig, an OmegaConf node (e.g. `cfg.data`, also of an older run's saved
    config, whose renamed keys are read under their new names) or a plain dict."""
    if isinstance(cfg, DataConfig):
        return cfg
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg)
    in2 = node.get("in2")
    for old, new in RENAMED_IN2_KEYS.items():
        if in2 is not None and old in in2:
            in2[new] = in2.pop(old)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), node))


def config_dict(cfg: DataConfig) -> dict[str, Any]:
    """The config as plain nested dicts (choices as their strings), for fingerprints and build.json."""

    def plain(items: list[tuple[str, Any]]) -> dict[str, Any]:
        return {k: v.value if isinstance(v, Enum) else v for k, v in items}

    return dataclasses.asdict(cfg, dict_factory=plain)


def is_file_path(path: str) -> bool:
    """A path with a data-file suffix (possibly compressed), as opposed to a hub dataset name."""
    suffixes = [s for s in Path(path).suffixes if s not in COMPRESSION_SUFFIXES]
    return bool(suffixes) and suffixes[-1] in FILE_FORMATS


def check_paths(source: str, path: Optional[str], filler_path: Optional[str]) -> None:
    """Fail at start-up, naming the key and the path, when a configured data file does not exist."""
    if source in (DataSource.nq, DataSource.hf) and not path:
        raise ValueError(f"data.source={source} needs data.path (a data file, or a hub dataset name for hf)")
    local = [("data.path", path)] if source == DataSource.nq or (source == DataSource.hf and is_file_path(path)) else []
    for key, p in local + ([("data.filler_path", filler_path)] if filler_path else []):
        if not Path(p).exists():
            raise FileNotFoundError(f"{key}: data file not found: {p}")


def _choice(key: str, value: Any, kind: type[StrEnum]) -> None:
    # Composed configs are checked by OmegaConf already; a DataConfig built in Python is not.
    if value not in [m.value for m in kind]:
        raise ValueError(f"{key}={value!r} is not known (known: {', '.join(m.value for m in kind)})")


# data.in2 settings of the segment layout that data.in2.layout=mdqa has no use for (its samples are n_docs whole
# documents in the mdqa probe's prompt, the gold slot uniform): set, they would be silently ignored. (answer_lead,
# a model recipe's, is not among them: NQ questions have no answer lead in either layout.)
SEGMENT_ONLY = ("context_len_min", "context_lens", "curriculum", "tasks", "instruction", "depth_law", "depth_ramp")


def _validate_mdqa_layout(cfg: DataConfig) -> None:
    c = cfg.in2
    if c.n_docs < 2:
        raise ValueError(f"data.in2.n_docs={c.n_docs} must be >= 2 (the gold and at least one distractor)")
    if cfg.source != DataSource.nq:
        raise ValueError(f"data.in2.layout=mdqa renders NQ's titled passages as the mdqa probe does: it needs "
                         f"data.source=nq (got {cfg.source})")
    if cfg.filler_path:
        raise ValueError("data.in2.layout=mdqa draws its distractors from the source's titled passages: "
                         f"data.filler_path={cfg.filler_path} has no titles; leave it unset")
    default, unused = In2Config(), []
    for name in SEGMENT_ONLY:
        value, base = getattr(c, name), getattr(default, name)
        if dataclasses.is_dataclass(value):
            unused += _changed(value, base, f"data.in2.{name}")
        elif value != base:
            unused.append(f"data.in2.{name}={value}")
    if unused:
        raise ValueError(f"data.in2.layout=mdqa does not use {', '.join(unused)}: its samples are the mdqa "
                         f"probe's prompt over data.in2.n_docs={c.n_docs} whole documents, the gold slot uniform; "
                         "leave them at their defaults (as data=in2_nq_mdqa does)")


def _validate_teacher_candidates(c: In2Config) -> None:
    if not c.teacher_candidates:
        return
    key = f"data.in2.teacher_candidates={list(c.teacher_candidates)}"
    if c.layout != In2Layout.mdqa:
        raise ValueError(f"{key}: teacher prompts move the gold among whole documents, which only "
                         f"data.in2.layout=mdqa has (got {c.layout}); leave it empty")
    if c.teacher_slot is not None:
        raise ValueError(f"{key} with data.in2.teacher_slot={c.teacher_slot}: one teacher slot, or candidates to "
                         "choose it from per sample, not both")
    if any(isinstance(s, bool) or not -1 <= s < c.n_docs for s in c.teacher_candidates):
        raise ValueError(f"{key}: each must be a slot in [0, data.in2.n_docs={c.n_docs}) or -1 (the last)")
    if len(set(c.teacher_candidate_indices)) != len(c.teacher_candidates):
        raise ValueError(f"{key} names a slot twice (-1 is slot {c.n_docs - 1})")


def _validate_teacher_slot(c: In2Config) -> None:
    if c.teacher_slot is None:
        return
    if c.layout != In2Layout.mdqa:
        raise ValueError(f"data.in2.teacher_slot={c.teacher_slot}: teacher prompts move the gold among whole "
                         f"documents, which only data.in2.layout=mdqa has (got {c.layout}); leave it unset")
    if isinstance(c.teacher_slot, bool) or not -1 <= c.teacher_slot < c.n_docs:
        raise ValueError(f"data.in2.teacher_slot={c.teacher_slot!r} must be a slot in [0, data.in2.n_docs={c.n_docs}) "
                         "or -1 (the last)")


def _validate_in2(cfg: DataConfig) -> None:
    c = cfg.in2
    _choice("data.in2.layout", c.layout, In2Layout)
    if c.layout == In2Layout.mdqa:
        _validate_mdqa_layout(cfg)
    _validate_teacher_slot(c)
    _validate_teacher_candidates(c)
    shares = vars(c.tasks)
    if any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"data.in2.tasks must be non-negative with a positive sum, got {shares}")
    if c.context_lens and c.context_len_min is not None:
        raise ValueError("set data.in2.context_lens (a set) or data.in2.context_len_min (a range), not both")
    if c.context_lens and max(c.context_lens) > cfg.context_len:
        raise ValueError(f"data.in2.context_lens has {max(c.context_lens)}, more than data.context_len={cfg.context_len}")
    if c.context_len_min is not None and not 0 < c.context_len_min <= cfg.context_len:
        raise ValueError(f"data.in2.context_len_min={c.context_len_min} must be in (0, data.context_len={cfg.context_len}]")
    _choice("data.in2.depth_law", c.depth_law, DepthLaw)
    if not 0 < c.depth_ends <= 0.5:
        raise ValueError(f"data.in2.depth_ends={c.depth_ends} must be a share of the offsets at each end, in (0, 0.5]")
    if len(c.depth_beta) != 2 or min(c.depth_beta) <= 0:
        raise ValueError(f"data.in2.depth_beta={list(c.depth_beta)} must be two positive numbers (a, b)")
    if c.depth_law == DepthLaw.valley and (c.prior_layers is None or c.prior_layers < 1):
        raise ValueError(f"data.in2.depth_law=valley needs data.in2.prior_layers >= 1, the model's layer count "
                         f"(got {c.prior_layers})")
    if not 0 < c.prior_alpha < 1:
        raise ValueError(f"data.in2.prior_alpha={c.prior_alpha} must be in (0, 1)")
    if not 0 <= c.depth_ramp <= 1:
        raise ValueError(f"data.in2.depth_ramp={c.depth_ramp} must be a share of the training split, in [0, 1]")
    if not 0 <= c.curriculum <= 1:
        raise ValueError(f"data.in2.curriculum={c.curriculum} must be a share of the training split, in [0, 1]")
    if c.curriculum and c.context_len_min is None:
        raise ValueError("data.in2.curriculum ramps budgets up from data.in2.context_len_min: set it")
    smallest = min(c.context_lens) if c.context_lens else (c.context_len_min or cfg.context_len)
    if not 0 < c.segment_len < smallest:
        raise ValueError(
            f"data.in2.segment_len={c.segment_len} must be positive and smaller than the smallest context "
            f"length ({smallest})"
        )


def _validate_windows(cfg: DataConfig) -> None:
    w = cfg.windows
    for key in ("train_docs", "eval_docs"):
        first_last = list(getattr(w, key))
        if len(first_last) != 2 or not 0 <= first_last[0] < first_last[1]:
            raise ValueError(f"data.windows.{key}={first_last} must be a non-empty [first, last) range")
    (t0, t1), (e0, e1) = w.train_docs, w.eval_docs
    if max(t0, e0) < min(t1, e1):
        raise ValueError(f"data.windows.train_docs={list(w.train_docs)} and data.windows.eval_docs="
                         f"{list(w.eval_docs)} overlap: a held-out document would be trained on")
    if w.doc_len < cfg.context_len:
        raise ValueError(f"data.windows.doc_len={w.doc_len} must be >= data.context_len={cfg.context_len} (the window)")


def validate_data(cfg: DataConfig) -> None:
    """Fail at start-up, naming the key, on settings that cannot give a sample, before anything is loaded."""
    _choice("data.source", cfg.source, DataSource)
    _choice("data.format", cfg.format, DataFormat)
    if cfg.prebuilt:  # the folder holds the samples; the settings that built them are not needed
        if not Path(cfg.prebuilt).is_dir():
            raise FileNotFoundError(f"data.prebuilt: no such folder: {cfg.prebuilt}")
        return
    for key in ("context_len", "num_train", "num_eval"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"data.{key}={getattr(cfg, key)} must be >= 1")
    if cfg.pack_len is not None and cfg.pack_len < cfg.context_len:
        raise ValueError(f"data.pack_len={cfg.pack_len} is shorter than data.context_len={cfg.context_len}, "
                         "a sample's budget: a longest sample would fit no pack")
    if cfg.format == DataFormat.in2:
        _validate_in2(cfg)
    else:
        _validate_windows(cfg)
    check_split(cfg.nq_split, "data.nq_split")
    check_near_duplicates(cfg.near_duplicates)
    check_paths(cfg.source, cfg.path, cfg.filler_path)


def ignored_settings(cfg: DataConfig) -> list[str]:
    """`data.<section>.key=value` of every changed setting in the sections that `cfg.format` and `cfg.source`
    do not use (`data.nq_split` is read by the nq source only)."""
    unused = ["windows" if cfg.format == DataFormat.in2 else "in2"]
    unused += ["nq_split", "near_duplicates"] if cfg.source != DataSource.nq else []
    return [s for name in unused for s in _changed(getattr(cfg, name), type(getattr(cfg, name))(), f"data.{name}")]


def _changed(section: Any, default: Any, prefix: str) -> list[str]:
    """`key=value` of every setting in `section` that differs from `default` (nested sections walked)."""
    out = []
    for f in dataclasses.fields(section):
        value, base = getattr(section, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out += _changed(value, base, f"{prefix}.{f.name}")
        elif value != base:
            out.append(f"{prefix}.{f.name}={value}")
    return out
