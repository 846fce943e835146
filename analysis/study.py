"""Debias study: compare the arms of a Hydra multirun on position fairness and on the Jacobian valley.

    python -m analysis.study outputs/in2/<sweep>                      # writes <sweep>/study/report.md
    python -m analysis.study outputs/in2/<sweep> --out study --reference none --n-boot 2000

A study is one `-m` sweep directory with one job directory per (arm, seed): `<sweep>/<n>/` holding
`.hydra/overrides.yaml` (the arm is the `debias=` override, `a+b` for `debias=[a,b]`, `none` without one;
the seed is `seed=`, 0 without one), `eval/in2_step0.json` and `eval/in2_step<N>.json` (the final step is
the largest N; any other N is a saved checkpoint scored by `scripts.eval_checkpoint`), and `metrics.jsonl`.
Every job asks the same held-out IN2 questions (same data seed), so arms are compared paired by question id:

- fairness metrics of each arm's final answers (`fairness`): mean accuracy, worst depth bin, best minus
  worst bin (gap), middle [0.25, 0.75) minus ends accuracy and their ratio; a question's score is the mean
  of its correctness over the arm's seeds; each metric also per seed;
- a two-level bootstrap (`paired_bootstrap`): each resample draws every arm's seeds with replacement
  (training randomness; with 1 seed this level is empty), then one set of question indices for every arm,
  so each arm's difference to the reference arm (default `none`) has the question-difficulty variance
  shared by both arms removed; each value and difference with its percentile 95% interval, and the
  worst bin's minimum detectable difference (`min_detectable_effect`);
- the flat-curve floor of worst bin and gap (`flat_curve`): both are extremes over bins, so a perfectly flat
  curve has a gap above 0; their values with the arm's scores shuffled across depth bins;
- the Jacobian valley (`valley/<set>/peak_to_trough_log10`, `valley/<set>/middle_mass`) at the first and
  last logged step of each arm, mean over seeds;
- whether the per-step Jacobian metrics track the curve (`tracking`): the Spearman rank correlation, over
  every (job, evaluated step), of the change in each valley metric and in the measured-λ rollout's fit
  (`rollout/<set>/measured/w1`, `.../spearman`) with the change in middle minus ends accuracy, with a
  bootstrap interval that resamples whole jobs.

Writes `<out>/report.md`, `<out>/study.json` (every number), `<out>/accuracy_by_depth.png` and
`<out>/valley_accuracy_scatter.png`.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import yaml

from analysis.compare import positive_int
from analysis.evaluation.config import Probe
from analysis.evaluation.fairness import FAIRNESS_METRICS, MIDDLE, fairness, middle_of, resampled_metrics
from analysis.evaluation.result import ProbeResult
from analysis.evaluation.scoring import bootstrap_ci
from analysis.measure.prior import spearman
from analysis.report.figures import ScatterPanel, plot_depth_intervals, plot_valley_accuracy_scatter
from analysis.report.metrics_log import read_metrics
from analysis.report.tables import markdown_table, num, with_ci
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import OVERRIDES, RunDir

REFERENCE_ARM = "none"  # the arm of jobs without a debias override
START = "start"  # the checkpoint every job fine-tunes, as its step-0 evaluation scored it (a row of the table)
DEFAULT_BINS = 10  # depth bins when no outcome's label tells the bin width
VALLEY_METRICS = ("peak_to_trough_log10", "middle_mass")
VALLEY_KEY = re.compile(rf"^valley/([^/]+)/({'|'.join(VALLEY_METRICS)})$")
SET_ORDER = ("vanilla", "chunked")  # known Jacobian sets first, any other after them
CHUNK = 256  # bootstrap resamples processed at once: (arms, CHUNK, questions) floats stay small
POWER = 0.8  # the probability of detecting a true difference of the minimum detectable effect
# per-step Jacobian metrics whose change is set against the change in middle minus ends accuracy (`tracking`)
TRACKED = ("valley/<set>/peak_to_trough_log10", "valley/<set>/middle_mass", "rollout/<set>/measured/w1",
           "rollout/<set>/measured/spearman")
MIN_JOBS = 3  # jobs a rank correlation needs before it is reported
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


@dataclass
class Study:
    """The jobs of a sweep, and the held-out questions they share (sorted by id)."""

    sweep_dir: Path
    jobs: list[Job]
    ids: list[str]
    bins: np.ndarray  # (n,) depth bin (outcome `position`) of each question
    depths: np.ndarray  # (n,) gold depth in [0, 1] of each question
    n_bins: int
    labels: dict[int, str]  # bin -> its lower edge as written in the eval JSONs

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
        """(seeds, n) per-question correctness of each seed of `arm` at its final step (or step 0)."""
        return np.stack([_correct_vector(job.start if start else job.final, self.ids) for job in self.arm_jobs(arm)])

    def scores(self, arm: str, start: bool = False) -> np.ndarray:
        """(n,) per-question correctness of `arm` at its final step (or step 0), mean over its seeds."""
        return self.seed_scores(arm, start).mean(axis=0)


@dataclass
class Estimate:
    """One metric of one arm: its value and 95% interval, and its paired difference to the reference arm."""

    value: float
    low: float
    high: float
    diff: float
    diff_low: float
    diff_high: float

    @property
    def resolved(self) -> bool:
        """The difference interval excludes 0."""
        return self.diff_low > 0 or self.diff_high < 0


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


def _merged_metrics(job_dir: Path) -> dict[int, dict[str, Any]]:
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
               _merged_metrics(job_dir), results, _log_wall_s(paths.log))


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


def _correct_vector(result: ProbeResult, ids: Sequence[str]) -> np.ndarray:
    correct = {str(o["id"]): float(o["correct"]) for o in result.outcomes if o["position"] >= 0}
    return np.array([correct[i] for i in ids], dtype=np.float64)


def _n_bins(outcomes: Sequence[Mapping[str, Any]]) -> int:
    """Bin count from a label: bin p has lower edge p / bins (`data_builders.probes.bin_label`)."""
    for o in outcomes:
        if o["position"] > 0 and float(o["label"]) > 0:
            return int(round(o["position"] / float(o["label"])))
    return DEFAULT_BINS


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def load_study(sweep_dir: str | Path) -> Study:
    """Read every job of a sweep (subdirectories with `.hydra/overrides.yaml`).

    Raises StudyError naming the path when a job has no step-0 or final eval JSON, when two jobs share an
    (arm, seed), or when an eval JSON of any step asked other questions than the first job's final one (ids, or
    a question's depth).
    """
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        raise StudyError(f"{sweep}: not a directory")
    job_dirs = sorted((p.parents[1] for p in sweep.glob(f"*/{OVERRIDES}")), key=_job_order)
    if not job_dirs:
        raise StudyError(f"{sweep}: no job directories (subdirectories with {OVERRIDES})")
    jobs = [_load_job(d) for d in job_dirs]
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
    return Study(sweep, jobs, ids, bins, depths, n_bins, labels)


# ---------------------------------------------------------------------------------------------- fairness


def _interval(samples: np.ndarray, alpha: float) -> tuple[float, float]:
    """Percentile interval of the finite samples (nan, nan) when none is finite."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return float("nan"), float("nan")
    low, high = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _seed_rows(scores: np.ndarray) -> np.ndarray:
    """(seeds, n) rows of per-question scores; a 1-D vector is one seed."""
    rows = np.asarray(scores, dtype=np.float64)
    return rows[None] if rows.ndim == 1 else rows


