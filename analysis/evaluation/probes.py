"""Position-wise accuracy: greedy answers to probes whose gold sits at known positions, with each answer's kind
and, by default (`eval.loglik`), the teacher-forced log-likelihood of the gold answer.

The training loop calls `evaluate_in2` on held-out IN2 records (accuracy by gold depth) and, when
`eval.probes` is set, `evaluate_probes` on key-value / multi-document QA / needle probes built by
`build_probes`. Results go to the metrics log via `ProbeResult.to_metrics` and to
`<run>/eval/<probe>_step<N>.json`.
"""
from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Mapping, Sequence

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data_builders.probes import (
    NQ_FILE,
    Layout,
    ProbeItem,
    in2_probe,
    kv_probe,
    mdqa_probe,
    needle_probe,
    nq_filler,
    synthetic_filler,
)

if TYPE_CHECKING:
    from models.attention.attn_calibration import AttnCalibration

from analysis.evaluation.answer_kinds import describe_answer, gold_segment_index, kv_values, segment_texts
from analysis.evaluation.answer_record import AnswerRecord, chunks_of, record_path
from analysis.evaluation.comparability import probe_settings
from analysis.evaluation.config import (
    EvalConfig,
    Metric,
    Probe,
    probe_budget,
    probe_metric,
    probe_source,
    valprobing_files,
)
from analysis.evaluation.generate import GenerateFn, model_generate_fn
from analysis.evaluation.loglik import (
    LOGLIK_DEFINITION,
    LoglikFn,
    answers_and_logliks,
    best,
    model_loglik_fn,
    shares_prefill,
)
from analysis.evaluation.result import ITEM_DIGEST, ProbeResult
from analysis.evaluation.reuse import evaluation_key, item_digest
from analysis.evaluation.scoring import exact_match, first_line, whole_word_subspan_em
from data_builders.valprobing import build_task, read_pieces, shape_of

log = logging.getLogger(__name__)
# In an evaluation's settings (its result and its answer record's key): answers and log-likelihoods from one prefill
# a batch, not two passes; the values agree up to float rounding, so results made either way are not mixed
PREFILL = "answers and log-likelihoods share each batch's prefill"


def _answer_details(item: ProbeItem, prediction: str) -> dict[str, Any]:
    """What an answer is, beside its score: its kind of span (the gold document, a distractor, none; for kv the
    pair whose value it names) when the prompt's documents are known, the length of its first line and its
    short-answer scores."""
    if isinstance(item.prompt, str) and item.segments:
        documents = segment_texts(item.prompt, item.segments)
        return describe_answer(prediction, item.answers, documents, gold_segment_index(item.position, item.extra),
                               kv_values(documents) if item.probe == Probe.kv else None)
    line = first_line(prediction)
    return {"first_line_words": len(line.split()), "short_em": exact_match(line, item.answers),
            "whole_word": whole_word_subspan_em(line, item.answers)}


def _outcome(item: ProbeItem, prediction: str | None, metric: Metric, values: list[float] | None) -> dict[str, Any]:
    outcome = {"id": item.id, "query": item.query, "position": item.position, "label": item.label,
               "prediction": prediction or "", "answers": item.answers,
               "correct": math.nan if prediction is None else float(metric.score(prediction, item.answers)),
               "extra": {**item.extra, **({} if prediction is None else {"answer": _answer_details(item, prediction)})},
               ITEM_DIGEST: item_digest(item)}
    if values is not None:
        outcome["loglik"] = best(values)
        outcome["extra"]["loglik_aliases"] = values
    return outcome


def _described(item: ProbeItem, outcome: dict[str, Any]) -> dict[str, Any]:
    """A read-back outcome with `extra["answer"]` made again from its item and prediction, and its item's digest (a
    record made before outcomes kept it has none)."""
    outcome = {**outcome, ITEM_DIGEST: item_digest(item)}
    if "answer" not in outcome.get("extra", {}):
        return outcome  # nothing was answered (the log-likelihood alone)
    return {**outcome, "extra": {**outcome["extra"], "answer": _answer_details(item, outcome["prediction"])}}


