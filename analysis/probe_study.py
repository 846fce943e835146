"""A fine-tuning experiment read through its probes: arms x settings x seeds of fine-tunes, each asked the same
questions at several gold positions, against the model they all start from (issue 39; docs/READS_MIDDLE.md).

    python -m analysis.probe_study outputs/reads_middle        # writes <dir>/report/{report.md,study.json,*.png}

The folder is what `scripts.reads_middle` writes: `plan.json` (the runs, their arm, setting and seed, and the
evaluations), `runs/<n>/` (train.py run directories), `evals/<evaluation>/<target>/eval/<probe>_step<N>.json`
(`scripts.eval_checkpoint` outputs; target `base` or `run-<n>`) and `selection.json` (each arm's setting, chosen on
the dev evaluation by `choose`).

What is compared (every interval from `analysis.stats`, docs/STATISTICS.md). A question is the unit: mdqa and kv ask
each at every gold position (and mdqa once closed-book), so a question's items are compared with each other first.
For each arm's chosen setting, its seeds (shared by the arms: seed k is one LoRA init and data order) and the
questions form the crossed design arms x seeds x questions (`stats.crossed_interval`, t intervals with the seed part
pooled over the arms, their degrees of freedom reported):

- the score at each position (accuracy, and log p(gold answer) in nats: a measure that no answer format moves),
  and its change against the starting model, question by question;
- each position's contrast to the starting model's strong end (gold 9 minus gold 4 is the bias), and how much
  the fine-tune moved it: the debiasing effect, free of whatever moves every position alike;
- what the answers are (span of the gold, of a distractor, of no document; first-line length; short-answer
  scores), so that a change of format shows as one;
- the Jacobian valley and middle mass of every run at its first and last measured step, beside its change in
  accuracy and log-likelihood at the middle position;
- the goals of issue 39 for every arm, the headline arm (chosen on dev) first.

A change's minimum detectable effect (80% power at 5%, from its t interval) is reported with it: a null is read
against it.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from analysis import stats
from analysis.command_line import CommandParser
from analysis.evaluation.answer_kinds import summarize
from analysis.evaluation.result import LOGLIK, ProbeResult, pairing_mismatch
from analysis.evaluation.watch import watched_changes
from analysis.report.figures import plot_arm_curves
from analysis.report.position_tables import answer_cells, answer_columns
from analysis.report.tables import markdown_table, num
from analysis.study.load import VALLEY_METRICS, merged_metrics
from analysis.study.valley import valley_ends
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import RunDir

PLAN = "plan.json"
SELECTION = "selection.json"
BASE = "base"  # the target name of the starting model in evals/<evaluation>/
CLOSED_BOOK = -1  # the position of a question asked without documents
SCORES = (stats.ACCURACY, LOGLIK)
POWER = stats.POWER


class ProbeStudyError(ValueError):
    """A study folder that cannot be read; the message names the file at fault."""


def run_target(n: int) -> str:
    """The target name of run `n` in evals/<evaluation>/."""
    return f"run-{n}"


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the plan: its arm (debias objective), setting (the other swept keys) and seed."""

    n: int
    arm: str
    setting: str
    seed: int
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """The experiment: runs, evaluations (name -> {probe, part, args}) and which evaluation chooses the settings."""

    folder: Path
    runs: tuple[PlannedRun, ...]
    evaluations: Mapping[str, Mapping[str, Any]]
    dev: str  # the evaluation that chooses each arm's setting (mdqa on the dev questions)
    exp: str = "reads_middle"  # the experiment (+exp=), whose goals the report checks (GOALS)

    @property
    def arms(self) -> list[str]:
        return list(dict.fromkeys(r.arm for r in self.runs))

    def settings(self, arm: str) -> list[str]:
        return list(dict.fromkeys(r.setting for r in self.runs if r.arm == arm))

    def seeds(self) -> list[int]:
        return sorted({r.seed for r in self.runs})

    def runs_of(self, arm: str, setting: str) -> list[PlannedRun]:
        return sorted((r for r in self.runs if r.arm == arm and r.setting == setting), key=lambda r: r.seed)

    def eval_dir(self, evaluation: str, target: str) -> Path:
        return self.folder / "evals" / evaluation / target

    def run_dir(self, n: int) -> Path:
        return self.folder / "runs" / str(n)


def read_plan(folder: str | Path) -> Plan:
    path = Path(folder) / PLAN
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        runs = tuple(PlannedRun(int(r["n"]), str(r["arm"]), str(r["setting"]), int(r["seed"]), tuple(r["overrides"]))
                     for r in data["runs"])
        return Plan(Path(folder), runs, data["evaluations"], str(data["dev"]), str(data.get("exp", "reads_middle")))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ProbeStudyError(f"{path}: unreadable plan ({err}); scripts.reads_middle writes it") from err


def result_files(plan: Plan, evaluation: str, target: str) -> list[Path]:
    """The eval JSONs that evaluation `evaluation` of `target` wrote, sorted (one when it is done, none before)."""
    probe = plan.evaluations[evaluation]["probe"]
    return sorted(RunDir(plan.eval_dir(evaluation, target)).eval.glob(f"{probe}_step*.json"))


