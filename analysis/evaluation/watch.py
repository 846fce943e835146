"""Position signals on the task's own prompts, measured while a model trains: the `watch/*` metrics (issue 64).

The generic valley (`valley/*`, analysis.measure.topology) is measured on plain held-out text. What a
position-debiasing fine-tune changes is how the model reads the task's prompts, so the watch measures those:

- **The panel.** A fixed set of prompts in the evaluation's own format: mdqa (`n_docs` documents, the chat template
  when the evaluation uses it), kv (`n_pairs` pairs), or a run's own held-out IN2 records. Each question is asked
  with its gold at every slot of `watch.slots` among the same distractors. mdqa questions are dev questions of the
  training data's split (never trained on, never test) that the dev evaluation's sample (`skip_examples`, seed 0)
  does not ask; kv records are UUID pairs drawn as Liu et al.'s, with a seed no evaluation uses; IN2 records are
  the last held-out records, their gold segment moved to the slot's depth of the same context.
- **The Jacobian per slot.** rho^2(j) = ||d h_last / d e_j||^2 at the answer position (the last prompt token),
  Hutchinson with `num_probes` probes of a fixed generator per prompt (the same probe at every measurement and in
  every run: differences are precise). Per prompt: each unit's (document, pair, or IN2 depth tenth) share of the
  prompt's rho^2, the gold unit's share, the documents' share of all of it, and the closed-form prior's share
  p^2 over the same spans (alpha fitted to the prompt's profile: analysis.measure.prior.fit_alpha).
  Every prompt is measured at the first step and the last; in between, one prompt every `every` steps, in turn,
  the sets taking turns (each set's prompts refreshed at the same rate, not one set after the other).
  Each logged value pools the latest measurement of every prompt (a window of one rotation).
- **The answer's log p per slot** (analysis.evaluation.loglik: teacher-forced, the best of the first aliases, the
  evaluation's own definition) over the whole panel every `loglik_every` steps, at the first step and at the last.
- **Contrasts.** Within question: ln(gold share at `middle`) − ln(gold share at the set's strong slot), and
  log p at `middle` − log p at the strong slot, with an interval over questions.

`WatchPanel` holds the measurements (its state travels in checkpoints) and makes the metrics; every measurement is
also a row of `<run>/watch.jsonl`, which the run summary and `analysis.compare` read.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from analysis import stats
from analysis.evaluation.loglik import answer_targets, best, continuation_logprobs, sequence_logprobs
from analysis.evaluation.reuse import computation_key
from analysis.measure.jacobian import eval_mode, hutchinson_with_output
from analysis.measure.prior import fit_alpha, prior_profile
from data_builders.files import atomic_write_text
from data_builders.probes import ProbeItem, kv_probe, mdqa_probe
from data_builders.question_split import EvaluationPart, QuestionSplit
from models.attention.attn_calibration import encode_with_segments

PREFIX = "watch"
WATCH_CACHE = "watch"  # <POSDEBIAS_CACHE>/watch: first panels, by function and panel (WatchPanel.measure_first)
# the measurement's own version, in the first panel's cache key: cached rows of another computation are not read
# back (2: the Jacobian's forward is one pass over the prompt, so its log p is the plain forward's under bf16 too)
MEASUREMENT = 2


class WatchSet(StrEnum):
    in2 = "in2"  # the run's own held-out IN2 records, the gold moved through the context
    mdqa = "mdqa"  # multi-document QA in the evaluation's prompt (needs watch.data_dir)
    kv = "kv"  # key-value retrieval (watch.data_dir's kv file, or synthetic pairs)


@dataclass
class WatchConfig:
    """Hydra section `watch`: the position signals on the task's own prompts (module docstring)."""

    enabled: bool = True  # watch=off: false, whatever an experiment sets below
    sets: list[WatchSet] = field(default_factory=lambda: [WatchSet.in2])
    questions: int = 8  # questions (records) of each set, each asked with its gold at every slot
    slots: list[int] = field(default_factory=lambda: [0, 4, 9])  # gold slots: documents, pairs, or IN2 depth tenths
    middle: int = 4  # the contrasts: the signal at this slot minus at the set's strong slot
    strong: dict[str, int] = field(default_factory=lambda: {"in2": 9, "mdqa": 9, "kv": 0})
    every: int = 1  # one panel prompt's Jacobian every N steps, in turn; 0 = none (not even at the first and last)
    num_probes: int = 1  # Hutchinson probes per measurement
    seed: int = 0  # the probes' generator: the same probe for a prompt at every step and in every run
    loglik_every: int = 0  # the whole panel's log p every N steps; 0 = at the first and last step only
    loglik: bool = True  # false: no log p at all
    # questions of each set whose answer log p is measured: the Jacobian's `questions`, then more, whose log p alone
    # is measured (0: the Jacobian's alone). A log p contrast over ~80 questions ranks runs that 12 cannot
    # (docs/WATCH.md); it costs one forward a prompt at the first step (cached), the last, and every loglik_every
    loglik_questions: int = 0
    # folder of nq-open-oracle.jsonl.gz for mdqa; None: the training data's own NQ file (data.source=nq)
    data_dir: Optional[str] = None
    n_docs: int = 10  # mdqa documents per prompt
    n_pairs: int = 10  # kv pairs per prompt
    skip_examples: int = 100  # the dev mdqa and kv evaluations' samples (seed 0), which the watch leaves out
    train_window: int = 20  # steps of the per-slot training loss's rolling window

    @property
    def on(self) -> bool:
        return self.enabled and (self.every > 0 or self.loglik)


