"""Compare runs and checkpoints: accuracy by gold position, Jacobian profiles, valley and prior metrics.

    python -m analysis.compare outputs/in2/<runA> outputs/in2/<runB> --data-dir $POSDEBIAS_DATA
    python -m analysis.compare <run>/checkpoints/step-100 <run>/checkpoints/step-300 --probes kv,needle
    python -m analysis.compare <run> --probes kv,mdqa --data-dir $POSDEBIAS_DATA \
        --interventions reorder,truncate:5,query_aware,ms_poe

Each PATH is a run directory (its latest checkpoint, metrics.jsonl and jacobian.npz) or a checkpoint
folder (`save_pretrained` with a tokenizer; one inside `<run>/checkpoints/` also finds its run's files).
Only what is missing is computed:

- probes: `<run>/eval/<probe>_step<N>.json` is reused when it asked exactly the items asked here (their
  digests; same ids and answers for a file written before results kept digests) with the same settings, else
  the checkpoint answers them (greedy, batched, analysis.evaluation.probes); two PATHs that are one checkpoint
  (the same folder, e.g. a run and its last checkpoint, or the same weights: `reuse.function_digest`) are
  evaluated once, and a line says so;
- Jacobian profiles: from `jacobian.npz` when it holds the checkpoint's step (with step 0 beside it),
  else measured on held-out text (NQ long answers from --data-dir, else synthetic documents) joined
  into documents of the checkpoint's own tokens, with the jacobian settings of the first PATH that
  has a run config (`.hydra/config.yaml`), so measured and recorded profiles are of one kind.

IN2 records are token ids, so the in2 probe needs one tokenizer for all PATHs; they come from the
runs' own `eval/in2_step<N>.json` when those agree, else are rebuilt from the first run config's data
section (`build_datasets`, cached). Results the PATHs would be compared on that were not asked alike (a setting
both record differs, or an item id holds another prompt: `result.pairing_mismatch`) fail, naming the setting;
needle and VaLProbing items count each tokenizer's tokens, so PATHs with other tokenizers are compared on them by
their settings. `--interventions` also answers the probes each inference-time intervention
changes (analysis.evaluation.interventions) with every PATH, and reports them beside the plain curves: one figure per
probe and a table with each intervention's accuracy minus the un-intervened checkpoint's on the same items
(paired 95% interval resampling whole questions, `analysis.stats`). Writes `<out>/report.md` and its PNGs;
nothing reads wandb unless --wandb is given, nothing is logged to wandb unless --wandb-log is (the report's PNGs and accuracy
tables as one wandb run of job type `report`, written under `<out>/wandb/`). Resolving PATHs, loading
checkpoints and answering probes is `analysis.evaluation.checkpoints`; this module is the report and its CLI.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis import stats
from analysis.command_line import CommandParser, positive_int
from analysis.evaluation.checkpoints import (
    CompareError,
    ProbeBank,
    Target,
    answer_checkpoint,
    build_in2_items,
    check_unseen_mdqa,
    count_layers,
    counts_tokens,
    evaluated,
    load_checkpoint_tokenizer,
    load_model,
    reference_run,
    resolve_target,
)
from analysis.evaluation.comparability import REFERENCE, describe_settings, probe_settings
from analysis.evaluation.config import (
    DEFAULT_PROBES,
    POSITION_AXIS,
    PROBES,
    EvalConfig,
    KVProbeConfig,
    MDQAProbeConfig,
    MDQAQuestions,
    NeedleProbeConfig,
    Probe,
    ValProbingConfig,
    check_valprobing,
    probe_budget,
    probe_metric,
    with_budget,
)
from analysis.evaluation.interventions import Intervention, by_final_position
from analysis.evaluation.result import (
    LOGLIK,
    ProbeResult,
    fingerprint,
    paired_delta,
    pairing_mismatch,
    settings_mismatch,
)
from analysis.evaluation.reuse import function_digest, item_digest
from analysis.evaluation.watch import position_signals, read_rows
from analysis.measure.heldout import HeldoutError, heldout_documents
from analysis.measure.jacobian import JacobianConfig, build_eval_sequences, measure_sets, read_jacobian
from analysis.measure.rollout import (
    ROLLOUT_METRICS,
    RolloutVariant,
    mean_rollout,
    measure_rollouts,
    record_name,
    rollout_metrics,
)
from analysis.measure.topology import METRIC_KEYS, topology_metrics
from analysis.report.figures import PathProfile, plot_needle_grid, plot_position_accuracy, plot_profiles
from analysis.report.metrics_log import LoggerConfig, LoggerMode, log_report, read_metrics, shorten
from analysis.report.position_tables import answers_table, contrast_table
from analysis.report.tables import deltas_to_first, markdown_table, paired_cell, with_delta
from analysis.report.valprobing import report_lines as valprobing_report
from data_builders.files import atomic_write_text
from data_builders.mdqa import Distractors
from data_builders.probes import ProbeItem
from data_builders.tokenizer import default_cache_dir
from data_builders.valprobing import PRESETS as VALPROBING_PRESETS
from models.attention.attn_calibration import AttnCalibrationConfig
from models.attention.ms_poe import MsPoEConfig
from models.attention.patching import LayerSet
from models.build import DType
from models.training.run_dir import RUN_CONFIG, RunDir


@dataclass
class JacobianProfiles:
    """Mean Jacobian profiles (L,) per evaluation set: the checkpoint's, and step 0's from its run."""

    latest: dict[str, np.ndarray]
    initial: dict[str, np.ndarray]  # empty when no step-0 record exists
    source: str  # where `latest` comes from, for the report
    # {set: {variant: (L,)}}: the checkpoint's attention rollouts (analysis.measure.rollout); empty when unknown
    rollouts: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class Entry:
    """Everything the report shows for one PATH."""

    target: Target
    layers: int
    vocab: int
    results: dict[str, ProbeResult] = field(default_factory=dict)
    profiles: JacobianProfiles | None = None
    topology: dict[str, dict[str, float]] = field(default_factory=dict)  # set -> METRIC_KEYS -> value
    notes: list[str] = field(default_factory=list)
    # intervention tag -> probe -> result, and the wall time each probe's answers took (tag -> probe -> s)
    interventions: dict[str, dict[str, ProbeResult]] = field(default_factory=dict)
    intervention_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    plain_seconds: dict[str, float] = field(default_factory=dict)  # probe -> s, for the probes answered now
    digest: str | None = None  # `reuse.function_digest` of the weights, when the model was loaded


def short_labels(paths: Sequence[str | Path]) -> list[str]:
    """The fewest trailing path components that tell the PATHs apart ("runA", "step-1", ...)."""
    parts = [Path(p).resolve().parts for p in paths]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{'/'.join(p[-1:])} #{i + 1}" for i, p in enumerate(parts)]  # one path given twice


def check_shared_vocab(targets: Sequence[Target], tokenizers: Sequence[PreTrainedTokenizerBase]) -> None:
    """IN2 prompts are token ids: every PATH must read them with the first PATH's vocabulary."""
    reference = tokenizers[0].get_vocab()
    for target, tokenizer in zip(targets[1:], tokenizers[1:]):
        if tokenizer.get_vocab() != reference:
            raise CompareError(
                f"incompatible tokenizers: {target.path} (vocab {len(tokenizer)}) and {targets[0].path} "
                f"(vocab {len(tokenizers[0])}) differ, and the in2 probe needs shared token sequences; "
                "leave in2 out (--probes kv,mdqa,needle) to compare them"
            )


