"""What train.py measures and evaluates while a model trains, beside the measurement and evaluation code it runs.

Three parts, each built once by the recipe and called at its cadence, with what it needs given explicitly:

- `JacobianWatch`: the per-step Jacobian profile on held-out text and its topology against the prior, the attention
  rollouts (analysis.measure), recorded in jacobian.npz and rollout.npz, charted in wandb, drawn at the end;
- `TaskWatch`: the position signals on the task's own prompts (analysis.evaluation.watch), in watch.jsonl;
- `Evaluations`: the held-out loss, the IN2 accuracy by gold depth and the position probes (analysis.evaluation),
  their JSONs, figures and charts.

Every rank measures and evaluates (under ZeRO-3 each forward gathers the weights collectively); the main process
records and draws. `logger` is the run's MetricsLogger (or NullLogger on the other ranks).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from analysis.evaluation.config import EvalConfig
from analysis.evaluation.probes import evaluate_in2, evaluate_probes
from analysis.evaluation.result import Checkpoint, ProbeResult, write_eval_json
from analysis.evaluation.reuse import function_digest
from analysis.evaluation.watch import (
    NQ_FILE,
)
from analysis.evaluation.watch import PREFIX as WATCH_PREFIX
from analysis.evaluation.watch import (
    WatchConfig,
    WatchPanel,
    WatchSet,
    append_rows,
    build_panel,
    panel_header,
    read_rows,
    truncate_rows,
    validate_watch,
)
from analysis.measure.jacobian import (
    ChunkedSource,
    Estimator,
    JacobianConfig,
    JacobianRecorder,
    ProbeWindow,
    ProfileResult,
    build_eval_sequences,
    excerpts_per_sequence,
    measure_sets,
    measure_window,
)
from analysis.measure.rollout import (
    RolloutVariant,
    mean_rollout,
    measure_rollouts,
    record_name,
    rollout_set_metrics,
)
from analysis.measure.step import measure_step
from analysis.measure.topology import prefixed, topology_metrics, valley_metrics
from analysis.report.figures import (
    plot_depth_accuracy,
    plot_evolution,
    plot_heatmap,
    plot_needle_grid,
    plot_position_accuracy,
    plot_profile_vs_prior,
)
from analysis.report.metrics_log import accuracy_chart, profile_charts, watch_charts
from analysis.report.run_summary import headline_numbers, run_summary
from data_builders.build import DataBundle, built_with, train_documents
from data_builders.collate import collate
from data_builders.config import DataConfig, DataFormat, DataSource, In2Layout
from data_builders.files import atomic_write_text
from data_builders.in2 import make_format
from models.training.loss import labelled_nll
from models.training.run_dir import RunDir
from models.training.slot_loss import SlotLoss, check_slots

log = logging.getLogger("train")


# ---------------------------------------------------------------------------------------------- the Jacobian


def jacobian_sequences(bundle: DataBundle, jac: JacobianConfig) -> dict[str, torch.Tensor]:
    """The measured sets: vanilla from held-out documents; chunked from held-out documents too, or
    from training text with `jacobian.chunked_source=train`."""
    chunk_docs = None
    if jac.chunked_source == ChunkedSource.train and jac.n_chunked:
        chunk_docs = train_documents(bundle, min(jac.chunk_len, jac.seq_len),
                                     jac.n_chunked * excerpts_per_sequence(jac.seq_len, jac.chunk_len))
    return build_eval_sequences(bundle.heldout_docs, jac.seq_len, jac.n_vanilla, jac.n_chunked, jac.chunk_len,
                                chunk_docs)


@dataclass
class JacobianWatch:
    """The per-step Jacobian of a run: its sequences, window of probes and journals."""

    cfg: JacobianConfig
    seqs: dict[str, torch.Tensor]
    layers: int
    paths: RunDir
    window: Optional[ProbeWindow] = None  # jacobian.window > 1: the probes of the last measured steps
    recorder: Optional[JacobianRecorder] = None  # main process only: jacobian.npz
    rollout_recorder: Optional[JacobianRecorder] = None  # main process only: rollout.npz

    @classmethod
    def build(cls, cfg: JacobianConfig, bundle: DataBundle, layers: int, run_dir: Path, is_main: bool,
              device: torch.device) -> Optional[JacobianWatch]:
        """None when the profile is off (jacobian.every=0)."""
        seqs = {k: v.to(device) for k, v in jacobian_sequences(bundle, cfg).items()} if cfg.every > 0 else {}
        if not seqs:
            return None
        paths = RunDir(run_dir)
        recorder = rollout_recorder = None
        if is_main:
            recorder = JacobianRecorder(paths.jacobian, {k: v.shape[0] for k, v in seqs.items()}, cfg.seq_len)
            if cfg.rollout:
                rollout_recorder = JacobianRecorder(
                    paths.rollout, {record_name(k, v): n.shape[0] for k, n in seqs.items() for v in RolloutVariant},
                    cfg.seq_len)
        return cls(cfg, seqs, layers, paths, ProbeWindow(cfg.window) if cfg.window > 1 else None, recorder,
                   rollout_recorder)

    def due(self, step: int) -> bool:
        return step % self.cfg.every == 0

    def measure(self, model: torch.nn.Module, step: int, logger: Any) -> dict[str, float]:
        """Profiles of every set and their topology metrics; recorded (and charted) by the main process."""
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        jac, seqs = self.cfg, self.seqs
        if jac.estimator == Estimator.hutchinson and len({ids.shape[-1] for ids in seqs.values()}) == 1:
            # one forward pass gives the profile and the rollouts (analysis.measure.step)
            measured = measure_step(model, seqs, jac, step, self.window, jac.rollout)
            results, pooled, rolls = measured.profiles, measured.pooled, measured.rollouts
        else:
            pooled = measure_window(model, seqs, jac, step, self.window) if self.window else None
            results = ({name: res.window for name, res in pooled.items()} if pooled
                       else measure_sets(model, seqs, jac))
            rolls = measure_rollouts(model, seqs) if jac.rollout else {}
        # With a window the logged profile pools the probes of the last jacobian.window steps; the step's own
        # estimate is logged beside it under step/ (docs/REFERENCE.md, "Metric names").
        for name, res in (pooled or {}).items():
            own = valley_metrics(res.step.profile.mean(axis=0))
            metrics.update({f"step/valley/{name}/{k.removeprefix('valley/')}": v for k, v in own.items()})
            metrics[f"jacobian/{name}/probes"] = res.probes
            metrics[f"jacobian/{name}/rel_stderr"] = float(np.mean(res.window.stderr / res.window.profile))
        profiles = {name: res.profile.mean(axis=0) for name, res in results.items()}
        for name, profile in profiles.items():
            metrics.update(prefixed(topology_metrics(profile, self.layers), name))
        metrics.update(rollout_set_metrics(profiles, rolls))
        metrics["jacobian/wall_s"] = time.perf_counter() - started  # profiles, fits, rollouts: what a step costs
        if self.recorder is not None:
            self._record(step, results, rolls, profiles, metrics, logger)
        return metrics

    def _record(self, step: int, results: dict[str, ProfileResult], rolls: dict, profiles: dict[str, np.ndarray],
                metrics: dict[str, float], logger: Any) -> None:
        self.recorder.add(step, results)
        if self.rollout_recorder is not None:
            self.rollout_recorder.add(step, {record_name(name, v): ProfileResult(rows, None)
                                             for name, by_variant in rolls.items() for v, rows in by_variant.items()})
        n_measured = len(self.recorder.steps)
        if logger.wandb_run is None:
            return
        if (n_measured - 1) % self.cfg.chart_every == 0:  # step 0, then every chart_every
            alphas = {name: metrics[f"prior/{name}/alpha"] for name in results}
            curves = {name: {v: mean_rollout(rows) for v, rows in by_variant.items()}
                      for name, by_variant in rolls.items()}
            logger.log_media(profile_charts(profiles, alphas, self.layers, step, curves), step=step)
        if n_measured % self.cfg.plot_every == 0:
            logger.log_media({f"jacobian/{name}/heatmap": logger.image(
                plot_heatmap(self.paths.jacobian, self.paths.plot(f"jacobian_heatmap_{name}"), name))
                for name in results}, step=step)

    def end_figures(self, exp_name: str) -> None:
        """The main process's journals closed (jacobian.npz then holds every step on its own) and drawn: each set's
        evolution, and its step-0 profile against the prior and the rollouts."""
        if self.recorder is None:
            return
        self.close()
        rollouts_at_0 = self.rollout_recorder is not None and self.rollout_recorder.steps[:1].tolist() == [0]
        for name in self.seqs:
            plot_evolution(self.paths.jacobian, self.paths.plot(f"jacobian_evolution_{name}"), name)
            if self.recorder.steps[0] == 0:
                curves = {str(v): mean_rollout(self.rollout_recorder.array(record_name(name, v))[:, 0])
                          for v in RolloutVariant} if rollouts_at_0 else None
                plot_profile_vs_prior(self.recorder.array(name)[:, 0].mean(axis=0), self.layers,
                                      self.paths.plot(f"jacobian_step0_vs_prior_{name}"),
                                      title=f"{exp_name}: step-0 Jacobian profile ({name}), the prior and the "
                                            "rollouts", rollouts=curves)

    def close(self) -> None:
        for recorder in (self.recorder, self.rollout_recorder):
            if recorder is not None:
                recorder.close()

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.window.state_dict() if self.window is not None else None

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if self.window is not None:
            self.window.load_state_dict(state or {})  # an older checkpoint: the window starts anew


# ---------------------------------------------------------------------------------------------- the task's prompts


def training_slots(data: DataConfig) -> int:
    """Gold slots of the training samples: mdqa-layout documents, else tenths of the context's depth."""
    built = built_with(data).in2
    return built.n_docs if built.layout == In2Layout.mdqa else 10


