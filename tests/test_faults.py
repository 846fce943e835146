"""Training that survives faults: SIGTERM / SIGUSR1, a kill mid-save, non-finite losses."""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from analysis.measure.jacobian import read_jacobian
from models.training.checkpoint import atomic_checkpoint, list_checkpoints, resolve_checkpoint
from models.training.engines import TorchEngine
from models.training.state import TrainerState
from tests.conftest import ROOT, TINY
from train import run


def test_kill_mid_save_keeps_last_good_checkpoint(compose_cfg, tmp_path, monkeypatch):
    real_save, calls = TorchEngine.save, []

    def crashing_save(self, folder, tokenizer):
        calls.append(folder)
        real_save(self, folder, tokenizer)
        if len(calls) == 2:  # the second checkpoint dies after writing its weights, before it is published
            raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(TorchEngine, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        run(compose_cfg(*TINY, "trainer.max_steps=4", "trainer.save_every=2"), tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]
    assert resolve_checkpoint("latest", tmp_path).name == "step-2"
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step-2")


def test_atomic_checkpoint_publishes_every_ranks_files_and_replaces_a_resaved_step(tmp_path):
    """Two ranks (threads sharing a barrier) write one folder; the main one publishes it whole."""
    sync = threading.Barrier(2)

    def rank(r: int):
        def write(folder):
            sync.wait()  # both ranks are inside the same temporary folder before either publishes
            (folder / f"shard-{r}.txt").write_text(f"rank {r}")

        return atomic_checkpoint(tmp_path, 4, write, keep_last_n=1, is_main=r == 0, barrier=sync.wait)

    with ThreadPoolExecutor(2) as pool:
        finals = list(pool.map(rank, [0, 1]))
    step4 = tmp_path / "checkpoints" / "step-4"
    assert finals == [step4, step4]
    assert sorted(p.name for p in step4.iterdir()) == ["shard-0.txt", "shard-1.txt"]
    atomic_checkpoint(tmp_path, 4, lambda folder: (folder / "again.txt").write_text("x"))  # replaced, not merged
    assert [p.name for p in step4.iterdir()] == ["again.txt"]
    atomic_checkpoint(tmp_path, 6, lambda folder: (folder / "six.txt").write_text("6"), keep_last_n=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-6"]  # no temporary or old folder left


def test_trainer_state_keeps_the_json_of_older_checkpoints(tmp_path):
    """trainer_state.json as train.py wrote it before TrainerState kept its parts by name (the same keys and values),
    read back whole, and one from before metrics_bytes and the file sizes were recorded, which still resumes."""
    before = {"step": 3, "stream_position": 7, "metrics_bytes": 120, "debias": {"alpha": 0.5}, "wandb_run_id": "ab"}
    state = TrainerState(3, 7, 120, "ab", {"debias": {"alpha": 0.5}})
    assert state.state_dict() == before and TrainerState.from_state_dict(before) == state
    state.save(tmp_path, rank=0)
    assert TrainerState.read(tmp_path) == state and (tmp_path / "rng-rank0.pt").is_file()
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "stream_position": 5}))
    assert TrainerState.load(tmp_path, rank=0) == TrainerState(2, 5)
    with pytest.raises(FileNotFoundError, match="fewer ranks"):
        TrainerState.load(tmp_path, rank=1)