def _asked(result: ProbeResult) -> frozenset[tuple[str, tuple[str, ...]]]:
    """What makes two probe runs the same probe: the (id, answers) of every item asked."""
    return frozenset((o["id"], tuple(o["answers"])) for o in result.outcomes)


def _to_ask(items: Iterable[ProbeItem]) -> frozenset[tuple[str, tuple[str, ...]]]:
    """`_asked` of the result these items would give."""
    return frozenset((it.id, tuple(it.answers)) for it in items)


def _reusable(saved: ProbeResult, probe: str, items: Sequence[ProbeItem], cfg: EvalConfig) -> bool:
    """Whether a saved result is what asking `items` as `cfg` says would give, up to the answers: the same items
    (their digests, when it kept them), metric, budget and every other setting both record."""
    expected = {"metric": probe_metric(probe, cfg).name, **probe_settings(probe, cfg, items)}
    return (_asked(saved) == _to_ask(items) and saved.fingerprint in (None, fingerprint(map(item_digest, items)))
            and all(saved.settings.get(key) == expected[key] for key in ("metric", "max_new_tokens"))
            and settings_mismatch(probe, saved.settings, expected, ("saved", "asked")) is None)


def saved_result(target: Target, probe: str) -> tuple[ProbeResult, Path] | None:
    """`<run>/eval/<probe>_step<N>.json` of the checkpoint's step, if the run wrote one."""
    if target.run_dir is None or target.step is None:
        return None
    path = RunDir(target.run_dir).eval_json(probe, target.step)
    if not path.is_file():
        return None
    try:
        return ProbeResult.load_json(path), path
    except (OSError, ValueError, KeyError) as err:
        raise CompareError(f"{target.path}: unreadable {path}: {err}") from err


def in2_items(
    targets: Sequence[Target],
    reference: tuple[Target, DictConfig] | None,
    tokenizer: PreTrainedTokenizerBase,
    examples: int,
) -> tuple[list[ProbeItem] | None, str]:
    """IN2 items for every PATH (None: take each run's saved result as it is), and where they come from.

    None when every PATH has a saved in2 result and all asked the same records (nothing to rebuild),
    or when no run config exists to rebuild them from; else `build_in2_items` of the reference run.
    """
    saved = [saved_result(t, "in2") for t in targets]
    if all(saved) and len({_asked(s[0]) for s in saved}) == 1 and not any(
            pairing_mismatch(saved[0][0], s[0], (str(saved[0][1]), str(s[1]))) for s in saved[1:]):
        return None, "the runs' own eval JSONs, which asked the same records alike"
    if reference is None:
        return None, "saved results only: no PATH has a run config (.hydra/config.yaml) to rebuild records"
    items = build_in2_items(reference, tokenizer, examples)
    return items, f"{len(items)} held-out records rebuilt from the run config of {reference[0].label}"


def recorded_profiles(target: Target) -> JacobianProfiles | None:
    """The checkpoint's step (and step 0) from its run's jacobian.npz, if that step was recorded."""
    path = RunDir(target.run_dir).jacobian if target.run_dir is not None else None
    if path is None or target.step is None or not path.is_file():
        return None
    try:
        steps, raw = read_jacobian(path)
        arrays = {k: v.astype(np.float64) for k, v in raw.items()}  # (n_seq, S, L) each
    except (OSError, ValueError, KeyError) as err:
        raise CompareError(f"{target.path}: unreadable {path}: {err}") from err
    hits = np.flatnonzero(steps == target.step)
    if not len(hits):
        return None
    arrays = {k: v for k, v in arrays.items() if v.shape[0] > 0}
    if not arrays:
        return None
    initial = {k: v[:, 0].mean(0) for k, v in arrays.items()} if steps[0] == 0 and target.step > 0 else {}
    L = next(iter(arrays.values())).shape[-1]
    return JacobianProfiles({k: v[:, hits[0]].mean(0) for k, v in arrays.items()}, initial,
                            f"jacobian.npz of its run, step {target.step}, L={L}",
                            recorded_rollouts(RunDir(target.run_dir).rollout, target.step, list(arrays)))


def recorded_rollouts(path: Path, step: int, sets: Sequence[str]) -> dict[str, dict[str, np.ndarray]]:
    """{set: {variant: (L,)}} of `step` from a run's rollout.npz; empty when it has none for that step."""
    if not path.is_file():
        return {}
    steps, arrays = read_jacobian(path)
    hits = np.flatnonzero(steps == step)
    if not len(hits):
        return {}
    return {name: {v: mean_rollout(arrays[record_name(name, v)][:, hits[0]]) for v in RolloutVariant
                   if record_name(name, v) in arrays} for name in sets}


def measure_profiles(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: JacobianConfig,
    data_dir: str | Path | None,
) -> JacobianProfiles:
    """Profiles measured now on held-out text in this checkpoint's tokens (no step-0 record)."""
    n_docs = cfg.n_vanilla + cfg.n_chunked * math.ceil(cfg.seq_len / cfg.chunk_len)
    try:
        docs, source = heldout_documents(tokenizer, data_dir, cfg.seq_len, n_docs)
    except HeldoutError as err:
        raise CompareError(str(err)) from err
    seqs = build_eval_sequences(docs, cfg.seq_len, cfg.n_vanilla, cfg.n_chunked, cfg.chunk_len)
    seqs = {k: v for k, v in seqs.items() if len(v)}
    results = measure_sets(model, seqs, cfg)
    rolls = {name: {v: mean_rollout(rows) for v, rows in by_variant.items()}
             for name, by_variant in measure_rollouts(model, seqs).items()}
    return JacobianProfiles({k: r.profile.mean(0) for k, r in results.items()}, {},
                            f"measured on {source}, L={cfg.seq_len}, {cfg.estimator}", rolls)


def jacobian_settings(reference: tuple[Target, DictConfig] | None, seq_len: int | None) -> JacobianConfig:
    """The reference run's jacobian section (the defaults without one), `seq_len` overriding its L.

    A profile here is measured once: the probes a run pooled over `window` steps are drawn at once (hutchinson needs
    2 for its standard error), and a run that measured no set (jacobian=off allows it) measures the default sets."""
    cfg = JacobianConfig()
    if reference is not None:
        source, run_cfg = reference
        try:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JacobianConfig), run_cfg.jacobian))
        except OmegaConfBaseException as err:
            raise CompareError(f"{source.path}: unreadable jacobian section in {RUN_CONFIG}: {err}") from err
    cfg = replace(cfg, num_probes=max(2, cfg.num_probes * cfg.window), window=1)
    if cfg.n_vanilla == cfg.n_chunked == 0:
        cfg = replace(cfg, n_vanilla=JacobianConfig.n_vanilla, n_chunked=JacobianConfig.n_chunked)
    if seq_len is not None:
        cfg.seq_len = seq_len
    return cfg


