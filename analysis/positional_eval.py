"""Position-wise accuracy: greedy answers to probes whose gold sits at known positions.

The training loop calls `evaluate_in2` on held-out IN2 records (accuracy by gold depth) and, when
`eval.probes` is set, `evaluate_probes` on key-value / multi-document QA / needle probes. Results go
to the metrics log via `ProbeResult.to_metrics` and to `run_dir/eval/<name>_step<N>.json`.

kv and mdqa are set up as Liu et al. 2023 (Lost in the Middle) did by default: their prompts, data formats,
gold positions, 100-token greedy budget and metrics (`best_subspan_em` on the answer's first line), and
retrieved (BM25) distractors. Every result carries its `settings` (metric, budget, source, ...), saved in
its JSON, so a reader can tell which numbers are comparable with published curves.
"""
from __future__ import annotations

import itertools
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from analysis.scoring import (
    best_subspan_em,
    bootstrap_ci,
    exact_match,
    first_line,
    paired_bootstrap_ci,
    substring_match,
    whole_word_subspan_em,
)
from data_builders.files import atomic_write_text
from data_builders.mdqa import Distractors
from data_builders.probes import (
    KV_FILE,
    NQ_FILE,
    Layout,
    Order,
    ProbeItem,
    expand_paths,
    in2_probe,
    kv_probe,
    mdqa_probe,
    needle_probe,
    nq_filler,
    synthetic_filler,
)

if TYPE_CHECKING:
    from models.attn_calibration import AttnCalibration

log = logging.getLogger(__name__)

Scorer = Callable[[str, Sequence[str]], float]
GenerateFn = Callable[[Sequence[ProbeItem]], list[str]]
BatchContext = Callable[[Sequence[int], int], ContextManager]

REFERENCE = "Liu et al. 2023, Lost in the Middle (github.com/nelson-liu/lost-in-the-middle)"


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
    )
}


class Probe(StrEnum):
    kv = "kv"  # key-value retrieval (Liu et al. 2023): the gold pair's index
    mdqa = "mdqa"  # multi-document QA over NQ (needs data_dir or eval.mdqa.path): the gold document's index
    needle = "needle"  # a code hidden at a depth of filler text, per context length


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


@dataclass
class NeedleProbeConfig:
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])  # context lengths in tokens (grid rows)
    depths: list[float] = field(default_factory=lambda: [round(0.1 * k, 1) for k in range(11)])  # 0 = first
    max_new_tokens: int = 16  # a 5-digit code after the prompt's "is"


@dataclass
class EvalConfig:
    every: int = 50  # held-out loss every N steps (0 = off)
    num_examples: int = 200  # held-out IN2 questions scored for accuracy by depth (at start and end)
    bins: int = 10  # equal-width gold-depth bins of the IN2 accuracy curve
    max_new_tokens: int = 8  # greedy answer length of IN2 questions, in tokens
    batch_size: int = 16  # prompts per generate call
    # Padded prompt tokens per generate call: long prompts go in smaller batches (attention memory grows
    # with batch x length^2: 16 kv prompts of 140 pairs would need tens of GB on a CPU).
    batch_tokens: int = 16384
    probes: list[Probe] = field(default_factory=list)  # extra probes every probe_every steps
    probe_every: int = 0  # steps between probe runs (0 = off)
    probe_examples: int = 20  # queries per probe; each is asked once per gold position
    data_dir: Optional[str] = None  # folder of the kv / nq files; None = synthetic kv and filler, no mdqa
    chat_template: bool = False  # wrap text prompts in the tokenizer's chat template (instruct models)
    kv: KVProbeConfig = field(default_factory=KVProbeConfig)
    mdqa: MDQAProbeConfig = field(default_factory=MDQAProbeConfig)
    needle: NeedleProbeConfig = field(default_factory=NeedleProbeConfig)