def test_nonfinite_loss_is_skipped_and_counted(compose_cfg, tmp_path, monkeypatch):
    real, seen = TorchEngine.forward_backward, []

    def poisoned(self, batch):
        seen.append(1)
        if len(seen) == 2:  # the second micro-batch returns NaN and must not update the weights
            return torch.tensor(float("nan"))
        return real(self, batch)

    monkeypatch.setattr(TorchEngine, "forward_backward", poisoned)
    run(compose_cfg(*TINY, "trainer.max_steps=3"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bad = {r["step"]: r["train/bad_steps"] for r in rows if "train/bad_steps" in r}
    assert bad == {1: 0, 2: 1, 3: 1}


def test_too_many_nonfinite_losses_stop_the_run(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(TorchEngine, "forward_backward", lambda self, batch: torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match="max_bad_steps=1"):
        run(compose_cfg(*TINY, "trainer.max_steps=5", "trainer.max_bad_steps=1"), tmp_path)


@pytest.mark.slow  # a `python train.py` process of its own (~15 s): the default suite keeps the in-process faults
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])  # USR1: SLURM
def test_a_stop_signal_saves_and_exits_cleanly(tmp_path, signum):
    env = {**os.environ, "POSDEBIAS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "train.py", *TINY, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "stop requested" in out
    ckpt = resolve_checkpoint("latest", tmp_path / "run")
    AutoModelForCausalLM.from_pretrained(ckpt)


def test_a_stop_requested_on_another_rank_stops_every_rank_after_the_same_step(compose_cfg, tmp_path, monkeypatch):
    """A signal reaches the ranks at slightly different steps, and saving is collective. A process group
    stand-in in which another rank was asked to stop during step 2: this rank saves step 2 and exits."""
    dist, asked = torch.distributed, []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if op == dist.ReduceOp.MAX:  # "was any rank asked to stop?", once per step
            asked.append(len(asked) + 1 == 2)
            tensor.fill_(float(asked[-1]))

    for name, fake in {"is_initialized": lambda: True, "get_world_size": lambda *a, **k: 1,
                       "get_rank": lambda *a, **k: 0, "barrier": lambda *a, **k: None, "all_reduce": all_reduce}.items():
        monkeypatch.setattr(dist, name, fake)
    run(compose_cfg(*TINY, "trainer.max_steps=6"), tmp_path)
    assert asked == [False, True]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]


@pytest.mark.distributed  # a minute: the process group's own connect timeout outlasts the 5 s one
def test_rank_that_cannot_reach_the_others_fails_naming_itself(tmp_path):
    """Rank 0 of 2 waits for a rank that never comes: a timeout error naming the rank, not a hang."""
    code = "from models.training.distributed import init_distributed; init_distributed(5)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode != 0
    assert "rank 0 of 2: could not join the process group within 5 s" in out.stderr


def train_cli(run_dir, *overrides, limit_file_bytes=None, timeout=300) -> subprocess.CompletedProcess:
    """`python train.py` into `run_dir` in a process of its own; `limit_file_bytes`: no file it writes may grow
    past this size (RLIMIT_FSIZE, with SIGXFSZ ignored so that the write fails as on a full disk)."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return subprocess.run([sys.executable, "train.py", *TINY, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit if limit_file_bytes else None)


@pytest.mark.slow  # a `python train.py` process of its own (~15 s): the default suite keeps the in-process faults
def test_a_full_disk_keeps_the_last_good_checkpoint_and_says_what_it_needed(tmp_path):
    first = train_cli(tmp_path, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    good = tmp_path / "checkpoints" / "step-2"
    files = {p.name: p.read_bytes() for p in good.iterdir()}
    weights = (good / "model.safetensors").stat().st_size
    full = train_cli(tmp_path, "trainer.max_steps=4", "trainer.resume_from=latest", limit_file_bytes=weights - 1)
    assert full.returncode != 0
    failed = next(line for line in (full.stdout + full.stderr).splitlines() if "run failed:" in line)
    assert f"saving {tmp_path / 'checkpoints' / 'step-4'} failed for lack of space" in failed, failed
    assert "it needs about" in failed and "(the size of step-2)" in failed and f"{good} is intact" in failed
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")], "partial folder left"
    assert {p.name: p.read_bytes() for p in good.iterdir()} == files
    assert resolve_checkpoint("latest", tmp_path) == good


@pytest.fixture(scope="module")
def four_step_run(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4, which each test copies before damaging."""
    run_dir = tmp_path_factory.mktemp("four_steps") / "run"
    first = train_cli(run_dir, "trainer.max_steps=4", "trainer.save_every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    return run_dir


@pytest.mark.slow  # a `python train.py` process of its own (~15 s): the default suite keeps the in-process faults
@pytest.mark.parametrize("damaged", ["optimizer.pt", "model.safetensors"])
def test_a_damaged_checkpoint_fails_by_name_and_latest_skips_it(tmp_path, four_step_run, damaged):
    run_dir = tmp_path / "run"
    shutil.copytree(four_step_run, run_dir)
    newest = run_dir / "checkpoints" / "step-4"
    cut = newest / damaged
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # a crash or a full disk mid-write
    leftover = run_dir / "checkpoints" / ".tmp-step-6"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")

    named = train_cli(run_dir / "other", "trainer.max_steps=6", f"trainer.resume_from={newest}")
    assert named.returncode != 0 and not (run_dir / "other" / "metrics.jsonl").exists()  # before training
    assert f"{cut} has {cut.stat().st_size} bytes" in named.stdout + named.stderr, named.stderr[-2000:]

    latest = train_cli(run_dir, "trainer.max_steps=6", "trainer.resume_from=latest")
    assert latest.returncode == 0, latest.stderr[-2000:]
    log = (run_dir / "train.log").read_text()
    assert f"skipping damaged checkpoint {newest}: {cut} has" in log
    assert f"resumed from {run_dir / 'checkpoints' / 'step-2'} at step 2" in log
    assert f"removing {leftover}, left by a crash" in log and not leftover.exists()


TIMING_KEYS = ("train/wall_s", "train/tokens_per_s", "train/peak_mem_mib", "jacobian/wall_s", "watch/wall_s")
KILL_RUN = ["trainer.max_steps=8", "trainer.save_every=1", "trainer.keep_last_n=2", "eval.every=2",
            "jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2",
            "jacobian.n_vanilla=1", "jacobian.n_chunked=1"]


def metric_rows(run_dir) -> list[dict]:
    """metrics.jsonl's rows without timings; every line must parse (a torn line fails here)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def watched_state(run_dir, moment: str):
    """What changes when the run reaches a moment of that kind again: a checkpoint save starting (a folder
    appears under checkpoints/, whatever its name), a Jacobian journal record, an evaluation file, a logged row."""
    if moment == "save":
        folder = run_dir / "checkpoints"
        return tuple(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else ()
    paths = {"journal": [run_dir / "jacobian.journal"], "eval": sorted((run_dir / "eval").glob("*.json")),
             "rows": [run_dir / "metrics.jsonl"]}[moment]
    return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in paths if p.is_file())


def killed_and_resumed(run_dir, kills: int, seed: int) -> list[str]:
    """Start the run and SIGKILL it `kills` times, each at a moment drawn (seeded) from: inside a checkpoint
    save, the n-th Jacobian journal record, evaluation file or logged row of that process, or a random time;
    each time resuming from the latest checkpoint (from scratch while there is none); then let it finish.
    Returns where each kill landed ("... (finished first)" when the process ended before it)."""
    rng, landed = random.Random(seed), []
    for attempt in range(kills + 1):
        resume = ["trainer.resume_from=latest"] if list_checkpoints(run_dir) else []
        proc = subprocess.Popen([sys.executable, "train.py", *TINY, *KILL_RUN, *resume, f"hydra.run.dir={run_dir}"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if attempt == kills:
            assert proc.wait(timeout=600) == 0
            break
        moment = rng.choice(["save", "journal", "eval", "rows", "time"])
        nth = 1 if moment == "save" else rng.randint(1, 3)  # a save is seen as its folder appears
        deadline = time.monotonic() + (rng.uniform(0.0, 15.0) if moment == "time" else 300.0)
        state, changes = None if moment == "time" else watched_state(run_dir, moment), 0
        while proc.poll() is None and time.monotonic() < deadline and changes < nth:
            time.sleep(0.001)
            if moment != "time" and (now := watched_state(run_dir, moment)) != state:
                state, changes = now, changes + 1
        proc.send_signal(signal.SIGKILL)
        landed.append(moment if proc.wait() == -signal.SIGKILL else f"{moment} (finished first)")
    return landed


def check_survives_sigkill(tmp_path, kills: int, seed: int) -> None:
    reference = train_cli(tmp_path / "reference", *KILL_RUN)
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed = tmp_path / "killed"
    landed = killed_and_resumed(killed, kills, seed)
    print("kills landed:", landed)
    assert sum("finished" not in where for where in landed) >= kills // 2, landed
    weights = [(d / "checkpoints" / "step-8" / "model.safetensors").read_bytes() for d in (tmp_path / "reference", killed)]
    assert weights[0] == weights[1], "final weights differ from the uninterrupted run's"
    assert metric_rows(killed) == metric_rows(tmp_path / "reference")  # each step once, in order, same values
    for journal in ("jacobian.npz", "rollout.npz"):
        steps, arrays = read_jacobian(killed / journal)
        ref_steps, ref_arrays = read_jacobian(tmp_path / "reference" / journal)
        assert steps.tolist() == ref_steps.tolist() == list(range(9))
        for name in ref_arrays:
            np.testing.assert_array_equal(arrays[name], ref_arrays[name])


@pytest.mark.slow
def test_sigkill_twenty_times_loses_nothing(tmp_path):
    check_survives_sigkill(tmp_path, kills=20, seed=1)
