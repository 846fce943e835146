"""scripts/gpu_check.py --dry-run: the GPU check's whole sequence at tiny sizes on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts.gpu_check import checks
from tests.conftest import ROOT

pytestmark = pytest.mark.distributed  # one rank through the real deepspeed launcher


def test_the_real_sizes_are_the_papers(tmp_path):
    by_name = {c.name: " ".join(c.command) for c in checks(tmp_path, dry_run=False)}
    assert list(by_name) == ["pytest -m gpu", "in2 bf16", "zero3 lora", "micro100", "jacobian k=8"]
    assert "model=qwen2_0.5b_init" in by_name["in2 bf16"] and "trainer=gpu" in by_name["in2 bf16"]
    assert "deepspeed --num_gpus 1" in by_name["zero3 lora"] and "peft=lora" in by_name["zero3 lora"]
    assert "model=" not in by_name["micro100"]  # the experiment's own Qwen2-0.5B architecture, L = 2048
    assert "--device cuda" in by_name["jacobian k=8"] and "--tiny" not in by_name["jacobian k=8"]


def test_dry_run_runs_every_check_and_prints_one_table(tmp_path):
    env = {**os.environ, "POSDEBIAS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--dry-run", "--out", str(tmp_path / "out")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in (tmp_path / "out" / "gpu_check.md").read_text().splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["pytest -m gpu", "in2 bf16", "zero3 lora", "micro100", "jacobian k=8"]
    assert all(r[1].strip() == "0" for r in rows)
    header = (tmp_path / "out" / "gpu_check.md").read_text().splitlines()[0]
    columns = [c.strip() for c in header.split("|")[1:-1]]
    jacobian = dict(zip(columns, (v.strip() for v in rows[-1])))
    assert float(jacobian["hutchinson k8 / train step"]) > 0 and float(jacobian["looped / train step"]) > 0
    for row in rows[1:-1]:  # the training runs: a step time, throughput and the step-0 fit to the prior
        values = dict(zip(columns, (v.strip() for v in row)))
        assert float(values["step s (median)"]) > 0 and float(values["tokens/s (median)"]) > 0
        assert -1 <= float(values["step-0 Spearman"]) <= 1 and float(values["step-0 W1"]) >= 0