def validate_watch(cfg: WatchConfig) -> None:
    """Start-up checks, naming the key."""
    if not cfg.sets:
        raise ValueError("watch.sets=[] watches nothing: give in2, mdqa or kv (watch=off turns the watch off)")
    for key in ("questions", "n_docs", "n_pairs", "num_probes", "train_window"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"watch.{key}={getattr(cfg, key)} must be >= 1")
    for key in ("every", "loglik_every", "skip_examples"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"watch.{key}={getattr(cfg, key)} must be >= 0")
    if cfg.loglik_questions and (cfg.loglik_questions < cfg.questions or not cfg.loglik):
        raise ValueError(f"watch.loglik_questions={cfg.loglik_questions} measures the log p of the Jacobian's "
                         f"watch.questions={cfg.questions} and more: give 0 or >= {cfg.questions}, with watch.loglik=true")
    if len(set(cfg.slots)) < 2 or min(cfg.slots) < 0:
        raise ValueError(f"watch.slots={cfg.slots}: give two or more distinct slots >= 0")
    for s in cfg.sets:
        units = {WatchSet.mdqa: cfg.n_docs, WatchSet.kv: cfg.n_pairs, WatchSet.in2: 10}[WatchSet(s)]
        if max(cfg.slots) >= units:
            raise ValueError(f"watch.slots={cfg.slots}: {s} prompts have {units} slots (0..{units - 1})")
        strong = cfg.strong.get(str(s))
        if strong is None or strong not in cfg.slots or cfg.middle not in cfg.slots or strong == cfg.middle:
            raise ValueError(f"watch.middle={cfg.middle} and watch.strong.{s}={strong} must be two different slots of "
                             f"watch.slots={cfg.slots}")
    if WatchSet.mdqa in cfg.sets and cfg.data_dir is not None and not (Path(cfg.data_dir) / NQ_FILE).is_file():
        raise FileNotFoundError(f"watch.sets has mdqa: watch.data_dir={cfg.data_dir} holds no {NQ_FILE}")


NQ_FILE = "nq-open-oracle.jsonl.gz"


# ---------------------------------------------------------------------------------------------- the panel's prompts


@dataclass(frozen=True)
class WatchItem:
    """One panel prompt: a question with its gold at one slot."""

    set: str
    question: str  # pairs one question's slots
    slot: int  # the gold's slot
    ids: tuple[int, ...]  # the prompt's token ids, as the evaluation encodes them
    units: tuple[tuple[int, int], ...]  # token ranges [start, end) of the context's units (documents, pairs, tenths)
    gold: tuple[int, int]  # token range of the gold unit
    targets: tuple[tuple[int, ...], ...]  # the gold answer's first aliases as token ids after the prompt

    @property
    def key(self) -> str:
        return f"{self.set}/{self.question}/{self.slot}"


