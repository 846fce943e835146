"""Debias study: compare the arms of a Hydra multirun on position fairness and on the Jacobian valley.

    python -m analysis.study outputs/in2/<sweep>                      # writes <sweep>/study/report.md
    python -m analysis.study outputs/in2/<sweep> --out study --reference none --seeds shared --score correct

A study is one `-m` sweep directory with one job directory per (arm, seed): `<sweep>/<n>/` holding
`.hydra/overrides.yaml` (the arm is the `debias=` override, `a+b` for `debias=[a,b]`, `none` without one;
the seed is `seed=`, 0 without one), `eval/in2_step0.json` and `eval/in2_step<N>.json` (the final step is
the largest N; any other N is a saved checkpoint scored by `scripts.eval_checkpoint`), `metrics.jsonl`, and
`finished.json`, which `train.py` writes last: a job without it was killed or is still running, and the study
names it and stops (`--skip-incomplete`: leave it out, named in the report) rather than take its last evaluation
for a final one. `python train.py -m <the sweep's command> resume_sweep=<sweep>` finishes such jobs.
Every job asks the same held-out IN2 questions (same data seed), so arms are compared paired by question id,
and seed k of every arm starts from the same initialisation and data order (`--seeds shared`, the default).
Every statistic comes from `analysis.stats` (docs/STATISTICS.md):

- fairness metrics of each arm's final scores (`fairness_estimates`; `--score FIELD` compares another outcome
  field than `correct`, e.g. a log-likelihood): mean, worst depth bin, best minus worst bin (gap), middle
  [0.25, 0.75) minus ends and their ratio, on each question's mean over the arm's seeds, and per seed;
- mean and middle minus ends, and each bin's mean: t intervals of the crossed design arms x seeds x questions,
  the seed part pooled over the arms (`stats.crossed_interval`), for each arm and its difference to the
  reference arm (default `none`);
- worst bin and gap: the difference with a paired permutation test's p-value (an extreme has no interval that
  covers), the flat-curve floor (`flat_curve`: both are extremes over bins, so a perfectly flat curve has a gap
  above 0), and the worst bin's minimum detectable effect by simulation (`stats.worst_bin_mde`);
- the Jacobian valley (`valley/<set>/peak_to_trough_log10`, `valley/<set>/middle_mass`) at the first and
  last logged step of each arm, mean over seeds;
- whether the per-step Jacobian metrics track the curve (`tracking`): Spearman's ρ over arms (the independent
  units) of the change in each valley metric and in the measured-λ rollout's fit (`rollout/<set>/measured/w1`,
  `.../spearman`) against the change in middle minus ends, with exact permutation p-values, Holm-adjusted.

Writes `<out>/report.md`, `<out>/study.json` (every number), `<out>/accuracy_by_depth.png`,
`<out>/valley_accuracy_scatter.png` and `<out>/answers/` (every job's per-question answers, for re-analysis).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from analysis import stats
from analysis.compare import positive_int
from analysis.evaluation.config import Probe
from analysis.evaluation.fairness import FAIRNESS_METRICS, MIDDLE, fairness, middle_of, resampled_metrics
from analysis.evaluation.result import ProbeResult
from analysis.report.figures import ScatterPanel, plot_depth_intervals, plot_valley_accuracy_scatter
from analysis.report.metrics_log import read_metrics
from analysis.report.tables import markdown_table, num, with_ci
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import FINISHED, OVERRIDES, STEP_DIR, RunDir

REFERENCE_ARM = "none"  # the arm of jobs without a debias override
START = "start"  # the checkpoint every job fine-tunes, as its step-0 evaluation scored it (a row of the table)
DEFAULT_BINS = 10  # depth bins when no outcome's label tells the bin width
VALLEY_METRICS = ("peak_to_trough_log10", "middle_mass")
VALLEY_KEY = re.compile(rf"^valley/([^/]+)/({'|'.join(VALLEY_METRICS)})$")
SET_ORDER = ("vanilla", "chunked")  # known Jacobian sets first, any other after them
MDE_SIMULATIONS = 1000  # simulated studies behind the worst-bin minimum detectable effect
# per-step Jacobian metrics whose change is set against the change in middle minus ends accuracy (`tracking`)
TRACKED = ("valley/<set>/peak_to_trough_log10", "valley/<set>/middle_mass", "rollout/<set>/measured/w1",
           "rollout/<set>/measured/spearman")
MIN_ARMS = 3  # arms a rank correlation needs before it is reported
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")  # a train.log line's timestamp


class StudyError(ValueError):
    """A sweep directory that cannot be read as a study; the message names the path at fault."""


@dataclass
class Job:
    """One (arm, seed) job of the sweep: its step-0, final and every other evaluated step's IN2 results, and
    its merged metrics."""

    path: Path
    arm: str
    seed: int
    start: ProbeResult
    final: ProbeResult
    final_step: int
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> every key logged at it
    evals: dict[int, ProbeResult] = field(default_factory=dict)  # step -> IN2 results of every evaluated step
    wall_s: float | None = None  # first to last line of its train.log (set-up, evaluations, Jacobian included)


@dataclass(frozen=True)
class LeftOutJob:
    """A job of the sweep left out by `--skip-incomplete`: it did not finish (no finished.json), or it shares its
    seed with one that did not (the arms of the crossed design must share their seeds)."""

    path: Path
    arm: str
    seed: int
    reason: str


@dataclass
class Study:
    """The finished jobs of a sweep, the held-out questions they share (sorted by id), and the jobs left out
    because they did not finish."""

    sweep_dir: Path
    jobs: list[Job]
    ids: list[str]
    bins: np.ndarray  # (n,) depth bin (outcome `position`) of each question
    depths: np.ndarray  # (n,) gold depth in [0, 1] of each question
    n_bins: int
    labels: dict[int, str]  # bin -> its lower edge as written in the eval JSONs
    score: stats.Score = stats.ACCURACY  # the outcome field compared, and which way is better
    left_out: list[LeftOutJob] = field(default_factory=list)

    @property
    def arms(self) -> list[str]:
        """Arm names, the reference arm `none` first (when present), the others sorted."""
        names = sorted({job.arm for job in self.jobs})
        return sorted(names, key=lambda name: name != REFERENCE_ARM)

    def arm_jobs(self, arm: str) -> list[Job]:
        found = sorted((job for job in self.jobs if job.arm == arm), key=lambda job: job.seed)
        if not found:
            raise StudyError(f"{self.sweep_dir}: no job of arm {arm!r}; arms: {', '.join(self.arms)}")
        return found

    def seeds(self, arm: str) -> list[int]:
        return [job.seed for job in self.arm_jobs(arm)]

    def seed_scores(self, arm: str, start: bool = False) -> np.ndarray:
        """(seeds, n) per-question score of each seed of `arm` at its final step (or step 0)."""
        return np.stack([_score_vector(job.start if start else job.final, self.ids, self.score)
                         for job in self.arm_jobs(arm)])


# ---------------------------------------------------------------------------------------------- loading


def _strip_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value.strip()  # +key=v adds, ++key=v forces, ~key deletes


def arm_name(overrides: Sequence[str]) -> str:
    """The arm of a job from its Hydra overrides: `debias=x` -> `x`, `debias=[a,b]` -> `a+b`, none -> `none`."""
    for override in overrides:
        key, value = _strip_override(override)
        if key != "debias":
            continue
        if value.startswith("[") and value.endswith("]"):
            parts = [part.strip().strip("'\"") for part in value[1:-1].split(",")]
            return "+".join(part for part in parts if part) or REFERENCE_ARM
        return value.strip("'\"") or REFERENCE_ARM
    return REFERENCE_ARM


def seed_of(overrides: Sequence[str]) -> int:
    """The `seed=` override of a job, 0 (the config's default) without one."""
    for override in overrides:
        key, value = _strip_override(override)
        if key == "seed":
            return int(value)
    return 0


def _read_overrides(path: Path) -> list[str]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError) as err:
        raise StudyError(f"{path}: unreadable overrides ({err})") from err
    if not isinstance(data, list):
        raise StudyError(f"{path}: expected a YAML list of overrides, got {type(data).__name__}")
    return [str(item) for item in data]