def load_result(plan: Plan, evaluation: str, target: str) -> ProbeResult | None:
    """The evaluation's result for `target`, None when it was not made (yet)."""
    found = result_files(plan, evaluation, target)
    if not found:
        return None
    if len(found) > 1:
        raise ProbeStudyError(f"{found[0].parent}: {len(found)} {plan.evaluations[evaluation]['probe']} "
                              "evaluations of one target; keep one")
    try:
        return ProbeResult.load_json(found[0])
    except (OSError, ValueError, KeyError) as err:
        raise ProbeStudyError(f"{found[0]}: unreadable eval JSON ({err})") from err


# ---------------------------------------------------------------------------------------------- score tables


@dataclass
class Table:
    """Scores of one evaluation: y (arms, seeds, questions, positions) and the starting model's (questions,
    positions) for one score field; positions ascending, the closed-book baseline (-1) first when asked."""

    arms: list[str]
    questions: list[str]
    positions: list[int]
    y: np.ndarray
    base: np.ndarray
    dropped: int = 0  # questions left out for a non-finite score anywhere (counted, never silent)

    def column(self, position: int) -> int:
        return self.positions.index(position)


def _by_question(result: ProbeResult, score: stats.Score, where: str) -> dict[tuple[str, int], float]:
    """(question, position) -> score of every item (`ProbeResult.scores_by_question` at each position)."""
    try:
        return {(q, p): v for p in result.labels() for q, v in result.scores_by_question(p, score).items()}
    except KeyError as err:
        raise ProbeStudyError(f"{where}: an item has no {score.field!r} score") from err
    except ValueError as err:  # a question asked twice at one position
        raise ProbeStudyError(f"{where}: {err}") from err


def score_table(base: ProbeResult, arms: Mapping[str, Sequence[ProbeResult]], score: stats.Score,
                where: str = "") -> Table:
    """The `Table` of `score` over the questions every result asked at every position (they must all ask the same:
    ProbeStudyError otherwise); a question with a non-finite score anywhere is left out and counted."""
    tables = {"base": _by_question(base, score, f"{where} base")}
    for arm, results in arms.items():
        for s, result in enumerate(results):
            tables[f"{arm}/{s}"] = _by_question(result, score, f"{where} {arm} seed #{s}")
    keys = set(tables["base"])
    for name, table in tables.items():
        if set(table) != keys:
            raise ProbeStudyError(f"{where}: {name} asked other questions or positions than the starting model "
                                  f"({len(set(table) - keys)} extra, {len(keys - set(table))} missing)")
    questions = sorted({q for q, _ in keys})
    positions = sorted({p for _, p in keys})
    seeds = {len(r) for r in arms.values()}
    if len(seeds) > 1:
        raise ProbeStudyError(f"{where}: arms have different numbers of seeds ({ {a: len(r) for a, r in arms.items()} })")
    n_seeds = seeds.pop() if seeds else 0
    y = np.array([[[[tables[f"{arm}/{s}"][q, p] for p in positions] for q in questions] for s in range(n_seeds)]
                  for arm in arms], dtype=np.float64).reshape(len(arms), n_seeds, len(questions), len(positions))
    b = np.array([[tables["base"][q, p] for p in positions] for q in questions], dtype=np.float64)
    finite = np.isfinite(b).all(axis=1) & np.isfinite(y).all(axis=(0, 1, 3))
    return Table(list(arms), [q for q, k in zip(questions, finite) if k], positions, y[:, :, finite], b[finite],
                 int((~finite).sum()))


def _mde(iv: stats.Interval, alpha: float = stats.ALPHA) -> float:
    """The effect a t test of this interval's precision detects with probability POWER (two-sided, `alpha`)."""
    if iv.df is None or not math.isfinite(iv.half_width):
        return math.nan
    t = scipy_stats.t.ppf(1 - alpha / 2, iv.df)
    return float((t + scipy_stats.t.ppf(POWER, iv.df)) * iv.half_width / t)


def _interval(y: np.ndarray, arm: int, reference: int | None = None) -> dict[str, Any]:
    """The crossed-design interval of the mean over questions of y (arms, seeds, questions) for `arm` (or its
    difference to `reference`), with its MDE."""
    iv = stats.crossed_interval(y, stats.mean_of(y.shape[-1]), arm, reference)
    return {**iv.as_dict(), "mde": _mde(iv)}


def position_estimates(table: Table, strong: int) -> dict[str, Any]:
    """For every arm: each position's score and its change against the starting model, and each position's
    contrast to `strong` and the change of that contrast (the debiasing effect), with intervals."""
    s = table.column(strong)
    out: dict[str, Any] = {"positions": table.positions, "strong": strong, "questions": len(table.questions),
                           "dropped": table.dropped, "base": {}, "arms": {}}
    for p in table.positions:
        c = table.column(p)
        base_iv = stats.mean_interval(table.base[:, c])
        out["base"][str(p)] = {"value": base_iv.as_dict(),
                               "contrast": stats.mean_interval(table.base[:, c] - table.base[:, s]).as_dict()}
    for a, arm in enumerate(table.arms):
        rows = {}
        for p in table.positions:
            c = table.column(p)
            contrast = table.y[..., c] - table.y[..., s]
            base_contrast = table.base[:, c] - table.base[:, s]
            rows[str(p)] = {
                "value": _interval(table.y[..., c], a),
                "change": _interval(table.y[..., c] - table.base[:, c], a),
                "contrast": _interval(contrast, a) if p != strong else None,
                "contrast_change": _interval(contrast - base_contrast, a) if p != strong else None,
                "vs_first_arm": _interval(table.y[..., c], a, 0) if a else None,
            }
        out["arms"][arm] = rows
    return out