def _text_items(items: Iterable[ProbeItem], set_name: str, tokenizer: PreTrainedTokenizerBase,
                chat_template: bool) -> list[WatchItem]:
    out = []
    for it in items:
        ids, units = encode_with_segments(tokenizer, str(it.prompt), it.segments or [], chat_template,
                                          f"watch.sets={set_name}")
        targets = tuple(tuple(a) for a in answer_targets(it, tokenizer, chat_template))
        out.append(WatchItem(set_name, str(it.query), it.position, tuple(ids), tuple(units), units[it.position],
                             targets))
    return out


def _unasked(items: list[ProbeItem], asked: set[str], questions: int, slots: Sequence[int]) -> list[ProbeItem]:
    """The first `questions` questions of `items` that `asked` leaves out, at `slots`."""
    keep: list[str] = []
    for it in items:
        if it.query not in asked and it.query not in keep:
            keep.append(str(it.query))
    if len(keep) < questions:
        raise ValueError(f"watch.questions / watch.loglik_questions: {questions} asked, only {len(keep)} questions are "
                         "left once the evaluation's sample is left out (watch.skip_examples)")
    chosen = set(keep[:questions])
    return [it for it in items if it.query in chosen and it.position in slots]


def mdqa_items(cfg: WatchConfig, path: Path, split: QuestionSplit, tokenizer: PreTrainedTokenizerBase,
               chat_template: bool, questions: Optional[int] = None) -> list[WatchItem]:
    """The first `questions` (default watch.questions) dev questions of `split` in the NQ file `path` that the dev
    evaluation's sample does not ask, each with its gold at every slot (distractors retrieved from the file's own
    passages, as the evaluation's)."""
    dev = dict(heldout=split, part=EvaluationPart.dev, closed_book=False, n_docs=cfg.n_docs)
    asked = {str(it.query) for it in mdqa_probe(path, positions=[0], n_examples=cfg.skip_examples, seed=0, **dev)
             } if cfg.skip_examples else set()
    items = mdqa_probe(path, positions=sorted(set(cfg.slots)), **dev)
    return _text_items(_unasked(items, asked, questions or cfg.questions, cfg.slots), WatchSet.mdqa, tokenizer,
                       chat_template)


def kv_items(cfg: WatchConfig, tokenizer: PreTrainedTokenizerBase, chat_template: bool,
             questions: Optional[int] = None) -> list[WatchItem]:
    """The first `questions` (default watch.questions) synthetic kv records: UUID pairs as Liu et al.'s files hold
    them, drawn one after another with a seed no evaluation uses (the first records do not depend on how many)."""
    items = kv_probe(None, cfg.n_pairs, sorted(set(cfg.slots)), n_examples=questions or cfg.questions,
                     seed=cfg.seed + 1)
    return _text_items(items, WatchSet.kv, tokenizer, chat_template)


