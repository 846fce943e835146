"""What a position-wise evaluation asks: the probes, their settings and metrics (`eval.*` of a run).

`EvalConfig` is the `eval` config group; `KVProbeConfig`, `MDQAProbeConfig` and `NeedleProbeConfig` its
probes' sections. `probe_budget`, `probe_metric` and `probe_source` say what each probe generates, how it
is scored and which file it reads; `check_probes` fails at start-up on a probe it cannot build or a
missing file, naming its key, and `check_mdqa_questions` when mdqa would ask a question the model trains on.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Callable, Optional, Sequence

from analysis.evaluation.scoring import (
    best_subspan_em,
    exact_match,
    first_line,
    label_or_description,
    name_in_output,
    substring_match,
    whole_word_subspan_em,
    word_recall,
)
from data_builders.config import DataConfig, DataFormat, DataSource
from data_builders.files import expand_paths
from data_builders.mdqa import Distractors
from data_builders.probes import HELDOUT_POOL, KV_FILE, NQ_FILE, Order, check_mdqa_pool
from data_builders.question_split import DEV_SHARE, EvaluationPart, QuestionSplit, check_split
from data_builders.valprobing import PIECES_DIR, PIECES_FILES, Task, shape_of

Scorer = Callable[[str, Sequence[str]], float]


@dataclass(frozen=True)
class Metric:
    """A scorer under the name its numbers are reported with, and where its definition comes from."""

    name: str
    score: Scorer
    definition: str


def _qa_best_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    return best_subspan_em(first_line(prediction), answers)


def _qa_whole_word_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    return whole_word_subspan_em(first_line(prediction), answers)


METRICS = {
    m.name: m
    for m in (
        Metric("substring_match", substring_match,
               "the answer occurs in the whole generation, ignoring case (the reference's kv scorer, "
               "scripts/evaluate_kv_responses.py)"),
        Metric("best_subspan_em", _qa_best_subspan_em,
               "a SQuAD-normalized answer is a substring of the normalized first line of the stripped "
               "generation (the reference's QA metric, lost_in_the_middle.metrics.best_subspan_em)"),
        Metric("whole_word_subspan_em", _qa_whole_word_subspan_em,
               "a normalized answer is a run of whole words of the normalized first line (stricter than "
               "the reference's best_subspan_em: not comparable with published numbers)"),
        Metric("exact_match", exact_match,
               "the first line of the generation normalizes to an answer (IN2 questions, trained to answer alone)"),
        Metric("word_recall", word_recall,
               "the share of the gold sentence's distinct lower-cased whitespace-split words in the whole generation "
               "(VaLProbing's document score, FILM's plot.py)"),
        Metric("name_in_output", name_in_output,
               "the gold function name, dots stripped, occurs in the whole generation, case-sensitive "
               "(VaLProbing's code score, FILM's plot.py)"),
        Metric("label_or_description", label_or_description,
               "the gold label or description, dots stripped, occurs in the whole generation, ignoring case "
               "(VaLProbing's database score, FILM's plot.py)"),
    )
}
VALPROBING_METRIC = {Task.document: "word_recall", Task.code: "name_in_output", Task.database: "label_or_description"}


class Probe(StrEnum):
    """Every position-wise probe (what each asks: `description`); `eval.probes` takes all but in2 (scored whenever
    the data is IN2)."""

    kv = "kv"
    mdqa = "mdqa"
    needle = "needle"
    in2 = "in2"
    valprobing_document = Task.document.probe
    valprobing_code = Task.code.probe
    valprobing_database = Task.database.probe

    @property
    def valprobing_task(self) -> Task | None:
        return next((t for t in Task if t.probe == self.value), None)

    @property
    def description(self) -> str:
        """What the probe asks, and what its position is (one line: `posdebias ls` lists them)."""
        if (task := self.valprobing_task) is not None:
            return (f"VaLProbing's {task} task (FILM; needs data_dir or eval.valprobing.path): the gold piece's "
                    "bin")
        return {
            Probe.kv: "key-value retrieval (Liu et al. 2023): the gold pair's index",
            Probe.mdqa: "multi-document QA over NQ (needs data_dir or eval.mdqa.path): the gold document's index",
            Probe.needle: "a code hidden at a depth of filler text, per context length",
            Probe.in2: "held-out IN2 records of a run (its run config rebuilds them): the gold depth bin",
        }[self]


PROBES = tuple(Probe)
VALPROBING = tuple(p for p in Probe if p.valprobing_task is not None)
# What a report asks when no probe is named: the probes that need no data folder's own files (VaLProbing does).
DEFAULT_PROBES = tuple(p for p in Probe if p not in VALPROBING)
POSITION_AXIS = {  # what a probe's position is, for figure axes
    Probe.kv: "gold key-value pair index",
    Probe.mdqa: "gold document index",
    Probe.needle: "needle depth",
    Probe.in2: "gold depth bin (lower edge)",
    **{p: "bin of the gold piece (its first piece)" for p in VALPROBING},
}


class MDQAQuestions(StrEnum):
    all = "all"  # every question of the file, as the reference asks them
    heldout = "heldout"  # only the evaluation questions of eval.mdqa.split (data_builders.question_split)
    dev = "dev"  # the dev part of those (choose settings here; data_builders.question_split.evaluation_part)
    test = "test"  # the test part of those (report here: no choice looked at it)

    @property
    def held_out(self) -> bool:
        """Asks evaluation questions only (all of them, or one part)."""
        return self != MDQAQuestions.all

    @property
    def part(self) -> EvaluationPart | None:
        return EvaluationPart(self.value) if self in (MDQAQuestions.dev, MDQAQuestions.test) else None


class In2Metric(StrEnum):
    """How the held-out IN2 answers are scored (`eval.in2_metric`): each scores the answer's first line."""

    exact_match = "exact_match"  # the line is an answer: a model trained to answer alone (the default)
    best_subspan_em = "best_subspan_em"  # an answer is in the line: mdqa's metric, for data.in2.layout=mdqa
    whole_word_subspan_em = "whole_word_subspan_em"  # an answer is whole words of the line


