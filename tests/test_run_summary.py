"""The end of a run: summary.md, train.log and the console say what the run's own files hold."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from analysis.evaluation.fairness import fairness
from analysis.evaluation.result import LOGLIK, ProbeResult
from analysis.report.metrics_log import read_metrics
from analysis.report.run_summary import file_lines, progress_lines, run_summary, training_wall_time
from tests.conftest import ROOT, TINY

JACOBIAN = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2",
            "jacobian.n_vanilla=1", "jacobian.n_chunked=1"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`python train.py` as a person runs it: 3 steps, the Jacobian each step, a checkpoint at step 2, offline wandb."""
    run_dir = tmp_path_factory.mktemp("run")
    overrides = [o for o in TINY if not o.startswith(("jacobian=", "logger.mode=", "eval.every="))]
    done = subprocess.run([sys.executable, "train.py", *overrides, *JACOBIAN, "trainer.max_steps=3", "eval.every=2",
                           "trainer.save_every=2", "logger.mode=offline", f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout + done.stderr


def test_the_summary_is_printed_logged_and_written(cli_run):
    run_dir, console = cli_run
    summary = (run_dir / "summary.md").read_text()
    log = (run_dir / "train.log").read_text()
    assert summary.splitlines()[0] in console and summary.splitlines()[0] in log
    assert f"run directory: {run_dir}" in summary


def test_the_summary_numbers_are_the_run_files_numbers(cli_run):
    run_dir, _ = cli_run
    summary = (run_dir / "summary.md").read_text()
    rows = read_metrics(run_dir)
    trained = [r for r in rows if "train/loss" in r]
    assert f"steps 0 → 3 (3 updates), final train/loss {trained[-1]['train/loss']:.3f}" in summary
    assert f"peak memory {max(r['train/peak_mem_mib'] for r in trained):.0f} MiB" in summary
    jacobian = [r["jacobian/wall_s"] for r in rows if "jacobian/wall_s" in r]
    assert len(jacobian) == 4 and min(jacobian) > 0  # steps 0-3
    assert f"Jacobian and rollouts: {np.mean(jacobian):.3g} s a measured step, 4 measured" in summary
    for step in (0, 3):  # the start and end curves, with their fairness numbers
        result = ProbeResult.load_json(run_dir / "eval" / f"in2_step{step}.json")
        scores = np.array([o["correct"] for o in result.outcomes])
        bins = np.array([o["position"] for o in result.outcomes])
        depths = np.array([o["extra"]["depth"] for o in result.outcomes])
        assert f"step {step}" in summary
        worst = fairness(scores, bins, depths)["worst_bin"]
        assert f"{worst:.3f}" in summary.split("**worst bin**")[1].splitlines()[0]
        # the same curve by the gold answer's log-likelihood, whatever the answers' format
        loglik = np.array([o["loglik"] for o in result.outcomes])
        middle = fairness(loglik, bins, depths, LOGLIK)["middle_minus_ends"]
        table = summary.split("## Log-likelihood of the gold answer by gold depth")[1]
        assert f"{middle:.3f}" in table.split("**middle − ends**")[1].splitlines()[0]
        words = np.median([o["extra"]["answer"]["first_line_words"] for o in result.outcomes])
        assert f"step {step}: {words:g}" in summary.split("median length in words: ")[1].splitlines()[0]
    valley = [r for r in rows if "valley/vanilla/anchor_to_trough_log10" in r]
    line = next(x for x in summary.splitlines() if "`valley/vanilla/anchor_to_trough_log10`" in x)
    assert [valley[0]["step"], valley[-1]["step"]] == [0, 3]
    key = "valley/vanilla/anchor_to_trough_log10"
    assert line.split("|")[2:4] == [f" {valley[0][key]:.3f} ", f" {valley[-1][key]:.3f} "]
    assert "step-2, step-3" in summary  # keep_last_n=2
    assert "in2_accuracy_by_depth.png" in summary
    offline = next((run_dir / "wandb").glob("offline-run-*"))
    assert f"`wandb sync {offline}`" in summary
    assert f"`python -m analysis.compare {run_dir}`" in summary
    assert summary == run_summary(run_dir, "default")  # nothing in it but what the files say


def test_a_resumed_runs_wall_time_adds_up_its_processes():
    # steps 1-3 in one process (60 s by step 3), steps 4-5 after a resume (its clock starts again: 25 s by step 5)
    rows = [{"step": s, "train/loss": 1.0, "train/wall_s": w, "train/tokens": 100}
            for s, w in [(1, 20.0), (2, 40.0), (3, 60.0), (4, 12.0), (5, 25.0)]]
    assert training_wall_time(rows) == (85.0, 2)
    assert "- training wall time 85 s over 2 processes (evaluation and Jacobian included), 6 tokens/s" \
        in progress_lines(rows)
    assert training_wall_time(rows[:3]) == (60.0, 1) and "over" not in progress_lines(rows[:3])[1]


def test_train_log_holds_start_up_evaluations_and_saves(cli_run):
    run_dir, _ = cli_run
    log = (run_dir / "train.log").read_text()
    state = json.loads((run_dir / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["step"] == 3
    checkpoints = run_dir / "checkpoints"
    for expected in ("model qwen2_tiny (random init, 2 layers", f"writing to {run_dir}", "global batch = 4",
                     "step 0: in2 exact match", "step 2: held-out answer loss", "step 3: in2 exact match",
                     f"saved checkpoint {checkpoints / 'step-2'}",
                     f"saved checkpoint {checkpoints / 'step-3'}", "run finished"):
        assert expected in log, expected


def test_a_failed_run_says_what_failed_and_where_its_log_is(tmp_path):
    done = subprocess.run([sys.executable, "train.py", *TINY, "trainer.max_steps=1", "data.in2.segment_len=500",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0
    line = next(x for x in done.stderr.splitlines() + done.stdout.splitlines() if "run failed:" in x)
    assert "data.in2.segment_len=500" in line and f"(log: {tmp_path / 'train.log'})" in line
    assert "run failed:" in (tmp_path / "train.log").read_text()


def test_where_things_are_lists_only_the_files_the_run_wrote(tmp_path):
    """Issue 66: a jacobian=off run's summary pointed at a jacobian.npz that does not exist."""
    (tmp_path / "metrics.jsonl").write_text("")
    text = "\n".join(file_lines(tmp_path, None))
    assert f"- every logged number: {tmp_path / 'metrics.jsonl'}\n" in text
    assert "jacobian.npz" not in text and "rollout.npz" not in text
    for name in ("jacobian.npz", "rollout.npz"):
        (tmp_path / name).write_bytes(b"")
    assert (f"- every logged number: {tmp_path / 'metrics.jsonl'}; Jacobian profiles: {tmp_path / 'jacobian.npz'}; "
            f"attention rollouts: {tmp_path / 'rollout.npz'}") in "\n".join(file_lines(tmp_path, None))