def answer_kinds(base: ProbeResult, arms: Mapping[str, Sequence[ProbeResult]]) -> dict[str, Any]:
    """`answer_kinds.summarize` of the answers at each position: the starting model's, and each arm's over all its
    seeds."""
    def of(results: Sequence[ProbeResult]) -> dict[str, Any]:
        described = [o for r in results for o in r.outcomes if "answer" in o.get("extra", {})]
        positions = sorted({int(o["position"]) for o in described})
        return {str(p): summarize([o["extra"]["answer"] for o in described if o["position"] == p]) for p in positions}

    return {"base": of([base]), **{arm: of(results) for arm, results in arms.items()}}


# ---------------------------------------------------------------------------------------------- choosing


def mean_accuracy_score(result: ProbeResult, base: ProbeResult | None) -> float:
    """Issue 39's dev score: the mean accuracy over the gold positions (closed-book left out), the mdqa curve's mean.
    A lift of the weak positions raises it and a loss at the strong one lowers it."""
    return result.mean_of(stats.ACCURACY)


def middle_loglik_score(result: ProbeResult, base: ProbeResult | None) -> float:
    """Issue 65's dev score, its goals as one number: how much more the log p of the gold answer rose at the middle
    gold position than at the strong end, where a fall of the strong end earns nothing: Δ middle − max(Δ strong, 0),
    in nats, each Δ the mean change against the starting model over the questions both asked (its strong end by log
    p). An answer format that moves every position alike scores 0, a lift of the start alone 0, a contrast won by
    lowering the end no more than the middle's own rise. Log p, not accuracy: 100 dev questions resolve a few tenths
    of a nat, not a few points of accuracy."""
    if base is None:
        raise ProbeStudyError("the middle gold's dev score is against the starting model: its dev evaluation is "
                              "missing")
    gold = sorted(p for p in base.labels() if p >= 0)
    middle, strong = gold[len(gold) // 2], base.strong_end(LOGLIK)
    mid, end = (float(np.mean(_changes(result, base, at))) for at in (middle, strong))
    return mid - max(end, 0.0)


def _changes(result: ProbeResult, base: ProbeResult, position: int) -> list[float]:
    """`result`'s log p minus the starting model's at `position`, question by question (those both asked)."""
    mine, start = result.scores_by_question(position, LOGLIK), base.scores_by_question(position, LOGLIK)
    shared = sorted(mine.keys() & start.keys())
    if not shared:
        raise ProbeStudyError(f"no question asked at gold {position} by both a run and the starting model")
    return [mine[q] - start[q] for q in shared]


@dataclass(frozen=True)
class DevRule:
    """How an experiment chooses each arm's setting on the dev evaluation: `score(run's result, starting model's)`,
    higher is better, and what it is in words (selection.json's `rule`)."""

    score: Callable[[ProbeResult, ProbeResult | None], float]
    text: str


DEV_RULES = {  # an experiment's choice rule (Plan.exp); one not named here chooses as reads_middle does
    "reads_middle": DevRule(mean_accuracy_score, "the dev mdqa accuracy averaged over the gold positions "
                                                 "(closed-book left out)"),
    "lift_middle": DevRule(middle_loglik_score, "the dev mdqa log p (nats) of the gold answer: its change at the "
                                                "middle gold position less its rise at the strong end (a fall "
                                                "there counts as 0), against the starting model"),
}


def dev_rule(plan: Plan) -> DevRule:
    return DEV_RULES.get(plan.exp, DEV_RULES["reads_middle"])


def check_paired(plan: Plan, evaluation: str, target: str, result: ProbeResult, base: ProbeResult) -> None:
    """ProbeStudyError naming `target` when its result of `evaluation` was not asked as the starting model's was
    (`result.pairing_mismatch`): a comparison with the base needs the same items."""
    why = pairing_mismatch(result, base, (target, BASE))
    if why:
        raise ProbeStudyError(f"{plan.eval_dir(evaluation, target)}: not paired with the starting model's "
                              f"{evaluation} evaluation: {why}")


def dev_result(plan: Plan, target: str, base: ProbeResult | None) -> ProbeResult | None:
    """`target`'s dev evaluation, None when it is not written, checked against the starting model's
    (`check_paired`) when that is written."""
    found = load_result(plan, plan.dev, target)
    if found is not None and base is not None:
        check_paired(plan, plan.dev, target, found, base)
    return found


def choose(plan: Plan, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Each arm's setting with the best mean dev score (the experiment's `dev_rule`) over its seeds (ties: the
    first in the plan's order), and the headline arm: the arm whose chosen setting scores best. Reads the dev
    evaluation only, of the runs of `seeds` (default: every seed). A setting with a run that has no dev evaluation
    is left out (named under `incomplete`, its arm's choice not `complete`); ProbeStudyError when no arm has a
    complete setting."""
    rule, base = dev_rule(plan), load_result(plan, plan.dev, BASE)
    arms: dict[str, Any] = {}
    incomplete: dict[str, list[int]] = {}
    for arm in plan.arms:
        scores = {}
        for setting in plan.settings(arm):
            runs = [r for r in plan.runs_of(arm, setting) if seeds is None or r.seed in seeds]
            results = [dev_result(plan, run_target(r.n), base) for r in runs]
            missing = [r.n for r, res in zip(runs, results) if res is None]
            if missing:
                incomplete[f"{arm} {setting}"] = missing
                continue
            scores[setting] = float(np.mean([rule.score(r, base) for r in results]))
        if not scores:
            continue
        best = max(scores, key=lambda k: (scores[k], -list(scores).index(k)))
        arms[arm] = {"setting": best, "dev_scores": scores, "runs": [r.n for r in plan.runs_of(arm, best)],
                     "complete": len(scores) == len(plan.settings(arm))}
    if not arms:
        raise ProbeStudyError(f"{plan.folder}: no arm has a setting whose every run has its {plan.dev} evaluation "
                              f"(missing: {incomplete})")
    headline = max(arms, key=lambda a: (arms[a]["dev_scores"][arms[a]["setting"]], -plan.arms.index(a)))
    return {"rule": f"per arm, the setting of the highest mean over seeds of {rule.text}; the headline arm is the "
                    "arm whose chosen setting scores highest; ties go to the first in the plan",
            "seeds": sorted(plan.seeds() if seeds is None else seeds), "evaluation": plan.dev,
            "base_dev_score": None if base is None else rule.score(base, base),
            "arms": arms, "headline": headline, "incomplete": incomplete}


def watch_against_dev(plan: Plan, selection: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The watched signals as a cheap first filter, beside the dev choice: for each signal, Spearman's rho over the
    runs between its change and the run's dev score (the experiment's `dev_rule`), with the exact permutation p,
    and for each arm the setting that the signal's mean change over the choice's seeds would have chosen (higher is
    better: every watched contrast rises when the middle is lifted), against the setting chosen on dev."""
    seeds = set(selection.get("seeds", plan.seeds()))
    rule, base = dev_rule(plan), load_result(plan, plan.dev, BASE)
    score = {r.n: rule.score(res, base) for r in plan.runs
             if r.seed in seeds and (res := dev_result(plan, run_target(r.n), base)) is not None}
    watched = {n: watched_changes(RunDir(plan.run_dir(n)).watch) for n in score}
    out = []
    for key in dict.fromkeys(k for changes in watched.values() for k in changes):
        runs = [n for n in score if key in watched[n]]
        corr = stats.permutation_correlation([watched[n][key] for n in runs], [score[n] for n in runs])
        would: dict[str, Any] = {}
        for arm, info in selection["arms"].items():
            means = {}
            for setting in plan.settings(arm):
                mine = [watched[r.n][key] for r in plan.runs_of(arm, setting) if r.n in runs]
                if mine and len(mine) == len([r for r in plan.runs_of(arm, setting) if r.seed in seeds]):
                    means[setting] = float(np.mean(mine))
            if means:
                best = max(means, key=lambda k: (means[k], -list(means).index(k)))
                would[arm] = {"setting": best, "agrees": best == info["setting"], "means": means}
        out.append({"signal": key, "runs": runs, **corr.as_dict(), "choices": would})
    return out


def read_selection(folder: Path) -> dict[str, Any]:
    path = folder / SELECTION
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ProbeStudyError(f"{path}: unreadable ({err}); `python -m scripts.reads_middle` chooses the settings "
                              "after the dev evaluations") from err


# ---------------------------------------------------------------------------------------------- the Jacobian


def run_valley(run_dir: Path) -> dict[str, Any]:
    """`valley/<set>/<metric>` -> {first_step, first, last_step, last}: the study's valley metrics
    (`analysis.study.VALLEY_METRICS`) at the run's first and last measured step."""
    return {f"valley/{name}/{metric}": {"first_step": s0, "first": v0, "last_step": s1, "last": v1}
            for (name, metric), (s0, v0, s1, v1) in sorted(valley_ends(merged_metrics(run_dir)).items())}


# ---------------------------------------------------------------------------------------------- goals


@dataclass
class Goal:
    what: str
    target: str
    measured: str
    met: bool | None  # None: not measured


def reads_middle_goals(tests: Mapping[str, Mapping[str, Any]], arm: str) -> list[Goal]:
    """Issue 39's goals for `arm` from the test estimates (`tests`: `goal_evaluations`, its mdqa and kv): every weak
    gold position (all but the strong end) lifted to >= 0.20 and above the base, the strong end non-inferior, the
    log-likelihood contrast middle - strong at >= -0.5 nats with a resolved rise, kv's worst position >= 0.20."""
    mdqa, kv = tests["mdqa"], tests.get("kv")
    acc, ll = mdqa[stats.ACCURACY.field], mdqa[LOGLIK.field]
    strong, gold = acc["strong"], [p for p in acc["positions"] if p >= 0]
    middle = gold[len(gold) // 2]
    acc, ll = acc["arms"][arm], ll["arms"][arm]
    out = []
    for p in (p for p in gold if p != strong):
        row = acc[str(p)]
        met = row["value"]["value"] >= 0.20 and row["change"]["low"] > 0
        out.append(Goal(f"mdqa accuracy at gold {p}", ">= 0.20 and above the base (interval over seeds and questions)",
                        f"{num(row['value']['value'])}, change {_iv(row['change'])}", met))
    row = acc[str(strong)]
    out.append(Goal(f"mdqa accuracy at gold {strong}", "at most 0.05 below the base (non-inferior: the change's "
                    "interval above -0.05)", f"change {_iv(row['change'])}", row["change"]["low"] > -0.05))
    row, strong_ll = ll[str(middle)], ll[str(strong)]["change"]
    met = row["contrast"]["value"] >= -0.5 and row["contrast_change"]["low"] > 0 and strong_ll["high"] >= 0
    out.append(Goal(f"mdqa log-likelihood contrast gold {middle} - gold {strong}",
                    f">= -0.5 nats, its rise's interval above 0, gold {strong}'s own not lower",
                    f"{_iv(row['contrast'])}; rise {_iv(row['contrast_change'])}; gold {strong} change "
                    f"{_iv(strong_ll)}", met))
    what, target = "kv worst position's accuracy", ">= 0.20, both ends at most 0.05 below the base"
    if kv is None:
        return out + [Goal(what, target, "not measured", None)]
    kacc = kv[stats.ACCURACY.field]
    kgold = [p for p in kacc["positions"] if p >= 0]
    kacc = kacc["arms"][arm]
    worst = min(kgold, key=lambda p: kacc[str(p)]["value"]["value"])
    ends = [kacc[str(p)]["change"] for p in (kgold[0], kgold[-1])]
    met = kacc[str(worst)]["value"]["value"] >= 0.20 and all(e["low"] > -0.05 for e in ends)
    out.append(Goal(what, target, f"{num(kacc[str(worst)]['value']['value'])} at pair {worst}; ends' changes "
                    f"{_iv(ends[0])}, {_iv(ends[1])}", met))
    return out


LIFT_MIDDLE_KV_PAIRS = (4, 7)  # kv-10's middle pairs (of 0, 1, 4, 7, 9), issue 65's
FORMAT_WORDS = 3  # the answer format kept: the median first-line words within this of the start's


def lift_middle_goals(tests: Mapping[str, Mapping[str, Any]], arm: str) -> list[Goal]:
    """Issue 65's goals for `arm` (docs/LIFT_MIDDLE.md): the middle gold of mdqa-10 lifted by accuracy and log p
    without lowering the strong end, the contrast middle - strong, kv's middle pairs (not the first pair alone),
    the answer format kept, and mdqa-20's middle gold by log p. A goal whose evaluation is missing is not
    measured."""
    mdqa, kv, mdqa20 = tests["mdqa"], tests.get("kv"), tests.get("mdqa20")
    acc, ll = mdqa[stats.ACCURACY.field], mdqa[LOGLIK.field]
    strong, gold = ll["strong"], [p for p in acc["positions"] if p >= 0]
    middle = gold[len(gold) // 2]
    acc, ll = acc["arms"][arm], ll["arms"][arm]
    mid_acc, mid_ll, strong_ll = acc[str(middle)]["change"], ll[str(middle)]["change"], ll[str(strong)]["change"]
    out = [Goal(f"mdqa accuracy change at gold {middle}", ">= +0.05, its interval above 0", _iv(mid_acc),
                mid_acc["value"] >= 0.05 and mid_acc["low"] > 0),
           Goal(f"mdqa log p change at gold {middle}", ">= +0.5 nats", _iv(mid_ll), mid_ll["value"] >= 0.5),
           Goal(f"mdqa log p change at gold {strong}", ">= -0.05 nats (the middle lifted, not the end lowered)",
                _iv(strong_ll), strong_ll["value"] >= -0.05),
           Goal(f"mdqa log p gold {middle} - gold {strong}", ">= -0.5 nats", _iv(ll[str(middle)]["contrast"]),
                ll[str(middle)]["contrast"]["value"] >= -0.5)]
    what = f"kv accuracy change at pairs {' and '.join(map(str, LIFT_MIDDLE_KV_PAIRS))}"
    target = ">= +0.10 each; the first pair not the whole of the mean gain"
    kacc = None if kv is None else kv[stats.ACCURACY.field]
    if kacc is None or not all(p in kacc["positions"] for p in LIFT_MIDDLE_KV_PAIRS):
        out.append(Goal(what, target, "not measured", None))
    else:
        kgold = [p for p in kacc["positions"] if p >= 0]
        change = {p: kacc["arms"][arm][str(p)]["change"] for p in kgold}
        rest = float(np.mean([change[p]["value"] for p in kgold[1:]]))  # the mean gain without the first pair
        out.append(Goal(what, target, ", ".join(f"pair {p} {_iv(change[p])}" for p in LIFT_MIDDLE_KV_PAIRS)
                        + f"; first pair {_iv(change[kgold[0]])}, the others' mean {num(rest, True)}",
                        all(change[p]["value"] >= 0.10 for p in LIFT_MIDDLE_KV_PAIRS) and rest > 0))
    words = {who: {p: s.get("median_first_line_words") for p, s in mdqa.get("answers", {}).get(who, {}).items()}
             for who in (BASE, arm)}
    shifts = {p: words[arm][p] - words[BASE][p] for p in words[BASE]
              if p in words[arm] and int(p) >= 0 and None not in (words[arm][p], words[BASE][p])}
    out.append(Goal("the answer format (mdqa median first-line words)", f"within ±{FORMAT_WORDS} of the start's",
                    ", ".join(f"gold {p} {num(words[BASE][p])} → {num(words[arm][p])}" for p in shifts) or
                    "not measured", all(abs(d) <= FORMAT_WORDS for d in shifts.values()) if shifts else None))
    what, target = "mdqa-20 log p change at its middle gold", "its interval above 0"
    if mdqa20 is None or LOGLIK.field not in mdqa20:
        return out + [Goal(what, target, "not measured", None)]
    ll20 = mdqa20[LOGLIK.field]
    gold20 = [p for p in ll20["positions"] if p >= 0]
    middle20 = gold20[len(gold20) // 2]
    row = ll20["arms"][arm][str(middle20)]["change"]
    return out + [Goal(what.replace("its middle gold", f"gold {middle20}"), target, _iv(row), row["low"] > 0)]


GOALS = {"reads_middle": reads_middle_goals, "lift_middle": lift_middle_goals}  # an experiment's goals (Plan.exp)


def goal_evaluations(plan: Plan, evaluations: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The goals' evaluations, by name without `_test` (scripts.reads_middle's: mdqa, kv, mdqa20), dev left out."""
    return {name.removesuffix("_test"): numbers for name, numbers in evaluations.items()
            if plan.evaluations[name].get("part") != "dev"}


def _iv(e: Mapping[str, Any] | None, signed: bool = True) -> str:
    if e is None:
        return "–"
    return f"{num(e['value'], signed)} [{num(e['low'], signed)}, {num(e['high'], signed)}]"


# ---------------------------------------------------------------------------------------------- the study


@dataclass
class Study:
    plan: Plan
    selection: dict[str, Any]
    numbers: dict[str, Any] = field(default_factory=dict)


def _results(plan: Plan, evaluation: str, runs: Sequence[PlannedRun], base: ProbeResult) -> list[ProbeResult]:
    """The runs' results of `evaluation`, each asked as the starting model's was (`check_paired`): ProbeStudyError
    naming the run when one is missing or not paired."""
    results = []
    for r in runs:
        result = load_result(plan, evaluation, run_target(r.n))
        if result is None:
            raise ProbeStudyError(f"{plan.eval_dir(evaluation, run_target(r.n))}: no {evaluation} evaluation of run "
                                  f"{r.n} ({r.arm}, {r.setting}, seed {r.seed})")
        check_paired(plan, evaluation, run_target(r.n), result, base)
        results.append(result)
    return results


def evaluation_numbers(plan: Plan, evaluation: str, chosen: Mapping[str, str]) -> dict[str, Any] | None:
    """Every estimate of one evaluation for the chosen setting of each arm; None when the starting model's
    evaluation is missing."""
    base = load_result(plan, evaluation, BASE)
    if base is None:
        return None
    arms = {arm: _results(plan, evaluation, plan.runs_of(arm, setting), base)
            for arm, setting in chosen.items()}
    probe = plan.evaluations[evaluation]["probe"]
    out: dict[str, Any] = {"probe": probe, "part": plan.evaluations[evaluation].get("part"),
                           "settings": base.settings, "seeds": plan.seeds()}
    measured = [base, *(r for rs in arms.values() for r in rs)]
    for score in SCORES:
        if not all(score in r.scores for r in measured):  # answers=false: the log p alone
            continue
        table = score_table(base, arms, score, f"{plan.folder / 'evals' / evaluation}:")
        strong = base.strong_end(LOGLIK if base.has_loglik else stats.ACCURACY)
        out[score.field] = position_estimates(table, strong)
    out["answers"] = answer_kinds(base, arms)
    return out


def study_numbers(folder: str | Path) -> Study:
    plan = read_plan(folder)
    selection = read_selection(plan.folder)
    chosen = {arm: info["setting"] for arm, info in selection["arms"].items()}
    headline = selection["headline"]
    order = [headline] + [a for a in plan.arms if a != headline and a in chosen]
    chosen = {arm: chosen[arm] for arm in order}
    numbers: dict[str, Any] = {"selection": selection, "evaluations": {},
                               "watch_vs_dev": watch_against_dev(plan, selection)}
    for evaluation in plan.evaluations:
        found = evaluation_numbers(plan, evaluation, chosen)
        if found is not None:
            numbers["evaluations"][evaluation] = found
    numbers["runs"] = [{"n": r.n, "arm": r.arm, "setting": r.setting, "seed": r.seed,
                        "chosen": chosen.get(r.arm) == r.setting, "valley": run_valley(plan.run_dir(r.n)),
                        "changes": _run_changes(plan, r)}
                       for r in plan.runs if _ran(plan, r)]
    tests = goal_evaluations(plan, numbers["evaluations"])
    if "mdqa" in tests and LOGLIK.field in tests["mdqa"] and plan.exp in GOALS:
        numbers["goals"] = {arm: [g.__dict__ for g in GOALS[plan.exp](tests, arm)] for arm in chosen}
    return Study(plan, selection, numbers)


def _ran(plan: Plan, run: PlannedRun) -> bool:
    """Whether the run was trained or evaluated (`--choose-on-seeds` never trains the later seeds of the settings
    that were not chosen)."""
    return plan.run_dir(run.n).is_dir() or any(plan.eval_dir(e, run_target(run.n)).is_dir() for e in plan.evaluations)


def _run_changes(plan: Plan, run: PlannedRun) -> dict[str, Any]:
    """A run's own change against the starting model on the test mdqa evaluation (means over questions): accuracy
    at the middle gold position, and the log-likelihood contrast middle minus the starting model's strong end."""
    evaluation = next((e for e, spec in plan.evaluations.items()
                       if spec["probe"] == "mdqa" and spec.get("part") != "dev"), None)
    base = mine = None
    if evaluation is not None:
        base, mine = load_result(plan, evaluation, BASE), load_result(plan, evaluation, run_target(run.n))
    if base is None or mine is None:
        return {}
    gold = sorted(p for p in base.labels() if p >= 0)
    middle = gold[len(gold) // 2]
    b_acc, m_acc = base.accuracy_by_position(), mine.accuracy_by_position()
    out = {"middle": middle, "accuracy_middle": m_acc[middle] - b_acc[middle]}
    if base.has_loglik and mine.has_loglik:
        strong = base.strong_end(LOGLIK)
        b, m = base.accuracy_by_position(LOGLIK), mine.accuracy_by_position(LOGLIK)
        out |= {"strong": strong, "loglik_contrast": (m[middle] - m[strong]) - (b[middle] - b[strong])}
    return out


# ---------------------------------------------------------------------------------------------- the report


def _position_header(positions: Sequence[int]) -> list[str]:
    return ["closed-book" if p == CLOSED_BOOK else f"gold {p}" for p in positions]


def position_lines(numbers: Mapping[str, Any], score: stats.Score) -> list[str]:
    est = numbers[score.field]
    positions = est["positions"]
    signed = not score.rate
    rows = [["starting model"] + [_iv(est["base"][str(p)]["value"], signed) for p in positions]]
    for arm, row in est["arms"].items():
        rows.append([arm] + [_iv(row[str(p)]["value"], signed) for p in positions])
        rows.append([f"{arm}: change"] + [_marked(row[str(p)]["change"]) for p in positions])
    lines = markdown_table(["", *_position_header(positions)], rows)
    strong = est["strong"]
    contrasts = [p for p in positions if p != strong]
    rows = [["starting model"] + [_iv(est["base"][str(p)]["contrast"]) for p in contrasts]]
    for arm, row in est["arms"].items():
        rows.append([arm] + [_iv(row[str(p)]["contrast"]) for p in contrasts])
        rows.append([f"{arm}: change (MDE)"] + [
            f"{_marked(row[str(p)]['contrast_change'])} ({num(row[str(p)]['contrast_change']['mde'])})"
            for p in contrasts])
    header = [f"{h} − gold {strong}" for h in _position_header(contrasts)]
    return lines + ["", f"Each position minus the starting model's strong end (gold {strong}), paired by question:", ""] \
        + markdown_table(["", *header], rows)


def interval_method(estimates: Mapping[str, Any]) -> str:
    """How the arms' intervals of one score were made, with the range of their degrees of freedom: each cell has
    its own (Satterthwaite), and a cell whose seed part dominates has few, so its interval is wide."""
    shown = ("value", "change", "contrast", "contrast_change")  # what `position_lines` prints
    cells = [cell[k] for row in estimates["arms"].values() for cell in row.values() for k in shown
             if cell.get(k) and cell[k].get("df") is not None]
    if not cells:
        return "none"
    design = {re.sub(r"^t\([^)]*\),? ", "", iv["method"]) for iv in cells}  # `stats.crossed_interval`'s, df dropped
    dfs = [iv["df"] for iv in cells]
    return f"t with each cell's own df ({min(dfs):.1f} to {max(dfs):.1f}; every cell's in study.json), " + \
        "; ".join(sorted(design))


def _marked(e: Mapping[str, Any]) -> str:
    """A change with its interval, ` *` when the interval excludes 0."""
    return _iv(e) + (" *" if e.get("resolved") else "")


def answer_lines(answers: Mapping[str, Any], probe: str) -> list[str]:
    """The answer kinds table of one evaluation (`position_tables.answer_columns`)."""
    rows = [["starting model" if who == BASE else who, "closed-book" if int(p) == CLOSED_BOOK else f"gold {p}",
             *answer_cells(summary)]
            for who, by_position in answers.items() for p, summary in by_position.items()]
    return markdown_table(["model", "position", *answer_columns(probe)], rows)


def run_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for r in runs:
        cells = [str(r["n"]), r["arm"], r["setting"], str(r["seed"]), "yes" if r["chosen"] else ""]
        for metric in VALLEY_METRICS:
            key = f"valley/vanilla/{metric}"
            v = r["valley"].get(key)
            cells.append("–" if v is None else f"{num(v['first'])} → {num(v['last'])}")
        changes = r["changes"]
        cells += [num(changes.get("accuracy_middle"), signed=True), num(changes.get("loglik_contrast"), signed=True)]
        rows.append(cells)
    return markdown_table(["run", "arm", "setting", "seed", "chosen", "valley peak-to-trough (decades)",
                           "middle mass", "Δ accuracy, middle gold", "Δ log-lik. contrast middle − strong (nats)"],
                          rows)


def watch_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The watched signals beside the dev choice (`watch_against_dev`); nothing for runs without a watch."""
    if not rows:
        return []
    table = [[f"`{r['signal']}`", str(len(r["runs"])), num(r["rho"], True), num(r["p_value"]),
              "; ".join(f"{arm}: {c['setting']} ({'as dev' if c['agrees'] else 'not as dev'})"
                        for arm, c in r["choices"].items()) or "–"]
             for r in sorted(rows, key=lambda r: -abs(r["rho"]) if math.isfinite(r["rho"]) else 0)]
    return ["## The watched signals beside the dev choice", "",
            "Each run's end-minus-start change of a watched signal against its dev score: Spearman's rho over the runs "
            "(exact permutation p), and the setting each arm would get from the signal's mean change over the "
            "choice's seeds.", ""] + markdown_table(["signal", "runs", "rho with dev", "p", "its choice"], table) + [""]


def report_lines(study: Study) -> list[str]:
    numbers, plan = study.numbers, study.plan
    sel = numbers["selection"]
    lines = [f"# Probe study: {plan.folder}", "",
             f"Settings chosen on `{sel['evaluation']}` ({sel['rule']}); headline arm: **{sel['headline']}**.", ""]
    rows = [[arm, setting, num(score), "yes" if info["setting"] == setting else ""]
            for arm, info in sel["arms"].items() for setting, score in info["dev_scores"].items()]
    seeds = ", ".join(map(str, sel.get("seeds", plan.seeds())))
    lines += markdown_table(["arm", "setting", f"dev score (mean over seeds {seeds})", "chosen"], rows)
    lines += ["", f"Starting model's dev score: {num(sel.get('base_dev_score'))}.", ""]
    if sel.get("incomplete"):
        missing = "; ".join(f"{setting} (runs {', '.join(map(str, runs))})"
                            for setting, runs in sel["incomplete"].items())
        lines += [f"**A partial choice:** it did not see these settings, which have runs without a dev evaluation: "
                  f"{missing}.", ""]
    lines += watch_lines(numbers.get("watch_vs_dev", []))
    if "goals" in numbers:
        lines += ["## Goals (test questions)", ""]
        rows = [[arm, g["what"], g["target"], g["measured"], {True: "met", False: "not met", None: "–"}[g["met"]]]
                for arm, gs in numbers["goals"].items() for g in gs]
        lines += markdown_table(["arm", "goal", "target", "measured", ""], rows) + [""]
    for evaluation, est in numbers["evaluations"].items():
        spec = plan.evaluations[evaluation]
        lines += [f"## {evaluation}: {spec['probe']}" + (f", {spec['part']} questions" if spec.get("part") else ""), ""]
        for score in SCORES:
            if score.field not in est:
                continue
            e = est[score.field]
            lines += [f"### {score.label}", "", f"{e['questions']} questions ({e['dropped']} left out for a non-finite "
                      f"score); intervals: {interval_method(e)}; `*`: the interval excludes 0.", ""]
            lines += position_lines(est, score) + [""]
        lines += ["### What the answers are", ""] + answer_lines(est["answers"], spec["probe"]) + [""]
    lines += ["## Every run: the Jacobian beside its change on the test mdqa", ""] + run_lines(numbers["runs"])
    return lines


def write_report(study: Study, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for evaluation, est in study.numbers["evaluations"].items():
        for score in SCORES:
            if score.field in est:
                plot_arm_curves(est[score.field], out / f"{evaluation}_{score.field}.png",
                                f"{evaluation}: {score.label} by gold position", score)
    atomic_write_text(out / "study.json", json.dumps(json_safe(study.numbers), indent=1))
    atomic_write_text(out / "report.md", "\n".join(report_lines(study)) + "\n")
    return out / "report.md"


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m analysis.probe_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the experiment folder (scripts.reads_middle's)")
    parser.add_argument("--out", default=None, help="report folder (default: FOLDER/report)")
    args = parser.parse_args(argv)
    try:
        study = study_numbers(args.folder)
    except ProbeStudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {write_report(study, Path(args.out) if args.out else Path(args.folder) / 'report')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
