"""What a person reads when a run ends: `summary.md`, made from the run directory's own files.

`train.py` prints it, writes it to `train.log` and to `<run_dir>/summary.md`, and puts its headline
numbers in the wandb run summary. Everything in it is read back from what the run wrote (metrics.jsonl,
eval/in2_step*.json, checkpoints/, plots/, wandb/), so the summary never says what the files do not.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from analysis.evaluation.fairness import fairness
from analysis.evaluation.result import LOGLIK, ProbeResult
from analysis.evaluation.valprobing import summarize as summarize_valprobing
from analysis.evaluation.watch import PREFIX as WATCH_PREFIX
from analysis.evaluation.watch import position_signals, read_rows
from analysis.report.metrics_log import read_metrics
from analysis.report.tables import markdown_table, num
from analysis.stats import ACCURACY, Score
from data_builders.valprobing import Task
from models.training.checkpoint import list_checkpoints
from models.training.run_dir import RunDir
from models.training.slot_loss import PREFIX as TRAIN_PREFIX

# Per measured set: the valley's depth and width, the prior's fit, and the best rollout's fit.
JACOBIAN_KEYS = (
    "valley/{set}/anchor_to_trough_log10",
    "valley/{set}/peak_to_trough_log10",
    "valley/{set}/middle_mass",
    "prior/{set}/spearman",
    "prior/{set}/w1",
    "rollout/{set}/measured/w1",
    "rollout/{set}/attention_only/w1",
)
FAIRNESS_ROWS = {"worst_bin": "worst bin", "gap": "gap (max − min)", "middle_minus_ends": "middle − ends"}
MISSING = "—"  # the cell of a number the run did not log, or logged as nan or inf


@dataclass
class DepthCurve:
    """Held-out IN2 accuracy (`metric`) by gold depth bin at one step, and its position-fairness numbers; the same
    for the gold answer's log-likelihood when the evaluation kept it, and how long the answers' first lines were."""

    step: int
    metric: str  # how the answers were scored (eval.in2_metric)
    by_bin: dict[str, float]  # bin label (its lower depth edge) -> accuracy
    fairness: dict[str, float]
    loglik_by_bin: dict[str, float] | None = None  # bin label -> mean log p(answer), nats
    loglik_fairness: dict[str, float] | None = None
    median_words: float | None = None  # median first-line length of the answers, in words


def depth_curve(step: int, path: Path) -> DepthCurve:
    result = ProbeResult.load_json(path)
    outcomes = result.outcomes
    bins = np.array([o["position"] for o in outcomes], dtype=np.int64)
    depths = np.array([o["extra"]["depth"] for o in outcomes], dtype=np.float64)
    labels = result.labels()

    def curve(score: Score) -> tuple[dict[str, float], dict[str, float]]:
        scores = np.array([o[score.field] for o in outcomes], dtype=np.float64)
        by_bin = {labels[position]: value for position, value in result.accuracy_by_position(score).items()}
        return by_bin, fairness(scores, bins, depths, score)

    by_bin, fair = curve(ACCURACY)
    loglik_by_bin, loglik_fair = curve(LOGLIK) if result.has_loglik else (None, None)
    words = [o["extra"]["answer"]["first_line_words"] for o in outcomes if "answer" in o["extra"]]
    return DepthCurve(step, str(result.settings.get("metric", "exact_match")), by_bin, fair, loglik_by_bin,
                      loglik_fair, float(np.median(words)) if words else None)


def _steps_of(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, Any]]:
    return [(row["step"], row[key]) for row in rows if key in row]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def training_wall_time(trained: Sequence[Mapping[str, Any]]) -> tuple[float, int]:
    """The wall time of the logged training steps and how many processes made them: `train/wall_s` counts from its
    own process's loop start, so a resumed run's rows start again near 0; each process's last value is summed (the
    steps a kill lost after the last checkpoint are not in the rows, nor their time)."""
    total, last, processes = 0.0, 0.0, 0
    for row in trained:
        wall = row.get("train/wall_s")
        if wall is None:
            continue
        if wall < last or not processes:
            total, processes = total + last, processes + 1
        last = wall
    return total + last, processes


def progress_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Steps, wall time, tokens/s and peak memory of the training rows."""
    trained = [row for row in rows if "train/loss" in row]
    if not trained:
        return ["- no training step was logged"]
    wall, processes = training_wall_time(trained)
    tokens = sum(row.get("train/tokens", 0) for row in trained)
    peak = max(row.get("train/peak_mem_mib", 0.0) for row in trained)
    steps = [row["step"] for row in trained]
    first, last = min(steps), max(steps)
    lines = [f"- steps {first - 1} → {last} ({len(set(steps))} updates), final train/loss "
             f"{num(trained[-1]['train/loss'], missing=MISSING)}"]
    if first > 1:
        lines[0] += f" (resumed at step {first - 1})"
    over = f" over {processes} processes" if processes > 1 else ""
    lines.append(f"- training wall time {_duration(wall)}{over} (evaluation and Jacobian included), "
                 f"{tokens / wall:.0f} tokens/s" if wall > 0 else "- training wall time not logged")
    jacobian = [row["jacobian/wall_s"] for row in rows if "jacobian/wall_s" in row]
    if jacobian and wall > 0:
        lines.append(f"- Jacobian and rollouts: {np.mean(jacobian):.3g} s a measured step, {len(jacobian)} measured, "
                     f"{sum(jacobian) / wall:.0%} of the training wall time")
    lines.append(f"- peak memory {peak:.0f} MiB")
    last_row = trained[-1]  # the counts are running totals (models.training.step_health)
    lines.append(f"- skipped steps: {int(last_row.get('train/bad_steps', 0))} (a non-finite loss or gradient norm; "
                 f"the log says which and why); loss spikes: {int(last_row.get('train/loss_spikes', 0))} (an "
                 "exploding loss, named in the log)")
    return lines


