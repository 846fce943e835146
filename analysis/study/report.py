"""The debias study (the report: its tables, figures and verdict); the package's docstring says what a study is."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from analysis import stats
from analysis.evaluation.config import Probe
from analysis.evaluation.fairness import FAIRNESS_METRICS, MIDDLE
from analysis.report.figures import ScatterPanel, plot_depth_intervals, plot_valley_accuracy_scatter
from analysis.report.tables import markdown_table, num, with_ci
from analysis.study.fairness import LINEAR_METRICS
from analysis.study.load import (
    MDE_SIMULATIONS,
    MIN_ARMS,
    REFERENCE_ARM,
    START,
    VALLEY_METRICS,
    Study,
    StudyError,
)
from analysis.study.numbers import analyse
from analysis.study.tracking import arm_correlation
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import RunDir


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
