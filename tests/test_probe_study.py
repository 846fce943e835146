"""analysis.probe_study (an experiment's arms x seeds of probe evaluations against its starting model) and
scripts.reads_middle (the experiment's plan, scheduler and, in the slow tier, a tiny run end to end)."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from analysis import probe_study, stats
from analysis.evaluation.result import LOGLIK, ProbeResult
from analysis.probe_study import BASE, PLAN, SELECTION, ProbeStudyError, run_target
from data_builders.mdqa import write_jsonl_gz
from models.training.checkpoint import list_checkpoints
from models.training.run_dir import RunDir
from models.training.state import TrainerState
from scripts import reads_middle
from scripts.investigations.synthetic_oracle import oracle_records

QUESTIONS = ("q0", "q1", "q2", "q3")
POSITIONS = (-1, 0, 1, 2)


def result(correct, loglik=None, probe="mdqa", kinds=None) -> ProbeResult:
    """A ProbeResult from {question: {position: score}} tables (and log-likelihoods, answer kinds alike)."""
    outcomes = []
    for q, row in correct.items():
        for p, c in row.items():
            o = {"id": f"{q}@{p}", "query": q, "position": p, "label": str(p), "prediction": "x", "answers": ["a"],
                 "correct": float(c), "extra": {}}
            if loglik is not None:
                o["loglik"] = float(loglik[q][p])
            if kinds is not None:
                o["extra"]["answer"] = {"kind": kinds, "first_line_words": 3, "short_em": 0.0, "whole_word": 1.0,
                                        "copies_gold": None}
            outcomes.append(o)
    return ProbeResult(probe, outcomes, {"metric": "best_subspan_em"})


def table(seed: int, lift: float = 0.0, strong_drop: float = 0.0, questions=QUESTIONS):
    """Accuracy and log-likelihood tables: the strong end (position 2) better than the others."""
    rng = np.random.default_rng(seed)
    acc = {q: {p: float(rng.random() < (0.8 - strong_drop if p == 2 else 0.2 + lift)) for p in POSITIONS}
           for q in questions}
    ll = {q: {p: float(-5.0 + (2.0 if p == 2 else lift) + rng.normal()) for p in POSITIONS} for q in questions}
    return acc, ll


def test_position_estimates_are_the_hand_computed_means_changes_and_contrasts():
    base_acc, base_ll = table(0)
    arms = {"a": [result(*table(s, lift=0.5)) for s in (1, 2)], "b": [result(*table(s)) for s in (3, 4)]}
    t = probe_study.score_table(result(base_acc, base_ll), arms, LOGLIK)
    assert t.positions == [-1, 0, 1, 2] and t.questions == list(QUESTIONS) and t.y.shape == (2, 2, 4, 4)
    est = probe_study.position_estimates(t, strong=2)
    y = np.array([[[table(s, lift=0.5)[1][q][p] for p in POSITIONS] for q in QUESTIONS] for s in (1, 2)])
    b = np.array([[base_ll[q][p] for p in POSITIONS] for q in QUESTIONS])
    row = est["arms"]["a"]["0"]
    assert row["value"]["value"] == pytest.approx(y[..., 1].mean())
    assert row["change"]["value"] == pytest.approx((y[..., 1] - b[:, 1]).mean())
    assert row["contrast"]["value"] == pytest.approx((y[..., 1] - y[..., 3]).mean())
    assert row["contrast_change"]["value"] == pytest.approx(((y[..., 1] - y[..., 3]) - (b[:, 1] - b[:, 3])).mean())
    assert row["vs_first_arm"] is None and est["arms"]["b"]["0"]["vs_first_arm"] is not None
    assert est["arms"]["a"]["2"]["contrast"] is None  # the strong end has no contrast to itself
    assert est["base"]["0"]["contrast"]["value"] == pytest.approx((b[:, 1] - b[:, 3]).mean())
    low, high = row["change"]["low"], row["change"]["high"]
    assert low < row["change"]["value"] < high and "crossed design: 2 seeds" in row["change"]["method"]
    assert row["change"]["mde"] > 0


def test_a_question_with_a_nonfinite_score_is_left_out_and_counted():
    base_acc, base_ll = table(0)
    arm_acc, arm_ll = table(1)
    arm_ll["q2"][1] = -math.inf
    t = probe_study.score_table(result(base_acc, base_ll), {"a": [result(arm_acc, arm_ll)]}, LOGLIK)
    assert t.questions == ["q0", "q1", "q3"] and t.dropped == 1


def test_results_that_asked_other_questions_are_refused():
    base_acc, base_ll = table(0)
    acc, ll = table(1)
    del acc["q3"], ll["q3"]
    with pytest.raises(ProbeStudyError, match="other questions"):
        probe_study.score_table(result(base_acc, base_ll), {"a": [result(acc, ll)]}, stats.ACCURACY)


def test_the_mde_is_the_80_percent_power_effect_of_the_interval():
    iv = stats.Interval(0.0, -1.0, 1.0, 100, "t", df=1e6)
    assert probe_study._mde(iv) == pytest.approx((1.959964 + 0.841621) / 1.959964, rel=1e-4)


def test_goals_read_the_estimates():
    many = [f"q{i}" for i in range(40)]
    base_acc, base_ll = table(0, questions=many)
    good = [result(*table(s, lift=1.0, questions=many)) for s in (1, 2)]  # weak positions answered, +1 nat
    est = {}
    for score in (stats.ACCURACY, LOGLIK):
        est[score.field] = probe_study.position_estimates(
            probe_study.score_table(result(base_acc, base_ll), {"good": good}, score), strong=2)
    goals = {g.what: g for g in probe_study.reads_middle_goals({"mdqa": est}, "good")}
    assert goals["mdqa accuracy at gold 0"].met and goals["mdqa accuracy at gold 1"].met
    assert goals["mdqa accuracy at gold 2"].met  # the strong end kept: its rate is 0.8 in every table
    assert goals["kv worst position's accuracy"].met is None
    dropped = [result(*table(s, strong_drop=0.6, questions=many)) for s in (1, 2)]
    est = {score.field: probe_study.position_estimates(
        probe_study.score_table(result(base_acc, base_ll), {"dropped": dropped}, score), strong=2)
        for score in (stats.ACCURACY, LOGLIK)}
    goals = {g.what: g for g in probe_study.reads_middle_goals({"mdqa": est}, "dropped")}
    assert not goals["mdqa accuracy at gold 0"].met and not goals["mdqa accuracy at gold 2"].met
    assert "gold 1 - gold 2" in next(k for k in goals if "log-likelihood" in k)


def estimates(base: tuple, arm: list[tuple], strong: int) -> dict:
    """`evaluation_numbers`-shaped estimates of one arm ("a") against the base, from (accuracy, log p) tables."""
    return {score.field: probe_study.position_estimates(
        probe_study.score_table(result(*base), {"a": [result(*t) for t in arm]}, score), strong=strong)
        for score in (stats.ACCURACY, LOGLIK)}


def shifted(tables: tuple, by: dict[int, tuple[float, float]]) -> tuple:
    """(accuracy, log p) tables with position p's accuracy set to by[p][0] (if not None) and log p moved by by[p][1]."""
    acc, ll = tables
    return ({q: {p: (by[p][0] if by.get(p, (None,))[0] is not None else c) for p, c in row.items()}
             for q, row in acc.items()},
            {q: {p: v + by.get(p, (None, 0.0))[1] for p, v in row.items()} for q, row in ll.items()})


