"""Debias study: compare the arms of a Hydra multirun on position fairness and on the Jacobian valley.

    python -m analysis.study outputs/in2/<sweep>                      # writes <sweep>/study/report.md
    python -m analysis.study outputs/in2/<sweep> --out study --reference none --n-boot 2000

A study is one `-m` sweep directory with one job directory per (arm, seed): `<sweep>/<n>/` holding
`.hydra/overrides.yaml` (the arm is the `debias=` override, `a+b` for `debias=[a,b]`, `none` without one;
the seed is `seed=`, 0 without one), `eval/in2_step0.json` and `eval/in2_step<N>.json` (the final step is
the largest N), and `metrics.jsonl`. Every job asks the same held-out IN2 questions (same data seed), so
arms are compared paired by question id:

- fairness metrics of each arm's final answers (`fairness`): mean accuracy, worst depth bin, best minus
  worst bin (gap), middle [0.25, 0.75) minus ends accuracy and their ratio; a question's score is the mean
  of its correctness over the arm's seeds;
- a paired bootstrap over questions (`paired_bootstrap`): one set of resampled question indices for every
  arm, so each arm's difference to the reference arm (default `none`) has the question-difficulty variance
  shared by both arms removed; each value and difference with its percentile 95% interval;
- the Jacobian valley (`valley/<set>/peak_to_trough_log10`, `valley/<set>/middle_mass`) at the first and
  last logged step of each arm, mean over seeds.

Writes `<out>/report.md`, `<out>/study.json` (every number) and `<out>/accuracy_by_depth.png`.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from analysis.compare import positive_int
from analysis.evaluation.config import Probe
from analysis.evaluation.fairness import FAIRNESS_METRICS, MIDDLE, middle_of, resampled_metrics
from analysis.evaluation.result import ProbeResult
from analysis.evaluation.scoring import bootstrap_ci
from analysis.report.figures import plot_depth_intervals
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


class StudyError(ValueError):
    """A sweep directory that cannot be read as a study; the message names the path at fault."""


@dataclass
class Job:
    """One (arm, seed) job of the sweep: its step-0 and final IN2 results and its merged metrics."""

    path: Path
    arm: str
    seed: int
    start: ProbeResult
    final: ProbeResult
    final_step: int
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> every key logged at it


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

    def scores(self, arm: str, start: bool = False) -> np.ndarray:
        """(n,) per-question correctness of `arm` at its final step (or step 0), mean over its seeds."""
        rows = [_correct_vector(job.start if start else job.final, self.ids) for job in self.arm_jobs(arm)]
        return np.mean(rows, axis=0)


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
    for step in (0, final_step):
        try:
            results[step] = ProbeResult.load_json(files[step])
        except (OSError, ValueError, KeyError) as err:
            raise StudyError(f"{files[step]}: unreadable eval JSON ({err})") from err
    return Job(job_dir, arm_name(overrides), seed_of(overrides), results[0], results[final_step], final_step,
               _merged_metrics(job_dir))


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
    (arm, seed), or when a job asked other questions than the first job (ids, or a question's depth).
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
        for step, result in ((0, job.start), (job.final_step, job.final)):
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

    Resamples questions with replacement (`n_boot` times, fixed `seed`); every arm is scored on the same
    resampled indices, so a difference is taken question by question. Returns ({arm: {metric: Estimate}},
    {arm: (n_boot,) worst_bin difference samples}): the samples give the interval widths the report shows.
    """
    if reference not in scores:
        raise StudyError(f"reference arm {reference!r} is not among the arms: {', '.join(scores)}")
    arms = [reference, *(a for a in scores if a != reference)]
    matrix = np.stack([np.asarray(scores[a], dtype=np.float64) for a in arms])  # (A, n)
    bins, depths = np.asarray(bins, dtype=np.int64), np.asarray(depths, dtype=np.float64)
    n_bins, middle, n = int(bins.max()) + 1, middle_of(depths), matrix.shape[1]

    rng = np.random.default_rng(seed)
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in FAIRNESS_METRICS}
    for start in range(0, n_boot, CHUNK):
        idx = rng.integers(0, n, size=(min(CHUNK, n_boot - start), n))  # (c, n), shared by every arm
        metrics, _ = resampled_metrics(matrix, bins, middle, idx, n_bins)
        for name, values in metrics.items():
            chunks[name].append(values)
    samples = {name: np.concatenate(values, axis=1) for name, values in chunks.items()}  # {metric: (A, n_boot)}
    point, _ = resampled_metrics(matrix, bins, middle, np.arange(n)[None], n_bins)

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