def _resample_seeds(rows: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """(count, n) per-question means over the seeds of `rows` (seeds, n) drawn with replacement."""
    n_seeds = rows.shape[0]
    if n_seeds == 1:  # nothing to draw: the seed level is empty
        return np.broadcast_to(rows, (count, rows.shape[1]))
    weights = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=count) / n_seeds  # (count, seeds)
    return weights @ rows


def paired_bootstrap(
    scores: Mapping[str, np.ndarray],
    bins: np.ndarray,
    depths: np.ndarray,
    reference: str = REFERENCE_ARM,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[dict[str, dict[str, Estimate]], dict[str, np.ndarray]]:
    """Each arm's fairness metrics with their intervals, and their differences to `reference`, paired.

    scores: {arm: (seeds, n) per-question scores of each seed, or (n,) for one seed}. A point value is the
    metric of each question's mean over the arm's seeds. Each of the `n_boot` resamples (fixed `seed`) has
    two levels: every arm's seeds drawn with replacement, then question indices with replacement, the same
    for every arm, so a difference is taken question by question. Seeds are drawn independently for each
    arm, not paired by their number: arms differ in their data or their losses, so seed k of two arms is no
    shared unit (where their runs correlate, independent draws err wide). Seeds and questions are crossed
    (every seed answers every question): drawing both (a pigeonhole bootstrap) counts the seed x question
    noise more than once (wider), and k drawn seeds carry (k - 1) / k of their variance (narrower). An arm
    of one seed has no seed level; with 1-D scores this is the question-only bootstrap. The seed level draws
    from its own stream, so the question indices do not depend on the number of seeds. Returns ({arm:
    {metric: Estimate}}, {arm: (n_boot,) worst_bin difference samples}): the samples give the interval
    widths and the minimum detectable effects the report shows.
    """
    if reference not in scores:
        raise StudyError(f"reference arm {reference!r} is not among the arms: {', '.join(scores)}")
    arms = [reference, *(a for a in scores if a != reference)]
    rows = [_seed_rows(scores[a]) for a in arms]  # A x (seeds, n)
    means = np.stack([r.mean(axis=0) for r in rows])  # (A, n)
    bins, depths = np.asarray(bins, dtype=np.int64), np.asarray(depths, dtype=np.float64)
    n_bins, middle, n = int(bins.max()) + 1, middle_of(depths), means.shape[1]

    rng, seed_rng = np.random.default_rng(seed), np.random.default_rng((seed, 1))
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in FAIRNESS_METRICS}
    for start in range(0, n_boot, CHUNK):
        count = min(CHUNK, n_boot - start)
        idx = rng.integers(0, n, size=(count, n))  # (c, n), shared by every arm
        drawn = np.stack([_resample_seeds(r, count, seed_rng) for r in rows])  # (A, c, n)
        metrics, _ = resampled_metrics(drawn, bins, middle, idx, n_bins)
        for name, values in metrics.items():
            chunks[name].append(values)
    samples = {name: np.concatenate(values, axis=1) for name, values in chunks.items()}  # {metric: (A, n_boot)}
    point, _ = resampled_metrics(means, bins, middle, np.arange(n)[None], n_bins)

    estimates: dict[str, dict[str, Estimate]] = {}
    worst_diffs: dict[str, np.ndarray] = {}
    for a, arm in enumerate(arms):
        estimates[arm] = {}
        for name in FAIRNESS_METRICS:
            diff = samples[name][a] - samples[name][0]  # same resample, arm minus reference
            estimates[arm][name] = Estimate(float(point[name][a, 0]), *_interval(samples[name][a], alpha),
                                            float(point[name][a, 0] - point[name][0, 0]), *_interval(diff, alpha))
            if name == "worst_bin":
                worst_diffs[arm] = diff
    return estimates, worst_diffs