def test_lift_middle_goals_ask_the_middle_up_and_the_strong_end_kept():
    many = [f"q{i}" for i in range(40)]
    base = table(0, questions=many)  # positions -1, 0, 1, 2: middle gold 1, strong end 2
    lifted = [shifted(table(0, questions=many), {1: (1.0, 2.0)}) for _ in (1, 2)]
    goals = {g.what: g for g in probe_study.lift_middle_goals({"mdqa": estimates(base, lifted, 2)}, "a")}
    assert goals["mdqa accuracy change at gold 1"].met and goals["mdqa log p change at gold 1"].met
    assert goals["mdqa log p change at gold 2"].met and goals["mdqa log p gold 1 - gold 2"].met
    assert goals["kv accuracy change at pairs 4 and 7"].met is None
    assert goals["mdqa-20 log p change at its middle gold"].met is None
    lowered = [shifted(table(0, questions=many), {1: (None, 0.6), 2: (None, -0.3)}) for _ in (1, 2)]
    goals = {g.what: g for g in probe_study.lift_middle_goals({"mdqa": estimates(base, lowered, 2)}, "a")}
    assert goals["mdqa log p change at gold 1"].met  # +0.6
    assert not goals["mdqa log p change at gold 2"].met  # -0.3: the contrast rose by lowering the end
    assert not goals["mdqa accuracy change at gold 1"].met


def test_lift_middle_kv_goal_needs_the_middle_pairs_not_the_first_alone():
    questions = [f"k{i}" for i in range(40)]

    def kv_tables(acc_by: dict[int, float]) -> tuple:
        return ({q: {p: acc_by.get(p, 0.2) for p in (0, 1, 4, 7, 9)} for q in questions},
                {q: {p: -3.0 for p in (0, 1, 4, 7, 9)} for q in questions})

    mdqa = estimates(table(0), [table(1)], 2)
    base = kv_tables({0: 0.5, 9: 0.5})
    for arm_acc, met in (({0: 0.5, 4: 0.35, 7: 0.35, 9: 0.5}, True),  # the middle pairs +0.15
                         ({0: 1.0, 9: 0.5}, False),  # the first pair's gain only
                         ({0: 0.5, 4: 0.25, 7: 0.45, 9: 0.5}, False)):  # pair 4 only +0.05
        kv = estimates(base, [kv_tables(arm_acc)], 9)
        goal = next(g for g in probe_study.lift_middle_goals({"mdqa": mdqa, "kv": kv}, "a") if "kv" in g.what)
        assert goal.met is met, (arm_acc, goal.measured)


def test_lift_middle_format_goal_compares_median_first_line_words():
    mdqa = estimates(table(0), [table(1)], 2)
    for arm_words, met in ((16.0, True), (19.0, True), (12.0, False)):
        mdqa["answers"] = {"base": {"-1": {"median_first_line_words": 3.0}, "0": {"median_first_line_words": 16.0}},
                           "a": {"-1": {"median_first_line_words": 40.0}, "0": {"median_first_line_words": arm_words}}}
        goal = next(g for g in probe_study.lift_middle_goals({"mdqa": mdqa}, "a") if "format" in g.what)
        assert goal.met is met, goal.measured  # closed-book (-1) is not a gold position: left out


@pytest.mark.parametrize("exp, goal", [(None, "mdqa accuracy at gold 0"), ("lift_middle", "mdqa log p change at gold 1")])
def test_an_experiments_report_checks_its_own_goals(tmp_path, exp, goal):
    write_experiment(tmp_path, {("kd", "lr=1", 0): 0.5, ("kd", "lr=1", 1): 0.75})
    if exp is not None:  # a plan without "exp" is issue 39's, +exp=reads_middle
        (tmp_path / PLAN).write_text(json.dumps({**json.loads((tmp_path / PLAN).read_text()), "exp": exp}))
    (tmp_path / SELECTION).write_text(json.dumps(probe_study.choose(probe_study.read_plan(tmp_path))))
    study = probe_study.study_numbers(tmp_path)
    assert [g["what"] for g in study.numbers["goals"]["kd"]][0 if exp is None else 1] == goal
    report = probe_study.write_report(study, tmp_path / "report").read_text()
    assert f"| kd | {goal} |" in report


def write_experiment(folder: Path, dev_scores: dict[tuple[str, str, int], float], test: bool = True) -> None:
    """A plan of arms x settings x seeds with dev (and test) evaluation JSONs whose dev accuracy is the given mean."""
    runs = [{"n": n, "arm": arm, "setting": setting, "seed": seed, "overrides": [f"debias={arm}", f"seed={seed}"]}
            for n, (arm, setting, seed) in enumerate(dev_scores)]
    evaluations = {"mdqa_dev": {"probe": "mdqa", "part": "dev", "args": []},
                   "mdqa_test": {"probe": "mdqa", "part": "test", "args": []}}
    (folder).mkdir(parents=True, exist_ok=True)
    (folder / PLAN).write_text(json.dumps({"runs": runs, "evaluations": evaluations, "dev": "mdqa_dev"}))
    save_evaluation(folder, "mdqa_dev", BASE, 0.25)
    save_evaluation(folder, "mdqa_test", BASE, 0.25)
    for n, (key, score) in enumerate(dev_scores.items()):
        save_evaluation(folder, "mdqa_dev", run_target(n), score)
        if test:
            save_evaluation(folder, "mdqa_test", run_target(n), score)


def save_evaluation(folder: Path, evaluation: str, target: str, score: float) -> None:
    """An mdqa evaluation JSON of the experiment in `folder` whose accuracy averages `score`."""
    acc = {q: {p: float(i < score * len(QUESTIONS)) for p in POSITIONS} for i, q in enumerate(QUESTIONS)}
    ll = {q: {p: -3.0 + score for p in POSITIONS} for q in QUESTIONS}
    out = folder / "evals" / evaluation / target / "eval"
    out.mkdir(parents=True, exist_ok=True)
    result(acc, ll, kinds="gold").save_json(out / "mdqa_step0.json")