def in2_items(records: Sequence[Mapping[str, Any]], context_start: int, cfg: WatchConfig,
              units: int = 10, questions: Optional[int] = None) -> list[WatchItem]:
    """The last held-out IN2 records with one gold segment, the gold cut out of the context and put back at depth
    slot / (units − 1) of the rest: the same distractor tokens around it. The units are the context's tenths.
    `context_start`: where every record's context begins (the prompt format's prefix length). The held-out split
    is the one pool a run never trains on, so these may be records its own IN2 curve scores too. `questions`:
    how many (default watch.questions)."""
    questions = questions or cfg.questions
    out: list[WatchItem] = []
    for rec in reversed(records):
        if len(rec["gold_spans"]) != 1 or len(out) == questions * len(cfg.slots):
            continue
        ids, (s, e) = [int(t) for t in rec["input_ids"][: rec["prompt_len"]]], rec["gold_spans"][0]
        end = context_start + int(rec["context_tokens"])
        gold, rest = ids[s:e], ids[context_start:s] + ids[e:end]
        target = [int(t) for t, label in zip(rec["input_ids"][rec["prompt_len"]:], rec["labels"][rec["prompt_len"]:])
                  if label != -100][:-1]
        for slot in cfg.slots:
            at = round(slot / (units - 1) * len(rest))
            context = rest[:at] + gold + rest[at:]
            prompt = ids[:context_start] + context + ids[end:]
            g = (context_start + at, context_start + at + len(gold))
            # the context's tenths, the gold's own span cut out of the tenth it falls in
            edges = [context_start + round(k * len(context) / units) for k in range(units + 1)]
            tenths = tuple((a, b) for a, b in zip(edges[:-1], edges[1:]))
            out.append(WatchItem(WatchSet.in2, str(rec["id"]), slot, tuple(prompt), tenths, g, (tuple(target),)))
    if len(out) < questions * len(cfg.slots):
        raise ValueError(f"watch.questions / watch.loglik_questions: {questions} asked, the held-out IN2 split has only "
                         f"{len(out) // len(cfg.slots)} records with one gold segment left for the watch")
    return out


def build_panel(cfg: WatchConfig, layers: int, tokenizer: PreTrainedTokenizerBase, chat_template: bool,
                split: QuestionSplit, nq_path: Optional[Path] = None, in2_records: Sequence[Mapping[str, Any]] = (),
                in2_context_start: int = 0) -> WatchPanel:
    """The panel of `cfg.sets`: mdqa dev questions of `split` in `nq_path`, kv records, and (in2) the held-out
    `in2_records` whose contexts begin at `in2_context_start`; each set's first watch.questions in the Jacobian's
    rotation, the rest up to watch.loglik_questions measured by log p alone."""
    n = max(cfg.questions, cfg.loglik_questions)
    per_set: list[list[WatchItem]] = []
    extra: list[WatchItem] = []
    for name in map(WatchSet, cfg.sets):
        if name == WatchSet.in2:
            found = in2_items(in2_records, in2_context_start, cfg, questions=n)
        elif name == WatchSet.mdqa:
            found = mdqa_items(cfg, Path(str(nq_path)), split, tokenizer, chat_template, questions=n)
        else:
            found = kv_items(cfg, tokenizer, chat_template, questions=n)
        jacobian = set(list(dict.fromkeys(it.question for it in found))[:cfg.questions])
        per_set.append([it for it in found if it.question in jacobian])
        extra += [it for it in found if it.question not in jacobian]
    # the rotation's order: the sets take turns, so that each is refreshed at the same rate during a run
    items = [it for turn in itertools.zip_longest(*per_set) for it in turn if it is not None]
    return WatchPanel(cfg, items, layers, extra)


# ---------------------------------------------------------------------------------------------- one measurement


@dataclass
class SlotMass:
    """What one prompt's rho^2 says by unit: shares of the prompt's whole rho^2."""

    units: list[float]  # each unit's share
    gold: float  # the gold unit's share
    prior_units: list[float]  # the closed-form prior's share p^2 over each unit's span
    alpha: float  # the prior's alpha, fitted to the prompt's profile

    @property
    def documents(self) -> float:
        return float(sum(self.units))


def slot_mass(sq: np.ndarray, units: Sequence[tuple[int, int]], gold: tuple[int, int], layers: int) -> SlotMass:
    """Aggregate rho^2 (L,) of one prompt by unit. The prior (its profile p over the L positions, alpha fitted to
    rho = sqrt(rho^2)) is compared as p^2, the shape it predicts for rho^2."""
    sq = np.asarray(sq, dtype=np.float64)
    total = float(sq.sum())
    share = (lambda a, b: float(sq[a:b].sum()) / total) if total > 0 else (lambda a, b: math.nan)
    fit = fit_alpha(np.sqrt(sq), layers)
    p2 = prior_profile(sq.size, layers, fit.alpha) ** 2
    return SlotMass([share(a, b) for a, b in units], share(*gold),
                    [float(p2[a:b].sum() / p2.sum()) for a, b in units], float(fit.alpha))