def run_probe(
    items: Sequence[ProbeItem], generate_fn: GenerateFn | None, metric: Metric, settings: Mapping[str, Any] | None = None,
    loglik_fn: LoglikFn | None = None, record: AnswerRecord | None = None,
    group: Callable[[ProbeItem], Hashable] | None = None,
) -> ProbeResult:
    """Answer every item with `generate_fn` and score each answer against the item's answers with `metric`.

    Each outcome also holds its item's digest (`reuse.item_digest`), `extra["answer"]` (`_answer_details`) and, with
    `loglik_fn`, `loglik`: the best teacher-forced log-likelihood of the item's first answers
    (`analysis.evaluation.loglik`), each alias's in `extra["loglik_aliases"]`. The result's settings are `settings`
    with the metric's name and definition.
    Without `generate_fn` nothing is answered (the log-likelihood alone, which it then needs): every prediction
    is empty and `correct` nan.

    Items are answered in the chunks of `answer_record.chunks_of` (`group`: keep each group's run of items in one
    chunk), recorded one by one in `record` when given: the chunks it holds already are read back, not answered.
    """
    if not items:
        raise ValueError("run_probe needs at least one item")
    if generate_fn is None and loglik_fn is None:
        raise ValueError("run_probe without answers needs a loglik_fn: it would measure nothing")
    chunks = chunks_of(items, group=group)
    done = record.read_back() if record is not None else {}
    read_back = sum(len(chunks[c]) for c in done)
    if read_back:
        log.info("%s: %d of %d answers read back from %s (the same weights, items and settings)", items[0].probe,
                 read_back, len(items), record.path)
    outcomes: list[dict[str, Any]] = []
    with tqdm(total=len(items), initial=read_back, desc=f"{items[0].probe} answered", unit="item",
              postfix={"read back": read_back} if record is not None else None) as bar:
        for c, rows in enumerate(chunks):
            if c in done:
                # what an answer is follows from it and its item: described again, so that a record made by
                # earlier code reads as this code describes (the record keeps what is costly, the answers)
                outcomes += [_described(items[i], o) for i, o in zip(rows, done[c])]
                continue
            chunk = [items[i] for i in rows]
            predictions = generate_fn(chunk) if generate_fn is not None else [None] * len(chunk)
            if len(predictions) != len(chunk):
                raise ValueError(f"generate_fn returned {len(predictions)} answers for {len(chunk)} items")
            logliks = loglik_fn(chunk) if loglik_fn is not None else [None] * len(chunk)
            fresh = [_outcome(it, p, metric, v) for it, p, v in zip(chunk, predictions, logliks)]
            if record is not None:
                record.append(c, fresh)
            outcomes += fresh
            bar.update(len(chunk))
    settings = {"metric": metric.name, "metric_definition": metric.definition, **(settings or {})}
    if generate_fn is None:
        settings["answers"] = "not asked: the log-likelihood alone (correct is nan)"
    if loglik_fn is not None:
        settings["loglik"] = LOGLIK_DEFINITION
    return ProbeResult(items[0].probe, outcomes, settings)


def evaluate_in2(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, Any]],
    cfg: EvalConfig,
    record_dir: Path | None = None,
) -> tuple[dict[str, float], ProbeResult]:
    """Accuracy (`cfg.in2_metric` on the answer's first line) on the first `cfg.num_examples` held-out IN2 records,
    by gold-depth bin.

    Metric keys: `eval/in2/acc_mean` and `eval/in2/acc@<lower bin edge>` (`acc@0.0` ... `acc@0.9` for
    10 bins); a bin without records has no key. With `record_dir` (a cache folder), every answer is recorded there
    as it is made, and the answers recorded by any earlier evaluation of the same weights on the same questions
    with the same settings are read back instead (`analysis.evaluation.answer_record`).
    """
    items = in2_probe(itertools.islice(records, cfg.num_examples), bins=cfg.bins)
    # every in2 metric scores the first line: generation stops there, with the scores of the whole budget
    generate, loglik, prefill = _answer_fns(model, tokenizer, cfg, cfg.max_new_tokens, first_line_only=True,
                                            chat_template=False, loglik=cfg.loglik)
    settings = {**probe_settings("in2", cfg, items), **prefill}
    metric = probe_metric("in2", cfg)
    how = {"batch_size": cfg.batch_size, "batch_tokens": cfg.batch_tokens, "metric": metric.name,
           "first_line_only": True, "loglik": cfg.loglik, "loglik_aliases": cfg.loglik_aliases}
    record = _record(model, items, {**settings, **how}, record_dir)
    result = run_probe(items, generate, metric, settings, loglik, record)
    return result.to_metrics("eval"), result


def _answer_fns(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: EvalConfig, max_new_tokens: int,
    first_line_only: bool, chat_template: bool, loglik: bool, answers: bool = True,
    calibration: AttnCalibration | None = None, shared_prefix: bool = False,
) -> tuple[GenerateFn | None, LoglikFn | None, dict[str, str]]:
    """`run_probe`'s generate_fn (None without `answers`) and loglik_fn (None without `loglik`), and what they add
    to the evaluation's settings. Asked both, they share each batch's prefill where the model allows it
    (`loglik.shares_prefill`; not with calibration or a shared prefix, which answer otherwise)."""
    if loglik and answers and calibration is None and not shared_prefix and shares_prefill(model):
        generate, score = answers_and_logliks(model, tokenizer, max_new_tokens, cfg.batch_size, chat_template,
                                              first_line_only, cfg.batch_tokens, cfg.loglik_aliases)
        return generate, score, {"prefill": PREFILL}
    score = (model_loglik_fn(model, tokenizer, chat_template, cfg.loglik_aliases, shared_prefix=shared_prefix)
             if loglik else None)
    generate = model_generate_fn(
        model, tokenizer, max_new_tokens, cfg.batch_size, chat_template, first_line_only=first_line_only,
        batch_tokens=cfg.batch_tokens, calibration=calibration, shared_prefix=shared_prefix) if answers else None
    return generate, score, {}