def test_each_arm_gets_the_setting_of_its_best_dev_mean_and_the_headline_is_the_best_arm(tmp_path):
    write_experiment(tmp_path, {("none", "lr=1", 0): 0.25, ("none", "lr=1", 1): 0.25,
                                ("none", "lr=2", 0): 0.5, ("none", "lr=2", 1): 0.25,
                                ("kd", "lr=1", 0): 0.75, ("kd", "lr=1", 1): 0.75,
                                ("kd", "lr=2", 0): 0.5, ("kd", "lr=2", 1): 0.5})
    chosen = probe_study.choose(probe_study.read_plan(tmp_path))
    assert {a: v["setting"] for a, v in chosen["arms"].items()} == {"none": "lr=2", "kd": "lr=1"}
    assert chosen["headline"] == "kd" and chosen["base_dev_score"] == pytest.approx(0.25)
    assert chosen["arms"]["none"]["dev_scores"] == {"lr=1": 0.25, "lr=2": 0.375}


def test_a_choice_on_some_seeds_reads_only_their_runs(tmp_path):
    # seed 1 would reverse the choice: lr=1 has the better mean over both seeds, lr=2 the better seed 0
    write_experiment(tmp_path, {("none", "lr=1", 0): 0.25, ("none", "lr=1", 1): 1.0,
                                ("none", "lr=2", 0): 0.5, ("none", "lr=2", 1): 0.0})
    plan = probe_study.read_plan(tmp_path)
    assert probe_study.choose(plan)["arms"]["none"]["setting"] == "lr=1"
    on_seed_0 = probe_study.choose(plan, seeds=[0])
    assert on_seed_0["arms"]["none"]["setting"] == "lr=2" and on_seed_0["seeds"] == [0]
    assert on_seed_0["arms"]["none"]["dev_scores"] == {"lr=1": 0.25, "lr=2": 0.5}
    assert on_seed_0["arms"]["none"]["runs"] == [2, 3]  # the chosen setting's every seed goes on to the test


def test_a_setting_with_a_run_missing_its_dev_evaluation_is_left_out_by_name(tmp_path):
    write_experiment(tmp_path, {("none", "lr=1", 0): 0.25, ("none", "lr=2", 0): 0.75})
    missing = tmp_path / "evals" / "mdqa_dev" / run_target(1)
    for f in (missing / "eval").iterdir():
        f.unlink()
    chosen = probe_study.choose(probe_study.read_plan(tmp_path))
    assert chosen["arms"]["none"]["setting"] == "lr=1" and chosen["incomplete"] == {"none lr=2": [1]}
    (tmp_path / SELECTION).write_text(json.dumps(chosen))
    report = probe_study.write_report(probe_study.study_numbers(tmp_path), tmp_path / "report").read_text()
    assert "**A partial choice:** it did not see these settings" in report and "none lr=2 (runs 1)" in report


def save_curve(folder: Path, target: str, accuracy: dict[int, float], loglik: dict[int, float],
               evaluation: str = "mdqa_dev") -> None:
    """An mdqa evaluation of `target` whose every question scores `accuracy[p]` and `loglik[p]` at gold position p
    (closed-book: 0 and -9)."""
    acc = {q: {p: accuracy.get(p, 0.0) for p in POSITIONS} for q in QUESTIONS}
    ll = {q: {p: loglik.get(p, -9.0) for p in POSITIONS} for q in QUESTIONS}
    out = folder / "evals" / evaluation / target / "eval"
    out.mkdir(parents=True, exist_ok=True)
    result(acc, ll, kinds="gold").save_json(out / "mdqa_step0.json")


def lift_experiment(folder: Path, exp: str | None) -> None:
    """One arm, four settings on dev against a starting model whose strong end is gold 2 (POSITIONS' last):
    lr=1 lifts the start alone (the best mean accuracy), lr=2 lifts the middle gold (1) by 1.0 nats but lowers the
    strong end by 0.8, lr=3 lifts the middle by 0.5 and keeps the end, lr=4 lifts every position by 2.0 (a format)."""
    runs = [{"n": n, "arm": "kd", "setting": f"lr={n + 1}", "seed": 0, "overrides": []} for n in range(4)]
    plan = {"runs": runs, "evaluations": {"mdqa_dev": {"probe": "mdqa", "part": "dev", "args": []}}, "dev": "mdqa_dev"}
    (folder / PLAN).write_text(json.dumps(plan | ({} if exp is None else {"exp": exp})))
    save_curve(folder, BASE, {0: 0.25, 1: 0.0, 2: 0.5}, {0: -4.0, 1: -5.0, 2: -3.0})
    save_curve(folder, run_target(0), {0: 1.0, 1: 0.0, 2: 0.5}, {0: -2.0, 1: -5.0, 2: -3.0})
    save_curve(folder, run_target(1), {0: 0.25, 1: 0.25, 2: 0.5}, {0: -4.0, 1: -4.0, 2: -3.8})
    save_curve(folder, run_target(2), {0: 0.25, 1: 0.25, 2: 0.5}, {0: -4.0, 1: -4.5, 2: -3.0})
    save_curve(folder, run_target(3), {0: 0.5, 1: 0.25, 2: 0.5}, {0: -2.0, 1: -3.0, 2: -1.0})


@pytest.mark.parametrize("exp, chosen, scores", [
    (None, "lr=1", {"lr=1": 0.5, "lr=2": 1 / 3, "lr=3": 1 / 3, "lr=4": 5 / 12}),
    ("lift_middle", "lr=2", {"lr=1": 0.0, "lr=2": 1.0, "lr=3": 0.5, "lr=4": 0.0}),
])
def test_each_experiment_chooses_by_its_own_dev_rule(tmp_path, exp, chosen, scores):
    # issue 39's rule (mean accuracy) takes the lift of the start; issue 65's takes the middle's log p rise beyond
    # the strong end's: a format that lifts every position alike scores 0, a lift of the start alone 0, and the
    # end's fall earns nothing (lr=2 scores its middle's own +1.0, not the contrast's +1.8)
    lift_experiment(tmp_path, exp)
    choice = probe_study.choose(probe_study.read_plan(tmp_path))
    assert choice["arms"]["kd"]["setting"] == chosen
    assert choice["arms"]["kd"]["dev_scores"] == pytest.approx(scores)
    assert probe_study.dev_rule(probe_study.read_plan(tmp_path)).text in choice["rule"]