class QAMetric(StrEnum):
    best_subspan_em = "best_subspan_em"  # the reference's metric (default): comparable with published curves
    whole_word_subspan_em = "whole_word_subspan_em"  # whole-word variant, stricter


@dataclass
class KVProbeConfig:
    # Records with ordered_kv_records / key / value, any pair count (the reference's 75-, 140-, 300-key
    # files); None = <data_dir>/kv-retrieval-75_keys.jsonl.gz, or synthetic UUID pairs without data_dir.
    path: Optional[str] = None
    n_pairs: Optional[int] = None  # pairs per prompt; None = every pair of the file's records (75 synthetic)
    positions: Optional[list[int]] = None  # gold pair indices; None = the reference's for that pair count
    max_new_tokens: int = 100  # the reference's budget; the value is looked for in the whole generation
    query_aware: bool = False  # the key before the JSON data too (the reference's query-aware prompt)


@dataclass
class MDQAProbeConfig:
    # An oracle file (one passage per question: distractors are added) or files in the reference format
    # (ctxs with isgold, asked as they are; a glob for several); None = <data_dir>/nq-open-oracle.jsonl.gz.
    path: Optional[str] = None
    n_docs: Optional[int] = None  # documents per prompt; None = 20 from an oracle file, else the file's own
    positions: Optional[list[int]] = None  # gold indices (oracle files); None = the reference's for n_docs
    distractors: Distractors = Distractors.retrieved  # retrieved: BM25, the reference's recipe; random: easier
    pool: Optional[str] = None  # JSONL passages to retrieve distractors from; None = the oracle file's own
    closed_book: bool = True  # also ask each question without documents (the no-context baseline)
    metric: QAMetric = QAMetric.best_subspan_em
    max_new_tokens: int = 100  # the reference's budget; the first line of the answer is scored
    query_aware: bool = False  # the question before the documents too (the reference's query-aware prompt)
    # Inference-time interventions on the ranked documents (the file's order; the gold ranks where it sits):
    # keep the top `keep`, lay them out by `order` (descending, ascending, outside_in). Positions stay the
    # gold's rank; each outcome's extra["final_position"] says where it ended (-1: truncated away).
    order: Optional[Order] = None
    keep: Optional[int] = None
    # heldout: ask only the evaluation questions of `split`, which IN2 data from NQ (data.source=nq) with
    # data.nq_split equal to it never trains on; training on NQ requires it (`check_mdqa_questions`).
    questions: MDQAQuestions = MDQAQuestions.all
    split: QuestionSplit = field(default_factory=QuestionSplit)
    dev_share: float = DEV_SHARE  # questions=dev|test: the expected share of the evaluation questions in dev


