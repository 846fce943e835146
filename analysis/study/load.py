"""The debias study: loading it (its jobs, their overrides, metrics and evaluations); the package's docstring says
what a study is."""
from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from analysis import stats
from analysis.evaluation.config import Probe
from analysis.evaluation.result import ProbeResult
from analysis.report.metrics_log import read_metrics
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
        return np.stack([score_vector(job.start if start else job.final, self.ids, self.score)
                         for job in self.arm_jobs(arm)])


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


def score_vector(result: ProbeResult, ids: Sequence[str], score: stats.Score = stats.ACCURACY) -> np.ndarray:
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