def test_the_middle_rule_needs_the_starting_models_dev_evaluation(tmp_path):
    lift_experiment(tmp_path, "lift_middle")
    for f in (tmp_path / "evals" / "mdqa_dev" / BASE / "eval").iterdir():
        f.unlink()
    with pytest.raises(ProbeStudyError, match="starting model: its dev evaluation is missing"):
        probe_study.choose(probe_study.read_plan(tmp_path))


@pytest.mark.parametrize("evaluation", ["mdqa_dev", "mdqa_test"])
def test_a_run_evaluated_unlike_the_starting_model_is_refused_by_name(tmp_path, evaluation):
    write_experiment(tmp_path, {("kd", "lr=1", 0): 0.5, ("kd", "lr=1", 1): 0.75})
    for target, n_docs in ((BASE, 10), (run_target(0), 10), (run_target(1), 20)):  # run 1: the same question ids
        path = tmp_path / "evals" / evaluation / target / "eval" / "mdqa_step0.json"    # among 20 documents
        found = ProbeResult.load_json(path)
        found.settings["n_docs"] = n_docs
        found.save_json(path)
    plan = probe_study.read_plan(tmp_path)
    with pytest.raises(ProbeStudyError, match=f"{evaluation}/run-1: not paired with the starting model's "
                                              f"{evaluation} evaluation: mdqa n_docs: 20 in run-1"):
        (tmp_path / SELECTION).write_text(json.dumps(probe_study.choose(plan)))
        probe_study.study_numbers(tmp_path)


def test_an_arm_whose_choice_saw_every_setting_goes_on_while_a_partial_one_waits_unless_accepted(
        tmp_path, monkeypatch, capsys):
    sweep = ["debias=none,kd", "trainer.lr=1,2", "seed=0,1"]
    plan = reads_middle.make_plan("reads_middle", reads_middle.sweep_grid("reads_middle", sweep), [0])
    (tmp_path / PLAN).write_text(json.dumps(plan))
    kd_lr2_seed0 = next(r["n"] for r in plan["runs"] if r["overrides"] == ["debias=kd", "trainer.lr=2", "seed=0"])
    save_evaluation(tmp_path, "mdqa_dev", BASE, 0.25)
    for r in plan["runs"]:
        if r["seed"] == 0 and r["n"] != kd_lr2_seed0:
            save_evaluation(tmp_path, "mdqa_dev", run_target(r["n"]), 0.5)
    started: list[str] = []
    monkeypatch.setattr(reads_middle.Scheduler, "run", lambda self, jobs: started.extend(j.name for j in jobs))
    command = [str(tmp_path), "--sweep", *sweep, "--choose-on-seeds", "0", "--base", "base",
               "--phase", "select", "dev", "test"]
    assert reads_middle.main(command) == 1
    err = capsys.readouterr().err
    assert f"not started for kd: the choice is incomplete (settings and their runs without a dev evaluation: " \
           f"{{'kd trainer.lr=2': [{kd_lr2_seed0}]}})" in err and "--accept-partial-choice" in err
    assert "the other seeds: not started for kd" in err and "the test evaluations: not started for kd" in err
    runs = {(r["arm"], r["setting"], r["seed"]): r["n"] for r in plan["runs"]}
    seed_0 = {f"mdqa_dev:run-{r['n']}" for r in plan["runs"] if r["seed"] == 0}
    none_chosen = [runs["none", "trainer.lr=1", 0], runs["none", "trainer.lr=1", 1]]  # ties go to the first lr
    assert set(started[:len(seed_0)]) == seed_0  # the dev evaluations the choice reads, then the none arm's alone
    assert started[len(seed_0):] == [f"mdqa_dev:run-{none_chosen[1]}",
                                     *(f"{name}:run-{n}" for n in none_chosen for name in ("mdqa_test", "kv"))]
    started.clear()
    assert reads_middle.main(command + ["--accept-partial-choice"]) == 0
    kd_chosen = [runs["kd", "trainer.lr=1", 0], runs["kd", "trainer.lr=1", 1]]
    assert f"mdqa_dev:run-{kd_chosen[1]}" in started
    assert {f"{name}:run-{n}" for n in kd_chosen for name in ("mdqa_test", "kv")} <= set(started)


def test_the_report_shows_the_chosen_arms_against_the_starting_model(tmp_path):
    write_experiment(tmp_path, {("none", "lr=1", 0): 0.5, ("none", "lr=1", 1): 0.5,
                                ("kd", "lr=1", 0): 0.75, ("kd", "lr=1", 1): 0.75})
    (tmp_path / SELECTION).write_text(json.dumps(probe_study.choose(probe_study.read_plan(tmp_path))))
    study = probe_study.study_numbers(tmp_path)
    report = probe_study.write_report(study, tmp_path / "report").read_text()
    assert "headline arm: **kd**" in report and "## mdqa_test: mdqa, test questions" in report
    assert list(study.numbers["evaluations"]["mdqa_test"]["correct"]["arms"]) == ["kd", "none"]  # headline first
    assert (tmp_path / "report" / "mdqa_test_loglik.png").is_file()
    kd = study.numbers["evaluations"]["mdqa_test"]["loglik"]["arms"]["kd"]["0"]
    assert kd["change"]["value"] == pytest.approx(0.5)  # -3 + 0.75 against -3 + 0.25 at every position
    assert study.numbers["goals"]["kd"] and [r["changes"] for r in study.numbers["runs"]][0]["middle"] == 1


def write_watch(run_dir: Path, lift: float) -> None:
    """A watch.jsonl whose mdqa log p at gold 4 rises by `lift` between steps 0 and 10 (gold 9's stays)."""
    rows = [{"step": 0, "kind": "panel", "sets": ["mdqa"], "slots": [0, 4, 9], "middle": 4, "strong": {"mdqa": 9},
             "every": 1, "loglik_every": 10, "questions": {"mdqa": 2}}]
    rows += [{"step": step, "kind": "loglik", "set": "mdqa", "question": q, "slot": slot,
              "loglik": (-3.0 + (lift if step else 0.0)) if slot == 4 else -1.0}
             for step in (0, 10) for q in ("a", "b") for slot in (4, 9)]
    RunDir(run_dir).watch.parent.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).watch.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_sets_the_watched_signals_beside_the_dev_choice(tmp_path):
    dev = {("kd", "lr=1", 0): 0.25, ("kd", "lr=2", 0): 0.5, ("kd", "lr=3", 0): 0.75, ("kd", "lr=4", 0): 1.0}
    write_experiment(tmp_path, dev)
    for n, score in enumerate(dev.values()):
        write_watch(tmp_path / "runs" / str(n), lift=2 * score if n != 3 else 0.1)  # the best dev run watched low
    (tmp_path / SELECTION).write_text(json.dumps(probe_study.choose(probe_study.read_plan(tmp_path))))
    study = probe_study.study_numbers(tmp_path)
    row = next(r for r in study.numbers["watch_vs_dev"] if r["signal"] == "watch/mdqa/loglik_contrast")
    assert row["runs"] == [0, 1, 2, 3] and row["rho"] == pytest.approx(-0.2)  # ranks 2 3 4 1 against 1 2 3 4
    kd = row["choices"]["kd"]
    assert kd["setting"] == "lr=3" and not kd["agrees"]  # dev chose lr=4
    assert kd["means"] == pytest.approx({"lr=1": 0.5, "lr=2": 1.0, "lr=3": 1.5, "lr=4": 0.1})
    report = probe_study.write_report(study, tmp_path / "report").read_text()
    assert "## The watched signals beside the dev choice" in report and "kd: lr=3 (not as dev)" in report