def min_detectable_effect(diff_samples: np.ndarray, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest true difference a two-sided test at level `alpha` detects with probability `power`.

    Normal approximation from the bootstrap standard error of the difference: (z_{1-alpha/2} + z_power) x SE,
    2.80 x SE at alpha 0.05 and power 0.8; nan with fewer than 2 finite samples.
    """
    finite = np.asarray(diff_samples, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size < 2:
        return float("nan")
    z = NormalDist().inv_cdf
    return float((z(1 - alpha / 2) + z(power)) * finite.std(ddof=1))


def flat_curve(
    scores: np.ndarray, bins: np.ndarray, depths: np.ndarray, n_perm: int = 2000, seed: int = 0
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
    for start in range(0, n_perm, CHUNK):
        count = min(CHUNK, n_perm - start)
        shuffled = rng.permuted(np.broadcast_to(scores, (count, n)), axis=1)  # (c, n)
        metrics, _ = resampled_metrics(shuffled[None], bins, middle, np.broadcast_to(np.arange(n), (count, n)),
                                       n_bins)
        for name, values in metrics.items():
            chunks[name].append(values[0])
    return {name: np.concatenate(values) for name, values in chunks.items()}


def bin_accuracy(
    scores: np.ndarray, bins: np.ndarray, n_bins: int, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy (B,) of each depth bin and its 95% bootstrap interval (B, 2), resampling within the bin
    (as `ProbeResult.ci_by_position` does); nan for a bin without questions."""
    acc, ci = np.full(n_bins, np.nan), np.full((n_bins, 2), np.nan)
    for b in range(n_bins):
        inside = np.asarray(scores, dtype=np.float64)[np.asarray(bins) == b]
        if inside.size:
            acc[b], ci[b] = inside.mean(), bootstrap_ci(inside, n_boot, alpha, seed)
    return acc, ci


# ---------------------------------------------------------------------------------------------- valley


def _valley_ends(job: Job) -> dict[tuple[str, str], tuple[int, float, int, float]]:
    """(set, metric) -> (first step, value, last step, value) of the valley keys this job logged."""
    logged: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, row in job.metrics.items():
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
    return _in_set_order(name for job in study.jobs for name, _ in _valley_ends(job))


def valley_changes(study: Study) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{arm: {set: {metric: {start, end, change, start_steps, end_steps, seeds}}}}: means over the arm's seeds
    that logged the metric (nan and no seeds when none did) at their first and last logged steps."""
    sets, out = valley_sets(study), {}
    for arm in study.arms:
        ends = [_valley_ends(job) for job in study.arm_jobs(arm)]
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


@dataclass
class RankCorrelation:
    """Spearman ρ of points pooled over jobs, and its percentile interval from resampling whole jobs."""

    rho: float
    low: float
    high: float
    n_points: int
    n_jobs: int
    undefined: int  # resamples whose ρ is undefined (every drawn x, or every drawn y, equal): left out
    reason: str | None  # why there is no ρ (n/a), None when there is one

    @property
    def resolved(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0


def rank_correlation(
    x: Sequence[float], y: Sequence[float], jobs: Sequence[str], n_boot: int = 2000, alpha: float = 0.05,
    seed: int = 0,
) -> RankCorrelation:
    """Spearman ρ of the points (x_i, y_i), `jobs` naming the job of each, with its percentile interval.

    Each of the `n_boot` resamples (fixed `seed`) draws the jobs with replacement and keeps every point of a
    drawn job together: the points of one run (its steps) are not independent, the job is the unit. No ρ
    (nan, with the reason) with fewer than MIN_JOBS jobs, or with every x or every y equal.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    names, job_of = np.unique(np.asarray(jobs, dtype=str), return_inverse=True)
    reason = None
    if len(names) < MIN_JOBS:
        reason = f"{len(names)} job{'' if len(names) == 1 else 's'} with points, fewer than {MIN_JOBS}"
    elif np.ptp(x) == 0:
        reason = "Δ metric equal at every point"
    elif np.ptp(y) == 0:
        reason = "Δ(middle − ends) equal at every point"
    if reason is not None:
        return RankCorrelation(math.nan, math.nan, math.nan, x.size, len(names), 0, reason)
    members = [np.flatnonzero(job_of == j) for j in range(len(names))]
    draws = np.random.default_rng(seed).integers(0, len(names), size=(n_boot, len(names)))  # job indices
    samples = np.empty(n_boot)
    for b, drawn in enumerate(draws):
        idx = np.concatenate([members[j] for j in drawn])
        samples[b] = spearman(x[idx], y[idx])
    return RankCorrelation(spearman(x, y), *_interval(samples, alpha), x.size, len(names),
                           int(np.isnan(samples).sum()), None)


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
    return fairness(_correct_vector(result, study.ids), study.bins, study.depths)["middle_minus_ends"]


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


def tracking(
    study: Study, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {predictor of TRACKED: {key, rho, low, high, n_points, n_jobs, undefined, reason, resolved,
    points}}}: how the change in each per-step Jacobian metric ranks with the change in middle minus ends
    accuracy (`tracking_points`, `rank_correlation`)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in tracked_sets(study):
        out[name] = {}
        for predictor in TRACKED:
            key = predictor.replace("<set>", name)
            points = tracking_points(study, key)
            r = rank_correlation([p["x"] for p in points], [p["y"] for p in points], [p["job"] for p in points],
                                 n_boot, alpha, seed)
            out[name][predictor] = {"key": key, **vars(r), "resolved": r.resolved, "points": points}
    return out


# ---------------------------------------------------------------------------------------------- analysis


def analyse(
    study: Study, reference: str = REFERENCE_ARM, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict[str, Any]:
    """Every number of the report (what `study.json` holds), arms in report order (reference first)."""
    if reference not in study.arms:
        raise StudyError(f"{study.sweep_dir}: reference arm {reference!r} has no job; arms: {', '.join(study.arms)}")
    arms = [reference, *(a for a in study.arms if a != reference)]
    rows = {arm: study.seed_scores(arm) for arm in arms}
    rows[START] = study.seed_scores(reference, start=True)  # what the arms start from, on the same questions
    estimates, worst_diffs = paired_bootstrap(rows, study.bins, study.depths, reference, n_boot, alpha, seed)
    fairness = {}
    for name, seed_rows in rows.items():
        per_seed, _ = resampled_metrics(seed_rows, study.bins, middle_of(study.depths), np.arange(len(study.ids))[None],
                                        study.n_bins)
        flat = flat_curve(seed_rows.mean(axis=0), study.bins, study.depths, n_boot, seed)
        fairness[name] = {metric: vars(e) | {"resolved": e.resolved, "per_seed": per_seed[metric][:, 0].tolist()}
                          for metric, e in estimates[name].items()}
        for metric, tail in (("worst_bin", alpha), ("gap", 1 - alpha)):  # the side a flat curve errs to
            fairness[name][metric]["flat"] = {"expected": float(flat[metric].mean()), "quantile": tail,
                                              "bound": float(np.quantile(flat[metric], tail))}

    by_bin = {}
    for arm in arms:
        acc, ci = bin_accuracy(rows[arm].mean(axis=0), study.bins, study.n_bins, n_boot, alpha, seed)
        by_bin[arm] = {"accuracy": acc.tolist(), "ci": ci.tolist()}
    start_acc, start_ci = bin_accuracy(study.scores(reference, start=True), study.bins, study.n_bins, n_boot,
                                       alpha, seed)
    ref_ci = np.asarray(by_bin[reference]["ci"])
    half_widths = (ref_ci[:, 1] - ref_ci[:, 0]) / 2  # (B,)
    worst_half, worst_mde = {}, {}
    for arm, diff in worst_diffs.items():
        if arm != reference:
            low, high = _interval(diff, alpha)
            worst_half[arm] = (high - low) / 2
            worst_mde[arm] = min_detectable_effect(diff, alpha)

    return {
        "sweep_dir": str(study.sweep_dir),
        "reference": reference,
        "n_boot": n_boot,
        "alpha": alpha,
        "seed": seed,
        "n_questions": len(study.ids),
        "middle": list(MIDDLE),
        "arms": {arm: {
            "seeds": study.seeds(arm),
            "jobs": [str(job.path) for job in study.arm_jobs(arm)],
            "final_steps": [job.final_step for job in study.arm_jobs(arm)],
            "seed_means": [job.final.mean for job in study.arm_jobs(arm)],
            "wall_s": [job.wall_s for job in study.arm_jobs(arm)],
            "resampled": ["seed", "question"] if len(rows[arm]) > 1 else ["question"],  # the bootstrap's levels
        } for arm in arms},
        "fairness": fairness,
        "bins": {"n_bins": study.n_bins, "labels": [study.labels.get(b, f"{b / study.n_bins:g}")
                                                    for b in range(study.n_bins)]},
        "by_bin": by_bin,
        "start": {"arm": reference, "step": 0, "accuracy": start_acc.tolist(), "ci": start_ci.tolist()},
        "resolution": {
            "median_bin_halfwidth": float(np.nanmedian(half_widths)) if np.isfinite(half_widths).any() else None,
            "bin_halfwidths": half_widths.tolist(),
            "worst_bin_diff_halfwidth": worst_half,
            "power": POWER,
            "worst_bin_mde": worst_mde,
        },
        "valley": valley_changes(study),
        "tracking": tracking(study, n_boot, alpha, seed),
    }


# ---------------------------------------------------------------------------------------------- figure


def plot_accuracy_by_depth(stats: Mapping[str, Any], out_png: str | Path) -> Path:
    """Final accuracy by gold depth of every arm with 95% bootstrap intervals; dashed grey: step 0 of the
    reference arm (`analysis.report.figures.plot_depth_intervals` of the `analyse` numbers)."""
    arms = {arm: (by_bin["accuracy"], by_bin["ci"]) for arm, by_bin in stats["by_bin"].items()}
    return plot_depth_intervals(arms, stats["start"]["accuracy"], f"{stats['start']['arm']}, step 0 (start)",
                                f"Final accuracy by gold depth: {stats['n_questions']} questions, mean over seeds",
                                out_png)


def plot_tracking(stats: Mapping[str, Any], out_png: str | Path) -> Path:
    """Δ of every TRACKED metric against Δ(middle − ends) (`stats["tracking"]`): a row of panels per set, points
    coloured by arm as in `plot_accuracy_by_depth`, each panel titled with its ρ and interval."""
    arms, rows = list(stats["arms"]), []
    for predictors in stats["tracking"].values():
        row = []
        for predictor, e in predictors.items():
            by_arm = {arm: [p for p in e["points"] if p["arm"] == arm] for arm in arms}
            value = f"n/a: {e['reason']}" if e["reason"] else f"ρ {_rho(e)}, {e['n_jobs']} jobs"
            row.append(ScatterPanel(f"{e['key']}\n{value}", f"Δ {predictor.split('/', 2)[2]}",
                                    {arm: ([p["x"] for p in ps], [p["y"] for p in ps]) for arm, ps in by_arm.items()
                                     if ps}))
        rows.append(row)
    return plot_valley_accuracy_scatter(rows, arms, "Δ(middle − ends accuracy)",
                                        "Change from each job's first evaluated step: one point per (job, step)",
                                        out_png)


# ---------------------------------------------------------------------------------------------- report


FAIRNESS_HEADER = ("metric", "arm", "seeds", "value [95% CI]", "per seed", "flat curve: expected (bound)",
                   "Δ vs {ref} [95% CI]")
VALLEY_HEADER = ("arm", "set", "steps", "peak_to_trough_log10 start", "end", "change",
                 "middle_mass start", "end", "change")
TRACKING_HEADER = ("predictor", "set", "points", "jobs", "Spearman ρ [{pct}% CI]", "reading")


def _flat(e: Mapping[str, Any]) -> str:
    """The flat-curve floor of a worst_bin or gap estimate, "expected (quantile%: bound)"; "–" for others."""
    if "flat" not in e:
        return "–"
    flat = e["flat"]
    return f"{num(flat['expected'])} ({round(100 * flat['quantile'])}%: {num(flat['bound'])})"


def fairness_table(stats: Mapping[str, Any]) -> list[str]:
    """Markdown rows metric x arm: value [95% CI], each seed's value, the flat-curve floor (worst_bin, gap)
    and the paired difference to the reference (`*`: excludes 0)."""
    ref, rows = stats["reference"], []
    for name in FAIRNESS_METRICS:
        for arm, metrics in stats["fairness"].items():
            e = metrics[name]
            diff = "(reference)" if arm == ref else with_ci(e["diff"], e["diff_low"], e["diff_high"], signed=True)
            if arm != ref and e["resolved"]:
                diff += " *"
            seeds = ",".join(map(str, stats["arms"][arm]["seeds"])) if arm in stats["arms"] else "step 0"
            rows.append([name, arm, seeds, with_ci(e["value"], e["low"], e["high"]),
                         ", ".join(num(v) for v in e["per_seed"]), _flat(e), diff])
    header = [h.format(ref=ref) for h in FAIRNESS_HEADER]
    return markdown_table(header, rows)


def _steps(steps: Sequence[int]) -> str:
    return "/".join(map(str, steps)) if steps else "–"


def valley_table(stats: Mapping[str, Any]) -> list[str]:
    """Markdown rows arm x set: each valley metric at the first and last logged step, and its change."""
    rows = []
    for arm, sets in stats["valley"].items():
        for name, metrics in sets.items():
            first = metrics[VALLEY_METRICS[0]]
            cells = [arm, name, f"{_steps(first['start_steps'])} → {_steps(first['end_steps'])}"]
            for metric in VALLEY_METRICS:
                m = metrics[metric]
                cells += [num(m["start"]), num(m["end"]), num(m["change"], signed=True)]
            rows.append(cells)
    return markdown_table(VALLEY_HEADER, rows)


def _rho(e: Mapping[str, Any]) -> str:
    return with_ci(e["rho"], e["low"], e["high"], signed=True)


def _reading(e: Mapping[str, Any]) -> str:
    """What a rank correlation's interval says: "tracks" only where it excludes 0."""
    if e["reason"]:
        return f"n/a: {e['reason']}"
    if e["low"] > 0:
        return "tracks: ρ > 0"
    if e["high"] < 0:
        return "tracks: ρ < 0"
    return "no rank correlation resolved"


def tracking_table(stats: Mapping[str, Any]) -> list[str]:
    """Markdown rows predictor x set: points, jobs, Spearman ρ [interval] and what the interval says."""
    rows = [[f"`{predictor}`", name, str(e["n_points"]), str(e["n_jobs"]), "n/a" if e["reason"] else _rho(e),
             _reading(e)] for name, predictors in stats["tracking"].items() for predictor, e in predictors.items()]
    return markdown_table([h.format(pct=round(100 * (1 - stats["alpha"]))) for h in TRACKING_HEADER], rows)


def tracking_summary(stats: Mapping[str, Any]) -> str:
    """One sentence from the intervals only: the predictors whose interval excludes 0, with ρ's sign."""
    entries = [e for predictors in stats["tracking"].values() for e in predictors.values() if not e["reason"]]
    tracks = [f"`{e['key']}` (ρ {'>' if e['low'] > 0 else '<'} 0)" for e in entries if e["resolved"]]
    pct = round(100 * (1 - stats["alpha"]))
    if not entries:
        return "No predictor has a rank correlation (every one n/a)."
    if not tracks:
        return (f"No rank correlation resolved: the {pct}% interval of each of the {len(entries)} predictors "
                "with a value includes 0.")
    return (f"{len(tracks)} of {len(entries)} predictors with a value track Δ(middle − ends) (their {pct}% "
            f"interval excludes 0): {', '.join(tracks)}; no rank correlation resolved for the others.")


def _levels(stats: Mapping[str, Any], arm: str) -> str:
    """The bootstrap levels behind an arm's intervals against the reference, as the report says them."""
    single = [a for a in dict.fromkeys((arm, stats["reference"])) if "seed" not in stats["arms"][a]["resampled"]]
    if not single:
        return "seed and question resampling"
    return (f"question resampling only; 1 seed of {' and '.join(f'`{a}`' for a in single)}: training randomness "
            "not included")


def _difference(e: Mapping[str, Any], higher: str, lower: str, null: str) -> str:
    """A difference to the reference as its interval allows: `higher` or `lower` only when it excludes 0."""
    ci = with_ci(e["diff"], e["diff_low"], e["diff_high"], signed=True)
    if e["diff_low"] > 0:
        return f"{higher}: {ci}"
    if e["diff_high"] < 0:
        return f"{lower}: {ci}"
    return f"{null}: {ci}"


def _flat_gap(e: Mapping[str, Any]) -> str:
    """Whether a gap is above the one-sided bound of a flat curve's gap at the same bin sizes."""
    flat = e["flat"]
    pct = round(100 * flat["quantile"])
    floor = f"a flat curve's at these bin sizes: {num(flat['expected'])}, {pct}% of them below {num(flat['bound'])}"
    if e["value"] <= flat["bound"]:
        return f"gap {num(e['value'])} indistinguishable from a flat curve ({floor})"
    return f"gap {num(e['value'])} above a flat curve's ({floor})"


def verdict_lines(stats: Mapping[str, Any]) -> list[str]:
    """One markdown bullet per arm that claims a difference to the reference only where its interval excludes
    0 (a null with the worst bin's minimum detectable effect), and a flat curve where the gap is inside the
    flat-curve floor."""
    ref, fair, mde = stats["reference"], stats["fairness"], stats["resolution"]["worst_bin_mde"]
    lines = [f"- `{ref}` (reference): {_flat_gap(fair[ref]['gap'])}."]
    for arm in stats["arms"]:
        if arm == ref:
            continue
        metrics = fair[arm]
        worst = _difference(metrics["worst_bin"], f"beats `{ref}` on worst-bin accuracy",
                            f"below `{ref}` on worst-bin accuracy",
                            f"no worst-bin difference to `{ref}` resolved (MDE ±{num(mde[arm])})")
        gap = _difference(metrics["gap"], f"wider gap than `{ref}`", f"narrower gap than `{ref}`",
                          f"no gap difference to `{ref}` resolved")
        mean = _difference(metrics["mean"], f"higher mean accuracy than `{ref}`",
                           f"lower mean accuracy than `{ref}`", f"no mean difference to `{ref}` resolved")
        lines.append(f"- `{arm}` ({_levels(stats, arm)}): {worst}; {_flat_gap(metrics['gap'])}; {gap}; {mean}.")
    return lines


def _minutes(walls: Sequence[float | None]) -> str:
    return ", ".join("–" if w is None else f"{w / 60:.1f}" for w in walls)


def report_lines(stats: Mapping[str, Any]) -> list[str]:
    """The report's markdown lines (without the figure, which `write_report` adds)."""
    ref, res = stats["reference"], stats["resolution"]
    arms = stats["arms"]
    arm_rows = [[arm, ",".join(map(str, info["seeds"])), "/".join(map(str, sorted(set(info["final_steps"])))),
                 ", ".join(num(m) for m in info["seed_means"]), _minutes(info["wall_s"])]
                for arm, info in arms.items()]
    pct = round(100 * (1 - stats["alpha"]))
    widths = ", ".join(f"{arm} ±{num(w)}" for arm, w in res["worst_bin_diff_halfwidth"].items()) or "no other arm"
    mdes = ", ".join(f"{arm} ±{num(m)}" for arm, m in res["worst_bin_mde"].items()) or "no other arm"
    single = [arm for arm, info in arms.items() if "seed" not in info["resampled"]]
    counts = sorted({len(info["seeds"]) for info in arms.values() if "seed" in info["resampled"]})
    seed_level = (f"{', '.join(f'`{arm}`' for arm in single)}: 1 seed: training randomness not included (the "
                  "intervals and Δ of such an arm resample questions only). " if single else "")
    if counts:  # a bootstrap of k values has (k - 1) / k of their variance
        seed_level += (f"The seed level draws from {'/'.join(map(str, counts))} seeds per arm; with k seeds it "
                       "carries (k - 1) / k of their variance (narrower intervals). ")
    lines = [
        "# Debias study", "",
        f"Sweep: `{stats['sweep_dir']}`", "",
        f"{len(arms)} arms, {sum(len(i['seeds']) for i in arms.values())} jobs, {stats['n_questions']} held-out "
        f"questions shared by every job (paired by id).", "",
        *markdown_table(["arm", "seeds", "final step", "mean accuracy per seed", "wall time per seed (min)"],
                        arm_rows), "",
        "Wall time: a job's train.log from its first line to its last (set-up, evaluations and the per-step "
        "Jacobian included).", "",
        "## Position fairness", "",
        f"Final-step accuracy; a metric's value is taken on each question's mean correctness over the arm's "
        f"seeds, `per seed` on each seed alone. `worst_bin`: lowest of the {stats['bins']['n_bins']} gold-depth "
        f"bins; `gap`: highest minus lowest bin; `middle_minus_ends` / `middle_over_ends`: gold depth in "
        f"[{MIDDLE[0]}, {MIDDLE[1]}) against the rest. Intervals: {pct}% percentile bootstrap at two levels "
        f"({stats['n_boot']} resamples, seed {stats['seed']}): each resample draws every arm's seeds with "
        "replacement (training randomness), independently for each arm (not paired by seed number), then the "
        f"questions with replacement, the same for every arm; Δ: arm minus `{ref}` on the same resampled "
        "questions (paired by id). Seeds and questions are crossed, so drawing both counts their interaction "
        f"noise more than once (wider intervals). {seed_level}`*`: the Δ interval excludes 0. `worst_bin` and "
        "`gap` are "
        "extremes over bins, biased even for a flat curve: `flat curve` is what a perfectly flat curve with the "
        f"arm's accuracy shows at these bin sizes (its question scores shuffled across depth bins, "
        f"{stats['n_boot']} times), expected value and one-sided {pct}% bound (worst_bin: "
        f"{100 - pct}% of flat curves fall below it; gap: {pct}% of flat curves' gaps lie below it). A "
        "resample's lowest bin is biased low as well, so their intervals sit below (worst_bin) or above (gap) "
        f"the point value; in the paired Δ the bias partly cancels. `{START}`: the starting checkpoint (every "
        "job's step-0 evaluation).", "",
        *fairness_table(stats), "",
        "### What the intervals say", "",
        f"A difference to `{ref}` is claimed only where its {pct}% interval excludes 0; a gap at or below the "
        "flat curve's bound is indistinguishable from a flat curve.", "",
        *verdict_lines(stats), "",
        "### What difference is resolvable", "",
        f"The accuracy of one depth bin of `{ref}` is known to ±{num(res['median_bin_halfwidth'])} (median over "
        f"bins of the half-width of each bin's {pct}% bootstrap interval, resampling the bin's questions with "
        f"seeds averaged: no seed level). The worst-bin difference to `{ref}` is known to: {widths} (half-width "
        f"of its paired interval). Its minimum detectable effect (MDE: the true difference this study finds "
        f"with {round(100 * res['power'])}% power, two-sided α = {stats['alpha']:g}; normal approximation, "
        "(z(1 - α/2) + z(power)) × the bootstrap standard error of the paired Δ, at the intervals' levels): "
        f"{mdes}; a smaller true change in the worst bin is found with less than that probability.", "",
        "## Jacobian valley", "",
    ]
    if any(stats["valley"][arm] for arm in stats["valley"]):
        lines += ["`valley/<set>/*` at each job's first and last logged step, mean over the arm's seeds that "
                  "logged it (n/a: no job of the arm logged it, e.g. jacobian off); steps: first → last.", "",
                  *valley_table(stats), ""]
    else:
        lines += ["No job logged valley metrics (Jacobian measurement off in every job).", ""]
    lines += ["## Does the Jacobian track the curve?", ""]
    if stats["tracking"]:
        lines += ["Do the metrics a run logs at every measured step (at a fraction of an evaluation's cost) "
                  "follow position accuracy without labels? One point per job (arm × seed) and evaluated "
                  "step s after the job's first step s0 that has both an `eval/in2_step<N>.json` and the metric "
                  "(saved checkpoints scored into the run add points): x = the metric at s minus at s0, y = "
                  f"middle − ends accuracy (gold depth in [{MIDDLE[0]}, {MIDDLE[1]}) against the rest) at s minus "
                  "at s0. `rollout/<set>/measured/*`: the fit of the measured-λ rollout to the measured profile "
                  "(W1: lower is closer; Spearman: higher is closer). ρ: Spearman rank correlation over every "
                  f"point; interval: {pct}% percentile bootstrap ({stats['n_boot']} resamples) that draws jobs "
                  "with replacement and keeps all steps of a drawn job together, since the points of one run "
                  "are not independent; resamples whose ρ is undefined (all drawn x or y equal) are left out "
                  f"(`undefined` in study.json). n/a: fewer than {MIN_JOBS} jobs with points, or a change equal at "
                  "every point. A predictor tracks the curve only where its interval excludes 0.", "",
                  *tracking_table(stats), "", tracking_summary(stats), ""]
    else:
        lines += ["No job logged valley or rollout metrics.", ""]
    return lines


def write_report(
    study: Study, out_dir: str | Path, reference: str = REFERENCE_ARM, n_boot: int = 2000, alpha: float = 0.05,
    seed: int = 0,
) -> Path:
    """`<out_dir>/report.md`, `<out_dir>/study.json`, `<out_dir>/accuracy_by_depth.png` and (when a job logged
    valley or rollout metrics) `<out_dir>/valley_accuracy_scatter.png`; the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = analyse(study, reference, n_boot, alpha, seed)
    png = plot_accuracy_by_depth(stats, out / "accuracy_by_depth.png")
    lines = report_lines(stats)
    lines += ["## Accuracy by gold depth", "",
              f"Final step, every arm, error bars: {round(100 * (1 - alpha))}% bootstrap intervals over the bin's "
              f"questions (seeds averaged: no seed level); dashed grey: `{reference}` at step 0 (the start).", "",
              f"![]({png.name})", ""]
    if stats["tracking"]:
        scatter = plot_tracking(stats, out / "valley_accuracy_scatter.png")
        lines += ["## Δ Jacobian metric against Δ(middle − ends)", "",
                  "The points of \"Does the Jacobian track the curve?\", coloured by arm; panel titles: Spearman ρ "
                  f"[{round(100 * (1 - alpha))}% interval, jobs resampled].", "", f"![]({scatter.name})", ""]
    atomic_write_text(out / "study.json", json.dumps(json_safe(stats), indent=1))
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.study",
        description="Compare the arms of a debias sweep (Hydra -m: one job per debias arm and seed) on position "
                    "fairness (paired bootstrap against the reference arm), on the Jacobian valley and on whether "
                    "it tracks the curve. Writes OUT/report.md, OUT/study.json, OUT/accuracy_by_depth.png and "
                    "OUT/valley_accuracy_scatter.png.",
    )
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR", help="the sweep directory (its job subdirectories)")
    parser.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR/study)")
    parser.add_argument("--reference", default=REFERENCE_ARM,
                        help=f"the arm differences are taken against (default: {REFERENCE_ARM})")
    parser.add_argument("--n-boot", type=positive_int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: the sweep cannot be read as a study)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "study"
    try:
        study = load_study(args.sweep_dir)
        report = write_report(study, out, args.reference, args.n_boot, seed=args.seed)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    stats = json.loads((out / "study.json").read_text(encoding="utf-8"))
    print("\n".join(fairness_table(stats)))
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