def accuracy_lines(curves: Sequence[DepthCurve]) -> list[str]:
    """The start and end curves as one table, bins then the fairness rows."""
    if not curves:
        return []
    header = ["gold depth", *(f"step {c.step}" for c in curves)]
    rows = [[label, *(num(c.by_bin.get(label), missing=MISSING) for c in curves)] for label in curves[0].by_bin]
    rows += [[f"**{name}**", *(num(c.fairness.get(key), missing=MISSING) for c in curves)]
             for key, name in FAIRNESS_ROWS.items()]
    metrics = " / ".join(dict.fromkeys(c.metric.replace("_", " ") for c in curves))
    lines = [f"## Accuracy by gold depth (held-out IN2, {metrics})", "",
             *markdown_table(header, rows), "",
             "middle: gold depth in [0.25, 0.75); gap: best bin minus worst bin.", ""]
    if all(c.median_words is not None for c in curves):
        lines += ["Answers' first line, median length in words: "
                  + ", ".join(f"step {c.step}: {c.median_words:g}" for c in curves)
                  + f" (a change here is a change of answer format, which {metrics} also scores).", ""]
    if all(c.loglik_by_bin is not None for c in curves):
        rows = [[label, *(num(c.loglik_by_bin.get(label), missing=MISSING) for c in curves)]
                for label in curves[0].loglik_by_bin]
        rows += [[f"**{name}**", *(num(c.loglik_fairness.get(key), missing=MISSING) for c in curves)]
                 for key, name in FAIRNESS_ROWS.items()]
        lines += ["## Log-likelihood of the gold answer by gold depth (held-out IN2, nats)", "",
                  *markdown_table(header, rows), "",
                  "log p(answer | prompt), teacher-forced: the position curve whatever the answer format.", ""]
    return lines