@dataclass
class ProbeResult:
    """Per-query outcomes of one probe run, with accuracy by gold position."""

    probe: str
    # One dict per item: id, query, position, label, prediction, answers, correct (0.0/1.0), extra.
    outcomes: list[dict[str, Any]]
    # How the numbers were made: metric (its name and definition), generation budget, data source,
    # positions... (`probe_settings`): what a reader needs to know which numbers are comparable.
    settings: dict[str, Any] = field(default_factory=dict)

    def _correct(self, position: int) -> np.ndarray:
        return np.array([o["correct"] for o in self.outcomes if o["position"] == position], dtype=float)

    def labels(self) -> dict[int, str]:
        """Metric-key label of each position present, in position order."""
        return dict(sorted({o["position"]: o["label"] for o in self.outcomes}.items()))

    def accuracy_by_position(self) -> dict[int, float]:
        """Mean correctness at each position present (-1 = closed-book baseline, if any)."""
        return {p: float(self._correct(p).mean()) for p in self.labels()}

    def ci_by_position(
        self, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> dict[int, tuple[float, float]]:
        """Percentile bootstrap interval of the accuracy at each position."""
        return {p: bootstrap_ci(self._correct(p), n_boot, alpha, seed) for p in self.labels()}

    def paired_difference(
        self, a: int, b: int, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> tuple[float, tuple[float, float]]:
        """acc(a) - acc(b) over the queries asked at both positions, with its paired bootstrap interval."""
        at_a = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == a}
        at_b = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == b}
        shared = sorted(at_a.keys() & at_b.keys())
        if not shared:
            raise ValueError(f"no query of probe {self.probe!r} was asked at both positions {a} and {b}")
        x, y = np.array([at_a[q] for q in shared]), np.array([at_b[q] for q in shared])
        return float((x - y).mean()), paired_bootstrap_ci(x, y, n_boot, alpha, seed)

    @property
    def mean(self) -> float:
        """Accuracy over all queries with a gold position (the closed-book baseline is left out)."""
        correct = [o["correct"] for o in self.outcomes if o["position"] >= 0]
        return float(np.mean(correct)) if correct else float("nan")

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """{'<prefix>/<probe>/acc@<label>': ..., '<prefix>/<probe>/acc_mean': ...}."""
        labels, key = self.labels(), f"{prefix}/{self.probe}/acc"
        metrics = {f"{key}@{labels[p]}": acc for p, acc in self.accuracy_by_position().items()}
        metrics[f"{key}_mean"] = self.mean
        return metrics

    def save_json(self, path: str | Path) -> Path:
        """Write the summary (accuracy, 95% interval and count per label) and every outcome."""
        labels, cis = self.labels(), self.ci_by_position()
        summary = {
            "probe": self.probe,
            "metric": self.settings.get("metric"),
            "settings": self.settings,
            "mean": self.mean,
            "accuracy": {labels[p]: acc for p, acc in self.accuracy_by_position().items()},
            "ci95": {labels[p]: list(ci) for p, ci in cis.items()},
            "n": {labels[p]: int(self._correct(p).size) for p in labels},
            "outcomes": self.outcomes,
        }
        # Atomic: compare and a resumed run read these back, and must never see half a file.
        atomic_write_text(Path(path), json.dumps(summary, indent=1))
        return Path(path)

    @classmethod
    def load_json(cls, path: str | Path) -> ProbeResult:
        """Read back a file written by `save_json`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["probe"], data["outcomes"], data.get("settings", {}))


def run_probe(
    items: Sequence[ProbeItem], generate_fn: GenerateFn, metric: Metric, settings: Mapping[str, Any] | None = None
) -> ProbeResult:
    """Answer every item with `generate_fn` and score each answer against the item's answers with `metric`.

    The result's settings are `settings` with the metric's name and definition.
    """
    if not items:
        raise ValueError("run_probe needs at least one item")
    predictions = generate_fn(items)
    if len(predictions) != len(items):
        raise ValueError(f"generate_fn returned {len(predictions)} answers for {len(items)} items")
    outcomes = [
        {
            "id": it.id,
            "query": it.query,
            "position": it.position,
            "label": it.label,
            "prediction": pred,
            "answers": it.answers,
            "correct": float(metric.score(pred, it.answers)),
            "extra": it.extra,
        }
        for it, pred in zip(items, predictions)
    ]
    settings = {"metric": metric.name, "metric_definition": metric.definition, **(settings or {})}
    return ProbeResult(items[0].probe, outcomes, settings)


class FirstLineComplete(StoppingCriteria):
    """Done for the rows whose new text has a newline after its first non-blank character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_width: int) -> None:
        self.tokenizer, self.prompt_width = tokenizer, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :], skip_special_tokens=True)
        return torch.tensor(["\n" in t.lstrip() for t in texts], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
    first_line_only: bool = False,
    batch_tokens: int | None = None,
    batch_context: BatchContext | None = None,
) -> list[str]:
    """Greedy continuations of token-id prompts, decoded without special tokens, in prompt order.

    Batches are left-padded (so every row's last prompt token is at the same column) and run with
    the KV cache; a batch holds at most `batch_size` prompts and, when set, at most `batch_tokens`
    padded prompt tokens (one prompt at least). Generation stops at the model's eos ids and the tokenizer's eos, and with
    `first_line_only` also once a row's first non-blank line is complete (what `first_line` keeps:
    the scores are those of the full budget, for less compute). The model is put in eval mode and
    its previous mode restored. `batch_context(rows, width)`, when given, is entered around each batch's
    generate call (rows: the prompts' indices, width: the padded length), e.g. to calibrate attention.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    too_long = sum(len(p) + max_new_tokens > limit for p in prompts) if limit else 0
    if too_long:
        log.warning("%d of %d prompts plus %d new tokens exceed the model's max_position_embeddings=%d: "
                    "their answers test length extrapolation", too_long, len(prompts), max_new_tokens, limit)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    # Models trained here end answers with the tokenizer's eos, which a config may not list.
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    # Similar lengths share a batch, so little compute goes to padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    for i in order:  # ascending lengths: the prompt being added sets the batch's width
        if not batches or len(batches[-1]) == batch_size or (
                batch_tokens is not None and (len(batches[-1]) + 1) * len(prompts[i]) > batch_tokens):
            batches.append([])
        batches[-1].append(i)
    outputs: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for rows in tqdm(batches, desc="generate", disable=not progress):
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, L)
            mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
            for r, i in enumerate(rows):
                n = len(prompts[i])
                ids[r, width - n :] = torch.tensor(list(prompts[i]), dtype=torch.long)
                mask[r, width - n :] = 1
            with batch_context(rows, width) if batch_context is not None else nullcontext():
                out = model.generate(
                    input_ids=ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    # Hub generation configs may set penalties (Qwen2-Instruct: repetition_penalty=1.05)
                    # that generate() would apply; pinned off so this stays plain argmax.
                    repetition_penalty=1.0,
                    no_repeat_ngram_size=0,
                    pad_token_id=pad,
                    eos_token_id=eos or None,
                    stopping_criteria=StoppingCriteriaList([FirstLineComplete(tokenizer, width)]) if first_line_only
                    else None,
                )  # (B, L + new)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(rows, texts):
                outputs[i] = text
    finally:
        model.train(was_training)
    return outputs


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int], chat_template: bool = False
) -> list[int]:
    """Token ids of a probe prompt; token-id prompts pass through untouched."""
    if not isinstance(prompt, str):
        return list(prompt)
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def model_generate_fn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    batch_size: int,
    chat_template: bool = False,
    progress: bool = True,
    first_line_only: bool = False,
    batch_tokens: int | None = None,
    calibration: AttnCalibration | None = None,
) -> GenerateFn:
    """A `generate_fn` for `run_probe` that answers items with `greedy_generate` on `model`; text prompts go
    through the chat template when `chat_template`, token-id prompts (in2) never do. With `calibration` (an
    installed `models.attn_calibration`), each batch is answered with its items' segments calibrated."""

    def generate(items: Sequence[ProbeItem]) -> list[str]:
        if calibration is None:
            prompts = [encode_prompt(tokenizer, it.prompt, chat_template) for it in items]
            return greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                                   batch_tokens)
        encoded = [calibration.encode(it.prompt, it.segments or [], chat_template) if isinstance(it.prompt, str)
                   else (list(it.prompt), []) for it in items]
        prompts, spans = [ids for ids, _ in encoded], [s for _, s in encoded]

        def calibrated(rows: Sequence[int], width: int) -> ContextManager:
            return calibration.batch([prompts[i] for i in rows], [spans[i] for i in rows], width)

        return greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                               batch_tokens, calibrated)

    return generate