@dataclass
class CompareConfig:
    """What `compare` asks of every PATH and where the report goes (`python -m analysis.compare`'s options)."""

    out: str | Path = "compare"  # the report's folder
    probes: Sequence[str] = DEFAULT_PROBES
    examples: int = 20  # queries per probe, each asked at every gold position (in2: examples x bins records)
    data_dir: str | Path | None = None  # folder of the kv / nq files; None = synthetic kv, filler and Jacobian text
    # the probes' settings (the defaults: the reference's setup for kv and mdqa)
    kv: KVProbeConfig = field(default_factory=KVProbeConfig)
    mdqa: MDQAProbeConfig = field(default_factory=MDQAProbeConfig)
    needle: NeedleProbeConfig = field(default_factory=NeedleProbeConfig)
    valprobing: ValProbingConfig = field(default_factory=ValProbingConfig)
    max_new_tokens: int | None = None  # one greedy budget for every probe (not comparable); None = each probe's own
    batch_size: int = 16  # prompts per generate call
    # wrap text prompts (kv, mdqa, needle) in each tokenizer's chat template; None = as the reference run's
    # eval.chat_template (no run among the PATHs: plain prompts)
    chat_template: bool | None = None
    loglik: bool = True  # also score each item's gold answer by its teacher-forced log-likelihood
    # record every answer as it is made (analysis.evaluation.answer_record): the same command after a kill answers
    # only what is missing
    resume: bool = True
    seq_len: int | None = None  # L of measured Jacobian profiles; None = the reference run's jacobian.seq_len (256)
    device: str = "auto"
    dtype: DType = DType.float32
    use_wandb: bool = False  # also read each run's wandb summary
    log_wandb: str | None = None  # offline | online: also log the report's PNGs and accuracy tables as a wandb run
    # `Intervention.parse` texts (reorder[:order], truncate:K[:order], query_aware, ms_poe, attn_calibration), each
    # answered by every PATH on the probes it changes
    interventions: Sequence[str] = ()
    ms_poe: MsPoEConfig = field(default_factory=MsPoEConfig)  # the settings of Ms-PoE
    calibration: AttnCalibrationConfig = field(default_factory=AttnCalibrationConfig)  # of attention calibration


@dataclass
class ComparePlan:
    """What every PATH is asked, built once: the probes and their items, each intervention with its items (the
    probe settings it makes), and the Jacobian settings of measured profiles."""

    probes: list[Probe]
    bank: ProbeBank
    interventions: list[tuple[Intervention, ProbeBank]]
    jacobian: JacobianConfig


def compare_plan(targets: Sequence[Target], tokenizers: Sequence[PreTrainedTokenizerBase], cfg: CompareConfig
                 ) -> tuple[ComparePlan, list[str]]:
    """The plan of `cfg` for the PATHs (in2 records shared by all, the interventions parsed and checked), and the
    report's notes on where its items come from."""
    probes = [Probe(p) for p in cfg.probes]
    reference = reference_run(targets)
    notes = [f"probes: {', '.join(probes)}; queries per probe and position: {cfg.examples}; "
             f"data folder: {cfg.data_dir or 'none (synthetic kv, filler and Jacobian text)'}"]
    in2 = None
    if Probe.in2 in probes:
        check_shared_vocab(targets, tokenizers)
        in2, in2_source = in2_items(targets, reference, tokenizers[0], cfg.examples)
        notes.append(f"in2 items: {in2_source}")
    chat_template = cfg.chat_template
    if chat_template is None:
        chat_template = reference is not None and bool(reference[1].get("eval", {}).get("chat_template", False))
    if chat_template:
        for target, tokenizer in zip(targets, tokenizers):
            if not getattr(tokenizer, "chat_template", None):
                raise CompareError(f"{target.path}: chat templates asked for, but its tokenizer has none (a base "
                                   "model's usually has none: use --no-chat-template)")
    notes.append(f"prompts: {'in the chat template' if chat_template else 'plain text'}")
    eval_cfg = EvalConfig(probe_examples=cfg.examples, data_dir=None if cfg.data_dir is None else str(cfg.data_dir),
                          batch_size=cfg.batch_size, chat_template=chat_template, loglik=cfg.loglik, kv=cfg.kv,
                          mdqa=cfg.mdqa, needle=cfg.needle, valprobing=cfg.valprobing)
    if cfg.max_new_tokens is not None:
        eval_cfg = with_budget(eval_cfg, cfg.max_new_tokens)
    try:
        interventions = [Intervention.parse(text, cfg.ms_poe, cfg.calibration) for text in cfg.interventions]
    except ValueError as err:
        raise CompareError(str(err)) from err
    for intervention in interventions:
        if not intervention.changes(probes):
            raise CompareError(f"intervention {intervention.tag} changes none of the probes {list(probes)}")
    banks = [(intervention, ProbeBank(intervention.configure(eval_cfg), in2)) for intervention in interventions]
    return ComparePlan(probes, ProbeBank(eval_cfg, in2), banks, jacobian_settings(reference, cfg.seq_len)), notes


def reuse_recorded(entry: Entry, tokenizer: PreTrainedTokenizerBase, plan: ComparePlan) -> dict[str, list[ProbeItem]]:
    """Take into `entry` each probe result its run recorded with the items and setup asked here; the items of the
    probes left to answer."""
    target, bank = entry.target, plan.bank
    pending: dict[str, list[ProbeItem]] = {}
    for probe in plan.probes:
        try:
            items = bank.items(probe, tokenizer)
        except CompareError as err:  # needle items depend on this PATH's tokenizer
            raise CompareError(f"{target.path}: {err}") from err
        saved = saved_result(target, probe)
        if saved is not None and (items is None or _reusable(saved[0], probe, items, bank.cfg)):
            entry.results[probe] = saved[0]
            entry.notes.append(f"{probe}: reused {saved[1]}")
        elif items:
            pending[probe] = items
            if saved is not None:
                entry.notes.append(f"{probe}: not reusing {saved[1]}, which asked other items or was made with "
                                   "other settings")
        else:
            entry.notes.append(f"{probe}: skipped (no items: mdqa needs --data-dir or --mdqa-path, in2 a run config)")
    return pending


