"""The Jacobian's sequence sets: a set of 0 sequences is absent everywhere; chunked excerpts from held-out
documents or from training text (jacobian.chunked_source)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.during_training import jacobian_sequences
from analysis.measure.jacobian import ChunkedSource, JacobianConfig, build_eval_sequences
from data_builders.build import build_datasets
from data_builders.config import DataConfig, DataFormat, WindowsConfig
from models.training.distributed import DistInfo
from tests.conftest import TINY
from train import as_train_config, run, validate

PROFILE = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"]


def test_a_set_of_no_sequences_is_left_out():
    docs = [np.arange(40) + 1000 * i for i in range(6)]
    assert list(build_eval_sequences(docs, 20, n_vanilla=2, n_chunked=0, chunk_len=10)) == ["vanilla"]
    assert list(build_eval_sequences(docs, 20, n_vanilla=0, n_chunked=2, chunk_len=10)) == ["chunked"]
    assert build_eval_sequences(docs, 20, n_vanilla=0, n_chunked=0, chunk_len=10) == {}


@pytest.mark.parametrize("absent, present", [("chunked", "vanilla"), ("vanilla", "chunked")])
def test_a_set_of_zero_sequences_is_absent_from_every_output(compose_cfg, tmp_path, absent, present):
    """npz, metrics, plots and wandb charts and images hold the measured set only (the run used to crash)."""
    run(compose_cfg(*TINY, *PROFILE, f"jacobian.n_{absent}=0", "jacobian.plot_every=1", "trainer.max_steps=2",
                    "logger.mode=offline"), tmp_path)
    with np.load(tmp_path / "jacobian.npz") as z:
        assert set(z.files) == {"steps", present, f"stderr/{present}"} and z[present].shape == (2, 3, 64)
    keys = {k for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert any(f"/{present}/" in k for k in keys) and not any(absent in k for k in keys)
    plots = {p.name for p in (tmp_path / "plots").glob("jacobian_*.png")}
    assert plots == {f"jacobian_{kind}_{present}.png" for kind in ("evolution", "step0_vs_prior", "heatmap")}
    media = list((tmp_path / "wandb").glob("offline-run-*/files/media/*/jacobian/*"))
    assert {p.name for p in media} == {present}


@pytest.mark.parametrize("every, fails", [(1, True), (0, False)])
def test_both_sets_empty_fails_at_start_up_naming_the_keys_unless_the_profile_is_off(compose_cfg, every, fails):
    cfg = as_train_config(compose_cfg(*TINY, *PROFILE, f"jacobian.every={every}", "jacobian.n_vanilla=0",
                                      "jacobian.n_chunked=0"))
    if not fails:
        validate(cfg, DistInfo())
        return
    with pytest.raises(ValueError, match=r"jacobian.n_vanilla=0 and jacobian.n_chunked=0 .*jacobian.every=0"):
        validate(cfg, DistInfo())
    cfg.jacobian.n_vanilla = -1
    with pytest.raises(ValueError, match=r"jacobian.n_vanilla=-1 must be >= 0"):
        validate(cfg, DistInfo())


def _joined(rows) -> str:
    """Token rows as one string in which a contiguous run of tokens is a substring (commas delimit ids)."""
    return "|".join("," + ",".join(map(str, row)) + "," for row in rows)


def _excerpts(seqs, chunk_len: int) -> list[str]:
    return ["," + ",".join(map(str, row[s:s + chunk_len])) + ","
            for row in seqs["chunked"].tolist() for s in range(0, len(row), chunk_len)]


@pytest.mark.parametrize("fmt", ["in2", "lm_windows"])
def test_chunked_source_train_takes_training_text_and_heldout_does_not(compose_cfg, fmt):
    if fmt == "in2":
        data = as_train_config(compose_cfg(*TINY)).data
    else:
        data = DataConfig(format=DataFormat.lm_windows, context_len=64, num_train=6, num_eval=3, num_train_docs=200,
                          num_eval_docs=40, vocab_size=300, windows=WindowsConfig(doc_len=128, train_docs=[0, 5],
                                                                                  eval_docs=[5, 7]))
    bundle = build_datasets(data)
    rows = bundle.train.to_dict()
    if fmt == "in2":  # the context only: no chat template here, so it opens the sample
        contexts = [ids[:n] for ids, n in zip(rows["input_ids"], rows["context_tokens"])]
    else:
        contexts = rows["input_ids"]
    train_text, whole_rows, heldout = _joined(contexts), _joined(rows["input_ids"]), _joined(bundle.heldout_docs)
    for source in ChunkedSource:
        jac = JacobianConfig(seq_len=64, chunk_len=32, n_vanilla=1, n_chunked=2, chunked_source=source)
        seqs = jacobian_sequences(bundle, jac)
        assert seqs["chunked"].shape == (2, 64) and seqs["vanilla"].shape == (1, 64)
        assert _joined(seqs["vanilla"].tolist()) in heldout  # vanilla stays held out either way
        for excerpt in _excerpts(seqs, 32):
            if source == ChunkedSource.train:
                assert excerpt in train_text and excerpt not in heldout
            else:
                assert excerpt in heldout and excerpt not in whole_rows