def merged_metrics(job_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl rows merged per step (groups of metrics of one step come on separate lines)."""
    if not RunDir(job_dir).metrics.is_file():
        return {}
    merged: dict[int, dict[str, Any]] = {}
    for row in read_metrics(job_dir):
        if "step" in row:
            merged.setdefault(int(row["step"]), {}).update(row)
    return dict(sorted(merged.items()))


def _log_wall_s(log_path: Path) -> float | None:
    """Seconds from the first to the last timestamped line of a job's train.log (None without two)."""
    if not log_path.is_file():
        return None
    stamps = [m.group(1) for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()
              if (m := LOG_TIME.match(line))]
    if len(stamps) < 2:
        return None
    first, last = (datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in (stamps[0], stamps[-1]))
    return (last - first).total_seconds()


def _job_status(job_dir: Path) -> LeftOutJob:
    """The job at `job_dir` with why it did not finish when it has no finished.json (reason "": it finished)."""
    paths = RunDir(job_dir)
    overrides = _read_overrides(paths.overrides)
    reason = ""
    if not paths.finished.is_file():
        folder = paths.checkpoints
        steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))) \
            if folder.is_dir() else []
        reached = f"its newest checkpoint is step-{steps[-1]}" if steps else "it saved no checkpoint"
        reason = f"no {FINISHED}: killed or still running; {reached}"
    return LeftOutJob(job_dir, arm_name(overrides), seed_of(overrides), reason)


def _load_job(job_dir: Path) -> Job:
    paths = RunDir(job_dir)
    overrides = _read_overrides(paths.overrides)
    files = paths.eval_files(Probe.in2)
    if 0 not in files:
        raise StudyError(f"{paths.eval_json(Probe.in2, 0)}: missing (every job needs its step-0 eval)")
    final_step = max(files)
    if final_step == 0:
        raise StudyError(f"{paths.eval}: only {paths.eval_json(Probe.in2, 0).name}, no final eval "
                         "(did the job finish?)")
    results = {}
    for step, path in files.items():
        try:
            results[step] = ProbeResult.load_json(path)
        except (OSError, ValueError, KeyError) as err:
            raise StudyError(f"{path}: unreadable eval JSON ({err})") from err
    return Job(job_dir, arm_name(overrides), seed_of(overrides), results[0], results[final_step], final_step,
               merged_metrics(job_dir), results, _log_wall_s(paths.log))


def _outcomes_by_id(result: ProbeResult, path: Path) -> dict[str, Mapping[str, Any]]:
    by_id: dict[str, Mapping[str, Any]] = {}
    for outcome in result.outcomes:
        if outcome["position"] < 0:
            continue  # a closed-book baseline has no depth
        key = str(outcome["id"])
        if key in by_id:  # pairing by id needs each question once
            raise StudyError(f"{path}: question id {key!r} occurs more than once")
        by_id[key] = outcome
    return by_id


def _score_vector(result: ProbeResult, ids: Sequence[str], score: stats.Score = stats.ACCURACY) -> np.ndarray:
    found = {str(o["id"]): float(o[score.field]) for o in result.outcomes if o["position"] >= 0}
    return np.array([found[i] for i in ids], dtype=np.float64)


def _n_bins(outcomes: Sequence[Mapping[str, Any]]) -> int:
    """Bin count from a label: bin p has lower edge p / bins (`data_builders.probes.bin_label`)."""
    for o in outcomes:
        if o["position"] > 0 and float(o["label"]) > 0:
            return int(round(o["position"] / float(o["label"])))
    return DEFAULT_BINS


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def load_study(sweep_dir: str | Path, score: stats.Score = stats.ACCURACY, skip_incomplete: bool = False) -> Study:
    """Read every job of a sweep (subdirectories with `.hydra/overrides.yaml`), comparing `score`.

    A job without finished.json did not finish: StudyError naming every such job, or with `skip_incomplete`
    it is left out, with its seed in every arm (the crossed design pairs seed k across arms), each job left out
    listed in `Study.left_out` with why. Raises StudyError naming the path when a finished job has
    no step-0 or final eval JSON, when two jobs share an (arm, seed), when an eval JSON of any step asked other
    questions than the first job's final one (ids, or a question's depth), or when its outcomes lack the score's
    field.
    """
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        raise StudyError(f"{sweep}: not a directory")
    job_dirs = sorted((p.parents[1] for p in sweep.glob(f"*/{OVERRIDES}")), key=_job_order)
    if not job_dirs:
        raise StudyError(f"{sweep}: no job directories (subdirectories with {OVERRIDES})")
    every = [_job_status(d) for d in job_dirs]
    unfinished = [job for job in every if job.reason]
    if unfinished and not skip_incomplete:
        named = "; ".join(f"{job.path} (arm {job.arm}, seed {job.seed}): {job.reason}" for job in unfinished)
        raise StudyError(f"{sweep}: {len(unfinished)} of {len(job_dirs)} jobs did not finish: {named}. Finish them "
                         f"by rerunning the sweep's command with resume_sweep={sweep}, or leave them out "
                         "(--skip-incomplete)")
    dropped_seeds = {job.seed: job.path for job in unfinished}
    left_out = unfinished + [
        replace(job, reason=f"finished, left out with seed {job.seed}: {dropped_seeds[job.seed]} did not finish "
                            "(the arms must share their seeds)")
        for job in every if not job.reason and job.seed in dropped_seeds]
    jobs = [_load_job(job.path) for job in every if job.seed not in dropped_seeds]
    if not jobs:
        raise StudyError(f"{sweep}: no seed of which every job finished ({len(unfinished)} of {len(job_dirs)} jobs "
                         f"have no {FINISHED})")
    seen: dict[tuple[str, int], Path] = {}
    for job in jobs:
        other = seen.setdefault((job.arm, job.seed), job.path)
        if other != job.path:
            raise StudyError(f"{job.path}: same arm {job.arm!r} and seed {job.seed} as {other} (does the sweep "
                             "vary something other than debias and seed?)")

    first_path = RunDir(jobs[0].path).eval_json(Probe.in2, jobs[0].final_step)
    first = _outcomes_by_id(jobs[0].final, first_path)
    for job in jobs:
        for step, result in job.evals.items():
            path = RunDir(job.path).eval_json(Probe.in2, step)
            outcomes = _outcomes_by_id(result, path)
            unscored = [i for i, o in outcomes.items() if score.field not in o]
            if unscored:
                raise StudyError(f"{path}: question {unscored[0]!r} (and {len(unscored) - 1} more) has no "
                                 f"{score.field!r} score")
            missing, extra = first.keys() - outcomes.keys(), outcomes.keys() - first.keys()
            if missing or extra:
                raise StudyError(f"{path}: its question ids differ from {first_path} ({len(missing)} missing, "
                                 f"{len(extra)} extra); the jobs of a study must ask the same held-out questions "
                                 "(same data seed)")
            moved = [i for i, o in outcomes.items() if o["position"] != first[i]["position"]]
            if moved:
                raise StudyError(f"{path}: question {moved[0]!r} (and {len(moved) - 1} more) is in another depth "
                                 f"bin than in {first_path}; the jobs must share their held-out data")

    ids = sorted(first)
    bins = np.array([first[i]["position"] for i in ids], dtype=np.int64)
    depths = np.array([float(first[i].get("extra", {}).get("depth", np.nan)) for i in ids], dtype=np.float64)
    if np.isnan(depths).any():
        raise StudyError(f"{first_path}: outcomes without extra['depth'] (the middle/ends split needs it)")
    labels = dict(sorted({int(o["position"]): str(o["label"]) for o in first.values()}.items()))
    n_bins = max(_n_bins(list(first.values())), int(bins.max()) + 1)
    left_out.sort(key=lambda job: _job_order(job.path))
    return Study(sweep, jobs, ids, bins, depths, n_bins, labels, score, left_out)