def valley_sets(study: Study) -> list[str]:
    """The Jacobian sets any job logged valley metrics for, `vanilla` and `chunked` first."""
    found = {name for job in study.jobs for name, _ in _valley_ends(job)}
    return sorted(found, key=lambda name: (SET_ORDER.index(name) if name in SET_ORDER else len(SET_ORDER), name))


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


# ---------------------------------------------------------------------------------------------- analysis


def analyse(
    study: Study, reference: str = REFERENCE_ARM, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict[str, Any]:
    """Every number of the report (what `study.json` holds), arms in report order (reference first)."""
    if reference not in study.arms:
        raise StudyError(f"{study.sweep_dir}: reference arm {reference!r} has no job; arms: {', '.join(study.arms)}")
    arms = [reference, *(a for a in study.arms if a != reference)]
    scores = {arm: study.scores(arm) for arm in arms}
    scores[START] = study.scores(reference, start=True)  # what the arms start from, on the same questions
    estimates, worst_diffs = paired_bootstrap(scores, study.bins, study.depths, reference, n_boot, alpha, seed)

    by_bin = {}
    for arm in arms:
        acc, ci = bin_accuracy(scores[arm], study.bins, study.n_bins, n_boot, alpha, seed)
        by_bin[arm] = {"accuracy": acc.tolist(), "ci": ci.tolist()}
    start_acc, start_ci = bin_accuracy(study.scores(reference, start=True), study.bins, study.n_bins, n_boot,
                                       alpha, seed)
    ref_ci = np.asarray(by_bin[reference]["ci"])
    half_widths = (ref_ci[:, 1] - ref_ci[:, 0]) / 2  # (B,)
    worst_half = {}
    for arm, diff in worst_diffs.items():
        if arm != reference:
            low, high = _interval(diff, alpha)
            worst_half[arm] = (high - low) / 2

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
        } for arm in arms},
        "fairness": {arm: {name: vars(e) | {"resolved": e.resolved} for name, e in metrics.items()}
                     for arm, metrics in estimates.items()},
        "bins": {"n_bins": study.n_bins, "labels": [study.labels.get(b, f"{b / study.n_bins:g}")
                                                    for b in range(study.n_bins)]},
        "by_bin": by_bin,
        "start": {"arm": reference, "step": 0, "accuracy": start_acc.tolist(), "ci": start_ci.tolist()},
        "resolution": {
            "median_bin_halfwidth": float(np.nanmedian(half_widths)) if np.isfinite(half_widths).any() else None,
            "bin_halfwidths": half_widths.tolist(),
            "worst_bin_diff_halfwidth": worst_half,
        },
        "valley": valley_changes(study),
    }


# ---------------------------------------------------------------------------------------------- figure


def plot_accuracy_by_depth(stats: Mapping[str, Any], out_png: str | Path) -> Path:
    """Final accuracy by gold depth of every arm with 95% bootstrap intervals; dashed grey: step 0 of the
    reference arm (`analysis.report.figures.plot_depth_intervals` of the `analyse` numbers)."""
    arms = {arm: (by_bin["accuracy"], by_bin["ci"]) for arm, by_bin in stats["by_bin"].items()}
    return plot_depth_intervals(arms, stats["start"]["accuracy"], f"{stats['start']['arm']}, step 0 (start)",
                                f"Final accuracy by gold depth: {stats['n_questions']} questions, mean over seeds",
                                out_png)


# ---------------------------------------------------------------------------------------------- report


FAIRNESS_HEADER = ("metric", "arm", "seeds", "value [95% CI]", "Δ vs {ref} [95% CI]")
VALLEY_HEADER = ("arm", "set", "steps", "peak_to_trough_log10 start", "end", "change",
                 "middle_mass start", "end", "change")


def fairness_table(stats: Mapping[str, Any]) -> list[str]:
    """Markdown rows metric x arm: value [95% CI] and paired difference to the reference (`*`: excludes 0)."""
    ref, rows = stats["reference"], []
    for name in FAIRNESS_METRICS:
        for arm, metrics in stats["fairness"].items():
            e = metrics[name]
            diff = "(reference)" if arm == ref else with_ci(e["diff"], e["diff_low"], e["diff_high"], signed=True)
            if arm != ref and e["resolved"]:
                diff += " *"
            seeds = ",".join(map(str, stats["arms"][arm]["seeds"])) if arm in stats["arms"] else "step 0"
            rows.append([name, arm, seeds, with_ci(e["value"], e["low"], e["high"]), diff])
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


