"""analysis.study on a synthetic sweep: fairness metrics, crossed-design intervals, permutation tests of the
extremes, flat-curve floor, detectable effects, job loading, whether the Jacobian tracks the curve, report and
CLI."""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from analysis.evaluation.fairness import fairness
from analysis.evaluation.result import ProbeResult
from analysis.stats import Score, crossed_interval, mean_of, per_seed_interval
from analysis.study import (
    StudyError,
    analyse,
    arm_correlation,
    arm_name,
    fairness_estimates,
    flat_curve,
    load_study,
    main,
    seed_of,
    verdict_lines,
    write_report,
)

N_QUESTIONS = 1000
FINAL_STEP = 200
# Correct-answer probability per depth bin (10 bins) of each arm's final answers.
ARM_PROBS = {
    "none": [0.85, 0.8, 0.7, 0.45, 0.4, 0.4, 0.45, 0.7, 0.8, 0.85],  # lost in the middle
    "depth_weight": [0.8, 0.8, 0.7, 0.6, 0.55, 0.55, 0.6, 0.7, 0.8, 0.8],
    "group_dro": [0.9] * 10,  # flat and high
}
START_PROBS = [0.5, 0.45, 0.3, 0.2, 0.15, 0.15, 0.2, 0.3, 0.45, 0.5]


def _questions(n: int = N_QUESTIONS, seed: int = 11) -> list[dict]:
    depths = np.random.default_rng(seed).uniform(0.0, 1.0, n)
    return [{"id": f"q{i:04d}", "depth": float(d), "position": min(int(d * 10), 9)} for i, d in enumerate(depths)]


def _outcome(q: dict, correct: float) -> dict:
    return {"id": q["id"], "query": f"question {q['id']}", "position": q["position"],
            "label": str(round(q["position"] / 10, 4)), "prediction": "a" if correct else "b", "answers": ["a"],
            "correct": correct, "extra": {"depth": q["depth"]}}


def _result(questions: list[dict], probs: list[float], rng: np.random.Generator) -> ProbeResult:
    outcomes = [_outcome(q, float(rng.random() < probs[q["position"]])) for q in questions]
    return ProbeResult(probe="in2", outcomes=outcomes, settings={})


def _write_job(job: Path, overrides: list[str], start: ProbeResult, final: ProbeResult,
               metrics: list[dict] | None, final_step: int = FINAL_STEP) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    start.save_json(job / "eval" / "in2_step0.json")
    final.save_json(job / "eval" / f"in2_step{final_step}.json")
    if metrics is not None:
        (job / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))
    (job / "finished.json").write_text(json.dumps({"step": final_step}) + "\n")  # train.py's last act


def _valley_rows(seed: int, deepen: float) -> list[dict]:
    """Two steps; several lines per step (metric groups); valley at both steps for vanilla and chunked."""
    rows = []
    for step, depth in ((0, 1.0 + seed), (FINAL_STEP, 1.0 + seed + deepen)):
        rows.append({"step": step, "train/loss": 2.0})
        rows.append({"step": step, "valley/vanilla/peak_to_trough_log10": depth,
                     "valley/vanilla/middle_mass": 0.2, "prior/vanilla/alpha": 0.5})
        rows.append({"step": step, "valley/chunked/peak_to_trough_log10": depth / 2,
                     "valley/chunked/middle_mass": "nan" if step == 0 else 0.3})
    return rows


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """3 arms x 2 seeds of one shared held-out set; depth_weight logged no Jacobian metrics."""
    root = tmp_path_factory.mktemp("sweep")
    questions, rng, n = _questions(), np.random.default_rng(5), 0
    for arm, probs in ARM_PROBS.items():
        for seed in (0, 1):
            overrides = ([] if arm == "none" else [f"debias={arm}"]) + [f"seed={seed}", "+exp=in2"]
            metrics = None if arm == "depth_weight" else _valley_rows(seed, deepen=1.0 if arm == "none" else -0.5)
            _write_job(root / str(n), overrides, _result(questions, START_PROBS, rng), _result(questions, probs, rng),
                       metrics)
            n += 1
    (root / "0" / "train.log").write_text(  # the first job's log: 7.5 min from its first line to its last
        "[2026-12-02 03:20:44,748][train][INFO] - start\n  a continuation line\n"
        "[2026-12-02 03:24:00,000][train][INFO] - step 0\n[2026-12-02 03:28:14,748][train][INFO] - run finished\n")
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