def test_the_report_gives_the_range_of_the_shown_intervals_degrees_of_freedom():
    def cell(df):
        return {"df": df, "method": f"t({df:.1f}), crossed design: 2 seeds (shared) x 9 questions"}
    estimates = {"arms": {"a": {"0": {"value": cell(199.0), "change": cell(1.2), "contrast": None,
                                      "vs_first_arm": cell(0.5)}},
                          "b": {"0": {"value": cell(37.5), "contrast_change": cell(3.0)}}}}
    # an arm-to-arm difference is not in the tables: its df (0.5) is not in the range
    assert probe_study.interval_method(estimates) == ("t with each cell's own df (1.2 to 199.0; every cell's in "
                                                      "study.json), crossed design: 2 seeds (shared) x 9 questions")


def test_one_seed_intervals_are_described_once_whatever_their_degrees_of_freedom():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(2, 1, 30))  # 2 arms, 1 seed, 30 questions
    cells = {"value": stats.crossed_interval(y, stats.mean_of(30), 0).as_dict(),
             "change": stats.crossed_interval(y[:, :, :20], stats.mean_of(20), 1).as_dict()}
    assert probe_study.interval_method({"arms": {"a": {"0": cells}}}) == (
        "t with each cell's own df (19.0 to 29.0; every cell's in study.json), over questions; 1 seed: training "
        "randomness not included")


def test_the_answer_kinds_table_names_what_a_kind_is_for_each_probe():
    kinds = probe_study.answer_kinds(result({"q0": {0: 1}}, kinds="gold"), {})
    header = {probe: probe_study.answer_lines(kinds, probe)[0] for probe in ("mdqa", "kv")}
    assert "span of the gold" in header["mdqa"] and "the gold pair's value" in header["kv"]
    row = probe_study.answer_lines(kinds, "kv")[2]
    assert row == "| starting model | gold 0 | 1.000 | 0.000 | 0.000 | 3.0 | 0.000 | 1.000 |"


def test_the_plan_is_the_product_of_the_experiments_sweep():
    grid = reads_middle.sweep_grid("reads_middle", ["trainer.lr=1e-3"])
    assert grid == {"debias": ["none", "pos2distill", "pos2distill_guard"], "trainer.lr": ["1e-3"], "seed": ["0", "1"]}
    plan = reads_middle.make_plan("reads_middle", reads_middle.sweep_grid("reads_middle", []))
    assert len(plan["runs"]) == 12 and plan["dev"] == "mdqa_dev"
    assert plan["runs"][3] == {"n": 3, "arm": "none", "setting": "trainer.lr=0.001", "seed": 1,
                               "overrides": ["debias=none", "trainer.lr=0.001", "seed=1"]}


def test_runs_go_seed_by_seed_each_evaluated_before_the_next_trains(tmp_path):
    plan = reads_middle.make_plan("reads_middle", reads_middle.sweep_grid("reads_middle", []))
    (tmp_path / PLAN).write_text(json.dumps(plan))
    plan = probe_study.read_plan(tmp_path)
    jobs = reads_middle.run_jobs(plan, plan.runs, {"train", "dev"}, "reads_middle", [], {}, "data", [])
    names = [j.name for j in jobs]
    assert names[:4] == ["train:0", "mdqa_dev:run-0", "train:2", "mdqa_dev:run-2"]
    assert [r.seed for r in plan.runs if f"train:{r.n}" in names[:12]] == [0] * 6  # seed 0 of every arm and lr first
    assert jobs[1].after == ("train:0",)
    # the first pos2distill run given answers the teacher prompts, the others wait for its answers
    followers = {j.name: j.wait_for[1] for j in jobs if j.wait_for}
    assert set(followers.values()) == {"train:4"} and len(followers) == 7
    later = reads_middle.run_jobs(plan, [r for r in plan.runs if r.seed == 1], {"train", "dev"}, "reads_middle", [],
                                  {}, "data", [])
    assert {j.wait_for[1] for j in later if j.wait_for} == {"train:5"}
    assert [j.name for j in reads_middle.run_jobs(plan, plan.runs[:2], {"dev"}, "reads_middle", [], {}, "d", [])] \
        == ["mdqa_dev:run-0", "mdqa_dev:run-1"]


def test_an_experiment_continues_only_with_the_staging_it_was_started_with(tmp_path, capsys):
    assert reads_middle.main([str(tmp_path), "--choose-on-seeds", "0", "1", "--phase", "report"]) == 2
    assert "some, not all" in capsys.readouterr().err and not (tmp_path / PLAN).exists()
    assert reads_middle.main([str(tmp_path), "--choose-on-seeds", "0", "--phase", "report"]) == 1  # no selection yet
    assert json.loads((tmp_path / PLAN).read_text())["choose_on_seeds"] == [0]
    capsys.readouterr()
    assert reads_middle.main([str(tmp_path), "--phase", "report"]) == 2
    assert "started with --choose-on-seeds [0]" in capsys.readouterr().err


def _job(tmp_path, name, code, after=(), wait_for=None):
    return reads_middle.Job(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", tuple(after),
                            wait_for=wait_for)


def test_the_scheduler_waits_for_what_a_job_needs_and_fails_its_dependants(tmp_path, capsys):
    marker = tmp_path / "answers.json"
    order = tmp_path / "order.txt"
    log = f"open({str(order)!r}, 'a').write('{{}}\\n')"
    jobs = [
        _job(tmp_path, "leader", f"import time; time.sleep(0.5); {log.format('leader')}; open({str(marker)!r}, 'w')"),
        _job(tmp_path, "follower", log.format("follower"), wait_for=(marker, "leader")),
        _job(tmp_path, "broken", "raise SystemExit(3)"),
        _job(tmp_path, "after_broken", log.format("after_broken"), after=["broken"]),
    ]
    ended = []
    scheduler = reads_middle.Scheduler(parallel=4, checkpoint=lambda: ended.append(1))
    scheduler.run(jobs)
    assert order.read_text().split() == ["leader", "follower"] and len(ended) >= 2  # kept as jobs end
    assert scheduler.failed["broken"].startswith("exit 3")
    assert "broken failed" in scheduler.failed["after_broken"]
    printed = capsys.readouterr().out  # where a long experiment stands, for a session that continues it
    assert "[jobs] 0 of 4 jobs done already, 4 to run" in printed
    assert "[jobs] done: leader (1 of 4 done)" in printed and "[jobs] done: follower (2 of 4 done)" in printed