# ---------------------------------------------------------------------------------------------- fairness


LINEAR_METRICS = ("mean", "middle_minus_ends")  # linear in the scores: crossed-design t intervals
EXTREME_METRICS = ("worst_bin", "gap")  # extremes over bins: a paired permutation test, no interval


def _stacked(rows: Mapping[str, np.ndarray], arms: Sequence[str]) -> np.ndarray:
    """(A, S, Q) scores of `arms`, each (S, Q) or (Q,) for one seed; StudyError if their seed counts differ."""
    tables = [np.asarray(rows[a], dtype=np.float64).reshape(-1, np.shape(rows[a])[-1]) for a in arms]
    counts = {a: t.shape[0] for a, t in zip(arms, tables)}
    if len(set(counts.values())) > 1:
        raise StudyError(f"arms have different numbers of seeds ({counts}); a crossed analysis needs every arm "
                         "trained at the same seeds")
    return np.stack(tables)


def _statistic(name: str, n: int, middle: np.ndarray) -> stats.Linear:
    return stats.mean_of(n) if name == "mean" else stats.contrast(middle)


def _estimate(y: np.ndarray, stat: stats.Linear, arm: int, reference: int, seeds: stats.Seeds,
              alpha: float) -> dict[str, Any]:
    level = stats.crossed_interval(y, stat, arm, None, seeds, alpha)
    out = {"value": level.value, "low": level.low, "high": level.high, "df": level.df, "method": level.method}
    if arm == reference:
        return out | {"diff": 0.0, "diff_low": 0.0, "diff_high": 0.0, "diff_df": None, "resolved": False}
    diff = stats.crossed_interval(y, stat, arm, reference, seeds, alpha)
    return out | {"diff": diff.value, "diff_low": diff.low, "diff_high": diff.high, "diff_df": diff.df,
                  "diff_method": diff.method, "resolved": diff.resolved}