def set_profiles(entry: Entry, profiles: JacobianProfiles) -> None:
    """`entry`'s Jacobian profiles, with their valley, prior and rollout metrics."""
    entry.profiles = profiles
    entry.notes.append(f"Jacobian: {profiles.source}" + ("" if profiles.initial else "; no step-0 profile"))
    entry.topology = {name: topology_metrics(p, entry.layers) for name, p in profiles.latest.items()}
    for name, by_variant in profiles.rollouts.items():
        entry.topology[name].update({f"rollout/{v}/{m}": value for v, curve in by_variant.items()
                                     for m, value in rollout_metrics(profiles.latest[name], curve).items()})


def answer_interventions(entry: Entry, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                         plan: ComparePlan, records: Path | None = None) -> None:
    """Answer the probes each intervention changes, with its bank of items (no run records them), into `entry`;
    `records`: the answer records' folder (`answer_checkpoint`)."""
    for intervention, bank in plan.interventions:
        asked = {p: its for p in intervention.changes(plan.probes) if (its := bank.items(p, tokenizer))}
        results, seconds = answer_checkpoint(model, tokenizer, asked, bank.cfg, intervention,
                                             f"{entry.target.path}: intervention {intervention.tag}", records)
        entry.interventions[intervention.tag] = results
        entry.intervention_seconds[intervention.tag] = seconds
        entry.notes.append(f"intervention {intervention.tag}: " + ", ".join(f"{p} answered in {s:.1f} s"
                                                                            for p, s in seconds.items()))


def answer_records(cfg: CompareConfig) -> Path | None:
    """Where the answers are recorded as they are made (`cfg.resume`), else None."""
    return default_cache_dir() if cfg.resume else None


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers turn every prompt into the same tokens: one vocabulary, one chat template."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def one_checkpoint(target: Target, tokenizer: PreTrainedTokenizerBase, digest: str | None,
                   earlier: Sequence[tuple[Entry, PreTrainedTokenizerBase]]) -> tuple[Entry, str] | None:
    """The earlier PATH's entry that is `target`'s checkpoint read with the same tokenizer, and how that is known:
    the same folder (or hub id), or the same weights (`digest`, when known); None when there is none."""
    where = target.hub_id or Path(target.checkpoint).resolve()
    for entry, other in earlier:
        if (entry.target.hub_id or Path(entry.target.checkpoint).resolve()) == where and same_tokenizer(other, tokenizer):
            return entry, f"both {target.where()}"
        if digest is not None and entry.digest == digest and same_tokenizer(other, tokenizer):
            return entry, f"the same weights, digest {digest[:12]}"
    return None


def share_evaluations(entry: Entry, twin: Entry, why: str, pending: dict[str, list[ProbeItem]],
                      profiles: JacobianProfiles | None) -> tuple[dict[str, list[ProbeItem]], JacobianProfiles]:
    """Take into `entry` what `twin`, an earlier PATH that is the same checkpoint, evaluated: the probes left to
    answer, the interventions and, without a recorded profile, the twin's; says so in one line. The probes still
    left to answer, and the profiles."""
    print(f"{twin.target.path} and {entry.target.path} are one checkpoint ({why}): evaluated once")
    entry.notes.append(f"one checkpoint with `{twin.target.label}` ({why}): evaluated once")
    entry.digest = entry.digest or twin.digest
    for probe in [p for p in pending if p in twin.results]:
        entry.results[probe] = twin.results[probe]
        entry.notes.append(f"{probe}: the answers of `{twin.target.label}`")
    entry.interventions, entry.intervention_seconds = twin.interventions, twin.intervention_seconds
    if profiles is None:
        profiles = replace(twin.profiles, source=f"{twin.profiles.source}, as for `{twin.target.label}`")
    return {p: items for p, items in pending.items() if p not in entry.results}, profiles


def evaluate_target(target: Target, tokenizer: PreTrainedTokenizerBase, plan: ComparePlan, cfg: CompareConfig,
                    earlier: Sequence[tuple[Entry, PreTrainedTokenizerBase]] = ()) -> Entry:
    """Reuse what the PATH's run recorded, and what an `earlier` PATH (its entry and tokenizer) that is the same
    checkpoint evaluated (`one_checkpoint`, `share_evaluations`), and compute the rest (loading the model only
    then); then answer the probes each intervention changes. What is answered here records the checkpoint."""
    entry = Entry(target, count_layers(target), len(tokenizer))
    pending = reuse_recorded(entry, tokenizer, plan)
    profiles = recorded_profiles(target)
    model = None
    twin = one_checkpoint(target, tokenizer, None, earlier)
    if twin is None and (pending or profiles is None or plan.interventions):
        model = load_model(target, cfg.device, cfg.dtype)
        entry.digest = function_digest(model)
        twin = one_checkpoint(target, tokenizer, entry.digest, earlier)
    if twin is not None:
        pending, profiles = share_evaluations(entry, *twin, pending, profiles)
    if model is None and (pending or profiles is None or len(entry.interventions) < len(plan.interventions)):
        model = load_model(target, cfg.device, cfg.dtype)
        entry.digest = function_digest(model)
    if pending:
        results, entry.plain_seconds = answer_checkpoint(model, tokenizer, pending, plan.bank.cfg,
                                                         record_dir=answer_records(cfg))
        for result in results.values():
            result.checkpoint = evaluated(target, entry.digest)
        entry.results.update(results)
        for probe, items in pending.items():
            entry.notes.append(f"{probe}: evaluated now ({len(items)} items, up to "
                               f"{probe_budget(probe, plan.bank.cfg)} new tokens, {entry.plain_seconds[probe]:.1f} s)")
    if profiles is None:
        profiles = measure_profiles(model, tokenizer, plan.jacobian, cfg.data_dir)
    set_profiles(entry, profiles)
    if len(entry.interventions) < len(plan.interventions):
        answer_interventions(entry, model, tokenizer, plan, answer_records(cfg))
        for results in entry.interventions.values():
            for result in results.values():
                result.checkpoint = evaluated(target, entry.digest)
    return entry


def check_pairable(entries: Sequence[Entry], tokenizers: Sequence[PreTrainedTokenizerBase],
                   probes: Sequence[str]) -> None:
    """CompareError when a PATH's result of a probe, which the report pairs with the first PATH's by question, was
    not asked alike (`result.pairing_mismatch`). Needle and VaLProbing items count each tokenizer's tokens
    (`counts_tokens`): PATHs with other tokenizers are compared on them by their settings, less the count of items
    that did not fit."""
    for probe in probes:
        held = [(e, tok) for e, tok in zip(entries, tokenizers) if probe in e.results]
        if not held:
            continue
        first, first_tokenizer = held[0]
        for other, tokenizer in held[1:]:
            own_items = counts_tokens(probe) and not same_tokenizer(first_tokenizer, tokenizer)
            why = pairing_mismatch(first.results[probe], other.results[probe],
                                   (str(first.target.path), str(other.target.path)),
                                   free={"skipped"} if own_items else (), items=not own_items)
            if why is not None:
                raise CompareError(f"{why}: not asked alike, so nothing pairs them; compare PATHs evaluated with "
                                   f"the same settings, or leave {probe} out (--probes)")


