"""Training that survives faults: SIGTERM / SIGUSR1, a kill mid-save, non-finite losses."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.checkpoint import atomic_checkpoint, list_checkpoints, resolve_checkpoint
from models.distributed import TorchEngine
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


def test_rank_that_cannot_reach_the_others_fails_naming_itself(tmp_path):
    """Rank 0 of 2 waits for a rank that never comes: a timeout error naming the rank, not a hang."""
    code = "from models.distributed import init_distributed; init_distributed(5)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode != 0
    assert "rank 0 of 2: could not join the process group within 5 s" in out.stderr