def evaluate_in2(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, Any]],
    cfg: EvalConfig,
) -> tuple[dict[str, float], ProbeResult]:
    """Exact-match accuracy on the first `cfg.num_examples` held-out IN2 records, by gold-depth bin.

    Metric keys: `eval/in2/acc_mean` and `eval/in2/acc@<lower bin edge>` (`acc@0.0` ... `acc@0.9` for
    10 bins); a bin without records has no key.
    """
    items = in2_probe(itertools.islice(records, cfg.num_examples), bins=cfg.bins)
    generate = model_generate_fn(model, tokenizer, cfg.max_new_tokens, cfg.batch_size, batch_tokens=cfg.batch_tokens)
    result = run_probe(items, generate, METRICS["exact_match"], probe_settings("in2", cfg, items))
    return result.to_metrics("eval"), result


def probe_source(name: str, cfg: EvalConfig) -> Path | None:
    """The file (or glob) a kv or mdqa probe reads: its `path`, else the data_dir file; None = synthetic kv
    (mdqa then has nothing to ask)."""
    probe_cfg = cfg.kv if name == Probe.kv else cfg.mdqa
    if probe_cfg.path is not None:
        return Path(probe_cfg.path).expanduser()
    if cfg.data_dir is None:
        return None
    return Path(cfg.data_dir) / (KV_FILE if name == Probe.kv else NQ_FILE)