def fairness_estimates(
    rows: Mapping[str, np.ndarray], bins: np.ndarray, depths: np.ndarray, reference: str = REFERENCE_ARM,
    seeds: stats.Seeds = stats.Seeds.shared, score: stats.Score = stats.ACCURACY, alpha: float = stats.ALPHA,
    n_perm: int = stats.N_PERM, seed: int = stats.RNG_SEED,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{arm: {metric: estimate}} of every arm in `rows` ({arm: (S, Q) per-seed scores}), differences to
    `reference`.

    mean and middle_minus_ends: `stats.crossed_interval` (arms x seeds x questions, seed part pooled over the
    arms), value and difference each with its t interval and df. worst_bin and gap: the value on the seed means
    and the paired permutation test's p-value of the difference (`stats.extreme_permutation_test`): `resolved`
    where p < alpha. middle_over_ends: the value only (a ratio)."""
    arms = [reference, *(a for a in rows if a != reference)]
    y = _stacked(rows, arms)  # (A, S, Q)
    bins, middle = np.asarray(bins, dtype=np.int64), middle_of(np.asarray(depths, dtype=np.float64))
    n_bins, means = int(bins.max()) + 1, y.mean(axis=1)  # (A, Q)
    point, _ = resampled_metrics(means, bins, middle, np.arange(y.shape[2])[None], n_bins, score)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for a, arm in enumerate(arms):
        out[arm] = {name: _estimate(y, _statistic(name, y.shape[2], middle), a, 0, seeds, alpha)
                    for name in LINEAR_METRICS}
        for name in EXTREME_METRICS:
            value = float(point[name][a, 0])
            if a == 0:
                out[arm][name] = {"value": value, "diff": 0.0, "p_value": None, "resolved": False}
                continue
            diff, p = stats.extreme_permutation_test(means[a], means[0], bins, name, score, n_perm, seed)
            out[arm][name] = {"value": value, "diff": float(diff), "p_value": float(p), "resolved": bool(p < alpha)}
        out[arm]["middle_over_ends"] = {"value": float(point["middle_over_ends"][a, 0])}
        per_seed, _ = resampled_metrics(y[a], bins, middle, np.arange(y.shape[2])[None], n_bins, score)
        for name in FAIRNESS_METRICS:
            out[arm][name]["per_seed"] = per_seed[name][:, 0].tolist()
    return out


def flat_curve(
    scores: np.ndarray, bins: np.ndarray, depths: np.ndarray, n_perm: int = stats.N_PERM,
    seed: int = stats.RNG_SEED, score: stats.Score = stats.ACCURACY,
) -> dict[str, np.ndarray]:
    """{metric: (n_perm,)} fairness metrics of a perfectly flat curve at these bin sizes and this accuracy.

    The per-question scores (n,) are shuffled across questions (the depth labels permuted) `n_perm` times
    (fixed `seed`): every bin then has the same expected accuracy, and what remains of worst_bin and gap is
    the chance spread of bins of these sizes (a flat curve's gap is above 0, its worst bin below the mean).
    """
    scores, bins = np.asarray(scores, dtype=np.float64), np.asarray(bins, dtype=np.int64)
    n, n_bins, middle = scores.size, int(bins.max()) + 1, middle_of(np.asarray(depths, dtype=np.float64))
    rng = np.random.default_rng(seed)
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in FAIRNESS_METRICS}
    for start in range(0, n_perm, stats.CHUNK):
        count = min(stats.CHUNK, n_perm - start)
        shuffled = rng.permuted(np.broadcast_to(scores, (count, n)), axis=1)  # (c, n)
        metrics, _ = resampled_metrics(shuffled[None], bins, middle, np.broadcast_to(np.arange(n), (count, n)),
                                       n_bins, score)
        for name, values in metrics.items():
            chunks[name].append(values[0])
    return {name: np.concatenate(values) for name, values in chunks.items()}


def bin_intervals(
    y: np.ndarray, bins: np.ndarray, n_bins: int, seeds: stats.Seeds = stats.Seeds.shared, alpha: float = stats.ALPHA
) -> tuple[np.ndarray, np.ndarray]:
    """Mean score (B,) of each depth bin of one arm's (S, Q) scores and its crossed-design interval (B, 2)
    (`stats.crossed_interval` over the bin's questions); nan for a bin with fewer than 2 questions."""
    y = np.asarray(y, dtype=np.float64).reshape(1, -1, np.shape(y)[-1])  # (1, S, Q)
    value, ci = np.full(n_bins, np.nan), np.full((n_bins, 2), np.nan)
    for b in range(n_bins):
        inside = np.asarray(bins) == b
        if inside.sum() >= 2:
            iv = stats.crossed_interval(y, stats.Linear(np.where(inside, 0, -1), (1.0,)), 0, None, seeds, alpha)
            value[b], ci[b] = iv.value, (iv.low, iv.high)
    return value, ci


# ---------------------------------------------------------------------------------------------- valley


def valley_ends(metrics: Mapping[int, Mapping[str, Any]]) -> dict[tuple[str, str], tuple[int, float, int, float]]:
    """(set, metric) -> (first step, value, last step, value) of the valley keys (VALLEY_METRICS) logged in
    `metrics` (step -> its merged row, `merged_metrics`)."""
    logged: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, row in metrics.items():
        for key, value in row.items():
            match = VALLEY_KEY.match(key)
            # non-finite values are null in metrics.jsonl (strings in files older than that rule): not a measurement
            if match and isinstance(value, (int, float)) and math.isfinite(value):
                logged.setdefault((match.group(1), match.group(2)), []).append((step, float(value)))
    return {key: (*values[0], *values[-1]) for key, values in logged.items()}


def _in_set_order(names: Iterable[str]) -> list[str]:
    """Jacobian set names once each, `vanilla` and `chunked` first, any other after them by name."""
    return sorted(set(names), key=lambda name: (SET_ORDER.index(name) if name in SET_ORDER else len(SET_ORDER), name))


def valley_sets(study: Study) -> list[str]:
    """The Jacobian sets any job logged valley metrics for, `vanilla` and `chunked` first."""
    return _in_set_order(name for job in study.jobs for name, _ in valley_ends(job.metrics))


def valley_changes(study: Study) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{arm: {set: {metric: {start, end, change, start_steps, end_steps, seeds}}}}: means over the arm's seeds
    that logged the metric (nan and no seeds when none did) at their first and last logged steps."""
    sets, out = valley_sets(study), {}
    for arm in study.arms:
        ends = [valley_ends(job.metrics) for job in study.arm_jobs(arm)]
        out[arm] = {}
        for name in sets:
            out[arm][name] = {}
            for metric in VALLEY_METRICS:
                found = [e[(name, metric)] for e in ends if (name, metric) in e]
                start = float(np.mean([f[1] for f in found])) if found else float("nan")
                end = float(np.mean([f[3] for f in found])) if found else float("nan")
                out[arm][name][metric] = {
                    "start": start, "end": end, "change": end - start,
                    "start_steps": sorted({f[0] for f in found}), "end_steps": sorted({f[2] for f in found}),
                    "seeds": len(found),
                }
    return out


# ---------------------------------------------------------------------------------------------- tracking


def _logged(job: Job, key: str) -> dict[int, float]:
    """step -> the finite values of `key` in the job's metrics (null or "nan" is no measurement)."""
    return {step: float(row[key]) for step, row in job.metrics.items()
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])}


def tracked_sets(study: Study) -> list[str]:
    """The Jacobian sets any job logged a key of TRACKED for, `vanilla` and `chunked` first."""
    keys = {key for job in study.jobs for row in job.metrics.values() for key in row}
    found = {key.split("/")[1] for key in keys if key.count("/") >= 2}
    return _in_set_order(name for name in found if any(t.replace("<set>", name) in keys for t in TRACKED))


def _middle_minus_ends(study: Study, result: ProbeResult) -> float:
    return fairness(_score_vector(result, study.ids, study.score), study.bins, study.depths,
                    study.score)["middle_minus_ends"]


def tracking_points(study: Study, key: str) -> list[dict[str, Any]]:
    """One point per job and step s that has both an IN2 eval and a finite `key`, after the job's first such
    step s0: x = `key` at s minus at s0, y = middle minus ends accuracy at s minus at s0."""
    points = []
    for job in study.jobs:
        logged = _logged(job, key)
        steps = [step for step in job.evals if step in logged]  # ascending
        for step in steps[1:]:
            y = _middle_minus_ends(study, job.evals[step]) - _middle_minus_ends(study, job.evals[steps[0]])
            points.append({"arm": job.arm, "seed": job.seed, "job": str(job.path), "base_step": steps[0],
                           "step": step, "x": logged[step] - logged[steps[0]], "y": y})
    return points


def arm_correlation(points: Sequence[Mapping[str, Any]], n_perm: int = stats.N_PERM,
                    seed: int = stats.RNG_SEED) -> dict[str, Any]:
    """Spearman ρ between Δ metric and Δ(middle − ends) over arms, each arm one point (the mean of its jobs'
    points), with the exact permutation p-value (`stats.permutation_correlation`): the jobs of one arm share
    its objective and its steps share a run, so neither is an independent unit; the arms are."""
    by_arm: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        by_arm.setdefault(p["arm"], []).append(p)
    x = [float(np.mean([p["x"] for p in ps])) for ps in by_arm.values()]
    y = [float(np.mean([p["y"] for p in ps])) for ps in by_arm.values()]
    r = stats.permutation_correlation(x, y, n_perm, seed, min_units=MIN_ARMS)
    reason = r.reason
    if reason is not None and reason.startswith("x or y"):
        reason = ("Δ metric equal at every arm" if len(set(np.round(x, stats.RANK_DECIMALS))) == 1
                  else "Δ(middle − ends) equal at every arm")
    return {**r.as_dict(), "reason": reason, "n_points": len(points), "n_jobs": len({p["job"] for p in points}),
            "arm_points": {arm: {"x": xa, "y": ya} for arm, xa, ya in zip(by_arm, x, y)}}


def tracking(
    study: Study, n_perm: int = stats.N_PERM, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED
) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {predictor of TRACKED: {key, rho, p_value, p_holm, resolved, n_units, n_points, n_jobs, reason,
    points, arm_points}}}: how the change in each per-step Jacobian metric ranks with the change in middle minus
    ends accuracy over arms (`tracking_points`, `arm_correlation`); p_holm: Holm-adjusted over every predictor
    and set with a value, `resolved` where it is below alpha."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in tracked_sets(study):
        out[name] = {}
        for predictor in TRACKED:
            key = predictor.replace("<set>", name)
            points = tracking_points(study, key)
            out[name][predictor] = {"key": key, **arm_correlation(points, n_perm, seed), "points": points}
    entries = [e for predictors in out.values() for e in predictors.values()]
    for e, adjusted in zip(entries, stats.holm([e["p_value"] for e in entries])):
        e["p_holm"] = adjusted
        e["resolved"] = bool(np.isfinite(adjusted) and adjusted < alpha)
    return out


# ---------------------------------------------------------------------------------------------- analysis


