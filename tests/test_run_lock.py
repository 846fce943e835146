"""One writer per run directory (models.training.run_lock), with real processes: a second writer is refused naming
the directory and the holder, a lock left by a SIGKILLed holder is taken over and logged, and `train.py` and
`scripts.eval_checkpoint` refuse a directory in use before writing anything into it."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from models.training import run_lock
from models.training.run_dir import LOCK
from scripts import eval_checkpoint
from tests.conftest import ROOT, TINY

HOLD = ("import sys, time; from models.training import run_lock; run_lock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """holder(folder) -> a real process holding `folder`'s lock (killed at the end of the test)."""
    procs: list[subprocess.Popen] = []

    def hold(folder: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_naming_the_directory_and_the_holder(tmp_path, holder):
    proc = holder(tmp_path / "run")
    with pytest.raises(run_lock.RunDirInUse) as err:
        run_lock.acquire(tmp_path / "run", "give another hydra.run.dir")
    message = str(err.value)
    assert str((tmp_path / "run").resolve()) in message and f"pid {proc.pid}" in message
    assert "wait for it to end, or give another hydra.run.dir" in message


def test_a_lock_left_by_a_killed_process_is_taken_over_and_logged(tmp_path, holder, caplog):
    proc = holder(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((tmp_path / "run" / LOCK).read_text())["pid"] == proc.pid  # it never released it
    with caplog.at_level(logging.WARNING, logger="models.training.run_lock"):
        assert run_lock.acquire(tmp_path / "run")
    try:
        assert f"took over the lock left by pid {proc.pid}" in caplog.text and "killed?" in caplog.text
        assert json.loads((tmp_path / "run" / LOCK).read_text())["pid"] == os.getpid()
    finally:
        run_lock.release(tmp_path / "run")
    assert (tmp_path / "run" / LOCK).read_text() == ""  # released: nobody holds it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="models.training.run_lock"), run_lock.holding(tmp_path / "run"):
        pass
    assert "took over" not in caplog.text  # a released lock is not a stale one


def test_a_holder_takes_its_own_lock_again_without_waiting(tmp_path):
    with run_lock.holding(tmp_path / "run"):
        with run_lock.holding(tmp_path / "run"):  # Hydra's callback, then run(): one lock
            pass
        assert json.loads((tmp_path / "run" / LOCK).read_text())["pid"] == os.getpid()  # still held
    assert (tmp_path / "run" / LOCK).read_text() == ""


@pytest.mark.parametrize("code, says", [
    (errno.EROFS, "it is on a read-only file system: give another hydra.run.dir, or remount it writable"),
    (errno.EACCES, "this user may not write in {run}: make it writable (chmod, chown), or give another hydra.run.dir"),
])
def test_a_run_directory_this_process_cannot_write_is_refused_naming_it(tmp_path, monkeypatch, code, says):
    """As root writes through a chmod, the operating system's error is raised where the lock file is opened."""
    run = (tmp_path / "run").resolve()
    real_open = os.open

    def refused(path, *args, **kwargs):
        if Path(path).parent == run:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(run_lock.RunDirNotWritable) as err:
        run_lock.acquire(run, "give another hydra.run.dir")
    assert isinstance(err.value, run_lock.RunDirInUse)  # refused wherever a directory in use is
    assert str(err.value) == f"cannot write {run}: {says.format(run=run)}"
    assert not run_lock._held


def test_train_refuses_a_run_directory_in_use_before_hydra_writes_there(tmp_path, holder):
    run_dir = tmp_path / "run"
    proc = holder(run_dir)
    second = subprocess.run([sys.executable, "train.py", "+exp=in2", *TINY, "trainer.max_steps=1",
                             f"hydra.run.dir={run_dir}", "trainer.resume_from=latest"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 1
    assert f"{run_dir.resolve()} is in use by pid {proc.pid}" in second.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK]  # no .hydra/, no train.log written


def test_eval_checkpoint_refuses_the_run_directory_of_a_run_still_going(tmp_path, holder, capsys):
    run_dir = tmp_path / "run"
    from train import compose_config, run
    run(compose_config(["+exp=in2", *TINY, "trainer.max_steps=1", "trainer.save_every=1"]), run_dir)
    proc = holder(run_dir)
    args = ["probes=[needle]", "examples=1", "needle.lengths=[64]", "needle.depths=[0.5]", "max_new_tokens=2"]
    assert eval_checkpoint.main([str(run_dir), *args]) == 1
    err = capsys.readouterr().err
    assert f"is in use by pid {proc.pid}" in err and "give out=<another folder>" in err
    assert not list((run_dir / "eval").glob("needle_step*.json"))
    assert eval_checkpoint.main([str(run_dir), *args, f"out={tmp_path / 'elsewhere'}"]) == 0  # a folder of its own