def measure_item(model: torch.nn.Module, item: WatchItem, index: int, cfg: WatchConfig, layers: int
                 ) -> tuple[SlotMass, float]:
    """One panel prompt's `slot_mass`, from `num_probes` probes of the prompt's own fixed generator, and the gold
    answer's log p (the best alias) from the same forward."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    with eval_mode(model):
        sq, last_logits, cache = hutchinson_with_output(model, torch.tensor([list(item.ids)]), cfg.num_probes,
                                                        generator=generator)  # (k, 1, L), (1, V)
        loglik = best(continuation_logprobs(model, last_logits[0], cache, item.targets)) if cfg.loglik else math.nan
    return slot_mass(sq.mean(axis=0)[0], item.units, item.gold, layers), loglik


def measure_logliks(model: torch.nn.Module, items: Sequence[WatchItem]) -> list[float]:
    """The gold answer's log p (the best alias, teacher-forced) of every item: one forward each, no Jacobian."""
    if not items:
        return []
    with eval_mode(model):
        return [best(sequence_logprobs(model, it.ids, it.targets)) for it in items]


# ---------------------------------------------------------------------------------------------- the panel over a run


def _contrast(by_slot: Mapping[str, Mapping[int, float]], middle: int, strong: int, log: bool) -> list[float]:
    """Per question with both slots: value at `middle` − at `strong` (of the logs with `log`)."""
    out = []
    for values in by_slot.values():
        a, b = values.get(middle), values.get(strong)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        if log:
            if a <= 0 or b <= 0:
                continue
            a, b = math.log(a), math.log(b)
        out.append(a - b)
    return out