def analyse(
    study: Study, reference: str = REFERENCE_ARM, seeds: stats.Seeds = stats.Seeds.shared, n_perm: int = stats.N_PERM,
    alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED, n_sim: int = MDE_SIMULATIONS,
) -> dict[str, Any]:
    """Every number of the report (what `study.json` holds), arms in report order (reference first).

    Questions with a non-finite score in any job are left out of every arm (the pairing) and counted."""
    if reference not in study.arms:
        raise StudyError(f"{study.sweep_dir}: reference arm {reference!r} has no job; arms: {', '.join(study.arms)}")
    arms = [reference, *(a for a in study.arms if a != reference)]
    rows = {arm: study.seed_scores(arm) for arm in arms}
    start_rows = study.seed_scores(reference, start=True)  # what the arms start from, on the same questions
    finite = np.all([np.isfinite(r).all(axis=0) for r in [*rows.values(), start_rows]], axis=0)  # (Q,)
    if finite.sum() < 4:
        raise StudyError(f"{study.sweep_dir}: {int(finite.sum())} questions with a finite {study.score.field} "
                         "in every job; an interval needs more")
    rows = {arm: r[:, finite] for arm, r in rows.items()}
    start_rows, bins, depths = start_rows[:, finite], study.bins[finite], study.depths[finite]
    fairness = fairness_estimates(rows, bins, depths, reference, seeds, study.score, alpha, n_perm, seed)
    fairness[START] = fairness_estimates({reference: rows[reference], START: start_rows}, bins, depths, reference,
                                         seeds, study.score, alpha, n_perm, seed)[START]
    for name, seed_rows in [*rows.items(), (START, start_rows)]:
        flat = flat_curve(seed_rows.mean(axis=0), bins, depths, n_perm, seed, study.score)
        worst_tail = alpha if study.score.higher_is_better else 1 - alpha
        for metric, tail in (("worst_bin", worst_tail), ("gap", 1 - alpha)):  # the side a flat curve errs to
            fairness[name][metric]["flat"] = {"expected": float(flat[metric].mean()), "quantile": tail,
                                              "bound": float(np.quantile(flat[metric], tail))}

    by_bin = {}
    for arm in arms:
        value, ci = bin_intervals(rows[arm], bins, study.n_bins, seeds, alpha)
        by_bin[arm] = {"accuracy": value.tolist(), "ci": ci.tolist()}
    start_value, start_ci = bin_intervals(start_rows, bins, study.n_bins, seeds, alpha)
    ref_ci = np.asarray(by_bin[reference]["ci"])
    half_widths = (ref_ci[:, 1] - ref_ci[:, 0]) / 2  # (B,)
    n_seeds = rows[reference].shape[0]
    rates = np.asarray(by_bin[reference]["accuracy"])
    mde = (stats.worst_bin_mde(rates, bins, n_seeds, stats.POWER, n_sim, alpha=alpha, seed=seed)
           if study.score.rate and np.isfinite(rates).all() else None)

    return {
        "sweep_dir": str(study.sweep_dir),
        "reference": reference,
        "score": {"field": study.score.field, "higher_is_better": study.score.higher_is_better},
        "seeds": seeds.value,
        "n_perm": n_perm,
        "alpha": alpha,
        "seed": seed,
        "n_questions": int(finite.sum()),
        "nonfinite_questions": int((~finite).sum()),
        "left_out": [{"job": str(job.path), "arm": job.arm, "seed": job.seed, "reason": job.reason}
                     for job in study.left_out],
        "middle": list(MIDDLE),
        "arms": {arm: {
            "seeds": study.seeds(arm),
            "jobs": [str(job.path) for job in study.arm_jobs(arm)],
            "final_steps": [job.final_step for job in study.arm_jobs(arm)],
            "seed_means": rows[arm].mean(axis=1).tolist(),
            "wall_s": [job.wall_s for job in study.arm_jobs(arm)],
        } for arm in arms},
        "fairness": fairness,
        "bins": {"n_bins": study.n_bins, "labels": [study.labels.get(b, f"{b / study.n_bins:g}")
                                                    for b in range(study.n_bins)]},
        "by_bin": by_bin,
        "start": {"arm": reference, "step": 0, "accuracy": start_value.tolist(), "ci": start_ci.tolist()},
        "resolution": {
            "median_bin_halfwidth": float(np.nanmedian(half_widths)) if np.isfinite(half_widths).any() else None,
            "bin_halfwidths": half_widths.tolist(),
            "mean_diff_halfwidth": {arm: (e["mean"]["diff_high"] - e["mean"]["diff_low"]) / 2
                                    for arm, e in fairness.items() if arm not in (reference, START)},
            "power": stats.POWER,
            "worst_bin_mde": mde,
            "mde_simulations": n_sim,
        },
        "valley": valley_changes(study),
        "tracking": tracking(study, n_perm, alpha, seed),
    }


# ---------------------------------------------------------------------------------------------- figure


def plot_accuracy_by_depth(numbers: Mapping[str, Any], out_png: str | Path) -> Path:
    """Final score by gold depth of every arm with its crossed-design 95% intervals; dashed grey: step 0 of the
    reference arm (`analysis.report.figures.plot_depth_intervals` of the `analyse` numbers)."""
    arms = {arm: (by_bin["accuracy"], by_bin["ci"]) for arm, by_bin in numbers["by_bin"].items()}
    field = numbers["score"]["field"]
    return plot_depth_intervals(arms, numbers["start"]["accuracy"], f"{numbers['start']['arm']}, step 0 (start)",
                                f"Final {'accuracy' if field == 'correct' else field} by gold depth: "
                                f"{numbers['n_questions']} questions, mean over seeds", out_png)


def plot_tracking(numbers: Mapping[str, Any], out_png: str | Path) -> Path:
    """Δ of every TRACKED metric against Δ(middle − ends) (`numbers["tracking"]`): a row of panels per set,
    points coloured by arm as in `plot_accuracy_by_depth`, each panel titled with its ρ over arms and p."""
    arms, rows = list(numbers["arms"]), []
    for predictors in numbers["tracking"].values():
        row = []
        for predictor, e in predictors.items():
            by_arm = {arm: [p for p in e["points"] if p["arm"] == arm] for arm in arms}
            value = f"n/a: {e['reason']}" if e["reason"] else f"ρ {_rho(e)} over {e['n_units']} arms"
            row.append(ScatterPanel(f"{e['key']}\n{value}", f"Δ {predictor.split('/', 2)[2]}",
                                    {arm: ([p["x"] for p in ps], [p["y"] for p in ps]) for arm, ps in by_arm.items()
                                     if ps}))
        rows.append(row)
    return plot_valley_accuracy_scatter(rows, arms, "Δ(middle − ends)",
                                        "Change from each job's first evaluated step: one point per (job, step)",
                                        out_png)


# ---------------------------------------------------------------------------------------------- report


FAIRNESS_HEADER = ("metric", "arm", "seeds", "value [95% CI]", "per seed", "flat curve: expected (bound)",
                   "Δ vs {ref} [95% CI] or (p)")
VALLEY_HEADER = ("arm", "set", "steps", "peak_to_trough_log10 start", "end", "change",
                 "middle_mass start", "end", "change")
TRACKING_HEADER = ("predictor", "set", "arms", "jobs", "Spearman ρ over arms", "p (exact)", "p (Holm)", "reading")