def valprobing_lines(run_dir: Path) -> list[str]:
    """VaLProbing's Avg and Gap of each probe the run asked (by FILM's score, x100, and by the gold's
    log-likelihood where measured, nats), at its first and last probe step."""
    rows, steps = [], None
    for task in Task:
        files = RunDir(run_dir).eval_files(task.probe)
        if not files:
            continue
        steps = sorted({min(files), max(files)})
        results = [ProbeResult.load_json(files[step]) for step in steps]
        for score in (ACCURACY, LOGLIK):
            if not all(score in r.scores for r in results):
                continue
            k = 100.0 if score.rate else 1.0
            cells = []
            for r in results:
                s = summarize_valprobing(r, score=score)
                cells += [f"{k * s.avg.value:.1f} [{k * s.avg.low:.1f}, {k * s.avg.high:.1f}]", f"{k * s.gap:.1f}"]
            rows.append([str(task), "FILM score x100" if score.rate else "log p(gold), nats", *cells])
    if not rows:
        return []
    header = ["task", "score", *(f"{name} step {step}" for step in steps for name in ("Avg", "Gap"))]
    return ["## VaLProbing (Avg and Gap)", "", *markdown_table(header, rows), "",
            "Avg: the mean over bins of each bin's mean over sets (95% interval over items); Gap: best bin minus worst "
            "(analysis.evaluation.valprobing).", ""]


def jacobian_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Valley depth and fits at the first and last measured steps, per measured set."""
    sets = sorted({key.split("/")[1] for row in rows for key in row if key.startswith("valley/")})
    table = []
    for name in sets:
        for pattern in JACOBIAN_KEYS:
            measured = _steps_of(rows, pattern.format(set=name))
            if measured:
                table.append((pattern.format(set=name), measured[0], measured[-1]))
    if not table:
        return []
    first_step, last_step = table[0][1][0], table[0][2][0]
    body = [[f"`{key}`", num(first[1], missing=MISSING), num(last[1], missing=MISSING)] for key, first, last in table]
    return ["## Jacobian profile (valley depth in decades; fits: Spearman, W1 at the W1-optimal α)", "",
            *markdown_table(["metric", f"step {first_step}", f"step {last_step}"], body), ""]


def wandb_sync_command(run_dir: Path) -> Optional[str]:
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    return f"wandb sync {shlex.quote(str(offline[-1]))}" if offline else None


def position_signal_lines(run_dir: Path, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The watch's signals (analysis.evaluation.watch): each one's value at the first and the last measurement,
    its change with an interval over the watch questions, and its step-to-step noise; what they cost."""
    watched = read_rows(RunDir(run_dir).watch)
    signals = position_signals(watched)
    train = [row for row in rows if f"{TRAIN_PREFIX}/nll_contrast" in row]
    if not signals and not train:
        return []
    noise = {k: v for row in rows for k, v in row.items() if k.startswith(f"{WATCH_PREFIX}/sd/")}  # the latest

    def sd(key: str) -> str:
        return num(noise.get(f"{WATCH_PREFIX}/sd/{key.removeprefix(WATCH_PREFIX + '/')}"), missing=MISSING)

    table = [[f"`{s.key}`", s.what, f"{num(s.start)} (step {s.steps[0]})", f"{num(s.end)} (step {s.steps[1]})",
              f"{s.change.value:+.3f} [{s.change.low:+.3f}, {s.change.high:+.3f}], {s.change.n} questions",
              sd(s.key)] for s in signals]
    if train:
        key = f"{TRAIN_PREFIX}/nll_contrast"
        table.append([f"`{key}`", "training NLL per answer token, middle − strong slot (rolling window)",
                      f"{num(train[0][key])} (step {train[0]['step']})", f"{num(train[-1][key])} (step "
                      f"{train[-1]['step']})", f"{train[-1][key] - train[0][key]:+.3f} (training samples: no paired "
                      "interval)", sd(key)])
    lines = ["## Position signals", "",
             "On the task's own prompts (the watch, analysis.evaluation.watch): the change is the mean over the watch "
             "questions of each one's end minus start, with its 95% interval over questions; a change inside the "
             "step-to-step SD is noise.", "",
             *markdown_table(["signal", "what", "start", "end", "change [95% interval]", "step-to-step SD"], table)]
    header = next((r for r in watched if r.get("kind") == "panel"), None)
    wall, _ = training_wall_time([row for row in rows if "train/loss" in row]) if rows else (0.0, 1)
    cost = [row[f"{WATCH_PREFIX}/wall_s"] for row in rows if f"{WATCH_PREFIX}/wall_s" in row]
    if header is not None:
        every, questions = header["every"], header["questions"]
        panel = ", ".join(f"{n} {name} questions" for name, n in questions.items())
        between = f"one prompt every {every} steps (watch.every), in turn" if every > 0 else "no Jacobian"
        logliks = f"; the whole panel's log p every {header['loglik_every']} steps" if header["loglik_every"] else ""
        lines += ["", f"- measured: every prompt of the panel ({panel} x slots {header['slots']}) at the first and "
                      f"last step; between them {between}{logliks}"]
    if cost and wall > 0:
        lines.append(f"- cost: {sum(cost):.3g} s in all, {sum(cost) / wall:.1%} of the training wall time")
    return [*lines, ""]