def watch_nq_file(watch: WatchConfig, data: DataConfig) -> Optional[Path]:
    """The NQ file the watch's mdqa questions come from: watch.data_dir's, else the training data's own."""
    if watch.data_dir is not None:
        return Path(watch.data_dir) / NQ_FILE
    built = built_with(data)
    return Path(built.path) if built.source == DataSource.nq and built.path else None


def check_watch(watch: WatchConfig, data: DataConfig) -> None:
    """The watch's own checks, and what its sets and its per-slot training loss need from the data."""
    if not watch.on:
        return
    validate_watch(watch)
    if data.format != DataFormat.in2:
        raise ValueError(f"watch is on, but data.format={data.format} has no questions to watch: watch=off "
                         "(language-model windows), or IN2 data")
    layout = built_with(data).in2.layout
    if WatchSet.in2 in watch.sets and layout != In2Layout.segments:
        raise ValueError(f"watch.sets has in2, whose prompts move a gold segment through an IN2 context, but "
                         f"data.in2.layout={layout}: watch mdqa (watch.sets=[mdqa,kv] watch.data_dir=...)")
    check_slots(watch.slots, training_slots(data))
    if WatchSet.mdqa in watch.sets and watch_nq_file(watch, data) is None:
        raise ValueError("watch.sets has mdqa, whose questions come from NQ: set watch.data_dir (the folder of "
                         f"{NQ_FILE}), or train on NQ (data.source=nq)")