def _flat(e: Mapping[str, Any]) -> str:
    """The flat-curve floor of a worst_bin or gap estimate, "expected (quantile%: bound)"; "–" for others."""
    if "flat" not in e:
        return "–"
    flat = e["flat"]
    return f"{num(flat['expected'])} ({round(100 * flat['quantile'])}%: {num(flat['bound'])})"


def _value(e: Mapping[str, Any]) -> str:
    return with_ci(e["value"], e["low"], e["high"]) if "low" in e else num(e["value"])


def _delta(e: Mapping[str, Any]) -> str:
    """A difference to the reference: with its t interval (linear metrics) or its permutation p (extremes)."""
    if "diff_low" in e:
        text = with_ci(e["diff"], e["diff_low"], e["diff_high"], signed=True)
    elif "p_value" in e:
        text = f"{num(e['diff'], signed=True)} (p {num(e['p_value'])})"
    else:
        return "–"
    return text + (" *" if e.get("resolved") else "")


def fairness_table(numbers: Mapping[str, Any]) -> list[str]:
    """Markdown rows metric x arm: value [95% CI], each seed's value, the flat-curve floor (worst_bin, gap)
    and the difference to the reference (`*`: its interval excludes 0, or its p is below α)."""
    ref, rows = numbers["reference"], []
    for name in FAIRNESS_METRICS:
        for arm, metrics in numbers["fairness"].items():
            e = metrics[name]
            seeds = ",".join(map(str, numbers["arms"][arm]["seeds"])) if arm in numbers["arms"] else "step 0"
            rows.append([name, arm, seeds, _value(e), ", ".join(num(v) for v in e["per_seed"]), _flat(e),
                         "(reference)" if arm == ref else _delta(e)])
    header = [h.format(ref=ref) for h in FAIRNESS_HEADER]
    return markdown_table(header, rows)


def _steps(steps: Sequence[int]) -> str:
    return "/".join(map(str, steps)) if steps else "–"


def valley_table(numbers: Mapping[str, Any]) -> list[str]:
    """Markdown rows arm x set: each valley metric at the first and last logged step, and its change."""
    rows = []
    for arm, sets in numbers["valley"].items():
        for name, metrics in sets.items():
            first = metrics[VALLEY_METRICS[0]]
            cells = [arm, name, f"{_steps(first['start_steps'])} → {_steps(first['end_steps'])}"]
            for metric in VALLEY_METRICS:
                m = metrics[metric]
                cells += [num(m["start"]), num(m["end"]), num(m["change"], signed=True)]
            rows.append(cells)
    return markdown_table(VALLEY_HEADER, rows)


def _rho(e: Mapping[str, Any]) -> str:
    return f"{num(e['rho'], signed=True)} (p {num(e['p_value'])})"


def _reading(e: Mapping[str, Any]) -> str:
    """What a rank correlation says: "tracks" only where its Holm-adjusted p is below α."""
    if e["reason"]:
        return f"n/a: {e['reason']}"
    if e["resolved"]:
        return f"tracks: ρ {'>' if e['rho'] > 0 else '<'} 0"
    return "no rank correlation resolved"


def tracking_table(numbers: Mapping[str, Any]) -> list[str]:
    """Markdown rows predictor x set: arms, jobs, Spearman ρ over arms, its exact and Holm-adjusted p-values and
    what they say."""
    rows = [[f"`{predictor}`", name, str(e["n_units"]), str(e["n_jobs"]),
             "n/a" if e["reason"] else num(e["rho"], signed=True),
             "n/a" if e["reason"] else num(e["p_value"]), "n/a" if e["reason"] else num(e["p_holm"]), _reading(e)]
            for name, predictors in numbers["tracking"].items() for predictor, e in predictors.items()]
    return markdown_table(list(TRACKING_HEADER), rows)


def tracking_summary(numbers: Mapping[str, Any]) -> str:
    """One sentence from the tests only: the predictors whose Holm-adjusted p is below α, with ρ's sign."""
    entries = [e for predictors in numbers["tracking"].values() for e in predictors.values() if not e["reason"]]
    tracks = [f"`{e['key']}` (ρ {'>' if e['rho'] > 0 else '<'} 0)" for e in entries if e["resolved"]]
    if not entries:
        return "No predictor has a rank correlation (every one n/a)."
    if not tracks:
        return (f"No rank correlation resolved: the Holm-adjusted p of each of the {len(entries)} predictors "
                f"with a value is at or above α = {numbers['alpha']:g}.")
    return (f"{len(tracks)} of {len(entries)} predictors with a value track Δ(middle − ends) over arms (Holm-"
            f"adjusted p below α = {numbers['alpha']:g}): {', '.join(tracks)}; no rank correlation resolved for "
            "the others.")


def _seed_note(numbers: Mapping[str, Any]) -> str:
    """What the intervals hold of training randomness, as the report says it."""
    counts = sorted({len(info["seeds"]) for info in numbers["arms"].values()})
    if counts == [1]:
        return "1 seed an arm: training randomness not included (the intervals hold the questions only)"
    return (f"{counts[0]} seeds an arm ({numbers['seeds']}): questions and seeds; the seed part pooled over the "
            f"{len(numbers['arms'])} arms")


def _difference(e: Mapping[str, Any], higher: str, lower: str, null: str) -> str:
    """A difference to the reference as its test allows: `higher` or `lower` only when it is resolved."""
    text = _delta(e).removesuffix(" *")
    if e["resolved"]:
        return f"{higher if e['diff'] > 0 else lower}: {text}"
    return f"{null}: {text}"


def _flat_gap(e: Mapping[str, Any]) -> str:
    """Whether a gap is above the one-sided bound of a flat curve's gap at the same bin sizes."""
    flat = e["flat"]
    pct = round(100 * flat["quantile"])
    floor = f"a flat curve's at these bin sizes: {num(flat['expected'])}, {pct}% of them below {num(flat['bound'])}"
    if e["value"] <= flat["bound"]:
        return f"gap {num(e['value'])} indistinguishable from a flat curve ({floor})"
    return f"gap {num(e['value'])} above a flat curve's ({floor})"


def _mde(numbers: Mapping[str, Any]) -> str:
    mde = numbers["resolution"]["worst_bin_mde"]
    if mde is None:
        return "MDE n/a: not a rate"
    return "no lift of the dip bin is detectable" if not math.isfinite(mde) else f"MDE {num(mde)}"


def verdict_lines(numbers: Mapping[str, Any]) -> list[str]:
    """One markdown bullet per arm that claims a difference to the reference only where it is resolved (a null
    with the worst bin's minimum detectable effect), and a flat curve where the gap is inside the flat-curve
    floor."""
    ref, fair = numbers["reference"], numbers["fairness"]
    lines = [f"- `{ref}` (reference): {_flat_gap(fair[ref]['gap'])}."]
    for arm in numbers["arms"]:
        if arm == ref:
            continue
        metrics = fair[arm]
        worst = _difference(metrics["worst_bin"], f"beats `{ref}` on its worst bin", f"below `{ref}` on its worst bin",
                            f"no worst-bin difference to `{ref}` resolved ({_mde(numbers)})")
        gap = _difference(metrics["gap"], f"wider gap than `{ref}`", f"narrower gap than `{ref}`",
                          f"no gap difference to `{ref}` resolved")
        mean = _difference(metrics["mean"], f"higher mean than `{ref}`", f"lower mean than `{ref}`",
                           f"no mean difference to `{ref}` resolved")
        middle = _difference(metrics["middle_minus_ends"], f"higher middle − ends than `{ref}`",
                             f"lower middle − ends than `{ref}`", f"no middle − ends difference to `{ref}` resolved")
        lines.append(f"- `{arm}`: {worst}; {_flat_gap(metrics['gap'])}; {gap}; {mean}; {middle}.")
    return lines