def check_probe_files(cfg: EvalConfig, prefix: str = "eval.") -> None:
    """Fail before a model is loaded when a file a requested probe reads is missing, naming its key."""
    wanted = set(map(Probe, cfg.probes))
    files = [(f"{name}.path" if getattr(cfg, name).path else "data_dir", probe_source(name, cfg))
             for name in (Probe.kv, Probe.mdqa) if name in wanted]
    if Probe.mdqa in wanted:
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


def build_probes(cfg: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[ProbeItem]]:
    """Items of every probe in `cfg.probes` (fixed seed: every step and run sees the same queries).

    A data file, count or position that does not fit raises a ValueError naming the file, line and reason.
    """
    probes: dict[str, list[ProbeItem]] = {}
    for name in map(Probe, cfg.probes):  # plain strings too: ValueError on an unknown probe
        source = probe_source(name, cfg) if name != Probe.needle else None
        if name == Probe.kv:
            probes[name] = kv_probe(source, cfg.kv.n_pairs, cfg.kv.positions, n_examples=cfg.probe_examples,
                                    query_aware=cfg.kv.query_aware)
        elif name == Probe.mdqa:
            if source is None:
                log.warning("eval.probes has mdqa but neither eval.mdqa.path nor eval.data_dir is set: mdqa is skipped")
                continue
            m = cfg.mdqa
            probes[name] = mdqa_probe(source, m.n_docs, m.positions, m.distractors, m.pool,
                                      n_examples=cfg.probe_examples, closed_book=m.closed_book,
                                      layout=Layout(m.query_aware, m.order, m.keep))
        else:
            filler = nq_filler(Path(cfg.data_dir) / NQ_FILE) if cfg.data_dir is not None else synthetic_filler()
            probes[name] = needle_probe(filler, cfg.needle.depths, cfg.needle.lengths, tokenizer,
                                        n_examples=cfg.probe_examples)
    return probes


def probe_budget(name: str, cfg: EvalConfig) -> int:
    """Greedy new-token budget of a probe: its own `max_new_tokens` (in2: `cfg.max_new_tokens`)."""
    return cfg.max_new_tokens if name == "in2" else getattr(cfg, name).max_new_tokens


def with_budget(cfg: EvalConfig, max_new_tokens: int) -> EvalConfig:
    """A copy of `cfg` in which every probe generates up to `max_new_tokens` (a quick look, not comparable)."""
    return replace(cfg, max_new_tokens=max_new_tokens, kv=replace(cfg.kv, max_new_tokens=max_new_tokens),
                   mdqa=replace(cfg.mdqa, max_new_tokens=max_new_tokens),
                   needle=replace(cfg.needle, max_new_tokens=max_new_tokens))


def probe_metric(name: str, cfg: EvalConfig) -> Metric:
    """The metric a probe is scored with: substring_match (kv, needle), eval.mdqa.metric, exact_match (in2)."""
    if name == "mdqa":
        return METRICS[str(cfg.mdqa.metric)]
    return METRICS["exact_match" if name == "in2" else "substring_match"]