def _record(model: PreTrainedModel, items: Sequence[ProbeItem], how: Mapping[str, Any], record_dir: Path | None,
            group: Callable[[ProbeItem], Hashable] | None = None) -> AnswerRecord | None:
    """The answer record of asking `model` `items` answered as `how` says, in `record_dir` (None: no record)."""
    if record_dir is None:
        return None
    chunks = [[items[i].id for i in rows] for rows in chunks_of(items, group=group)]
    key = evaluation_key(model, items, {**how, "chunks": [len(c) for c in chunks]})
    return AnswerRecord(record_path(record_dir, key), key, chunks)


def build_probes(cfg: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[ProbeItem]]:
    """Items of every probe in `cfg.probes` (fixed seed: every step and run sees the same queries).

    A data file, count or position that does not fit raises a ValueError naming the file, line and reason.
    """
    probes: dict[str, list[ProbeItem]] = {}
    pieces = valprobing_files(cfg)
    for name in map(Probe, cfg.probes):  # plain strings too: ValueError on an unknown probe
        if name == Probe.in2:
            raise ValueError("in2 items are a run's held-out records: evaluate_in2 scores them")
        if name.valprobing_task is not None:
            v = cfg.valprobing
            shape = shape_of(v.preset, v.pieces, v.sets, v.bin_width, v.max_prompt_tokens, "eval.valprobing")
            task = name.valprobing_task
            probes[name] = build_task(task, read_pieces(task, pieces[task][1]), shape, tokenizer, v.seed,
                                      cfg.chat_template).items
            continue
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
                                      layout=Layout(m.query_aware, m.order, m.keep),
                                      heldout=m.split if m.questions.held_out else None, part=m.questions.part,
                                      dev_share=m.dev_share)
        else:
            filler = nq_filler(Path(cfg.data_dir) / NQ_FILE) if cfg.data_dir is not None else synthetic_filler()
            probes[name] = needle_probe(filler, cfg.needle.depths, cfg.needle.lengths, tokenizer,
                                        n_examples=cfg.probe_examples)
    return probes


def evaluate_probes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Mapping[str, Sequence[ProbeItem]],
    cfg: EvalConfig,
    calibration: AttnCalibration | None = None,
    record_dir: Path | None = None,
    record_settings: Mapping[str, Any] | None = None,
) -> tuple[dict[str, float], dict[str, ProbeResult]]:
    """Run the probes from `build_probes` (and in2 items) on `model`, each with its budget and metric;
    metrics of all probes and the result of each. `calibration`: answer with attention calibration (whose
    per-batch segments the log-likelihood pass does not install: it is left out then). With `record_dir`, the
    answers are recorded and read back as `evaluate_in2` says; `record_settings`: what else changes the answers
    that the weights and items do not show (an installed intervention), part of the record's key."""
    results = {}
    for name, items in probes.items():
        # VaLProbing asks every position of one long context: its items share that context's prefill
        valprobing = Probe(name).valprobing_task is not None
        shared = valprobing and calibration is None
        answers = cfg.answers and (not valprobing or cfg.valprobing.answers)
        budget = probe_budget(name, cfg)
        generate, loglik, prefill = _answer_fns(
            model, tokenizer, cfg, budget, first_line_only=name == "mdqa", chat_template=cfg.chat_template,
            loglik=cfg.loglik and calibration is None, answers=answers, calibration=calibration, shared_prefix=shared)
        metric = probe_metric(name, cfg)
        settings = {**probe_settings(name, cfg, items), **prefill}
        group = _shared_context if shared else None
        how = {**settings, "budget": budget, "batch_size": cfg.batch_size, "batch_tokens": cfg.batch_tokens,
               "chat_template": cfg.chat_template, "metric": metric.name, "answers": answers, "shared_prefix": shared,
               "loglik": loglik is not None, "loglik_aliases": cfg.loglik_aliases, **(record_settings or {})}
        record = _record(model, items, how, record_dir, group)
        results[name] = run_probe(items, generate, metric, settings, loglik, record, group)
    metrics = {k: v for result in results.values() for k, v in result.to_metrics("eval").items()}
    return metrics, results


def _shared_context(item: ProbeItem) -> Any:
    """The VaLProbing set an item's context is (its items answer over one prefill of it)."""
    return item.extra["set"]
