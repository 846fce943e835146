"""The real `deepspeed` launcher with 2 CPU ranks (gloo): ZeRO-2/3, LoRA, resume, Jacobian under ZeRO-3.

Each multi-rank run is compared with a single-process run of the same global batch: one process
with `grad_accum=2` sees exactly the micro-batches that 2 ranks see with `grad_accum=1`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.distributed

STEPS = ["trainer.precision=fp32", "trainer.device=cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "POSDEBIAS_CACHE": str(tmp_path.parent / "cache"),
            "OMP_NUM_THREADS": "1"}


def _deepspeed(tmp_path, name: str, *overrides: str, steps: int = 4):
    run_dir = tmp_path / name
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "train.py", *TINY, *STEPS,
           f"trainer.max_steps={steps}", *overrides, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run_dir


def _single(tmp_path, name: str, *overrides: str, steps: int = 4):
    run_dir = tmp_path / name
    cmd = [sys.executable, "train.py", *TINY, *STEPS, f"trainer.max_steps={steps}", "trainer.grad_accum=2", *overrides,
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run_dir


def _logged(run_dir, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def _losses(run_dir) -> dict[int, float]:
    return _logged(run_dir, "train/loss")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs with the global batch of 2 ranks, with and without LoRA."""
    tmp = tmp_path_factory.mktemp("single")
    return {peft: _losses(_single(tmp, peft, f"peft={peft}")) for peft in ("none", "lora")}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_zero_matches_single_process(tmp_path, reference, stage, peft):
    run_dir = _deepspeed(tmp_path, f"{stage}-{peft}", f"trainer={stage}", f"peft={peft}")
    got, want = _losses(run_dir), reference[peft]
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)
    ckpt = run_dir / "checkpoints" / "step-4"
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "trainer_state.json").is_file()
    if peft == "lora" and stage == "zero3":
        _check_zero3_adapter(run_dir, ckpt)