def test_a_stopped_scheduler_stops_its_jobs(tmp_path):
    pid_file = tmp_path / "pid"
    job = _job(tmp_path, "long", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                 f"time.sleep(60)")

    stops = []

    def stop_once_started():
        if pid_file.is_file() and not stops:
            stops.append(1)
            raise KeyboardInterrupt

    checkpoints = []
    scheduler = reads_middle.Scheduler(parallel=1, checkpoint=lambda: checkpoints.append(pid_file.is_file()))
    sleep = time.sleep
    with pytest.MonkeyPatch.context() as mp:  # the scheduler's poll is where a SIGTERM or Ctrl-C lands
        mp.setattr(time, "sleep", lambda s: (stop_once_started(), sleep(s)))
        with pytest.raises(KeyboardInterrupt):
            scheduler.run([job])
    with pytest.raises(ProcessLookupError):  # terminated and reaped
        os.kill(int(pid_file.read_text()), 0)
    assert scheduler.failed["long"].startswith("stopped")
    assert checkpoints == [True]  # kept once more as the stop begins


def _write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _checkpoint(folder: Path, *names: str) -> Path:
    """A whole fake checkpoint: `names` and a trainer_state.json that lists their sizes, as train.py writes it."""
    for name in names:
        _write(folder / name, name)
    TrainerState(int(folder.name.split("-")[1]), 0, files={n: len(n) for n in names}).write(folder)
    return folder


def test_the_keep_mirrors_what_is_small_and_costly_and_fills_a_fresh_folder(tmp_path):
    out, kept, fresh = tmp_path / "out", tmp_path / "kept", tmp_path / "fresh"
    final = "runs/0/checkpoints/step-150/"  # run 0 finished with LoRA adapters: its final ones are kept
    adapters = ("adapter_config.json", "adapter_model.safetensors")
    small = ["plan.json", "selection.json", "evals/mdqa_dev/run-0/eval/mdqa_step150.json",
             "cache/distill_responses/ab.json", "cache/evaluations/answered/cd.jsonl",
             "runs/0/summary.md", "runs/0/metrics.jsonl", "runs/0/train.log", "runs/0/distill_responses.json",
             "runs/0/finished.json", *(final + name for name in (*adapters, "tokenizer.json", "trainer_state.json")),
             "runs/2/finished.json",  # run 2 finished with whole weights: too large to keep
             # run 1 is under way: its newest checkpoint whole and its folder's files, to resume it elsewhere
             *(f"runs/1/checkpoints/step-50/{name}" for name in (*adapters, "optimizer.pt", "trainer_state.json")),
             "runs/1/metrics.jsonl", "runs/1/.hydra/config.yaml", "runs/1/jacobian.npz"]
    _checkpoint(out / final, *adapters, "tokenizer.json", "optimizer.pt", "rng-rank0.pt")
    _checkpoint(out / "runs/0/checkpoints/step-125", *adapters)
    _checkpoint(out / "runs/1/checkpoints/step-25", *adapters, "optimizer.pt")
    _checkpoint(out / "runs/1/checkpoints/step-50", *adapters, "optimizer.pt")
    _checkpoint(out / "runs/2/checkpoints/step-150", "model.safetensors")
    _checkpoint(out / "runs/4/checkpoints/step-25", *adapters, "optimizer.pt")  # run 4 trains on a saved base
    for rel in small + ["runs/1/.lock", "runs/1/wandb/run.wandb", "runs/4/base_model/model.safetensors",
                        "runs/3/metrics.jsonl",  # run 3 has no checkpoint yet: nothing to resume from
                        "cache/models/smollm2/model.safetensors", "cache/distill_responses/.ab.json.x.tmp"]:
        if not (out / rel).exists():
            _write(out / rel, rel)
    keep = reads_middle.kept_in(kept, out)
    assert sorted(map(str, keep.save())) == sorted(small)
    assert keep.save() == []  # nothing changed
    _write(out / "cache/evaluations/answered/cd.jsonl", "more answers")
    assert list(map(str, keep.save())) == ["cache/evaluations/answered/cd.jsonl"]
    _write(out / "cache/evaluations/answered/cd.jsonl", "more")  # an older copy never replaces a longer record
    assert keep.save() == [] and (kept / "cache/evaluations/answered/cd.jsonl").read_text() == "more answers"
    _write(out / "cache/evaluations/answered/cd.jsonl", "more answers")
    restored = reads_middle.kept_in(kept, fresh).restore()
    assert sorted(map(str, restored)) == sorted(small)
    assert (fresh / "cache/evaluations/answered/cd.jsonl").read_text() == "more answers"
    assert [p.name for p in list_checkpoints(fresh / "runs/0")] == ["step-150"]  # its evaluations can run here
    assert [p.name for p in list_checkpoints(fresh / "runs/1")] == ["step-50"]  # it resumes here
    _write(fresh / "evals/mdqa_dev/run-0/eval/mdqa_step150.json", "kept here")
    assert reads_middle.kept_in(kept, fresh).restore() == []  # what a folder holds is never replaced
    _write(fresh / "plan.json", "another experiment")
    with pytest.raises(ValueError, match="the plans of two experiments"):
        reads_middle.kept_in(kept, fresh).restore()
    # run 1 goes on and finishes: the keep holds its logs and final adapters alone, not its states, its older
    # checkpoint nor the files only a resume reads
    shutil.rmtree(out / "runs/1/checkpoints/step-25")
    _checkpoint(out / "runs/1/checkpoints/step-150", *adapters, "optimizer.pt")
    _write(out / "runs/1/finished.json")
    keep.save()
    assert sorted(str(p.relative_to(kept / "runs/1")) for p in (kept / "runs/1").rglob("*") if p.is_file()) == [
        "checkpoints/step-150/adapter_config.json", "checkpoints/step-150/adapter_model.safetensors",
        "checkpoints/step-150/trainer_state.json", "finished.json", "metrics.jsonl"]