@dataclass
class WatchPanel:
    """The panel's prompts and their latest measurements; `metrics` pools them (module docstring)."""

    cfg: WatchConfig
    items: list[WatchItem]  # the Jacobian's, in the rotation's order (their log p from the same forward)
    layers: int
    extra: list[WatchItem] = field(default_factory=list)  # watch.loglik_questions beyond the Jacobian's: log p alone
    latest: dict[str, dict[str, Any]] = field(default_factory=dict)  # item key -> its latest Jacobian measurement
    logliks: dict[str, float] = field(default_factory=dict)  # item key -> its latest log p
    cursor: int = 0  # the next item the rotation measures
    history: list[dict[str, float]] = field(default_factory=list)  # the logged signals, for their step-to-step SD

    # -- measuring

    def jacobian_due(self, step: int, first: bool, last: bool) -> list[int]:
        """Indices of the items to measure at `step`: every one at the first and last step, else the next one every
        `every` steps, else none."""
        if self.cfg.every <= 0:
            return []
        if first or last:
            return list(range(len(self.items)))
        return [self.cursor % len(self.items)] if step % self.cfg.every == 0 else []

    def measure(self, model: torch.nn.Module, step: int, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Measure the items at `indices` (Jacobian and log p); their rows (for watch.jsonl)."""
        rows = []
        for i in indices:
            item = self.items[i]
            started = time.perf_counter()
            mass, loglik = measure_item(model, item, i, self.cfg, self.layers)
            rows.append(self._remember({
                "step": step, "kind": "jacobian", "set": item.set, "question": item.question, "slot": item.slot,
                "units": mass.units, "gold": mass.gold, "prior_units": mass.prior_units, "alpha": mass.alpha,
                "loglik": loglik, "seconds": time.perf_counter() - started}))
        if len(indices) == 1:
            self.cursor = (indices[0] + 1) % len(self.items)
        return rows

    def _remember(self, row: dict[str, Any]) -> dict[str, Any]:
        """Keep a row as its prompt's latest measurement."""
        key = f"{row['set']}/{row['question']}/{row['slot']}"
        if row["kind"] == "jacobian":
            self.latest[key] = row
        if self.cfg.loglik:
            self.logliks[key] = row["loglik"]
        return row

    def measure_first(self, model: torch.nn.Module, step: int, cache_dir: Optional[Path]) -> list[dict[str, Any]]:
        """What is due at the first step (`jacobian_due`, `loglik_due`), read back from `cache_dir` when the same
        function measured the same panel before: the runs of an experiment start from one model (LoRA's B is zero),
        so their first panels are one. The key hashes `MEASUREMENT`, the function and how it is computed
        (`reuse.computation_key`: call it under the autocast the measurement uses), every item and the probes'
        settings. None: measure."""
        jacobian, logliks = self.jacobian_due(step, True, False), self.loglik_due(step, True, False)
        path = None
        if cache_dir is not None:
            what = {"measurement": MEASUREMENT, "function": computation_key(model),
                    "probes": [self.cfg.num_probes, self.cfg.seed, self.cfg.loglik],
                    "items": [[it.key, it.ids, it.units, it.gold, it.targets] for it in map(self.items.__getitem__,
                                                                                            jacobian)],
                    "logliks": [[it.key, it.ids, it.targets] for it in logliks]}
            path = cache_dir / WATCH_CACHE / f"{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]}.json"
            if path.is_file():
                return [self._remember({**row, "step": step}) for row in json.loads(path.read_text(encoding="utf-8"))]
        rows = self.measure(model, step, jacobian) + self.measure_logliks(model, step, logliks)
        if path is not None:
            atomic_write_text(path, json.dumps(rows))
        return rows

    def measure_due(self, model: torch.nn.Module, step: int, first: bool = False, last: bool = False,
                    cache_dir: Optional[Path] = None) -> list[dict[str, Any]]:
        """Everything due at `step` (the Jacobians of `jacobian_due`, the log p of `loglik_due`; the first step's
        through the cache, `measure_first`); their rows."""
        if first:
            return self.measure_first(model, step, cache_dir)
        return (self.measure(model, step, self.jacobian_due(step, first, last))
                + self.measure_logliks(model, step, self.loglik_due(step, first, last)))

    def loglik_due(self, step: int, first: bool, last: bool) -> list[WatchItem]:
        """The items whose log p is measured alone at `step`: every one every loglik_every steps; at the first and
        last step, those no Jacobian measures there (the extra questions, or all when watch.every=0)."""
        if not self.cfg.loglik:
            return []
        if first or last:
            return self.extra if self.cfg.every > 0 else self.items + self.extra
        return self.items + self.extra if self.cfg.loglik_every > 0 and step % self.cfg.loglik_every == 0 else []

    def measure_logliks(self, model: torch.nn.Module, step: int, items: Sequence[WatchItem]) -> list[dict[str, Any]]:
        """The log p of `items`, forward passes only; their rows."""
        started = time.perf_counter()
        values = measure_logliks(model, items)
        seconds = (time.perf_counter() - started) / max(1, len(items))
        return [self._remember({"step": step, "kind": "loglik", "set": item.set, "question": item.question,
                                "slot": item.slot, "loglik": value, "seconds": seconds})
                for item, value in zip(items, values)]

    # -- the signals

    def sets(self) -> list[str]:
        return list(dict.fromkeys([it.set for it in self.items] + [key.split("/")[0] for key in self.latest]))

    def jacobian_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.sets():
            rows = [r for key, r in self.latest.items() if key.startswith(s + "/")]
            if not rows:
                continue
            gold: dict[str, dict[int, float]] = {}
            for r in rows:
                gold.setdefault(r["question"], {})[r["slot"]] = r["gold"]
            for slot in self.cfg.slots:
                at = [g[slot] for g in gold.values() if slot in g]
                if at:
                    out[f"{PREFIX}/{s}/gold_share@{slot}"] = float(np.mean(at))
            contrast = _contrast(gold, self.cfg.middle, self.cfg.strong[s], log=True)
            if contrast:
                out[f"{PREFIX}/{s}/gold_share_contrast"] = float(np.mean(contrast))
            out[f"{PREFIX}/{s}/doc_share"] = float(np.mean([sum(r["units"]) for r in rows]))
            units = np.array([r["units"] for r in rows])  # (n, units)
            prior = np.array([r["prior_units"] for r in rows])
            for k in range(units.shape[1]):
                out[f"{PREFIX}/{s}/unit_share@{k}"] = float(units[:, k].mean())
                out[f"{PREFIX}/{s}/prior_share@{k}"] = float(prior[:, k].mean())
        return out

    def logliks_complete(self, rows: Sequence[Mapping[str, Any]]) -> bool:
        """Whether `rows` (one step's) measured a log p that the pooled log p signals should show: any, without extra
        questions; with them, only a step that measured all of them, so that a logged value never mixes the extras'
        old log p with the rotation's new ones."""
        measured = {f"{r['set']}/{r['question']}/{r['slot']}" for r in rows if math.isfinite(r.get("loglik", math.nan))}
        return bool(measured) and all(it.key in measured for it in self.extra)

    def loglik_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.sets():
            by_q: dict[str, dict[int, float]] = {}
            for it in self.items + self.extra:
                if it.set == s and it.key in self.logliks:
                    by_q.setdefault(it.question, {})[it.slot] = self.logliks[it.key]
            if not by_q:
                continue
            for slot in self.cfg.slots:
                at = [v[slot] for v in by_q.values() if slot in v and math.isfinite(v[slot])]
                if at:
                    out[f"{PREFIX}/{s}/loglik@{slot}"] = float(np.mean(at))
            contrast = _contrast(by_q, self.cfg.middle, self.cfg.strong[s], log=False)
            if contrast:
                iv = stats.mean_interval(contrast)
                out |= {f"{PREFIX}/{s}/loglik_contrast": iv.value, f"{PREFIX}/{s}/loglik_contrast_lo": iv.low,
                        f"{PREFIX}/{s}/loglik_contrast_hi": iv.high}
        return out

    def noise(self, metrics: Mapping[str, float], window: int = 20) -> dict[str, float]:
        """Each contrast's and share's step-to-step SD over its last `window` logged values: the SD of successive
        differences over sqrt 2, which a trend hardly moves (`watch/sd/<signal>`)."""
        watched = {k: v for k, v in metrics.items() if k.endswith(("_contrast", "doc_share"))}
        self.history = (self.history + [watched])[-window:]
        out = {}
        for key in watched:
            series = np.array([h[key] for h in self.history if key in h])
            if series.size >= 3:
                out[f"{PREFIX}/sd/{key.removeprefix(PREFIX + '/')}"] = float(np.diff(series).std(ddof=1) / math.sqrt(2))
        return out

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"latest": self.latest, "logliks": self.logliks, "cursor": self.cursor, "history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latest = dict(state.get("latest", {}))
        self.logliks = dict(state.get("logliks", {}))
        self.cursor = int(state.get("cursor", 0))
        self.history = list(state.get("history", []))


def append_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_rows(path: Path, before_step: int) -> None:
    """Keep the rows of steps before `before_step` (a run resumed in place measures that step again)."""
    rows = [r for r in read_rows(path) if r["step"] < before_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- a run's change


def panel_header(panel: WatchPanel, step: int) -> dict[str, Any]:
    """watch.jsonl's first row: what the panel is, for whoever reads the rows back."""
    cfg, items, everything = panel.cfg, panel.items, panel.items + panel.extra
    count = lambda among, s: len({it.question for it in among if it.set == s})  # noqa: E731
    sets = list(dict.fromkeys(it.set for it in everything))
    return {"step": step, "kind": "panel", "sets": sets, "slots": cfg.slots, "middle": cfg.middle,
            "strong": dict(cfg.strong), "every": cfg.every, "loglik_every": cfg.loglik_every,
            "questions": {s: count(items, s) for s in sets}, "loglik_questions": {s: count(everything, s) for s in sets}}


@dataclass
class Signal:
    """One watched signal over a run: its value at the first and the last measurement, and the change per
    question with its interval over questions (`stats.mean_interval`)."""

    key: str  # the metrics key
    what: str  # in words
    start: float
    end: float
    change: stats.Interval
    steps: tuple[int, int]  # the steps the start and end come from


def _by_question(rows: Sequence[Mapping[str, Any]], value: str, first: bool) -> dict[str, dict[int, float]]:
    """question -> slot -> `value` of each prompt's first (or latest) row."""
    chosen: dict[tuple[str, int], Mapping[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["step"], reverse=first):
        chosen[(r["question"], r["slot"])] = r
    out: dict[str, dict[int, float]] = {}
    for (question, slot), r in chosen.items():
        out.setdefault(question, {})[slot] = r[value]
    return out


def _signal(key: str, what: str, start: Mapping[str, float], end: Mapping[str, float], steps: tuple[int, int]
            ) -> Optional[Signal]:
    shared = sorted(q for q in start.keys() & end.keys() if math.isfinite(start[q]) and math.isfinite(end[q]))
    if not shared:
        return None
    change = stats.mean_interval([end[q] - start[q] for q in shared])
    return Signal(key, what, float(np.mean([start[q] for q in shared])), float(np.mean([end[q] for q in shared])),
                  change, steps)


def _per_question(by_q: Mapping[str, Mapping[int, float]], middle: int, strong: int, kind: str) -> dict[str, float]:
    out = {}
    for q, v in by_q.items():
        if kind == "contrast_log":
            if v.get(middle, 0) > 0 and v.get(strong, 0) > 0:
                out[q] = math.log(v[middle]) - math.log(v[strong])
        elif kind == "contrast":
            if middle in v and strong in v:
                out[q] = v[middle] - v[strong]
        elif kind in v:  # a slot
            out[q] = v[kind]
    return out


def _measured_again(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of the prompts measured at two steps or more: a prompt measured once (a run still under way, before
    its rotation or its next log p panel came back to it) has no change to tell."""
    steps: dict[tuple[str, int], set[int]] = {}
    for r in rows:
        steps.setdefault((r["question"], r["slot"]), set()).add(r["step"])
    return [r for r in rows if len(steps[(r["question"], r["slot"])]) > 1]


def position_signals(rows: Sequence[Mapping[str, Any]]) -> list[Signal]:
    """The watched signals' start, end and change over a run, from its watch.jsonl rows (empty without them)."""
    header = next((r for r in rows if r.get("kind") == "panel"), None)
    if header is None:
        return []
    middle, out = header["middle"], []
    for s in header["sets"]:
        strong = header["strong"][s]
        for value, specs in (
            ("loglik", [("loglik_contrast", f"log p, gold at {middle} − at {strong} (nats)", "contrast"),
                        (f"loglik@{middle}", f"log p, gold at {middle} (nats)", middle),
                        (f"loglik@{strong}", f"log p, gold at {strong} (nats)", strong)]),
            ("gold", [("gold_share_contrast", f"ln gold share of rho², {middle} − {strong}", "contrast_log")]),
        ):
            mine = _measured_again([r for r in rows if r.get("kind") in ("jacobian", "loglik") and r["set"] == s
                                    and math.isfinite(r.get(value, math.nan))])
            if not mine:
                continue
            steps = (min(r["step"] for r in mine), max(r["step"] for r in mine))
            first, last = _by_question(mine, value, True), _by_question(mine, value, False)
            for key, what, how in specs:
                found = _signal(f"{PREFIX}/{s}/{key}", f"{s}: {what}", _per_question(first, middle, strong, how),
                                _per_question(last, middle, strong, how), steps)
                if found is not None:
                    out.append(found)
        jac = _measured_again([r for r in rows if r.get("kind") == "jacobian" and r["set"] == s])
        if jac:
            docs = [{**r, "docs": float(sum(r["units"]))} for r in jac]
            first, last = _by_question(docs, "docs", True), _by_question(docs, "docs", False)
            mean = {q: float(np.mean(list(v.values()))) for q, v in first.items()}
            mean_last = {q: float(np.mean(list(v.values()))) for q, v in last.items()}
            found = _signal(f"{PREFIX}/{s}/doc_share", f"{s}: the context's share of rho²", mean, mean_last,
                            (min(r["step"] for r in jac), max(r["step"] for r in jac)))
            if found is not None:
                out.append(found)
    return out


def watched_changes(journal: Path) -> dict[str, float]:
    """A run's end-minus-start change of every watched signal, from its watch.jsonl (empty without one)."""
    return {s.key: s.change.value for s in position_signals(read_rows(journal))}