def _check_zero3_adapter(run_dir, ckpt):
    """The adapter saved under ZeRO-3 is complete and reproduces the trained model's logits."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = load_file(ckpt / "adapter_model.safetensors")
    lora_keys = [k for k in adapter if "lora_" in k]
    assert lora_keys and all(t.numel() > 0 for t in adapter.values())
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base_model")
    n_targets = sum(1 for name, _ in base.named_modules() if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert len(lora_keys) == 2 * n_targets  # lora_A and lora_B of every target module
    reloaded = PeftModel.from_pretrained(base, ckpt).eval()
    trained_state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state")
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base_model"), ckpt)
    trained.load_state_dict(trained_state, strict=False)
    ids = torch.arange(5, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_zero3_partitions_pretrained_weights_while_they_load(tmp_path):
    """`from_pretrained` under ZeRO-3 never holds the whole model on a rank, and loads the same model."""
    base = _single(tmp_path, "base", steps=1) / "checkpoints" / "step-1"
    pretrained = ["model=hf", f"model.pretrained={base}", *(o for o in TINY if not o.startswith("model.init."))]
    run_dir = tmp_path / "zero3"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "train.py", *pretrained, *STEPS,
           "trainer=zero3", "trainer.max_steps=1", f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert re.search(r"ZeRO-3: (\d+) of \1 parameter tensors partitioned at load", (run_dir / "train.log").read_text())
    single = tmp_path / "single"
    subprocess.run([sys.executable, "train.py", *pretrained, *STEPS, "trainer.max_steps=1", "trainer.grad_accum=2",
                    f"hydra.run.dir={single}"], cwd=ROOT, env=_env(tmp_path), capture_output=True, check=True)
    assert _losses(run_dir)[1] == pytest.approx(_losses(single)[1], rel=1e-4)


def test_zero2_resume_matches_uninterrupted(tmp_path):
    full = _deepspeed(tmp_path, "full", "trainer=zero2")
    part = _deepspeed(tmp_path, "part", "trainer=zero2", "trainer.save_every=2")
    shutil.rmtree(part / "checkpoints" / "step-4")
    _deepspeed(tmp_path, "part", "trainer=zero2", "trainer.resume_from=latest")
    got, want = _losses(part), _losses(full)
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-6)


def test_group_dro_weights_read_every_rank(tmp_path):
    """q follows the bin losses of all ranks: 2 ranks of 4 rows give the q of one process reading the 8 rows."""
    dro = ["debias=group_dro", "debias.eta=0.5"]
    ds = _deepspeed(tmp_path, "ds", "trainer=zero2", *dro, steps=1)
    single = tmp_path / "single"
    subprocess.run([sys.executable, "train.py", *TINY, *STEPS, *dro, "trainer.max_steps=1",
                    "trainer.micro_batch_size=8", f"hydra.run.dir={single}"], cwd=ROOT, env=_env(tmp_path),
                   capture_output=True, check=True)
    keys = [f"debias/q@{k / 10}" for k in range(10)]
    got, want = [_logged(ds, k)[1] for k in keys], [_logged(single, k)[1] for k in keys]
    assert max(got) > 1.01 * min(got)  # q moved
    assert got == pytest.approx(want, rel=1e-6)


def test_jacobian_under_zero3_equals_single_process(tmp_path):
    jac = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=4"]
    ds_dir, sp_dir = _deepspeed(tmp_path, "ds", "trainer=zero3", *jac, steps=1), _single(tmp_path, "sp", *jac, steps=1)
    ds, sp = np.load(ds_dir / "jacobian.npz"), np.load(sp_dir / "jacobian.npz")
    for name in ("vanilla", "chunked"):
        np.testing.assert_allclose(ds[name][:, 0], sp[name][:, 0], rtol=1e-5)
    # The rollouts too: ZeRO-3 partitions o_proj and q/k outside their forward; the capture reads them inside.
    ds, sp = np.load(ds_dir / "rollout.npz"), np.load(sp_dir / "rollout.npz")
    assert sorted(ds.files) == sorted(sp.files) and "vanilla.measured_heads" in ds.files
    for name in ds.files:
        np.testing.assert_allclose(ds[name], sp[name], rtol=1e-4, atol=1e-7)


def test_torchrun_launch_matches_single_process(tmp_path, reference):
    run_dir = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "train.py", *TINY, *STEPS, "trainer.max_steps=2", "trainer=zero2",
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got = _losses(run_dir)
    # Steps 1-2 are warm-up, where the schedule does not depend on max_steps.
    for step in (1, 2):
        assert got[step] == pytest.approx(reference["none"][step], rel=1e-4)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_sequence_parallel_matches_one_process_on_whole_sequences(tmp_path, stage):
    """Two ranks sharing every sequence (DeepSpeed Ulysses over gloo) train like one process reading the
    whole sequences: same losses; the Jacobian (eval mode: whole sequences on every rank) too."""
    jac = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"]
    sp = _deepspeed(tmp_path, f"sp-{stage}", f"trainer={stage}", "trainer.sequence_parallel=2", *jac)
    assert "each sequence split over 2 ranks" in (sp / "train.log").read_text()
    one = tmp_path / "one"
    cmd = [sys.executable, "train.py", *TINY, *STEPS, "trainer.max_steps=4", *jac, f"hydra.run.dir={one}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got, want = _losses(sp), _losses(one)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    # AdamW and clipping hide a uniformly scaled gradient from the losses; its norm does not
    got, want = _logged(sp, "train/grad_norm"), _logged(one, "train/grad_norm")
    assert got == pytest.approx(want, rel=1e-4)
    ds, single = np.load(sp / "jacobian.npz"), np.load(one / "jacobian.npz")
    for name in ("vanilla", "chunked"):
        np.testing.assert_allclose(ds[name], single[name], rtol=1e-4)