@dataclass
class NeedleProbeConfig:
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])  # context lengths in tokens (grid rows)
    depths: list[float] = field(default_factory=lambda: [round(0.1 * k, 1) for k in range(11)])  # 0 = first
    max_new_tokens: int = 16  # a 5-digit code after the prompt's "is"


@dataclass
class ValProbingConfig:
    """VaLProbing's shape (data_builders.valprobing): a preset, any of whose settings can be given instead."""

    preset: str = "smollm2_8k"  # film32k: FILM's 32K shape (800 / 800 / 750 pieces, 4 sets, bins of 50)
    pieces: Optional[int] = None  # pieces a context, every task; None = the preset's (smollm2_8k: 200 / 200 / 175)
    sets: Optional[int] = None  # contexts a task, each asking every position once; None = the preset's (4)
    bin_width: Optional[int] = None  # positions a bin; None = the preset's (smollm2_8k: 25)
    max_prompt_tokens: Optional[int] = None  # longest prompt the model reads with its answer; None = the preset's
    seed: int = 0  # which pieces each set draws
    path: Optional[str] = None  # folder of FILM's pieces files; None = <data_dir>/valprobing
    max_new_tokens: int = 128  # FILM's budget; the whole answer is scored
    # false: the gold completion's log-likelihood alone (no answers, `correct` is nan): an 8K context's items
    # then cost ~0.6 s each on 2 CPU cores instead of ~18 s for 128 greedy tokens (docs/VALPROBING.md)
    answers: bool = True
    film_bins: bool = False  # summaries leave out each bin's last position, as FILM's plot.py does


@dataclass
class EvalConfig:
    every: int = 50  # held-out loss every N steps (0 = off)
    num_examples: int = 200  # held-out IN2 questions scored for accuracy by depth (at start and end); 0 = none
    bins: int = 10  # equal-width gold-depth bins of the IN2 accuracy curve
    max_new_tokens: int = 8  # greedy answer length of IN2 questions, in tokens
    # The IN2 answers' metric: exact_match, or best_subspan_em (with the mdqa probe's 100 tokens) for samples in the
    # mdqa evaluation's own prompt (data.in2.layout=mdqa), whose model may answer in a sentence, as the probe allows
    in2_metric: In2Metric = In2Metric.exact_match
    batch_size: int = 16  # prompts per generate call
    # Padded prompt tokens per generate call: long prompts go in smaller batches (attention memory grows
    # with batch x length^2: 16 kv prompts of 140 pairs would need tens of GB on a CPU).
    batch_tokens: int = 16384
    probes: list[Probe] = field(default_factory=list)  # extra probes every probe_every steps
    probe_every: int = 0  # steps between probe runs (0 = off)
    probe_examples: int = 20  # queries per probe; each is asked once per gold position
    data_dir: Optional[str] = None  # folder of the kv / nq files; None = synthetic kv and filler, no mdqa
    chat_template: bool = False  # wrap text prompts in the tokenizer's chat template (instruct models)
    # Every answer recorded as it is made (<POSDEBIAS_CACHE>/evaluations/answered, analysis.evaluation.answer_record)
    # and read back by any later evaluation of the same weights on the same items with the same settings: a killed
    # or resumed run answers only what is missing, a study's jobs answer step 0 once. Single process only.
    resume: bool = True
    # The teacher-forced log-likelihood of every item's gold answer (`loglik` in each outcome, analysis.evaluation
    # .loglik): position without answer format, one extra prompt pass an item; of the first loglik_aliases aliases.
    loglik: bool = True
    loglik_aliases: int = 3
    # false: the gold answer's log-likelihood alone, no greedy answers (`correct` is nan): a position curve at the
    # cost of one forward pass an item (scripts.eval_checkpoint answers=false)
    answers: bool = True
    kv: KVProbeConfig = field(default_factory=KVProbeConfig)
    mdqa: MDQAProbeConfig = field(default_factory=MDQAProbeConfig)
    needle: NeedleProbeConfig = field(default_factory=NeedleProbeConfig)
    valprobing: ValProbingConfig = field(default_factory=ValProbingConfig)