def test_the_keep_replaces_a_runs_checkpoint_only_by_a_newer_one_kept_whole(tmp_path):
    out, kept = tmp_path / "out", tmp_path / "kept"
    names = lambda folder: sorted(p.name for p in folder.iterdir())  # noqa: E731
    _write(out / "plan.json")
    adapters = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt")
    _checkpoint(out / "runs/0/checkpoints/step-25", *adapters)
    keep = reads_middle.kept_in(kept, out)
    keep.save()
    # a newer checkpoint kept only in part (a file went missing while it was copied, or the save was cut short):
    # the kept step 25 stays, and it is what a fresh folder gets back
    _checkpoint(out / "runs/0/checkpoints/step-50", *adapters)
    for name in adapters[:2]:
        _write(kept / "runs/0/checkpoints/step-50" / name, name)
    assert names(kept / "runs/0/checkpoints") == ["step-25", "step-50"]
    restored = reads_middle.kept_in(kept, tmp_path / "fresh").restore()
    assert {str(p.parent) for p in restored if p.parts[:3] == ("runs", "0", "checkpoints")} == {
        "runs/0/checkpoints/step-25"}
    keep.save()
    assert names(kept / "runs/0/checkpoints") == ["step-50"]  # whole now: the older one leaves
    assert names(kept / "runs/0/checkpoints/step-50") == [*adapters, "trainer_state.json"]
    # a file that goes missing while the checkpoint is copied: its trainer_state.json is not kept, nor the newer one
    _checkpoint(out / "runs/0/checkpoints/step-75", *adapters)
    read_bytes = Path.read_bytes

    def pruned_midway(path: Path) -> bytes:
        if path.name == "optimizer.pt" and path.parent.name == "step-75":
            raise FileNotFoundError(path)
        return read_bytes(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "read_bytes", pruned_midway)
        keep.save()
    assert names(kept / "runs/0/checkpoints") == ["step-50", "step-75"]
    assert not (kept / "runs/0/checkpoints/step-75/trainer_state.json").exists()
    # a finished run whose folder here holds no weights leaves its kept final adapters alone
    _checkpoint(kept / "runs/1/checkpoints/step-150", *adapters[:2])
    _write(kept / "runs/1/finished.json")
    _write(out / "runs/1/finished.json")
    keep.save()
    assert names(kept / "runs/1/checkpoints/step-150") == [*adapters[:2], "trainer_state.json"]


def test_a_restored_experiment_trains_only_the_runs_an_evaluation_still_needs(tmp_path):
    plan = reads_middle.make_plan("reads_middle", reads_middle.sweep_grid("reads_middle", []), [0])
    (tmp_path / PLAN).write_text(json.dumps(plan))
    plan = probe_study.read_plan(tmp_path)
    runs = {(r.arm, r.setting, r.seed): r for r in plan.runs}
    evaluated = [runs["none", "trainer.lr=0.0002", 0], runs["pos2distill", "trainer.lr=0.0002", 0]]
    for r in evaluated:
        save_evaluation(tmp_path, "mdqa_dev", run_target(r.n), 0.5)
    seed_0 = [r for r in plan.runs if r.seed == 0]
    jobs = {j.name: j for j in reads_middle.run_jobs(plan, seed_0, {"train", "dev"}, "reads_middle", [], {}, "d", [])}
    assert {n for n, j in jobs.items() if j.done} == {name for r in evaluated
                                                      for name in (f"train:{r.n}", f"mdqa_dev:run-{r.n}")}
    # the teacher prompts are answered by the first distilling run that trains, not by one that is not trained
    leader = runs["pos2distill", "trainer.lr=0.001", 0].n
    assert jobs[f"train:{leader}"].wait_for is None
    assert {j.wait_for[1] for j in jobs.values() if j.wait_for} == {f"train:{leader}"}
    # the chosen runs: one with its test evaluations (not trained), one without (trained, then evaluated), and one
    # whose weights are here (finished), evaluated first though its seed and number come last
    chosen = [runs["none", "trainer.lr=0.0002", 0], runs["none", "trainer.lr=0.0002", 1],
              runs["pos2distill", "trainer.lr=0.0002", 1]]
    save_evaluation(tmp_path, "mdqa_test", run_target(chosen[0].n), 0.5)
    _write(tmp_path / "evals" / "kv" / run_target(chosen[0].n) / "eval" / "kv_step150.json")
    _write(RunDir(plan.run_dir(chosen[2].n)).finished)
    _write(RunDir(plan.run_dir(chosen[2].n)).checkpoint(150) / "adapter_model.safetensors")
    # finished, but its weights are not here (whole weights, not kept): trained again like a run never trained
    _write(RunDir(plan.run_dir(chosen[1].n)).finished)
    tests = reads_middle.test_jobs(plan, chosen, {"train", "test"}, "reads_middle", [], {}, "d", [])
    first, trains, here = (r.n for r in chosen)
    assert [(j.name, j.done, j.after) for j in tests] == [
        (f"train:{here}", True, ()),
        (f"mdqa_test:run-{here}", False, (f"train:{here}",)),
        (f"kv:run-{here}", False, (f"train:{here}",)),
        (f"train:{first}", True, ()),
        (f"mdqa_test:run-{first}", True, (f"train:{first}",)),
        (f"kv:run-{first}", True, (f"train:{first}",)),
        (f"train:{trains}", False, ()),
        (f"mdqa_test:run-{trains}", False, (f"train:{trains}",)),
        (f"kv:run-{trains}", False, (f"train:{trains}",))]