def _minutes(walls: Sequence[float | None]) -> str:
    return ", ".join("–" if w is None else f"{w / 60:.1f}" for w in walls)


def report_lines(numbers: Mapping[str, Any]) -> list[str]:
    """The report's markdown lines (without the figure, which `write_report` adds)."""
    ref, res, arms = numbers["reference"], numbers["resolution"], numbers["arms"]
    score = numbers["score"]
    arm_rows = [[arm, ",".join(map(str, info["seeds"])), "/".join(map(str, sorted(set(info["final_steps"])))),
                 ", ".join(num(m) for m in info["seed_means"]), _minutes(info["wall_s"])]
                for arm, info in arms.items()]
    pct = round(100 * (1 - numbers["alpha"]))
    widths = ", ".join(f"{arm} ±{num(w)}" for arm, w in res["mean_diff_halfwidth"].items()) or "no other arm"
    dropped = (f" {numbers['nonfinite_questions']} questions with a non-finite score in some job are left out of "
               "every arm." if numbers["nonfinite_questions"] else "")
    left_out = numbers.get("left_out", [])
    unfinished = ([f"Left out (`--skip-incomplete`, {len(left_out)} jobs):", "",
                   *(f"- `{job['job']}` (arm {job['arm']}, seed {job['seed']}): {job['reason']}" for job in left_out),
                   ""] if left_out else [])
    lines = [
        "# Debias study", "",
        f"Sweep: `{numbers['sweep_dir']}`", "",
        f"{len(arms)} arms, {sum(len(i['seeds']) for i in arms.values())} jobs, {numbers['n_questions']} held-out "
        f"questions shared by every job (paired by id); score `{score['field']}` "
        f"({'higher' if score['higher_is_better'] else 'lower'} is better).{dropped}", "",
        *markdown_table(["arm", "seeds", "final step", f"mean {score['field']} per seed", "wall time per seed (min)"],
                        arm_rows), "",
        *unfinished,
        "Wall time: a job's train.log from its first line to its last (set-up, evaluations and the per-step "
        "Jacobian included).", "",
        "## Position fairness", "",
        f"Final-step scores; a metric's value is taken on each question's mean over the arm's seeds, `per seed` on "
        f"each seed alone. `worst_bin`: the worst of the {numbers['bins']['n_bins']} gold-depth bins; `gap`: best "
        f"minus worst bin; `middle_minus_ends` / `middle_over_ends`: gold depth in [{MIDDLE[0]}, {MIDDLE[1]}) "
        f"against the rest. Statistics (analysis.stats, docs/STATISTICS.md), {_seed_note(numbers)}:", "",
        f"- `mean`, `middle_minus_ends` and each bin's mean are linear in the scores: {pct}% t intervals of the "
        "crossed design arms x seeds x questions (variance components; a difference pairs the questions and, "
        "with shared seeds, the seeds; degrees of freedom in study.json, `df` / `diff_df`).",
        f"- `worst_bin` and `gap` are extremes over bins, biased even for a flat curve, and no interval of them "
        f"covers as it claims: Δ comes with the p-value of a paired permutation test ({numbers['n_perm']} swaps of "
        "the two arms' scores question by question; exact level). `flat curve`: what a perfectly flat curve "
        "with the arm's scores shows at these bin sizes (scores shuffled across bins), expected value and "
        f"one-sided {pct}% bound.",
        "- `middle_over_ends`: a ratio, value only.",
        f"- `*`: the Δ interval excludes 0, or p < α = {numbers['alpha']:g}. `{START}`: the starting checkpoint "
        "(every job's step-0 evaluation).", "",
        *fairness_table(numbers), "",
        "### What the tests say", "",
        *verdict_lines(numbers), "",
        "### What difference is resolvable", "",
        f"One depth bin of `{ref}` is known to ±{num(res['median_bin_halfwidth'])} (median over bins of its "
        f"{pct}% interval's half-width). The mean difference to `{ref}` is known to {widths}. The worst-bin "
        f"minimum detectable effect (the lift of `{ref}`'s worst bin that the permutation test finds with "
        f"{round(100 * res['power'])}% power at α = {numbers['alpha']:g}, by simulating {res['mde_simulations']} "
        f"studies of these bins and seeds with 0/1 answers at `{ref}`'s bin rates): {_mde(numbers)}. A worst bin "
        "can rise only to the second-worst bin; past that another bin is the worst, so a curve with two dips has "
        "no detectable lift of one.", "",
        "## Jacobian valley", "",
    ]
    if any(numbers["valley"][arm] for arm in numbers["valley"]):
        lines += ["`valley/<set>/*` at each job's first and last logged step, mean over the arm's seeds that "
                  "logged it (n/a: no job of the arm logged it, e.g. jacobian off); steps: first → last.", "",
                  *valley_table(numbers), ""]
    else:
        lines += ["No job logged valley metrics (Jacobian measurement off in every job).", ""]
    lines += ["## Does the Jacobian track the curve?", ""]
    if numbers["tracking"]:
        lines += ["Do the metrics a run logs at every measured step (at a fraction of an evaluation's cost) "
                  "follow position accuracy without labels? Per job (arm × seed) and evaluated step s after the "
                  "job's first step s0 that has both an `eval/in2_step<N>.json` and the metric: x = the metric at "
                  f"s minus at s0, y = middle − ends (gold depth in [{MIDDLE[0]}, {MIDDLE[1]}) against the rest) "
                  "at s minus at s0. `rollout/<set>/measured/*`: the fit of the measured-λ rollout to the "
                  "measured profile (W1: lower is closer; Spearman: higher is closer). The unit is the arm: the "
                  "seeds of one arm share its objective and the steps of one job share a run, so an arm's point "
                  "is the mean of its jobs' points, and ρ is Spearman's over arms (values rounded before ranking) "
                  "with the exact permutation p-value over every reordering of the arms; p (Holm): adjusted over "
                  f"every predictor and set with a value. n/a: fewer than {MIN_ARMS} arms with points, or a change "
                  "equal at every arm. A predictor tracks the curve only where its Holm-adjusted p is below α.", "",
                  *tracking_table(numbers), "", tracking_summary(numbers), ""]
    else:
        lines += ["No job logged valley or rollout metrics.", ""]
    return lines


def keep_answers(study: Study, out: Path) -> Path:
    """Copy every job's eval JSONs (the per-question answers) into `<out>/answers/<arm>/seed<k>/`, so that a later
    method can re-analyse the study without its run directories; the folder."""
    folder = out / "answers"
    for job in study.jobs:
        target = folder / job.arm / f"seed{job.seed}"
        target.mkdir(parents=True, exist_ok=True)
        for path in RunDir(job.path).eval_files(Probe.in2).values():
            atomic_write_text(target / path.name, path.read_text(encoding="utf-8"))
    return folder