def slot_loss_of(watch: WatchConfig, data: DataConfig, all_sum: Callable) -> Optional[SlotLoss]:
    """The training loss by gold slot (models.training.slot_loss) when the watch is on; `all_sum` sums over ranks."""
    if not watch.on:
        return None
    mdqa = built_with(data).in2.layout == In2Layout.mdqa
    return SlotLoss(training_slots(data), watch.train_window, watch.middle, watch.strong["mdqa" if mdqa else "in2"],
                    all_sum)


@dataclass
class TaskWatch:
    """The watch of a run (analysis.evaluation.watch): its panel, where its rows go, and how it measures."""

    panel: WatchPanel
    journal: Path  # <run>/watch.jsonl
    bf16: bool  # under the training's bf16 autocast
    cache_dir: Optional[Path]  # where the first panel is cached (None: several processes, sharded weights)
    is_main: bool
    slot_loss: Any  # the training loss by gold slot (models.training.slot_loss.SlotLoss)

    @classmethod
    def build(cls, watch: WatchConfig, data: DataConfig, evals: EvalConfig, bf16: bool, layers: int,
              bundle: DataBundle, run_dir: Path, cache_dir: Optional[Path], is_main: bool,
              slot_loss: Optional[SlotLoss]) -> Optional[TaskWatch]:
        """The watch of a run (None when it is off): mdqa dev questions of the training data's question split, kv
        records, the run's own held-out IN2 records, asked as the evaluations ask (`evals.chat_template`)."""
        if not watch.on:
            return None
        built, tokenizer = built_with(data), bundle.tokenizer
        split = built.nq_split if built.source == DataSource.nq else evals.mdqa.split
        start = len(make_format(tokenizer, built).prefix) if WatchSet.in2 in watch.sets else 0
        panel = build_panel(watch, layers, tokenizer, evals.chat_template, split, watch_nq_file(watch, data),
                            bundle.eval, start)
        return cls(panel, RunDir(run_dir).watch, bf16, cache_dir, is_main, slot_loss)

    def measure(self, model: torch.nn.Module, step: int, device_type: str, logger: Any, first: bool = False,
                last: bool = False) -> dict[str, float]:
        """The watch at `step` (before its update): the Jacobian of the prompts due (every one at the first and the
        last step, else one every watch.every steps), the panel's log p when due; their rows to watch.jsonl, the
        pooled signals to the log."""
        panel, started = self.panel, time.perf_counter()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16):
            rows = panel.measure_due(model, step, first, last, self.cache_dir)
        if not rows:
            return {}
        metrics = panel.jacobian_metrics() if any(r["kind"] == "jacobian" for r in rows) else {}
        metrics |= panel.loglik_metrics() if panel.logliks_complete(rows) else {}
        metrics |= panel.noise(metrics)
        metrics[f"{WATCH_PREFIX}/wall_s"] = time.perf_counter() - started
        if self.is_main:
            if first:
                append_rows(self.journal, [panel_header(panel, step)])
            append_rows(self.journal, rows)
            if logger.wandb_run is not None and (first or last or any(r["kind"] == "loglik" for r in rows)):
                logger.log_media(watch_charts(read_rows(self.journal), step), step=step)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"panel": self.panel.state_dict(), "slot_loss": self.slot_loss.state_dict()}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """A checkpoint's state (an older checkpoint, or one of a run without the watch: anew)."""
        self.panel.load_state_dict((state or {}).get("panel", {}))
        self.slot_loss.load_state_dict((state or {}).get("slot_loss"))

    def resumed_in_place(self, at_step: int) -> None:
        """The run continues in its own directory from `at_step`: its later rows are measured again."""
        if self.is_main:
            truncate_rows(self.journal, at_step)