def test_the_command_fills_a_fresh_folder_from_its_keep_and_keeps_what_it_chose(tmp_path, monkeypatch):
    sweep = ["debias=none", "trainer.lr=1,2", "seed=0,1"]
    kept, out = tmp_path / "kept", tmp_path / "out"
    plan = reads_middle.make_plan("reads_middle", reads_middle.sweep_grid("reads_middle", sweep), [0])
    _write(kept / PLAN, json.dumps(plan, indent=1))
    save_evaluation(kept, "mdqa_dev", BASE, 0.25)
    for r in plan["runs"][::2]:  # seed 0: lr=1 scores 0.25, lr=2 0.5
        save_evaluation(kept, "mdqa_dev", run_target(r["n"]), 0.25 * (1 + r["n"] // 2))
    envs: list[dict] = []
    monkeypatch.setattr(reads_middle.Scheduler, "run", lambda self, jobs: envs.append(self.env))
    command = [str(out), "--sweep", *sweep, "--choose-on-seeds", "0", "--base", "base", "--phase", "select",
               "--keep", str(kept)]
    assert reads_middle.main(command) == 0
    assert (out / "evals" / "mdqa_dev" / run_target(2) / "eval" / "mdqa_step0.json").is_file()
    assert json.loads((kept / SELECTION).read_text())["arms"]["none"]["setting"] == "trainer.lr=2"
    assert envs[0] == {"POSDEBIAS_CACHE": str(out / "cache")} and (out / "cache" / "models").is_symlink()

    def stopped_while_evaluating(self, jobs):  # a SIGTERM lands while a job writes its answers
        _write(out / "cache" / "evaluations" / "answered" / "ab.jsonl", "half an evaluation")
        os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(reads_middle.Scheduler, "run", stopped_while_evaluating)
    with pytest.raises(SystemExit) as stop:
        reads_middle.main(command)
    assert stop.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == handler
    assert (kept / "cache" / "evaluations" / "answered" / "ab.jsonl").read_text() == "half an evaluation"


def _kv_file(path: Path, records: int = 12, pairs: int = 12) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(records):
        kv = [[str(uuid.UUID(int=rng.getrandbits(128))), str(uuid.UUID(int=rng.getrandbits(128)))] for _ in range(pairs)]
        k = rng.randrange(pairs)
        rows.append({"ordered_kv_records": kv, "key": kv[k][0], "value": kv[k][1]})
    return write_jsonl_gz(path, rows)


@pytest.mark.slow
def test_a_tiny_experiment_runs_end_to_end_and_continues_where_it_stopped(tmp_path):
    """The whole of scripts.reads_middle on a tiny checkpoint and synthetic NQ and kv files (~3 min on 2 cores),
    staged as on a CPU (`--choose-on-seeds 0`): seed 0 of every setting trained, the settings chosen on its dev
    evaluations, seed 1 trained at the chosen settings only, the chosen runs evaluated on test and kv, the report
    written; run again, it starts nothing."""
    from tests.conftest import TINY
    from train import compose_config, run

    data = tmp_path / "data"
    write_jsonl_gz(data / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))
    _kv_file(data / "kv-retrieval-75_keys.jsonl.gz")
    run(compose_config(["+exp=biased_start", *TINY, "trainer.max_steps=1", "trainer.save_every=0"]), tmp_path / "tiny")
    distill = ["debias.distill.keep_wrong=true", "debias.distill.max_new_tokens=4"]
    command = [
        sys.executable, "-m", "scripts.reads_middle", str(tmp_path / "exp"), "--parallel", "2",
        "--sweep", "debias=none,pos2distill_guard", "trainer.lr=1e-3,2e-3", "seed=0,1", "--choose-on-seeds", "0",
        "--data-dir", str(data),
        "--train-args", "model=trained_tiny", f"model.pretrained={tmp_path / 'tiny' / 'checkpoints' / 'step-1'}",
        f"data.path={data / 'nq-open-oracle.jsonl.gz'}", "data.context_len=512", "data.in2.n_docs=3",
        "data.num_train=16", "data.num_eval=4", "eval.num_examples=4", "peft.r=4", "trainer.max_steps=2",
        "trainer.save_every=2", "eval.every=2", "logger.mode=disabled", "jacobian.seq_len=32", "jacobian.chunk_len=16",
        "data.in2.heldout_doc_len=64", "watch=off",
        "--arm-args", *[f"pos2distill_guard:{o}" for o in distill],
        "--eval-args", "chat_template=false", "examples=4", "mdqa.n_docs=3", "kv.n_pairs=4",
        "--keep", str(tmp_path / "kept")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exp = tmp_path / "exp"
    selection = json.loads((exp / SELECTION).read_text())
    assert set(selection["arms"]) == {"none", "pos2distill_guard"} and selection["seeds"] == [0]
    chosen = {n for info in selection["arms"].values() for n in info["runs"]}
    assert len(chosen) == 4
    trained = {n for n in range(8) if n % 2 == 0 or n in chosen}  # seed 0 of all, seed 1 at the chosen settings
    assert len(trained) == 6
    for n in range(8):
        assert (exp / "runs" / str(n) / "finished.json").is_file() == (n in trained)
        assert (exp / "evals" / "mdqa_dev" / run_target(n) / "eval" / "mdqa_step2.json").is_file() == (n in trained)
        assert (exp / "evals" / "kv" / run_target(n) / "eval" / "kv_step2.json").is_file() == (n in chosen)
    report = (exp / "report" / "report.md").read_text()
    assert "## kv: kv" in report and "valley" in report and "mean over seeds 0)" in report
    teacher_logs = [(exp / "logs" / f"train_{n}.log").read_text() for n in range(4, 8) if n in trained]
    assert sum("answers reused" in t for t in teacher_logs) == 2  # one run answers the teacher prompts, two read them
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "start:" not in again.stdout
    # a fresh machine: the kept folder alone holds everything (the finished runs' logs and final adapters), so
    # nothing is trained again
    assert list((tmp_path / "kept" / "cache" / "distill_responses").glob("*.json"))
    assert len(list((tmp_path / "kept" / "runs").glob("*/checkpoints/step-2/adapter_model.safetensors"))) == 6
    command[3] = str(tmp_path / "fresh")
    fresh = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and "start:" not in fresh.stdout, fresh.stdout[-2000:] + fresh.stderr[-2000:]
    assert (tmp_path / "fresh" / "report" / "report.md").read_text() == report.replace(str(exp), command[3])


def test_lift_middle_chooses_on_dev_log_p_alone_and_reports(tmp_path):
    """+exp=lift_middle's dev evaluation asks the log p alone (answers=false: its rule reads nothing else); the choice
    is the same as with answers, and the report is written."""
    from scripts.reads_middle import EVALUATIONS, EXTRA_EVALUATIONS

    dev_args = (EVALUATIONS | EXTRA_EVALUATIONS["lift_middle"])["mdqa_dev"][2]
    assert "answers=false" in dev_args and "mdqa.closed_book=false" in dev_args
    assert "answers=false" not in EVALUATIONS["mdqa_dev"][2]  # issue 39's rule reads the answers
    lift_experiment(tmp_path, "lift_middle")
    for path in (tmp_path / "evals" / "mdqa_dev").glob("*/eval/*.json"):
        found = json.loads(path.read_text())
        found["outcomes"] = [{**o, "correct": None, "prediction": ""} for o in found["outcomes"] if o["position"] >= 0]
        path.write_text(json.dumps(found))
    choice = probe_study.choose(probe_study.read_plan(tmp_path))
    assert choice["arms"]["kd"]["setting"] == "lr=2"
    assert choice["arms"]["kd"]["dev_scores"] == pytest.approx({"lr=1": 0.0, "lr=2": 1.0, "lr=3": 0.5, "lr=4": 0.0})
    (tmp_path / SELECTION).write_text(json.dumps(choice))
    report = probe_study.write_report(probe_study.study_numbers(tmp_path), tmp_path / "report").read_text()
    assert "## mdqa_dev" in report
