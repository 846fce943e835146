"""The micro-training experiment (+exp=micro100) at CPU scale: the paper's protocol, smaller model and L."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from train import run

CPU_SCALE = [
    "+exp=micro100", "model=qwen2_tiny", "model.init.hidden_size=32", "model.init.intermediate_size=64",
    "data.context_len=256", "data.windows.doc_len=512", "data.num_train_docs=1600", "data.num_eval_docs=400",
    "data.vocab_size=512", "jacobian.seq_len=256", "jacobian.n_vanilla=2", "jacobian.n_chunked=2",
    "jacobian.chunk_len=64", "logger.mode=disabled",
]


@pytest.mark.slow  # all 100 steps, measured at each; test_every_experiment_runs_two_steps runs micro100 by default
def test_micro100_cpu_scale_writes_paper_shaped_arrays(compose_cfg, tmp_path):
    cfg = compose_cfg(*CPU_SCALE)
    assert cfg.trainer.max_steps == 100 and cfg.trainer.micro_batch_size == 1
    assert cfg.trainer.weight_decay == 0.1 and cfg.trainer.lr == 5e-4
    run(cfg, tmp_path)
    arrays = np.load(tmp_path / "jacobian.npz")
    assert arrays["vanilla"].shape == (2, 101, 256) and arrays["chunked"].shape == (2, 101, 256)
    assert list(arrays["steps"]) == list(range(101))
    assert np.all(np.isfinite(arrays["vanilla"])) and np.all(arrays["vanilla"] > 0)
    for name in ("vanilla", "chunked"):
        Image.open(tmp_path / "plots" / f"jacobian_evolution_{name}.png").verify()


def test_micro100_reads_nq_passages(compose_cfg, tmp_path, nq_file):
    nq = nq_file
    cfg = compose_cfg(*CPU_SCALE, "trainer.max_steps=2", "data.source=nq", f"data.path={nq}",
                      "data.num_train_docs=2000", "data.num_eval_docs=400", "data.vocab_size=2000")
    bundle_metrics = run(cfg, tmp_path)
    assert np.load(tmp_path / "jacobian.npz")["vanilla"].shape == (2, 3, 256)
    assert "train/loss" in bundle_metrics