@pytest.fixture(scope="module")
def stats(sweep: Path) -> dict:
    return analyse(load_study(sweep), n_perm=500, n_sim=100)


def test_arm_and_seed_from_overrides():
    assert arm_name(["debias=[depth_sampling,group_dro]", "seed=2"]) == "depth_sampling+group_dro"
    assert arm_name(["+debias=[depth_sampling, group_dro]"]) == "depth_sampling+group_dro"
    assert arm_name(["debias=group_dro"]) == "group_dro"
    assert arm_name(["seed=1", "trainer.lr=0.001"]) == "none"
    assert arm_name([]) == "none"
    assert seed_of(["debias=group_dro", "seed=3"]) == 3
    assert seed_of(["debias=group_dro"]) == 0


def test_fairness_by_hand():
    scores = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.5])
    bins = np.array([0, 0, 2, 2, 5, 5, 9, 9])
    depths = np.array([0.01, 0.05, 0.26, 0.29, 0.55, 0.59, 0.91, 0.99])
    got = fairness(scores, bins, depths)
    # bins present: 0 -> 0.5, 2 -> 0.75, 5 -> 0.5, 9 -> 0.75 (empty bins are left out)
    # middle (depth in [0.25, 0.75)): 0.5, 1, 0, 1 -> 2.5 / 4; ends: 1, 0, 1, 0.5 -> 2.5 / 4
    assert got == {"mean": 5.0 / 8, "worst_bin": 0.5, "gap": 0.25, "middle_minus_ends": 0.0,
                   "middle_over_ends": 1.0}
    ends_zero = fairness(np.array([1.0, 0.0, 0.0]), np.array([4, 0, 9]), np.array([0.5, 0.1, 0.9]))
    assert ends_zero["middle_minus_ends"] == 1.0 and np.isnan(ends_zero["middle_over_ends"])
    assert ends_zero["worst_bin"] == 0.0 and ends_zero["gap"] == 1.0
    with pytest.raises(ValueError):
        fairness(np.array([1.0]), np.array([0, 1]), np.array([0.1, 0.2]))


def test_arm_against_itself_is_exactly_zero():
    rng = np.random.default_rng(0)
    depths = rng.uniform(0, 1, 300)
    bins = np.minimum((depths * 10).astype(int), 9)
    scores = (rng.random((2, 300)) < 0.6).astype(float)
    estimates = fairness_estimates({"none": scores, "copy": scores.copy(), "other": scores[::-1]}, bins, depths,
                                   n_perm=200)
    for name in ("mean", "middle_minus_ends"):
        e = estimates["copy"][name]
        assert e["diff"] == 0.0 and e["diff_low"] == pytest.approx(-e["diff_high"]), name
        assert not e["resolved"] and e["low"] <= e["value"] <= e["high"]
    for name in ("worst_bin", "gap"):
        e = estimates["copy"][name]
        assert e["diff"] == 0.0 and e["p_value"] == 1.0 and not e["resolved"]


def test_mean_difference_is_the_crossed_interval():
    """The study's mean difference is stats.crossed_interval of the stacked arms, paired by question and seed."""
    rng = np.random.default_rng(1)
    depths = rng.uniform(0, 1, 400)
    bins = np.minimum((depths * 10).astype(int), 9)
    rows = {"none": (rng.random((2, 400)) < 0.5).astype(float), "arm": (rng.random((2, 400)) < 0.7).astype(float),
            "third": (rng.random((2, 400)) < 0.6).astype(float)}
    got = fairness_estimates(rows, bins, depths, n_perm=100)["arm"]["mean"]
    want = crossed_interval(np.stack(list(rows.values())), mean_of(400), arm=1, reference=0)
    assert (got["diff"], got["diff_low"], got["diff_high"]) == (want.value, want.low, want.high)
    assert got["diff_df"] == want.df
    assert got["resolved"] and "3 arms" in got["diff_method"]


