"""Continuing a killed `python train.py -m` sweep with resume_sweep=<its directory>: the decision per job (skip a
finished one, resume an interrupted one, start the rest), the start-up checks, and a real 3-job sweep killed with
SIGKILL inside its second job."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.study import load_study
from models.training.launch import check_resume_sweep, job_overrides, sweep_dir, sweep_job_action
from models.training.run_dir import RunDir
from tests.conftest import ROOT, TINY


def _checkpoint(run_dir: Path, step: int) -> None:
    """An intact-looking checkpoint folder: trainer_state.json without recorded file sizes passes the check."""
    folder = RunDir(run_dir).checkpoints / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "stream_position": step}))


def test_a_job_is_skipped_resumed_or_started(tmp_path):
    overrides = ["seed=1", "trainer.lr=0.001"]
    job = tmp_path / "1"
    job.mkdir()
    assert sweep_job_action(job, overrides) == "start"
    RunDir(job).job_overrides.write_text(json.dumps(overrides) + "\n")
    _checkpoint(job, 2)
    assert sweep_job_action(job, overrides) == "resume"
    RunDir(job).finished.write_text('{"step": 4}\n')
    assert sweep_job_action(job, overrides) == "skip"
    with pytest.raises(ValueError, match=r"is the job of overrides \['seed=1', 'trainer.lr=0.001'\].*"
                                         r"this job's are \['seed=1', 'trainer.lr=0.003'\]: the command changed"):
        sweep_job_action(job, ["seed=1", "trainer.lr=0.003"])


def test_the_rerun_setting_is_not_part_of_a_jobs_overrides():
    assert job_overrides(["seed=0", "resume_sweep=/x", "+resume_sweep=/y"]) == ["seed=0"]


def test_resume_sweep_checks_name_the_key(tmp_path):
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    assert sweep_dir(None, "outputs/in2/multirun_now") == "outputs/in2/multirun_now"
    assert sweep_dir(str(tmp_path), "outputs/in2/multirun_now") == str(tmp_path)
    with pytest.raises(ValueError, match=r"resume_sweep=.*nowhere: no such directory"):
        sweep_dir(str(tmp_path / "nowhere"), "x")
    (tmp_path / "single").mkdir()
    with pytest.raises(ValueError, match="not the directory of a `-m` sweep"):
        sweep_dir(str(tmp_path / "single"), "x")
    check_resume_sweep(None, "latest", None)
    with pytest.raises(ValueError, match="continues a `-m` sweep: rerun the sweep's command, with -m"):
        check_resume_sweep(str(tmp_path), None, None)
    with pytest.raises(ValueError, match="with trainer.resume_from=latest"):
        check_resume_sweep(str(tmp_path), "latest", str(tmp_path))
    with pytest.raises(ValueError, match="drop the hydra.sweep.dir override"):
        check_resume_sweep(str(tmp_path), None, str(tmp_path / "other"))


MAX_STEPS = 4
SWEEP = [*TINY, "seed=0,1,2", f"trainer.max_steps={MAX_STEPS}", "trainer.save_every=1", "trainer.keep_last_n=2"]


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run directory except Hydra's own (rewritten at every start): its size and mtime."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and ".hydra" not in p.parts}


def _sweep(sweep: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", "-m", *SWEEP, f"hydra.sweep.dir={sweep}", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _metric_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    return [row["step"] for row in rows if "train/loss" in row]


@pytest.mark.slow
def test_a_sweep_killed_inside_its_second_job_continues_where_it_stopped(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _sweep(sweep)
    inside_second = RunDir(sweep / "1").checkpoints / "step-2"  # published whole: the job is past step 2
    deadline = time.monotonic() + 400
    while not inside_second.is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the second job never saved step-2"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    proc.stdout.close()
    assert RunDir(sweep / "0").finished.is_file() and not RunDir(sweep / "1").finished.is_file()
    assert not (sweep / "2").exists()
    first_job = _files(sweep / "0")

    rerun = _sweep(sweep, f"resume_sweep={sweep}")
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out[-3000:]
    assert _files(sweep / "0") == first_job, "the finished job was written again"
    assert f"resume_sweep: job {sweep / '0'} finished" in out and "skipped" in out
    assert f"resume_sweep: job {sweep / '1'} was interrupted: continuing from its newest intact checkpoint" in out
    resumed = RunDir(sweep / "1").log.read_text()
    assert f"resumed from {RunDir(sweep / '1').checkpoints}/step-" in resumed
    assert f"resume_sweep: job {sweep / '2'} has no checkpoint: starting it" in out
    for job in ("0", "1", "2"):
        assert json.loads(RunDir(sweep / job).finished.read_text()) == {"step": MAX_STEPS}
        assert _metric_steps(sweep / job) == list(range(1, MAX_STEPS + 1)), job  # each step once, in order

    # The resumed job ends where an uninterrupted run of its overrides ends.
    single = subprocess.run([sys.executable, "train.py", *[o for o in SWEEP if o != "seed=0,1,2"], "seed=1",
                             f"hydra.run.dir={tmp_path / 'single'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    weights = [(d / "checkpoints" / f"step-{MAX_STEPS}" / "model.safetensors").read_bytes()
               for d in (sweep / "1", tmp_path / "single")]
    assert weights[0] == weights[1], "the resumed job's final weights differ from an uninterrupted run's"

    study = load_study(sweep)
    assert [(job.path.name, job.seed, job.final_step) for job in study.jobs] == [
        ("0", 0, MAX_STEPS), ("1", 1, MAX_STEPS), ("2", 2, MAX_STEPS)]
    assert study.left_out == []