def valprobing_files(cfg: EvalConfig, prefix: str = "eval.") -> dict[Task, tuple[str, Path]]:
    """task -> (the key that names it, path) of the pieces file of every VaLProbing probe in `cfg.probes`."""
    key, folder = ((f"{prefix}valprobing.path", Path(cfg.valprobing.path).expanduser()) if cfg.valprobing.path
                   else (f"{prefix}data_dir", None if cfg.data_dir is None else Path(cfg.data_dir) / PIECES_DIR))
    tasks = [t for t in map(Probe, cfg.probes) if t.valprobing_task is not None]
    if tasks and folder is None:
        raise ValueError(f"{prefix}probes has {', '.join(tasks)}: set {prefix}data_dir (the folder holding "
                         f"{PIECES_DIR}/) or {prefix}valprobing.path")
    return {t.valprobing_task: (key, folder / PIECES_FILES[t.valprobing_task]) for t in tasks}


def probe_source(name: str, cfg: EvalConfig) -> Path | None:
    """The file (or glob) a kv or mdqa probe reads: its `path`, else the data_dir file; None = synthetic kv
    (mdqa then has nothing to ask)."""
    probe_cfg = cfg.kv if name == Probe.kv else cfg.mdqa
    if probe_cfg.path is not None:
        return Path(probe_cfg.path).expanduser()
    if cfg.data_dir is None:
        return None
    return Path(cfg.data_dir) / (KV_FILE if name == Probe.kv else NQ_FILE)


def validate_eval(cfg: EvalConfig, data: DataConfig) -> None:
    """Start-up checks of a training run's `eval` section, naming the key; `data`: the settings the training data is
    built with (`data_builders.build.built_with`), which the mdqa probe must not ask training questions of."""
    if cfg.loglik and cfg.loglik_aliases < 1:
        raise ValueError(f"eval.loglik_aliases={cfg.loglik_aliases}: the log-likelihood needs at least 1 answer "
                         "alias (or eval.loglik=false)")
    if cfg.probes and cfg.probe_every < 1:
        raise ValueError(f"eval.probes={[str(p) for p in cfg.probes]} needs eval.probe_every >= 1")
    if cfg.probes:
        check_probes(cfg)
    if Probe.mdqa in cfg.probes and probe_source(Probe.mdqa, cfg) is not None:
        check_mdqa_questions(cfg.mdqa, data)


def check_probes(cfg: EvalConfig, prefix: str = "eval.") -> None:
    """Fail before a model is loaded on a probe `build_probes` cannot build, or a missing file a requested probe
    reads, naming its key."""
    wanted = set(map(Probe, cfg.probes))
    if Probe.in2 in wanted:
        raise ValueError(f"{prefix}probes has in2: the held-out IN2 records are scored every eval.every steps "
                         f"whenever the data is IN2 (eval.num_examples of them); leave it out of {prefix}probes")
    files = [(f"{name}.path" if getattr(cfg, name).path else "data_dir", probe_source(name, cfg))
             for name in (Probe.kv, Probe.mdqa) if name in wanted]
    if Probe.mdqa in wanted:
        if cfg.mdqa.pool is not None and str(cfg.mdqa.pool) == HELDOUT_POOL:  # a rule, not a file
            check_mdqa_pool(cfg.mdqa.pool, cfg.mdqa.distractors,
                            cfg.mdqa.split if cfg.mdqa.questions.held_out else None, f"{prefix}mdqa.")
        else:
            files.append(("mdqa.pool", cfg.mdqa.pool))
    if Probe.needle in wanted and cfg.data_dir is not None:
        files.append(("data_dir", Path(cfg.data_dir) / NQ_FILE))
    for key, path in files:
        if path is None:
            continue
        try:
            missing = [f for f in expand_paths(Path(path).expanduser()) if not f.is_file()]
        except FileNotFoundError:
            missing = [path]
        if missing:
            value = cfg.data_dir if key == "data_dir" else path
            raise FileNotFoundError(f"{prefix}{key}={value}: {missing[0]} is not a file")
    check_valprobing(cfg, prefix)