# ---------------------------------------------------------------------------------------------- evaluations


def depth_curve(metrics: dict[str, float]) -> list[float]:
    return [v for k, v in metrics.items() if "acc@" in k]


@dataclass
class Evaluations:
    """A run's evaluations: the held-out split's loss, the IN2 curve of its held-out records and the probes."""

    cfg: Any  # EvalConfig
    exp_name: str
    tokenizer: Any
    heldout: Any  # the held-out split (datasets.Dataset)
    records: Any  # the held-out IN2 records scored by depth (empty: no questions)
    probe_items: dict[str, list]
    run_dir: Path
    is_main: bool
    answer_dir: Optional[Path]  # where answers are recorded and read back (eval.resume; None: off)
    one_process: bool  # the weights are whole here: their digest names what was evaluated
    accuracy_curves: dict[str, list[float]] = field(default_factory=dict)  # plotted at the end

    @classmethod
    def build(cls, cfg: EvalConfig, exp_name: str, in2: bool, bundle: DataBundle, probe_items: dict[str, list],
              run_dir: Path, is_main: bool, answer_dir: Optional[Path], one_process: bool) -> Evaluations:
        """A run's evaluations; accuracy by depth needs questions (`in2` data: language-model windows have none)."""
        n = min(cfg.num_examples, len(bundle.eval)) if in2 else 0
        return cls(cfg, exp_name, bundle.tokenizer, bundle.eval, bundle.eval.select(range(n)), probe_items, run_dir,
                   is_main, answer_dir, one_process)

    @property
    def has_questions(self) -> bool:
        return len(self.records) > 0

    def evaluated(self, model: torch.nn.Module) -> Checkpoint:
        """What an in-training evaluation evaluated: this run's weights now."""
        return Checkpoint(str(Path(self.run_dir).resolve()), function_digest(model) if self.one_process else None)

    @torch.no_grad()
    def heldout_loss(self, model: torch.nn.Module, batch_size: int, device: torch.device) -> float:
        """Token-weighted mean loss over the held-out split (answer tokens only, as in training)."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        for start in range(0, len(self.heldout), batch_size):
            batch = collate(self.heldout.select(range(start, min(len(self.heldout), start + batch_size))),
                            self.tokenizer.pad_token_id)
            nll, n = labelled_nll(model, batch, device)
            total, count = total + nll.item(), count + n
        model.train(was_training)
        return total / max(1, count)

    def depth_accuracy(self, model: torch.nn.Module, step: int, logger: Any) -> dict[str, float]:
        """Accuracy (eval.in2_metric) by gold depth on the held-out IN2 records (nothing without questions)."""
        if not self.has_questions:
            return {}
        metrics, result = evaluate_in2(model, self.tokenizer, self.records, self.cfg, self.answer_dir)
        if self.is_main:
            log.info("step %d: in2 %s %.3f over %d held-out questions, by depth bin %s", step,
                     self.cfg.in2_metric.replace("_", " "), metrics["eval/in2/acc_mean"], len(result.outcomes),
                     " ".join(f"{acc:.2f}" for acc in result.accuracy_by_position().values()))
            write_eval_json(self.run_dir, step, "in2", result, self.evaluated(model))
            self._chart(logger, "in2", result, step)
        return metrics

    def _chart(self, logger: Any, name: str, result: ProbeResult, step: int, png: Optional[Path] = None) -> None:
        """wandb only: a probe's accuracy by position as a chart over its table (`eval/<probe>/accuracy_by_position`,
        comparable across runs) and its PNG (`eval/<probe>/accuracy_plot`)."""
        if logger.wandb_run is None:
            return
        media = {f"eval/{name}/accuracy_by_position": accuracy_chart(
            result.accuracy_by_position(), result.labels(), f"{name} accuracy by gold position, step {step}")}
        if png is not None:
            media[f"eval/{name}/accuracy_plot"] = logger.image(png)
        logger.log_media(media, step=step)

    def probes(self, model: torch.nn.Module, step: int, logger: Any) -> dict[str, float]:
        """Position probes (kv, mdqa, needle) on fixed queries: metrics, per-query JSON, curve plot (and the
        needle's length x depth grid)."""
        metrics, results = evaluate_probes(model, self.tokenizer, self.probe_items, self.cfg,
                                           record_dir=self.answer_dir)
        if not self.is_main:
            return metrics
        paths = RunDir(self.run_dir)
        for name, result in results.items():
            log.info("step %d: %s accuracy %.3f over %d questions", step, name, result.mean, len(result.outcomes))
            write_eval_json(self.run_dir, step, name, result, self.evaluated(model))
            score = result.position_score
            png = plot_position_accuracy({f"step {step}": result}, paths.plot(f"{name}_accuracy_step{step}"),
                                         title=f"{self.exp_name}: {name} {score.label} by gold position, step {step}",
                                         score=score)
            self._chart(logger, name, result, step, png)
        if "needle" in results:
            grid = plot_needle_grid({f"step {step}": results["needle"]}, paths.plot(f"needle_grid_step{step}"),
                                    f"{self.exp_name}: needle accuracy by context length and depth, step {step}")
            if logger.wandb_run is not None:
                logger.log_media({"eval/needle/grid_plot": logger.image(grid)}, step=step)
        return metrics

    def periodic(self, model: torch.nn.Module, done: int, batch_size: int, device: torch.device,
                 logger: Any) -> dict[str, float]:
        """Held-out loss every eval.every steps, probes every eval.probe_every steps."""
        metrics: dict[str, float] = {}
        if self.cfg.every and done % self.cfg.every == 0:
            metrics["eval/loss"] = self.heldout_loss(model, batch_size, device)
            if self.is_main:
                log.info("step %d: held-out answer loss %.4f", done, metrics["eval/loss"])
        if self.probe_items and done % self.cfg.probe_every == 0:
            metrics.update(self.probes(model, done, logger))
        return metrics

    def start_curve_from(self, checkpoint_run: Path) -> None:
        """A resumed run's start curve: that of the run that wrote the checkpoint (copied here when resuming into a
        new directory), so that the accuracy plot compares start and end."""
        step0 = RunDir(checkpoint_run).eval_json("in2", 0)
        if not (self.has_questions and self.is_main and step0.is_file()):
            return
        result = ProbeResult.load_json(step0)
        self.accuracy_curves["step 0"] = depth_curve(result.to_metrics("eval"))
        if not RunDir(self.run_dir).eval_json("in2", 0).exists():
            write_eval_json(self.run_dir, 0, "in2", result)

    def end_figure(self, final: int, metrics: dict[str, float], logger: Any) -> None:
        """The IN2 curve at the start and the end (main process, with questions)."""
        if not (self.is_main and self.has_questions):
            return
        self.accuracy_curves[f"step {final}"] = depth_curve(metrics)
        png = plot_depth_accuracy(self.accuracy_curves, RunDir(self.run_dir).plot("in2_accuracy_by_depth"),
                                  title=f"{self.exp_name}: {self.cfg.in2_metric.replace('_', ' ')} by gold depth")
        if logger.wandb_run is not None:
            logger.log_media({"eval/in2/accuracy_plot": logger.image(png)}, step=final)


def write_summary(run_dir: Path, exp_name: str, start_model: Optional[str], logger: Any) -> str:
    """The end-of-run summary (`analysis.report.run_summary`): logged (console and train.log), written to
    summary.md, and its headline numbers put in the wandb run summary."""
    text = run_summary(run_dir, exp_name, start_model)
    atomic_write_text(RunDir(run_dir).summary, text)
    log.info("run finished\n%s", text)
    if logger.wandb_run is not None:
        logger.wandb_run.summary.update(headline_numbers(run_dir))
    return text