def path_profile(entry: Entry, set_name: str) -> PathProfile | None:
    """What the profiles figure draws of one PATH's set: its profile, step 0 and measured-λ rollout; None
    when the PATH has no profile of that set."""
    profile = entry.profiles.latest.get(set_name) if entry.profiles else None
    if profile is None:
        return None
    return PathProfile(entry.target.label, entry.target.step, entry.layers, profile,
                       entry.profiles.initial.get(set_name),
                       entry.profiles.rollouts.get(set_name, {}).get(RolloutVariant.measured))


def _last_logged(rows: Sequence[Mapping[str, Any]], key: str, step: int | None) -> str:
    """The last value of `key` logged at or before `step` (any step when unknown), with its step if earlier."""
    found = [r for r in rows if isinstance(r.get(key), (int, float)) and (step is None or r["step"] <= step)]
    if not found:
        return "–"
    value, at = float(found[-1][key]), found[-1]["step"]
    return with_delta(value) if at == step else f"{with_delta(value)} (step {at})"


def _wandb_summary(target: Target) -> tuple[str, dict[str, Any]]:
    """The newest wandb-summary.json of the run (online or synced runs write one; offline runs do not)."""
    if target.run_dir is None:
        return "none (not in a run directory)", {}
    found = sorted(target.run_dir.glob("wandb/*run-*/files/wandb-summary.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return "none (offline runs keep their history in run-*.wandb; metrics.jsonl has the same numbers)", {}
    try:
        return str(found[-1]), json.loads(found[-1].read_text())
    except (OSError, ValueError) as err:
        return f"{found[-1]} (unreadable: {err})", {}


def _inputs_table(entries: Sequence[Entry]) -> list[str]:
    rows = []
    for e in entries:
        run = e.target.run_dir
        logged = read_metrics(run) if run is not None and RunDir(run).metrics.is_file() else []
        losses = [_last_logged(logged, key, e.target.step) for key in ("train/loss", "eval/loss")]
        rows.append([e.target.label, f"`{e.target.path}`", f"`{e.target.checkpoint}`", str(e.target.step),
                     str(e.layers), str(e.vocab), *losses])
    return markdown_table(["PATH", "given", "checkpoint", "step", "layers", "vocab", "train/loss", "eval/loss"], rows)


def _accuracy_table(entries: Sequence[Entry], probes: Sequence[str]) -> list[str]:
    rows = []
    for probe in probes:
        results = [e.results.get(probe) for e in entries]
        rows.append([probe, *deltas_to_first([r.mean if r else None for r in results])])
        if any(r is not None and -1 in r.labels() for r in results):
            closed = [r.accuracy_by_position().get(-1) if r else None for r in results]
            rows.append([f"{probe} closed-book", *deltas_to_first(closed)])
    return markdown_table(["probe", *(e.target.label for e in entries)], rows)


def _settings_lines(entries: Sequence[Entry], probes: Sequence[str]) -> list[str]:
    """Per probe: each PATH's metric and settings, one line when all PATHs agree."""
    lines = []
    for probe in probes:
        described = {e.target.label: describe_settings(e.results[probe].settings) for e in entries
                     if probe in e.results}
        if not described:
            continue
        if len(set(described.values())) == 1:
            lines.append(f"- **{probe}**: {next(iter(described.values()))}")
        else:
            lines.append(f"- **{probe}**: the PATHs' settings differ, compare their numbers with care:")
            lines += [f"  - `{label}`: {text}" for label, text in described.items()]
    return lines


def _topology_table(entries: Sequence[Entry], set_name: str) -> list[str]:
    sources = [e.profiles.source if e.profiles and set_name in e.profiles.latest else "–" for e in entries]
    rows = [["source", *sources]]
    rollout_keys = [f"rollout/{v}/{m}" for v in RolloutVariant for m in ROLLOUT_METRICS]
    keys = [*METRIC_KEYS, *(k for k in rollout_keys if any(k in e.topology.get(set_name, {}) for e in entries))]
    rows += [[f"`{key}`", *deltas_to_first([e.topology.get(set_name, {}).get(key) for e in entries])] for key in keys]
    return markdown_table(["metric", *(e.target.label for e in entries)], rows)


def _last_value(value: Any) -> Any:
    """A summary value: a `define_metric` summary is a dict ({"min": ..., "last": ...}): its last value."""
    return value.get("last") if isinstance(value, dict) else value


def _wandb_table(entries: Sequence[Entry]) -> list[str]:
    rows = []
    for e in entries:
        where, summary = _wandb_summary(e.target)
        values = [_last_value(summary.get(k)) for k in ("train/loss", "eval/loss")]
        rows.append([e.target.label, where, *(with_delta(v if isinstance(v, (int, float)) else None) for v in values)])
    return markdown_table(["PATH", "summary", "train/loss", "eval/loss"], rows)


def _position_signal_lines(entries: Sequence[Entry]) -> list[str]:
    """The watch's signals of each run among the PATHs (analysis.evaluation.watch): what a fine-tune changed in how
    the model reads the task's prompts, first in the report."""
    runs: dict[Path, str] = {}
    for e in entries:
        if e.target.run_dir is not None and RunDir(e.target.run_dir).watch.is_file():
            runs.setdefault(e.target.run_dir, e.target.label)
    signals = {label: {s.key: s for s in position_signals(read_rows(RunDir(run_dir).watch))}
               for run_dir, label in runs.items()}
    signals = {label: found for label, found in signals.items() if found}
    if not signals:
        return []
    keys = list(dict.fromkeys(key for found in signals.values() for key in found))
    what = {key: s.what for found in signals.values() for key, s in found.items()}

    def cell(s: Any) -> str:
        if s is None:
            return "—"
        return (f"{s.start:.3f} → {s.end:.3f}: {s.change.value:+.3f} [{s.change.low:+.3f}, {s.change.high:+.3f}] "
                f"(steps {s.steps[0]} → {s.steps[1]})")

    rows = [[what[key], *(cell(found.get(key)) for found in signals.values())] for key in keys]
    return ["## Position signals", "",
            "Each run's watch (analysis.evaluation.watch, on the task's own prompts): first → last measurement, and "
            "the change per watch question with its 95% interval over questions.", "",
            *markdown_table(["signal", *signals], rows), ""]


def write_report(
    out: Path,
    entries: Sequence[Entry],
    probes: Sequence[str],
    notes: Sequence[str],
    use_wandb: bool = False,
    film_bins: bool = False,
) -> Path:
    """`<out>/report.md` with its PNGs: inputs, probe accuracy, curves, profiles, metrics, provenance; VaLProbing
    (`film_bins`: its bins as FILM's plot.py builds them)."""
    first = entries[0].target.label
    lines = ["# Checkpoint comparison", "", f"Deltas (Δ) are against the first PATH, `{first}`.", "",
             *_position_signal_lines(entries),
             "## Inputs", "", *_inputs_table(entries), "",
             "## Probe accuracy", "", "Mean accuracy over the gold positions (closed-book left out).", "",
             *_accuracy_table(entries, probes), "",
             "## Metrics and settings", "",
             "How each PATH's numbers were made (kv and mdqa: comparable with the published curves of "
             f"{REFERENCE} only where it says so).", "",
             *_settings_lines(entries, probes), "",
             "## Accuracy by gold position", "",
             "Error bars: 95% bootstrap intervals over the questions asked at each position; dashed: closed-book "
             "accuracy (mdqa).", ""]
    for probe in probes:
        results = {e.target.label: e.results[probe] for e in entries if probe in e.results}
        lines += [f"### {probe}", ""]
        if results:
            png = plot_position_accuracy(results, out / f"accuracy_{probe}.png",
                                         f"{probe}: accuracy by gold position", POSITION_AXIS[probe])
            lines += [f"![{probe}]({png.name})", ""]
        else:
            lines += ["No PATH has results for this probe (see Provenance).", ""]
    lines += _loglik_lines(out, entries, probes)
    valprobing = valprobing_report({e.target.label: e.results for e in entries}, out / "valprobing.png",
                                   film_bins, "VaLProbing")
    if valprobing:
        lines += ["## VaLProbing", "", *valprobing]
    needle = {e.target.label: e.results["needle"] for e in entries if "needle" in e.results}
    if needle:
        png = plot_needle_grid(needle, out / "needle_grid.png", "needle: accuracy by context length and depth")
        lines += ["## Needle grid", "", "Accuracy by context length and needle depth" + (
            "; bottom row: each PATH minus the first." if len(needle) > 1 else "."), "",
            f"![needle_grid]({png.name})", ""]

    if any(e.interventions for e in entries):
        lines += _intervention_lines(out, entries, probes)

    sets = list(dict.fromkeys(name for e in entries if e.profiles for name in e.profiles.latest))
    lines += ["## Jacobian profiles", "",
              "Solid: the checkpoint; dashed: its best-fitting Cesàro prior (free scale); dotted: step 0 of "
              "its run; dash-dot: its attention rollout with measured residual shares (analysis.measure.rollout, free "
              "scale). Anchored: divided by the last position.", ""]
    for name in sets:
        png = plot_profiles([path_profile(e, name) for e in entries], name, out / f"jacobian_{name}.png")
        lines += [f"### {name}", "", f"![{name}]({png.name})", ""]
    lines += ["## Valley, prior and rollout metrics", "",
              "`rollout/<variant>/*`: how well each attention rollout of the checkpoint predicts its measured "
              "profile (Spearman, W1, RMSE of log10 with a free scale).", ""]
    for name in sets:
        lines += [f"### {name}", "", *_topology_table(entries, name), ""]

    lines += ["## Provenance", "", *(f"- {note}" for note in notes)]
    lines += [f"- `{e.target.label}`: {note}" for e in entries for note in e.notes]
    if use_wandb:
        lines += ["", "## wandb", "", "Optional: each run's wandb summary, when it has one.", "",
                  *_wandb_table(entries)]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report


def _loglik_lines(out: Path, entries: Sequence[Entry], probes: Sequence[str]) -> list[str]:
    """Per probe every PATH answered with log-likelihoods (`eval.loglik`): the gold answer's log-likelihood by
    position (figure), each position's contrast to the first PATH's strong end and its change against the first
    PATH, and what the answers are (`analysis.report.position_tables`)."""
    lines: list[str] = []
    for probe in probes:
        results = {e.target.label: e.results[probe] for e in entries if probe in e.results}
        if not results or not all(r.has_loglik for r in results.values()):
            continue
        first = next(iter(results.values()))
        strong = first.strong_end(LOGLIK)
        png = plot_position_accuracy(results, out / f"loglik_{probe}.png",
                                     f"{probe}: log p(gold answer) by gold position", POSITION_AXIS[probe], LOGLIK)
        lines += [f"### {probe}", "", f"![loglik_{probe}]({png.name})", ""]
        if first.asks_at_several_positions:  # in2 asks each question at one depth: no within-question contrast
            lines += [*contrast_table(results, strong, score=LOGLIK), ""]
        if answers := answers_table(results):
            lines += ["What the answers are (shares of each position's answers):", "", *answers, ""]
    if not lines:
        return []
    return ["## Position without answer format: log-likelihood of the gold answer", "",
            "log p(gold answer | prompt) in nats, teacher-forced (analysis.evaluation.loglik): how much the document "
            "at each position raises the answer, whatever the model would write. Each position minus the strong end "
            "(the first PATH's better end), paired by question; `change vs` the first PATH: the debiasing effect, "
            "which a change of answer format, moving every position alike, does not move (95% intervals over "
            "questions, `*`: excludes 0).", "", *lines]


def _with_documents(result: ProbeResult) -> ProbeResult:
    """`result` without its closed-book outcomes (position -1)."""
    return ProbeResult(result.probe, [o for o in result.outcomes if o["position"] >= 0], result.settings)


def _intervention_lines(out: Path, entries: Sequence[Entry], probes: Sequence[str]) -> list[str]:
    """The interventions section: per probe a table (paired Δ against each PATH's plain answers) and a figure."""
    lines = ["## Interventions", "",
             "Inference-time interventions (analysis.evaluation.interventions), each asked the items of the probes "
             "it changes. Δ: its accuracy minus the same PATH's un-intervened accuracy on the same items (paired by "
             "id), with a paired 95% bootstrap interval that resamples whole questions, a question's positions "
             "together (`*`: excludes 0). Reordered or truncated mdqa items stay at the gold's retriever "
             "rank; the `by final position` figure puts them where the gold ended. Wall time: answering the "
             "probe's items, this machine (`plain`: the un-intervened answers, when answered in this run).", ""]
    for probe in probes:
        rows, curves, final = [], {}, {}
        for e in entries:
            if probe in e.results:
                curves[e.target.label] = e.results[probe]
                if any(probe in results for results in e.interventions.values()):
                    plain = e.results[probe]
                    seconds = e.plain_seconds.get(probe)
                    rows.append([e.target.label, "plain", with_delta(plain.mean), "",
                                 str(sum(o["position"] >= 0 for o in plain.outcomes)),
                                 "reused" if seconds is None else f"{seconds:.1f}"])
            for name, results in e.interventions.items():
                if probe not in results:
                    continue
                result = results[probe]
                curves[f"{e.target.label} · {name}"] = _with_documents(result)  # closed-book: the plain line only
                if any("final_position" in o["extra"] for o in result.outcomes):
                    final[f"{e.target.label} · {name}"] = by_final_position(result)
                delta, n = (paired_delta(e.results[probe], result, where=(e.target.label, f"{e.target.label} · {name}"))
                            if probe in e.results else (stats.NAN_INTERVAL, 0))
                rows.append([e.target.label, name, with_delta(result.mean),
                             paired_cell(delta), str(n), f"{e.intervention_seconds[name][probe]:.1f}"])
        if not rows:
            continue
        header = ["PATH", "intervention", "accuracy", "Δ vs plain [95% CI, questions resampled]", "items", "wall s"]
        lines += [f"### {probe}", "", *markdown_table(header, rows), ""]
        png = plot_position_accuracy(curves, out / f"interventions_{probe}.png",
                                     f"{probe}: accuracy by gold position, plain and intervened (closed-book: plain)",
                                     POSITION_AXIS[probe])
        lines += [f"![interventions_{probe}]({png.name})", ""]
        if final:
            png = plot_position_accuracy(final, out / f"interventions_{probe}_final_position.png",
                                         f"{probe}: accuracy by the gold's final position", "final gold position")
            lines += [f"![interventions_{probe}_final_position]({png.name})", ""]
    return lines


def report_images(report: Path) -> dict[str, Path]:
    """The PNGs a report shows (its `![name](file.png)` lines), keyed `compare/<file stem>`."""
    links = [line.split("](", 1)[1].rstrip(")") for line in report.read_text().splitlines() if line.startswith("![")]
    return {f"compare/{Path(link).stem}": report.parent / link for link in links}


def accuracy_rows(entries: Sequence[Entry]) -> tuple[list[list[Any]], list[list[Any]]]:
    """(mean accuracy rows [path, probe, accuracy], accuracy-by-position rows [path, probe, position, label,
    accuracy]) of every PATH and probe; position -1 is mdqa's closed-book baseline."""
    means, by_position = [], []
    for e in entries:
        for probe, result in e.results.items():
            means.append([e.target.label, probe, result.mean])
            labels = result.labels()
            by_position += [[e.target.label, probe, p, labels[p], acc] for p, acc in result.accuracy_by_position().items()]
    return means, by_position


def log_report_to_wandb(report: Path, entries: Sequence[Entry], mode: str, config: dict[str, Any]) -> str | None:
    """The report's PNGs and accuracy tables as one wandb run (job type `report`) under `<out>/wandb/`."""
    means, by_position = accuracy_rows(entries)
    name = "compare " + " ".join(e.target.label for e in entries)
    cfg = LoggerConfig(mode=LoggerMode(mode), name=shorten(name))
    tables = {"compare/probe_accuracy": (["path", "probe", "accuracy"], means),
              "compare/accuracy_by_position": (["path", "probe", "position", "label", "accuracy"], by_position)}
    return log_report(cfg, report.parent, report_images(report), tables, config)


def compare(paths: Sequence[str | Path], cfg: CompareConfig) -> Path:
    """Evaluate what the PATHs lack and write `<cfg.out>/report.md` with its PNGs; returns the report's path.

    Every PATH's probe results are also saved as `<out>/eval/<PATH label>_<probe>.json` (intervened ones as
    `<PATH label>_<probe>_<intervention tag>.json`). Raises CompareError naming the PATH that cannot be read or
    compared.
    """
    if not paths:
        raise CompareError("no PATH to compare")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise CompareError(f"--out {out}: a file, not a folder: give --out a new folder (or an earlier report's, "
                           "whose report.md is replaced)")
    unknown = [p for p in cfg.probes if p not in PROBES]
    if unknown:
        raise CompareError(f"unknown probes {unknown} (known: {', '.join(PROBES)})")
    try:
        check_valprobing(EvalConfig(probes=list(cfg.probes), valprobing=cfg.valprobing,
                                    data_dir=None if cfg.data_dir is None else str(cfg.data_dir)), prefix="--")
    except (ValueError, FileNotFoundError) as err:
        raise CompareError(str(err).replace("--valprobing.path", "--valprobing-path").replace(
            "--data_dir", "--data-dir")) from err
    targets = [resolve_target(p, label) for p, label in zip(paths, short_labels(paths))]
    if Probe.mdqa in cfg.probes and (cfg.data_dir is not None or cfg.mdqa.path is not None):
        try:  # a fine-tune on NQ is asked only questions it never trained on
            check_unseen_mdqa(targets, cfg.mdqa)
        except CompareError as err:
            raise CompareError(f"{err} (here: --mdqa-questions heldout, which asks the evaluation questions of the "
                               f"default split, share={cfg.mdqa.split.share}, salt={cfg.mdqa.split.salt!r})") from err
    tokenizers = [load_checkpoint_tokenizer(t) for t in targets]
    plan, notes = compare_plan(targets, tokenizers, cfg)
    entries: list[Entry] = []
    for target, tokenizer in tqdm(list(zip(targets, tokenizers)), desc="compare", unit="path"):
        entries.append(evaluate_target(target, tokenizer, plan, cfg, list(zip(entries, tokenizers))))
    check_pairable(entries, tokenizers, plan.probes)
    out.mkdir(parents=True, exist_ok=True)
    for e in entries:
        for probe, result in e.results.items():
            result.save_json(out / "eval" / f"{e.target.slug}_{probe}.json")
        for name, results in e.interventions.items():
            for probe, result in results.items():
                result.save_json(out / "eval" / f"{e.target.slug}_{probe}_{name}.json")
    report = write_report(out, entries, plan.probes, notes, cfg.use_wandb, cfg.valprobing.film_bins)
    if cfg.log_wandb is not None:
        config = {"paths": [str(p) for p in paths], "probes": list(plan.probes), "examples": cfg.examples,
                  "data_dir": None if cfg.data_dir is None else str(cfg.data_dir)}
        log_report_to_wandb(report, entries, cfg.log_wandb, config)
    return report


def _probe_list(text: str) -> list[str]:
    probes = [p for p in text.split(",") if p]
    unknown = [p for p in probes if p not in PROBES]
    if unknown or not probes:
        raise argparse.ArgumentTypeError(f"unknown probes {unknown} (known: {', '.join(PROBES)})")
    return probes


def _spec_list(text: str) -> list[str]:
    specs = [s for s in text.split(",") if s]
    for spec in specs:
        try:
            Intervention.parse(spec)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
    return specs


def _layers(text: str) -> str | list[int]:
    """A layers option: a named set (reference, last_half, all) or comma-separated 0-based indices."""
    try:
        return text if text in {str(s) for s in LayerSet} else [int(i) for i in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"layers {text!r}: a named set or comma-separated indices") from err


def _positive_list(text: str) -> list[int]:
    return [positive_int(v) for v in text.split(",")]


def _depth_list(text: str) -> list[float]:
    depths = [float(v) for v in text.split(",")]
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {depths}")
    return depths


def build_parser() -> argparse.ArgumentParser:
    # One declaration per option, each with its help text: long, and clearer in one place than split up.
    parser = CommandParser(
        prog="python -m analysis.compare",
        description="Compare runs and checkpoints: accuracy by gold position (kv, mdqa, needle, in2), "
                    "Jacobian profiles against the Cesàro prior, valley and prior metrics. Writes "
                    "OUT/report.md and its PNGs; evaluates only what the runs did not record.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a run directory (its latest checkpoint) or a checkpoint folder "
                             "(save_pretrained + tokenizer)")
    parser.add_argument("--out", default="compare", help="output folder (default: ./compare)")
    parser.add_argument("--probes", type=_probe_list, default=list(DEFAULT_PROBES),
                        help="comma-separated probes (default: kv,mdqa,needle,in2; mdqa needs --data-dir, "
                             "in2 one tokenizer for all PATHs; valprobing_document, valprobing_code, "
                             "valprobing_database need --data-dir or --valprobing-path)")
    parser.add_argument("--examples", type=positive_int, default=20,
                        help="queries per probe, each asked at every gold position; in2: N x bins held-out "
                             "records (default 20)")
    parser.add_argument("--data-dir", default=None,
                        help="folder with kv-retrieval-75_keys.jsonl.gz and nq-open-oracle.jsonl.gz "
                             "(default: none: synthetic kv, needle filler and Jacobian text; no mdqa)")
    parser.add_argument("--kv-path", default=None,
                        help="kv records (the reference's 75-, 140- or 300-key file; every pair is asked at the "
                             "reference's positions); default: --data-dir's 75-key file, else synthetic")
    parser.add_argument("--mdqa-path", default=None,
                        help="mdqa records: an oracle file (distractors are added) or the reference's "
                             "*_gold_at_K files (a quoted glob); default: --data-dir's nq-open-oracle file")
    parser.add_argument("--kv-pairs", type=positive_int, default=None,
                        help="kv pairs per prompt (default: every pair of the file's records, 75 synthetic)")
    parser.add_argument("--mdqa-docs", type=positive_int, default=None,
                        help="mdqa documents per prompt built from an oracle file (default 20)")
    parser.add_argument("--mdqa-questions", default=MDQAQuestions.all.value, choices=[q.value for q in MDQAQuestions],
                        help="mdqa questions asked: all (the reference's) or heldout (only the evaluation questions "
                             "of the default NQ split, data_builders.question_split: required for a PATH trained "
                             "on IN2 from NQ)")
    parser.add_argument("--distractors", default=Distractors.retrieved.value, choices=[d.value for d in Distractors],
                        help="mdqa distractors added to an oracle file: retrieved (BM25, the reference's recipe; "
                             "default) or random (easier, not comparable)")
    parser.add_argument("--needle-lens", type=_positive_list, default=NeedleProbeConfig().lengths,
                        help="needle grid context lengths in tokens (default 256,512,1024)")
    parser.add_argument("--needle-depths", type=_depth_list, default=NeedleProbeConfig().depths,
                        help="needle grid depths in [0, 1] (default 0,0.1,...,1)")
    parser.add_argument("--valprobing-preset", default=ValProbingConfig.preset, choices=sorted(VALPROBING_PRESETS),
                        help="VaLProbing's shape: smollm2_8k (fits 8K positions; default) or film32k (FILM's)")
    parser.add_argument("--valprobing-pieces", type=positive_int, default=None,
                        help="VaLProbing: pieces a context, every task (default: the preset's)")
    parser.add_argument("--valprobing-sets", type=positive_int, default=None,
                        help="VaLProbing: contexts a task, each asking every position (default: the preset's)")
    parser.add_argument("--valprobing-bin-width", type=positive_int, default=None,
                        help="VaLProbing: positions a bin (default: the preset's)")
    parser.add_argument("--valprobing-path", default=None,
                        help="folder of FILM's pieces files (default: --data-dir's valprobing/)")
    parser.add_argument("--film-bins", action="store_true",
                        help="VaLProbing: leave each bin's last position out, as FILM's plot.py does")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="one greedy answer budget for every probe, for a quick look (not comparable; "
                             "default per probe: kv 100, mdqa 100, needle 16, in2 8)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="prompts per generate call (default 16)")
    parser.add_argument("--loglik", action=argparse.BooleanOptionalAction, default=True,
                        help="also score each item's gold answer by its teacher-forced log-likelihood (default: on)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="record every answer as it is made ($POSDEBIAS_CACHE/evaluations/answered): the same "
                             "command run again after a kill answers only what is missing (default: on)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap kv, mdqa and needle prompts in each tokenizer's chat template (instruct models); "
                             "default: as the first run among the PATHs was evaluated (eval.chat_template)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="L of measured Jacobian profiles (default: the first run's jacobian.seq_len, "
                             "else 256)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    parser.add_argument("--dtype", default=DType.float32.value, choices=[d.value for d in DType],
                        help="weights dtype (default float32; auto: as saved)")
    parser.add_argument("--interventions", type=_spec_list, default=[],
                        help="comma-separated inference-time interventions answered beside the plain probes: "
                             "reorder[:outside_in|descending|ascending], truncate:K[:order], query_aware, ms_poe, "
                             "attn_calibration (default: none)")
    parser.add_argument("--ms-poe-layers", type=_layers, default="reference",
                        help="ms_poe: the layers patched: reference (all but the first two, the paper's runs), all, "
                             "or comma-separated 0-based indices")
    parser.add_argument("--calibration-layers", type=_layers, default="last_half",
                        help="attn_calibration: the layers calibrated: last_half (the paper's last 16 of 32), all, "
                             "or comma-separated 0-based indices")
    parser.add_argument("--wandb", action="store_true",
                        help="also read each run's wandb summary (optional; metrics.jsonl has the same numbers)")
    parser.add_argument("--wandb-log", choices=[LoggerMode.offline.value, LoggerMode.online.value], default=None,
                        metavar="MODE", help="also log the report's PNGs and accuracy tables to a wandb run: "
                                             "offline (OUT/wandb/, `wandb sync` uploads it) or online (default: off)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: a PATH cannot be compared; argparse errors exit with 2)."""
    args = build_parser().parse_args(argv)
    cfg = CompareConfig(
        out=args.out, probes=args.probes, examples=args.examples, data_dir=args.data_dir,
        kv=KVProbeConfig(path=args.kv_path, n_pairs=args.kv_pairs),
        mdqa=MDQAProbeConfig(path=args.mdqa_path, n_docs=args.mdqa_docs, distractors=args.distractors,
                             questions=MDQAQuestions(args.mdqa_questions)),
        needle=NeedleProbeConfig(lengths=args.needle_lens, depths=args.needle_depths),
        valprobing=ValProbingConfig(preset=args.valprobing_preset, pieces=args.valprobing_pieces,
                                    sets=args.valprobing_sets, bin_width=args.valprobing_bin_width,
                                    path=args.valprobing_path, film_bins=args.film_bins),
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, chat_template=args.chat_template,
        loglik=args.loglik, resume=args.resume, seq_len=args.seq_len,
        device=args.device, dtype=DType(args.dtype), use_wandb=args.wandb, log_wandb=args.wandb_log,
        interventions=args.interventions, ms_poe=MsPoEConfig(layers=args.ms_poe_layers),
        calibration=AttnCalibrationConfig(layers=args.calibration_layers),
    )
    try:
        report = compare(args.paths, cfg)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