def report_lines(stats: Mapping[str, Any]) -> list[str]:
    """The report's markdown lines (without the figure, which `write_report` adds)."""
    ref, res = stats["reference"], stats["resolution"]
    arms = stats["arms"]
    arm_rows = [[arm, ",".join(map(str, info["seeds"])), "/".join(map(str, sorted(set(info["final_steps"])))),
                 ", ".join(num(m) for m in info["seed_means"])] for arm, info in arms.items()]
    pct = round(100 * (1 - stats["alpha"]))
    widths = ", ".join(f"{arm} ±{num(w)}" for arm, w in res["worst_bin_diff_halfwidth"].items()) or "no other arm"
    lines = [
        "# Debias study", "",
        f"Sweep: `{stats['sweep_dir']}`", "",
        f"{len(arms)} arms, {sum(len(i['seeds']) for i in arms.values())} jobs, {stats['n_questions']} held-out "
        f"questions shared by every job (paired by id).", "",
        *markdown_table(["arm", "seeds", "final step", "mean accuracy per seed"], arm_rows), "",
        "## Position fairness", "",
        f"Final-step accuracy; a question's score is the mean of its correctness over the arm's seeds. "
        f"`worst_bin`: lowest of the {stats['bins']['n_bins']} gold-depth bins; `gap`: highest minus lowest bin; "
        f"`middle_minus_ends` / `middle_over_ends`: gold depth in [{MIDDLE[0]}, {MIDDLE[1]}) against the rest. "
        f"Intervals: {pct}% percentile bootstrap over questions ({stats['n_boot']} resamples, seed {stats['seed']}); "
        f"Δ: arm minus `{ref}` on the same resampled questions (paired). `*`: the Δ interval excludes 0. "
        "Seeds are averaged per question, so seed-to-seed variance is not a separate term of the intervals "
        "(the arms table shows each seed's mean). `worst_bin` and `gap` are extremes over bins: a resample's "
        "lowest bin is biased low, so their intervals sit below (worst_bin) or above (gap) the point value; "
        f"in the paired Δ the bias partly cancels. `{START}`: the starting checkpoint (every job's step-0 "
        "evaluation).", "",
        *fairness_table(stats), "",
        "### What difference is resolvable", "",
        f"The accuracy of one depth bin of `{ref}` is known to ±{num(res['median_bin_halfwidth'])} (median over "
        f"bins of the half-width of each bin's {pct}% bootstrap interval, resampling within the bin). The "
        f"worst-bin difference to `{ref}` is known to: {widths} (half-width of its paired interval); a smaller "
        "change in the worst bin cannot be told from noise with these questions.", "",
        "## Jacobian valley", "",
    ]
    if any(stats["valley"][arm] for arm in stats["valley"]):
        lines += ["`valley/<set>/*` at each job's first and last logged step, mean over the arm's seeds that "
                  "logged it (n/a: no job of the arm logged it, e.g. jacobian off); steps: first → last.", "",
                  *valley_table(stats), ""]
    else:
        lines += ["No job logged valley metrics (Jacobian measurement off in every job).", ""]
    return lines


def write_report(
    study: Study, out_dir: str | Path, reference: str = REFERENCE_ARM, n_boot: int = 2000, alpha: float = 0.05,
    seed: int = 0,
) -> Path:
    """`<out_dir>/report.md`, `<out_dir>/study.json` and `<out_dir>/accuracy_by_depth.png`; the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = analyse(study, reference, n_boot, alpha, seed)
    png = plot_accuracy_by_depth(stats, out / "accuracy_by_depth.png")
    lines = report_lines(stats)
    lines += ["## Accuracy by gold depth", "",
              f"Final step, every arm, error bars: {round(100 * (1 - alpha))}% bootstrap intervals; dashed grey: "
              f"`{reference}` at step 0 (the start).", "", f"![]({png.name})", ""]
    atomic_write_text(out / "study.json", json.dumps(json_safe(stats), indent=1))
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.study",
        description="Compare the arms of a debias sweep (Hydra -m: one job per debias arm and seed) on position "
                    "fairness (paired bootstrap against the reference arm) and on the Jacobian valley. Writes "
                    "OUT/report.md, OUT/study.json and OUT/accuracy_by_depth.png.",
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