def write_report(
    study: Study, out_dir: str | Path, reference: str = REFERENCE_ARM, seeds: stats.Seeds = stats.Seeds.shared,
    n_perm: int = stats.N_PERM, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED,
    n_sim: int = MDE_SIMULATIONS,
) -> Path:
    """`<out_dir>/report.md`, `<out_dir>/study.json`, `<out_dir>/accuracy_by_depth.png`, (when a job logged
    valley or rollout metrics) `<out_dir>/valley_accuracy_scatter.png` and every job's answers under
    `<out_dir>/answers/`; the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    numbers = analyse(study, reference, seeds, n_perm, alpha, seed, n_sim)
    png = plot_accuracy_by_depth(numbers, out / "accuracy_by_depth.png")
    lines = report_lines(numbers)
    lines += ["## Score by gold depth", "",
              f"Final step, every arm, error bars: {round(100 * (1 - alpha))}% crossed-design intervals over the "
              f"bin's questions and the arm's seeds; dashed grey: `{reference}` at step 0 (the start).", "",
              f"![]({png.name})", ""]
    if numbers["tracking"]:
        scatter = plot_tracking(numbers, out / "valley_accuracy_scatter.png")
        lines += ["## Δ Jacobian metric against Δ(middle − ends)", "",
                  "The points of \"Does the Jacobian track the curve?\", coloured by arm; panel titles: Spearman ρ "
                  "over arms and its exact permutation p.", "", f"![]({scatter.name})", ""]
    answers = keep_answers(study, out)
    lines += ["## Answers", "", f"Every job's eval JSONs: `{answers.name}/<arm>/seed<k>/`.", ""]
    atomic_write_text(out / "study.json", json.dumps(json_safe(numbers), indent=1))
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


def reanalyse_per_seed(study_json: str | Path, alpha: float = stats.ALPHA) -> list[str]:
    """Markdown lines re-analysing a study.json whose jobs' answers were not kept: the mean and middle − ends
    differences to the reference from each arm's per-seed values alone (`stats.per_seed_interval`: shared seeds,
    interaction pooled over the arms; given the questions asked, question sampling not included), and tracking
    from its points over arms (`arm_correlation`, Holm over the predictors with a value)."""
    path = Path(study_json)
    try:
        numbers = json.loads(path.read_text(encoding="utf-8"))
        ref, fair = numbers["reference"], numbers["fairness"]
        arms = [ref, *(a for a in numbers["arms"] if a != ref)]
        # per-seed values of each metric where the file has them; an older one kept only each seed's mean
        per_seed = {m: np.array([fair[a][m]["per_seed"] for a in arms], dtype=np.float64) for m in LINEAR_METRICS
                    if all("per_seed" in fair[a][m] for a in arms)}
        per_seed.setdefault("mean", np.array([numbers["arms"][a]["seed_means"] for a in arms], dtype=np.float64))
    except (OSError, ValueError, KeyError) as err:
        raise StudyError(f"{path}: not a study.json with per-seed values ({err!r})") from err
    pct = round(100 * (1 - alpha))
    rows = []
    for a, arm in enumerate(arms[1:], start=1):
        cells = [arm]
        for m in LINEAR_METRICS:
            if m not in per_seed:
                cells.append("n/a (no per-seed values)")
                continue
            iv = stats.per_seed_interval(per_seed[m], a, 0, stats.Seeds.shared, alpha)
            cells.append(with_ci(iv.value, iv.low, iv.high, signed=True) + (" *" if iv.resolved else ""))
        rows.append(cells)
    df = (len(arms) - 1) * (per_seed["mean"].shape[1] - 1)
    lines = [f"Differences to `{ref}` from the per-seed values ({pct}% t({df}) intervals, seed part pooled over "
             f"{len(arms)} arms, given the {numbers['n_questions']} questions; `*`: excludes 0):", "",
             *markdown_table(["arm", f"Δ mean vs {ref}", f"Δ middle − ends vs {ref}"], rows), ""]
    entries = [(name, predictor, arm_correlation(e["points"]))
               for name, predictors in numbers.get("tracking", {}).items() for predictor, e in predictors.items()]
    adjusted = stats.holm([r["p_value"] for _, _, r in entries])
    if entries:
        lines += ["Tracking over arms (Spearman ρ of the arms' mean Δ, exact permutation p, Holm over the predictors "
                  "with a value):", "",
                  *markdown_table(["predictor", "set", "arms", "ρ", "p", "p (Holm)"],
                                  [[f"`{predictor}`", name, str(r["n_units"]),
                                    "n/a" if r["reason"] else num(r["rho"], signed=True),
                                    "n/a" if r["reason"] else num(r["p_value"]), "n/a" if r["reason"] else num(p)]
                                   for (name, predictor, r), p in zip(entries, adjusted)]), ""]
    return lines


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.study",
        description="Compare the arms of a debias sweep (Hydra -m: one job per debias arm and seed) on position "
                    "fairness (crossed-design intervals and paired permutation tests against the reference arm), on "
                    "the Jacobian valley and on whether it tracks the curve. Writes OUT/report.md, OUT/study.json, "
                    "OUT/accuracy_by_depth.png, OUT/valley_accuracy_scatter.png and OUT/answers/.",
    )
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR",
                        help="the sweep directory (its job subdirectories); with --per-seed, a study.json")
    parser.add_argument("--per-seed", action="store_true",
                        help="re-analyse an older study.json that kept no answers, from its per-seed values and "
                             "tracking points (prints markdown)")
    parser.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR/study)")
    parser.add_argument("--reference", default=REFERENCE_ARM,
                        help=f"the arm differences are taken against (default: {REFERENCE_ARM})")
    parser.add_argument("--score", default=stats.ACCURACY.field,
                        help="the outcome field compared (default: correct)")
    parser.add_argument("--lower-is-better", action="store_true", help="lower scores are better (e.g. a loss)")
    parser.add_argument("--seeds", choices=[s.value for s in stats.Seeds], default=stats.Seeds.shared.value,
                        help="shared: seed k is the same init and data order in every arm (train.py's seed); "
                             "independent: each arm's seeds are its own draws (default: shared)")
    parser.add_argument("--n-perm", type=positive_int, default=stats.N_PERM,
                        help=f"permutations of the extremes' tests (default {stats.N_PERM})")
    parser.add_argument("--mde-simulations", type=positive_int, default=MDE_SIMULATIONS,
                        help=f"simulated studies behind the worst-bin MDE (default {MDE_SIMULATIONS})")
    parser.add_argument("--seed", type=int, default=stats.RNG_SEED, help="random seed (default 0)")
    parser.add_argument("--skip-incomplete", action="store_true",
                        help=f"leave out the jobs that did not finish (no {FINISHED}) and their seeds in every arm, "
                             "naming them in the report (default: stop, naming them)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: the sweep cannot be read as a study)."""
    args = build_parser().parse_args(argv)
    if args.per_seed:
        try:
            print("\n".join(reanalyse_per_seed(args.sweep_dir)))
        except StudyError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "study"
    score = stats.Score(args.score, not args.lower_is_better, rate=args.score == stats.ACCURACY.field,
                        label=args.score)
    try:
        study = load_study(args.sweep_dir, score, args.skip_incomplete)
        report = write_report(study, out, args.reference, stats.Seeds(args.seeds), args.n_perm, seed=args.seed,
                              n_sim=args.mde_simulations)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    numbers = json.loads((out / "study.json").read_text(encoding="utf-8"))
    print("\n".join(fairness_table(numbers)))
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