def probe_settings(name: str, cfg: EvalConfig, items: Sequence[ProbeItem]) -> dict[str, Any]:
    """What a probe's numbers depend on, saved with them: budget, data, positions, and whether the setup is the
    reference's (kv, mdqa: its metric, 100 new tokens, its data or distractor recipe), so comparable with
    published curves."""
    positions = sorted({it.position for it in items if it.position >= 0})
    settings: dict[str, Any] = {"max_new_tokens": probe_budget(name, cfg), "queries": len({it.query for it in items}),
                                "positions": positions, "chat_template": cfg.chat_template}
    if name == "mdqa":
        settings["answer_cut"] = "first line of the stripped generation"
    if name in ("kv", "mdqa"):
        source = probe_source(name, cfg)
        settings["source"] = str(source) if source is not None else "synthetic UUID pairs"
        settings["slots"] = sorted({it.n_positions for it in items if it.position >= 0})
        settings["reference"] = REFERENCE
        built = {it.extra.get("distractors") for it in items if it.position >= 0} - {None}
        if name == "mdqa":
            settings["distractors"] = "as in the file" if not built else sorted(built)[0]
        probe_cfg = getattr(cfg, name)
        settings["query_aware"] = probe_cfg.query_aware
        moved = name == "mdqa" and (cfg.mdqa.order is not None or cfg.mdqa.keep is not None)
        if moved:
            settings["order"] = None if cfg.mdqa.order is None else str(cfg.mdqa.order)
            settings["keep"] = cfg.mdqa.keep
        comparable = settings["max_new_tokens"] == 100 and not moved and (name == "kv" or (
            cfg.mdqa.metric == QAMetric.best_subspan_em and settings["distractors"] != Distractors.random))
        settings["comparable_with_reference"] = comparable
    if name == "needle":
        settings["lengths"] = sorted({it.extra["context_len"] for it in items})
        settings["depths"] = sorted({it.extra["depth"] for it in items})
    return settings


def describe_settings(settings: Mapping[str, Any]) -> str:
    """One line for tables and reports: metric, budget, source, positions, and comparability."""
    if not settings:
        return "not recorded (an eval JSON written before results named their metric and settings)"
    parts = [f"metric {settings.get('metric', '?')}", f"{settings.get('max_new_tokens', '?')} new tokens"]
    if "answer_cut" in settings:
        parts.append(f"scored on the {settings['answer_cut']}")
    if settings.get("intervention", "none") != "none":
        parts.append(f"intervention {settings['intervention']}")
    if settings.get("query_aware"):
        parts.append("query-aware prompts")
    if "order" in settings:
        parts.append(f"documents {settings['order'] or 'in rank order'}"
                     + (f", top {settings['keep']} kept" if settings.get("keep") is not None else ""))
    for key in ("source", "distractors", "slots", "positions", "lengths", "depths"):
        if key in settings:
            parts.append(f"{key} {settings[key]}")
    if "comparable_with_reference" in settings:
        parts.append("comparable with the reference's published numbers: "
                     + ("yes" if settings["comparable_with_reference"] else "no"))
    return "; ".join(parts)


def evaluate_probes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Mapping[str, Sequence[ProbeItem]],
    cfg: EvalConfig,
    calibration: AttnCalibration | None = None,
) -> tuple[dict[str, float], dict[str, ProbeResult]]:
    """Run the probes from `build_probes` (and in2 items) on `model`, each with its budget and metric;
    metrics of all probes and the result of each. `calibration`: answer with attention calibration."""
    results = {}
    for name, items in probes.items():
        generate = model_generate_fn(model, tokenizer, probe_budget(name, cfg), cfg.batch_size,
                                     cfg.chat_template, first_line_only=name == "mdqa", batch_tokens=cfg.batch_tokens,
                                     calibration=calibration)
        results[name] = run_probe(items, generate, probe_metric(name, cfg), probe_settings(name, cfg, items))
    metrics = {k: v for result in results.values() for k, v in result.to_metrics("eval").items()}
    return metrics, results


def write_eval_json(run_dir: str | Path, step: int, name: str, result: ProbeResult) -> Path:
    """Save `result` as `run_dir/eval/<name>_step<step>.json`."""
    return result.save_json(Path(run_dir) / "eval" / f"{name}_step{step}.json")