def file_lines(run_dir: Path, start_model: Optional[str]) -> list[str]:
    """Where the run's files are: only those it wrote (jacobian=off writes no profiles)."""
    checkpoints, paths = list_checkpoints(run_dir), RunDir(run_dir)
    plots = sorted(paths.plots.glob("*.png"))
    lines = ["## Where things are", "",
             f"- checkpoints: {', '.join(c.name for c in checkpoints) or 'none'} under {paths.checkpoints}",
             f"- plots ({len(plots)}): {', '.join(p.name for p in plots) or 'none'} under {paths.plots}"]
    written = [f"{what}: {path}" for what, path in (("every logged number", paths.metrics),
                                                    ("Jacobian profiles", paths.jacobian),
                                                    ("attention rollouts", paths.rollout),
                                                    ("the watch's measurements", paths.watch)) if path.is_file()]
    if written:
        lines.append(f"- {'; '.join(written)}")
    if sync := wandb_sync_command(run_dir):
        lines.append(f"- wandb (offline): `{sync}` uploads it")
    compared = [start_model] if start_model else []
    lines.append(f"- compare with the starting point: `python -m analysis.compare "
                 f"{' '.join(shlex.quote(str(p)) for p in [*compared, run_dir])}`")
    return lines


def run_summary(run_dir: str | Path, exp_name: str, start_model: Optional[str] = None) -> str:
    """The summary of the run in `run_dir`, as markdown. `start_model`: what the run fine-tuned
    (`model.pretrained`), which `analysis.compare` then compares the run with; None for a random init
    (the run's own step-0 evaluation is its starting point)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir) if RunDir(run_dir).metrics.is_file() else []
    files = RunDir(run_dir).eval_files("in2")
    curves = [depth_curve(step, files[step]) for step in sorted({min(files), max(files)})] if files else []
    lines = [f"# Run summary: {exp_name}", "", f"run directory: {run_dir}", "", *progress_lines(rows), "",
             *position_signal_lines(run_dir, rows), *accuracy_lines(curves), *valprobing_lines(run_dir),
             *jacobian_lines(rows), *file_lines(run_dir, start_model)]
    return "\n".join(lines) + "\n"


def headline_numbers(run_dir: str | Path) -> dict[str, float]:
    """The end state's fairness numbers for the wandb run summary (`summary/in2/<metric>`)."""
    files = RunDir(run_dir).eval_files("in2")
    if not files:
        return {}
    last = max(files)
    return {f"summary/in2/{key}": value for key, value in depth_curve(last, files[last]).fairness.items()}
