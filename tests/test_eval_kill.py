"""A real `scripts.eval_checkpoint` process killed with SIGKILL at 10 random moments: each rerun of the same command
continues from the answers recorded so far, and the final eval JSON is byte for byte an uninterrupted run's."""
from __future__ import annotations

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


@pytest.mark.slow  # 11 processes of ~8 s each
def test_an_evaluation_killed_at_10_random_moments_ends_with_the_uninterrupted_answers(tmp_path):
    model_dir = _model(tmp_path)
    env = {**os.environ, "POSDEBIAS_CACHE": str(tmp_path / "cache")}
    whole = subprocess.run(_command(model_dir, tmp_path / "whole", "resume=false"), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert not (tmp_path / "cache" / RECORD_SUBDIR).exists()  # resume=false records nothing

    rng = random.Random(0)
    out, kills_mid_answer = tmp_path / "killed", 0
    for moment in range(10):
        proc = subprocess.Popen(_command(model_dir, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        before = _recorded_chunks(tmp_path / "cache")
        if moment < 3:  # anywhere: start-up, loading, answering
            time.sleep(rng.uniform(0.5, 8.0))
        else:  # after at least one more chunk is recorded, a random part of the way into the next
            while proc.poll() is None and _recorded_chunks(tmp_path / "cache") <= before:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is None:
            proc.kill()
            kills_mid_answer += _recorded_chunks(tmp_path / "cache") > before
        proc.wait(timeout=60)
    assert kills_mid_answer >= 3  # most kills landed while the answers were being recorded
    final = subprocess.run(_command(model_dir, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "read back" in final.stderr
    name = Path("eval") / "kv_step0.json"
    assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
