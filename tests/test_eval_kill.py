"""A real `scripts.eval_checkpoint` process killed with SIGKILL at 10 random moments: each rerun of the same command
continues from the answers recorded so far, and the final eval JSON is byte for byte an uninterrupted run's."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from analysis.evaluation.answer_record import RECORD_SUBDIR
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from tests.conftest import ROOT

# 180 kv items of 10 pairs answered 24 tokens long: 12 chunks of 16 items (a kill mid-answer each time)
ARGS = ["probes=[kv]", "examples=60", "kv.n_pairs=10", "kv.positions=[0,4,9]", "max_new_tokens=24", "device=cpu",
        "batch_size=4"]


def _model(folder: Path) -> Path:
    tokenizer = train_bpe_tokenizer(synthetic_filler(200), 400, folder / "bpe")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer), eos_token_id=None)
    model_dir = folder / "model"
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _command(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scripts.eval_checkpoint", str(model_dir), *ARGS, f"out={out}", *extra]


def _recorded_chunks(cache: Path) -> int:
    files = list((cache / RECORD_SUBDIR).glob("*.jsonl"))
    return sum(f.read_bytes().count(b"\n") - 1 for f in files) if files else 0


def _wait_for_a_new_chunk(proc: subprocess.Popen, cache: Path, known: int, patience: float = math.inf) -> int:
    """Poll until more than `known` chunks are recorded, the process ends or `patience` seconds pass: the count."""
    end = time.monotonic() + patience
    while proc.poll() is None and time.monotonic() < end:
        if (count := _recorded_chunks(cache)) > known:
            return count
        time.sleep(0.005)
    return _recorded_chunks(cache)


@pytest.mark.slow  # 11 processes of ~8 s each
def test_an_evaluation_killed_at_10_random_moments_ends_with_the_uninterrupted_answers(tmp_path):
    model_dir = _model(tmp_path)
    cache = tmp_path / "cache"
    env = {**os.environ, "POSDEBIAS_CACHE": str(cache)}
    whole = subprocess.run(_command(model_dir, tmp_path / "whole", "resume=false"), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert not (cache / RECORD_SUBDIR).exists()  # resume=false records nothing

    # The kills keep pace with the machine (a fixed sleep let a fast one answer everything in the first kills):
    # a first kill never waits past the first chunk it records, a later one lands a random part of the way into
    # the chunk after a recorded one, measured in chunks timed on this machine.
    rng = random.Random(0)
    out, kills_mid_answer, chunk_seconds = tmp_path / "killed", 0, None
    for moment in range(10):
        proc = subprocess.Popen(_command(model_dir, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        before = _recorded_chunks(cache)
        if moment < 3:  # anywhere: start-up, loading, the first chunk's answers
            _wait_for_a_new_chunk(proc, cache, before, patience=rng.uniform(0.5, 4.0))
        else:
            count = _wait_for_a_new_chunk(proc, cache, before)
            if chunk_seconds is None:  # one chunk timed, once
                start = time.monotonic()
                _wait_for_a_new_chunk(proc, cache, count)
                chunk_seconds = time.monotonic() - start
            time.sleep(rng.uniform(0.05, 0.8) * chunk_seconds)
        if proc.poll() is None:
            proc.kill()
            kills_mid_answer += _recorded_chunks(cache) > before
        proc.wait(timeout=60)
    assert kills_mid_answer >= 5  # most kills landed while the answers were being recorded
    final = subprocess.run(_command(model_dir, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "read back" in final.stderr
    name = Path("eval") / "kv_step0.json"
    assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