def test_unequal_seed_counts_are_refused():
    bins, depths = _binned(50)
    with pytest.raises(StudyError, match="different numbers of seeds"):
        fairness_estimates({"none": np.zeros((2, 50)), "arm": np.zeros((1, 50))}, bins, depths)


def _binned(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n questions in 10 equal depth bins: (bins, depths)."""
    bins = np.arange(n) % 10
    return bins, (bins + np.random.default_rng(seed).uniform(0, 1, n)) / 10


def test_flat_curve_floor_matches_binomial_bins():
    """A curve that is not flat, shuffled across its bins, has the gap of 10 binomial bins at its mean."""
    bins, depths = _binned(2000)  # 200 questions a bin, the study's size
    probs = np.linspace(0.14, 0.54, 10)  # mean 0.34, the study's accuracy; its own gap is ~0.4
    scores = (np.random.default_rng(1).random(2000) < probs[bins]).astype(float)
    flat = flat_curve(scores, bins, depths, n_perm=400, seed=2)
    draws = np.random.default_rng(3).binomial(200, scores.mean(), size=(20000, 10)) / 200
    expected_gap = (draws.max(axis=1) - draws.min(axis=1)).mean()  # ~0.10
    assert 0.05 < flat["gap"].mean() == pytest.approx(expected_gap, abs=0.01)
    assert fairness(scores, bins, depths)["gap"] > np.quantile(flat["gap"], 0.95) > flat["gap"].mean()
    assert np.quantile(flat["worst_bin"], 0.05) < flat["worst_bin"].mean() < scores.mean()
    assert flat["worst_bin"].mean() == pytest.approx(draws.min(axis=1).mean(), abs=0.01)


def test_seeds_that_differ_widen_the_interval():
    """Seeds of systematically different accuracy widen the difference's interval past the questions'-only one
    (each seed alone)."""
    rng = np.random.default_rng(4)
    bins, depths = _binned(600)
    none = (rng.random((2, 600)) < 0.5).astype(float)
    arm = (rng.random((2, 600)) < np.array([[0.3], [0.7]])).astype(float)  # seed 1 is better by 0.4
    third = (rng.random((2, 600)) < 0.5).astype(float)
    two = fairness_estimates({"none": none, "arm": arm, "third": third}, bins, depths, n_perm=50)["arm"]["mean"]
    one = fairness_estimates({"none": none[:1], "arm": arm[:1], "third": third[:1]}, bins, depths,
                             n_perm=50)["arm"]["mean"]
    assert two["diff_high"] - two["diff_low"] > 2 * (one["diff_high"] - one["diff_low"])
    assert "training randomness not included" in one["diff_method"] and "2 seeds" in two["diff_method"]


def test_lower_is_better_takes_the_highest_bin_as_worst():
    bins, depths = _binned(40)
    loss = np.where(bins == 3, 5.0, 1.0)[None]  # bin 3 has the highest loss
    nll = Score("nll", higher_is_better=False, rate=False)
    e = fairness_estimates({"none": loss, "arm": loss}, bins, depths, score=nll, n_perm=20)
    assert e["none"]["worst_bin"]["value"] == 5.0 and np.isnan(e["none"]["middle_over_ends"]["value"])


def test_verdict_follows_the_tests(stats: dict):
    lines = verdict_lines(stats)
    dro = next(line for line in lines if line.startswith("- `group_dro`"))
    assert "beats `none` on its worst bin" in dro and "indistinguishable from a flat curve" in dro
    assert "higher middle − ends than `none`" in dro
    assert "above a flat curve's" in next(line for line in lines if line.startswith("- `none`"))

    crossing = copy.deepcopy(stats)  # the same point differences, no longer resolved
    crossing["fairness"]["group_dro"]["worst_bin"].update(p_value=0.2, resolved=False)
    crossing["fairness"]["group_dro"]["mean"].update(diff_low=-0.01, diff_high=0.02, resolved=False)
    dro = next(line for line in verdict_lines(crossing) if line.startswith("- `group_dro`"))
    assert "beats" not in dro and "no worst-bin difference to `none` resolved (" in dro and "(p 0.200)" in dro
    assert "mean than" not in dro and "no mean difference to `none` resolved" in dro


def test_single_seed_study_excludes_training_randomness(tmp_path: Path):
    questions, rng = _questions(200), np.random.default_rng(7)
    for n, arm in enumerate(ARM_PROBS):
        _write_job(tmp_path / str(n), [f"debias={arm}", "seed=3"], _result(questions, START_PROBS, rng),
                   _result(questions, ARM_PROBS[arm], rng), None)
    text = write_report(load_study(tmp_path), tmp_path / "out", n_perm=100, n_sim=50).read_text()
    assert "1 seed an arm: training randomness not included" in text
    data = json.loads((tmp_path / "out" / "study.json").read_text())
    assert "training randomness not included" in data["fairness"]["group_dro"]["mean"]["diff_method"]
    assert "No job logged valley or rollout metrics." in text and data["tracking"] == {}
    assert not (tmp_path / "out" / "valley_accuracy_scatter.png").exists()


def test_load_study_groups_arms_and_seeds(sweep: Path):
    study = load_study(sweep)
    assert study.arms == ["none", "depth_weight", "group_dro"]
    assert all(study.seeds(arm) == [0, 1] for arm in study.arms)
    assert len(study.ids) == N_QUESTIONS and study.n_bins == 10
    assert {job.final_step for job in study.jobs} == {FINAL_STEP}
    # several metric lines of one step are merged
    none0 = next(job for job in study.jobs if job.arm == "none" and job.seed == 0)
    assert {"train/loss", "valley/vanilla/middle_mass", "valley/chunked/middle_mass"} <= set(none0.metrics[0])
    scores = study.seed_scores("group_dro")
    assert scores.shape == (2, N_QUESTIONS) and set(np.unique(scores)) <= {0.0, 1.0}


def test_wall_time_per_job_from_its_log(sweep: Path, stats: dict, tmp_path: Path):
    assert stats["arms"]["none"]["wall_s"] == [450.0, None]  # the second job has no train.log
    assert stats["arms"]["group_dro"]["wall_s"] == [None, None]
    text = write_report(load_study(sweep), tmp_path / "out", n_perm=50, n_sim=50).read_text()
    assert "| none | 0,1 | 200 |" in text and "| 7.5, – |" in text


def test_better_arm_is_resolved(stats: dict):
    dro = stats["fairness"]["group_dro"]
    assert dro["worst_bin"]["diff"] > 0 and dro["worst_bin"]["p_value"] < 0.01 and dro["worst_bin"]["resolved"]
    assert dro["gap"]["diff"] < 0 and dro["gap"]["resolved"]
    assert dro["mean"]["diff_low"] > 0 and dro["mean"]["diff_df"] >= 2.0  # never below (3 - 1)(2 - 1)
    assert stats["fairness"]["none"]["middle_minus_ends"]["high"] < 0  # the synthetic middle dip
    assert math.isinf(stats["resolution"]["worst_bin_mde"])  # none has two equal dips: no lift of one is seen
    assert 0 < stats["resolution"]["median_bin_halfwidth"] < 0.2
    assert stats["fairness"]["none"]["mean"]["per_seed"] == pytest.approx(stats["arms"]["none"]["seed_means"])


def test_valley_start_end_and_missing(stats: dict):
    none = stats["valley"]["none"]
    ptt = none["vanilla"]["peak_to_trough_log10"]  # seeds 0, 1: 1, 2 at step 0; 2, 3 at the end
    assert (ptt["start"], ptt["end"], ptt["change"]) == (1.5, 2.5, 1.0)
    assert ptt["start_steps"] == [0] and ptt["end_steps"] == [FINAL_STEP]
    # a "nan" string (how metrics_log writes non-finite values) is not a measurement
    assert none["chunked"]["middle_mass"]["start_steps"] == [FINAL_STEP]
    assert np.isnan(stats["valley"]["depth_weight"]["vanilla"]["middle_mass"]["start"])
    assert stats["valley"]["group_dro"]["vanilla"]["peak_to_trough_log10"]["change"] == -0.5


MIDDLE_START = 60  # middle questions every job answers at step 0 (the shared start)
TRACKING_QUESTIONS = 300


def _middle_result(questions: list[dict], middle_correct: int) -> ProbeResult:
    """Every other end question correct; of the middle ones (depth in [0.25, 0.75)) the first `middle_correct`."""
    outcomes, k = [], 0
    for i, q in enumerate(questions):
        middle = 0.25 <= q["depth"] < 0.75
        outcomes.append(_outcome(q, float(k < middle_correct if middle else i % 2 == 0)))
        k += middle
    return ProbeResult(probe="in2", outcomes=outcomes, settings={})


def _tracking_sweep(root: Path, jobs: int, seeds: int = 1) -> Path:
    """`jobs` jobs (jobs / seeds arms: none, arm1, ...), evaluated at steps 0, 50, 100 and FINAL_STEP and logging
    metrics at 0, 100, 150 and FINAL_STEP. At 100 and FINAL_STEP each job's middle answers move by a count of its
    own (all distinct); peak_to_trough_log10 is 0.01 x the middle count (vanilla) or minus that (chunked),
    middle_mass and the vanilla rollout's w1 are drawn independently of it, its spearman is constant, the chunked
    rollout is not logged."""
    questions, rng = _questions(TRACKING_QUESTIONS), np.random.default_rng(3)
    moves = rng.choice(np.arange(-40, 60), size=(jobs, 2), replace=False)  # (jobs, steps 100 and FINAL_STEP)
    arms = ["none", *(f"arm{k}" for k in range(1, jobs // seeds))]
    for n in range(jobs):
        arm, seed = arms[n % len(arms)], n // len(arms)
        counts = {0: MIDDLE_START, 50: MIDDLE_START, 100: MIDDLE_START + int(moves[n, 0]),
                  FINAL_STEP: MIDDLE_START + int(moves[n, 1])}
        rows = [{"step": step, "valley/vanilla/peak_to_trough_log10": 0.01 * counts.get(step, 1000),
                 "valley/chunked/peak_to_trough_log10": -0.01 * counts.get(step, 1000),
                 "valley/vanilla/middle_mass": rng.uniform(), "valley/chunked/middle_mass": rng.uniform(),
                 "rollout/vanilla/measured/w1": rng.uniform(), "rollout/vanilla/measured/spearman": 0.5}
                for step in (0, 100, 150, FINAL_STEP)]
        job = root / str(n)
        _write_job(job, ([] if arm == "none" else [f"debias={arm}"]) + [f"seed={seed}"],
                   _middle_result(questions, counts[0]), _middle_result(questions, counts[FINAL_STEP]), rows)
        for step in (50, 100):
            _middle_result(questions, counts[step]).save_json(job / "eval" / f"in2_step{step}.json")
    return root


@pytest.fixture(scope="module")
def tracking_stats(tmp_path_factory) -> dict:
    """6 jobs: 6 arms x 1 seed."""
    return analyse(load_study(_tracking_sweep(tmp_path_factory.mktemp("tracking"), 6)), n_perm=200, n_sim=20)


def test_valley_change_monotone_in_accuracy_change_has_rank_correlation_one(tracking_stats: dict):
    vanilla, chunked = (tracking_stats["tracking"][name] for name in ("vanilla", "chunked"))
    rises, falls = vanilla["valley/<set>/peak_to_trough_log10"], chunked["valley/<set>/peak_to_trough_log10"]
    # 6 arms: the observed order and its reverse reach |ρ| = 1 among the 720 orders
    assert (rises["rho"], rises["p_value"], rises["n_units"]) == pytest.approx((1.0, 2 / 720, 6))
    assert (falls["rho"], falls["p_value"]) == pytest.approx((-1.0, 2 / 720))
    assert rises["exact"] and rises["resolved"] and falls["resolved"] and rises["reason"] is None
    assert rises["p_holm"] == pytest.approx(5 * 2 / 720)  # 5 predictors with a value
    # steps with both an eval and the metric: 0 (the base), 100 (a saved checkpoint) and the end; 50 logged no
    # metric and 150 has no eval
    assert (rises["n_jobs"], rises["n_points"]) == (6, 12)
    assert sorted((p["base_step"], p["step"]) for p in rises["points"]) == [(0, 100)] * 6 + [(0, FINAL_STEP)] * 6
    n_middle = sum(0.25 <= q["depth"] < 0.75 for q in _questions(TRACKING_QUESTIONS))
    for p in rises["points"]:  # x: 0.01 x the middle count's change; y: that change over the middle questions
        assert p["y"] == pytest.approx(p["x"] / 0.01 / n_middle)


def test_independent_change_is_not_resolved_and_constant_or_missing_is_na(tracking_stats: dict):
    vanilla, chunked = (tracking_stats["tracking"][name] for name in ("vanilla", "chunked"))
    for e in (vanilla["valley/<set>/middle_mass"], chunked["valley/<set>/middle_mass"]):
        assert e["p_value"] > 0.05 and not e["resolved"] and e["n_points"] == 12
    constant = vanilla["rollout/<set>/measured/spearman"]
    assert constant["reason"] == "Δ metric equal at every arm" and np.isnan(constant["rho"])
    assert constant["n_points"] == 12 and not constant["resolved"]
    missing = chunked["rollout/<set>/measured/w1"]
    assert missing["reason"] == "0 units, fewer than 3" and missing["points"] == []


def test_fewer_than_three_arms_is_na(tmp_path: Path):
    got = analyse(load_study(_tracking_sweep(tmp_path, 4, seeds=2)), n_perm=100, n_sim=20)["tracking"]["vanilla"]
    e = got["valley/<set>/peak_to_trough_log10"]
    assert e["reason"] == "2 units, fewer than 3" and np.isnan([e["rho"], e["p_value"]]).all()
    assert (e["n_jobs"], e["n_points"]) == (4, 8)


def test_the_arm_is_the_unit_not_the_job_or_step():
    """Points of one arm are averaged into one unit: repeating them (more seeds, more steps) leaves ρ and p."""
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=6), rng.normal(size=6)
    points = [{"arm": f"a{k}", "job": f"a{k}", "x": x[k], "y": y[k]} for k in range(6)]
    repeated = [{**p, "job": f"{p['job']}-{r}"} for p in points for r in range(4)]
    once, many = arm_correlation(points), arm_correlation(repeated)
    assert (many["n_points"], many["n_jobs"], many["n_units"]) == (24, 24, 6)
    assert (many["rho"], many["p_value"]) == (once["rho"], once["p_value"])


def test_tracking_report_and_json(tmp_path: Path):
    out = tmp_path / "out"
    text = write_report(load_study(_tracking_sweep(tmp_path / "sweep", 6)), out, n_perm=200, n_sim=20).read_text()
    assert "## Does the Jacobian track the curve?" in text and "![](valley_accuracy_scatter.png)" in text
    table = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| `")]  # tracking's
    rows = {(cells[0], cells[1]): cells[2:] for cells in table}
    ptt, rho = "`valley/<set>/peak_to_trough_log10`", "`rollout/<set>/measured/spearman`"
    assert rows[ptt, "vanilla"] == ["6", "6", "+1.000", "0.003", "0.014", "tracks: ρ > 0"]
    assert rows[ptt, "chunked"] == ["6", "6", "-1.000", "0.003", "0.014", "tracks: ρ < 0"]
    assert rows[rho, "vanilla"] == ["6", "6", "n/a", "n/a", "n/a", "n/a: Δ metric equal at every arm"]
    assert rows["`valley/<set>/middle_mass`", "vanilla"][5] == "no rank correlation resolved"
    assert len(rows) == 8  # 4 predictors x 2 sets
    assert "`valley/vanilla/peak_to_trough_log10` (ρ > 0), `valley/chunked/peak_to_trough_log10` (ρ < 0)" in text
    assert "The unit is the arm" in text
    assert (out / "valley_accuracy_scatter.png").stat().st_size > 0
    data = json.loads((out / "study.json").read_text())
    assert data["tracking"]["vanilla"]["valley/<set>/middle_mass"]["key"] == "valley/vanilla/middle_mass"
    assert len(data["tracking"]["chunked"]["valley/<set>/peak_to_trough_log10"]["points"]) == 12


def test_report_files(sweep: Path, tmp_path: Path):
    report = write_report(load_study(sweep), tmp_path / "out", n_perm=300, n_sim=50)
    text = report.read_text()
    assert report == tmp_path / "out" / "report.md"
    assert (tmp_path / "out" / "accuracy_by_depth.png").stat().st_size > 0
    assert "![](accuracy_by_depth.png)" in text and str(sweep) in text
    table = [line for line in text.splitlines() if line.startswith("| worst_bin |")]
    assert {line.split(" | ")[1] for line in table} == set(ARM_PROBS) | {"start"}  # + the starting checkpoint
    dro = next(line for line in table if "| group_dro |" in line)
    assert dro.rstrip(" |").endswith("*")
    assert "(5%: " in dro and "(95%: " in next(line for line in text.splitlines() if line.startswith("| gap | none |"))
    assert "- `group_dro`: beats `none` on its worst bin" in text
    assert "2 seeds an arm (shared): questions and seeds" in text and "training randomness not included" not in text
    assert sorted(p.name for p in (tmp_path / "out" / "answers" / "none" / "seed1").iterdir()) == [
        "in2_step0.json", f"in2_step{FINAL_STEP}.json"]
    assert "n/a" in text  # depth_weight has no valley metrics
    data = json.loads((tmp_path / "out" / "study.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert data["n_questions"] == N_QUESTIONS and list(data["fairness"]) == [*ARM_PROBS, "start"]


def test_cli(sweep: Path, tmp_path: Path, capsys):
    assert main([str(sweep), "--out", str(tmp_path / "cli"), "--n-perm", "200", "--mde-simulations", "50"]) == 0
    printed = capsys.readouterr().out
    assert all(f"| {arm} |" in printed for arm in ARM_PROBS) and "report.md" in printed
    assert main([str(sweep), "--out", str(tmp_path / "bad"), "--reference", "nope", "--n-perm", "50"]) == 1
    assert "nope" in capsys.readouterr().err


def test_different_question_ids_name_the_path(tmp_path: Path):
    questions, rng = _questions(50), np.random.default_rng(0)
    _write_job(tmp_path / "0", ["seed=0"], _result(questions, START_PROBS, rng), _result(questions, START_PROBS, rng),
               None)
    other = _questions(50)
    other[7]["id"] = "elsewhere"
    _write_job(tmp_path / "1", ["debias=group_dro"], _result(other, START_PROBS, rng),
               _result(other, START_PROBS, rng), None)
    with pytest.raises(StudyError, match=r"1/eval/in2_step0\.json.*question ids differ"):
        load_study(tmp_path)


def test_missing_eval_names_the_path(tmp_path: Path):
    questions, rng = _questions(20), np.random.default_rng(0)
    _write_job(tmp_path / "0", [], _result(questions, START_PROBS, rng), _result(questions, START_PROBS, rng), None)
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    (tmp_path / "1" / ".hydra" / "overrides.yaml").write_text("- debias=group_dro\n")
    (tmp_path / "1" / "finished.json").write_text('{"step": 200}\n')
    with pytest.raises(StudyError, match=r"1/eval/in2_step0\.json: missing"):
        load_study(tmp_path)
    _result(questions, START_PROBS, rng).save_json(tmp_path / "1" / "eval" / "in2_step0.json")
    with pytest.raises(StudyError, match=r"1/eval: only in2_step0\.json"):
        load_study(tmp_path)
    with pytest.raises(StudyError, match="no job directories"):
        load_study(tmp_path / "0" / "eval")


def test_an_unfinished_job_is_named_not_averaged_in(sweep: Path, tmp_path: Path, capsys):
    """A job killed after a mid-run evaluation has eval JSONs that look final; without finished.json the study
    stops naming it, or with --skip-incomplete leaves it and its seed out of every arm, named in the report."""
    copied = tmp_path / "sweep"
    shutil.copytree(sweep, copied)  # jobs 0-5: none, depth_weight, group_dro at seeds 0 and 1
    (copied / "3" / "finished.json").unlink()
    (copied / "3" / "checkpoints" / "step-120").mkdir(parents=True)
    with pytest.raises(StudyError) as err:
        load_study(copied)
    assert str(copied / "3") in str(err.value) and "arm depth_weight, seed 1" in str(err.value)
    assert "newest checkpoint is step-120" in str(err.value) and f"resume_sweep={copied}" in str(err.value)
    assert main([str(copied), "--out", str(tmp_path / "refused"), "--n-perm", "50", "--mde-simulations", "20"]) == 1
    assert "did not finish" in capsys.readouterr().err and not (tmp_path / "refused").exists()

    study = load_study(copied, skip_incomplete=True)
    assert [job.path.name for job in study.jobs] == ["0", "2", "4"]
    assert [(job.path.name, job.arm, job.seed) for job in study.left_out] == [
        ("1", "none", 1), ("3", "depth_weight", 1), ("5", "group_dro", 1)]
    assert main([str(copied), "--out", str(tmp_path / "out"), "--n-perm", "50", "--mde-simulations", "20",
                 "--skip-incomplete"]) == 0
    numbers = json.loads((tmp_path / "out" / "study.json").read_text())
    assert all(info["seeds"] == [0] for info in numbers["arms"].values())
    assert [job["job"] for job in numbers["left_out"]] == [str(copied / n) for n in ("1", "3", "5")]
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"`{copied / '3'}` (arm depth_weight, seed 1): no finished.json" in report
    assert f"`{copied / '1'}` (arm none, seed 1): finished, left out with seed 1: {copied / '3'} did not" in report
    (copied / "0" / "finished.json").unlink()
    with pytest.raises(StudyError, match="no seed of which every job finished"):
        load_study(copied, skip_incomplete=True)


def test_per_seed_reanalysis_of_an_old_study_json(stats: dict, tmp_path: Path, capsys):
    """A study.json without answers: differences from the per-seed values, seed part pooled over the arms."""
    path = tmp_path / "study.json"
    path.write_text(json.dumps(stats))
    assert main([str(path), "--per-seed"]) == 0
    printed = capsys.readouterr().out
    arms = list(stats["arms"])  # reference first
    per_seed = np.array([stats["fairness"][a]["mean"]["per_seed"] for a in arms])
    want = per_seed_interval(per_seed, arms.index("group_dro"), 0)
    row = next(line for line in printed.splitlines() if line.startswith("| group_dro |"))
    assert row.split(" | ")[1] == f"{want.value:+.3f} [{want.low:+.3f}, {want.high:+.3f}]" + (" *" * want.resolved)
    assert "t(2) intervals, seed part pooled over 3 arms" in printed
    old = {**stats, "fairness": {a: {m: {k: v for k, v in e.items() if k != "per_seed"} for m, e in f.items()}
                                 for a, f in stats["fairness"].items()}}
    path.write_text(json.dumps(old))
    assert main([str(path), "--per-seed"]) == 0
    assert "n/a (no per-seed values)" in capsys.readouterr().out  # middle − ends: only the seed means were kept
    assert main([str(tmp_path / "missing.json"), "--per-seed"]) == 1