def check_valprobing(cfg: EvalConfig, prefix: str = "eval.") -> None:
    """Fail before a model is loaded on an unknown VaLProbing preset or a missing pieces file, naming its key."""
    if not set(map(Probe, cfg.probes)) & set(VALPROBING):
        return
    v = cfg.valprobing
    shape_of(v.preset, v.pieces, v.sets, v.bin_width, v.max_prompt_tokens, key=f"{prefix}valprobing")
    if not v.answers and not cfg.loglik:
        raise ValueError(f"{prefix}valprobing.answers=false with {prefix}loglik=false would measure nothing: "
                         "turn one on")
    for key, path in valprobing_files(cfg, prefix).values():
        if not path.is_file():
            raise FileNotFoundError(f"{key}: {path} is not a file (FILM's VaLProbing pieces, "
                                    "github.com/microsoft/FILM VaLProbing/pieces/)")


def check_mdqa_questions(mdqa: MDQAProbeConfig, data: DataConfig, mdqa_key: str = "eval.mdqa",
                         data_key: str = "data") -> None:
    """Fail at start-up, naming the keys, when the mdqa probe would ask a question its model trains on: IN2
    data from NQ (`data.source=nq`: every question outside the evaluation ones of `data.nq_split` may be
    trained on) with mdqa asking every question, or the evaluation questions of another split.

    `data`: the settings the training data is built with (`data_builders.build.built_with`); other sources
    and language-model windows ask no NQ question.
    """
    check_split(mdqa.split, f"{mdqa_key}.split")
    if data.source != DataSource.nq or data.format != DataFormat.in2:
        return
    if not mdqa.questions.held_out:
        raise ValueError(f"{data_key}.source=nq trains on NQ-open questions that {mdqa_key}.questions="
                         f"{mdqa.questions} asks too: set {mdqa_key}.questions=heldout (or its dev or test part)")
    if mdqa.split != data.nq_split:
        raise ValueError(f"{mdqa_key}.split (share={mdqa.split.share}, salt={mdqa.split.salt!r}) differs from "
                         f"{data_key}.nq_split (share={data.nq_split.share}, salt={data.nq_split.salt!r}): the "
                         f"probe would ask questions the data trains on; set {mdqa_key}.split to the data's")


def probe_budget(name: str, cfg: EvalConfig) -> int:
    """Greedy new-token budget of a probe: its own `max_new_tokens` (in2: `cfg.max_new_tokens`)."""
    if name == "in2":
        return cfg.max_new_tokens
    return (cfg.valprobing if Probe(name).valprobing_task is not None else getattr(cfg, name)).max_new_tokens


def with_budget(cfg: EvalConfig, max_new_tokens: int) -> EvalConfig:
    """A copy of `cfg` in which every probe generates up to `max_new_tokens` (a quick look, not comparable)."""
    return replace(cfg, max_new_tokens=max_new_tokens, kv=replace(cfg.kv, max_new_tokens=max_new_tokens),
                   mdqa=replace(cfg.mdqa, max_new_tokens=max_new_tokens),
                   needle=replace(cfg.needle, max_new_tokens=max_new_tokens),
                   valprobing=replace(cfg.valprobing, max_new_tokens=max_new_tokens))


def probe_metric(name: str, cfg: EvalConfig) -> Metric:
    """The metric a probe is scored with: substring_match (kv, needle), eval.mdqa.metric, eval.in2_metric."""
    if name == "mdqa":
        return METRICS[str(cfg.mdqa.metric)]
    if name == "in2":
        return METRICS[str(cfg.in2_metric)]
    task = Probe(name).valprobing_task
    if task is not None:
        return METRICS[VALPROBING_METRIC[task]]
    return METRICS["substring_match"]
