"""Shared fixtures: Hydra `compose` of the real config tree, tiny CPU-scale overrides."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from train import compose_config

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"
# The real data files some tests read, where they come from (docs/REFERENCE.md, "Real data"), and the variable that turns
# their absence from a skip into a failure (.ci/run sets it: CI has ../shared/data and must run every test).
LITM, FILM = "github.com/nelson-liu/lost-in-the-middle", "github.com/microsoft/FILM"
SHARED_SOURCES = {
    "nq-open-oracle.jsonl.gz": (LITM, "qa_data/nq-open-oracle.jsonl.gz"),
    "kv-retrieval-75_keys.jsonl.gz": (LITM, "kv_retrieval_data/kv-retrieval-75_keys.jsonl.gz"),
    **{f"valprobing/{name}": (FILM, f"VaLProbing/pieces/{name.removesuffix('.gz')} (gzipped)")
       for name in ("document_sentences.jsonl.gz", "code_functions.jsonl.gz", "database_entities.jsonl.gz")},
}
REQUIRE_SHARED_DATA = "POSDEBIAS_REQUIRE_SHARED_DATA"


def missing_data_message(name: str) -> str:
    repo, source = SHARED_SOURCES[name]
    return f"{SHARED_DATA / name} is absent: get {source} from {repo} and put it in {(SHARED_DATA / name).parent}"


def shared_data_file(name: str) -> Path:
    """The real data file `name` of ../shared/data; the test skips, naming it and where to get it, when it is
    absent (a fresh clone has no ../shared), or fails when REQUIRE_SHARED_DATA is set."""
    path = SHARED_DATA / name
    if not path.is_file():
        if os.environ.get(REQUIRE_SHARED_DATA):
            pytest.fail(f"{missing_data_message(name)} ({REQUIRE_SHARED_DATA} is set)")
        pytest.skip(missing_data_message(name))
    return path


# A model and data small enough for a few optimizer steps in a couple of seconds on 2 cores.
TINY = [
    "model.init.hidden_size=32",
    "model.init.num_hidden_layers=2",
    "model.init.intermediate_size=64",
    "data.context_len=128",
    "data.in2.segment_len=64",
    "data.num_train=64",
    "data.num_eval=8",
    "data.num_train_docs=200",
    "data.num_eval_docs=80",
    "data.in2.heldout_doc_len=256",
    "data.vocab_size=400",
    "trainer.micro_batch_size=4",
    "trainer.warmup_steps=2",
    "eval.num_examples=8",
    "eval.every=0",
    "jacobian=off",
    "logger.mode=disabled",
]


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenizer and wandb caches go to per-session temporary folders, never the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("POSDEBIAS_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("WANDB_MODE", "offline")
    for key in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # wandb's own files, off ~/
        mp.setenv(key, str(tmp_path_factory.mktemp(key.lower())))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _release_deepspeed_shm():
    """Remove the shared-memory allreduce buffers DeepSpeed's CPU backend leaves in /dev/shm.

    Every 2-rank CPU run leaves ~70 MB per rank there, never unlinked: over a few suites they filled
    the RAM of a 24 GiB machine. Only buffers written during this session are removed.
    """
    started = time.time()
    yield
    for buffer in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        try:
            if buffer.stat().st_mtime >= started:
                buffer.unlink()
        except OSError:  # another process removed it, or it is not ours to remove
            pass


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> the composed training config, as `python train.py ...` would see it."""

    def _compose(*overrides: str):
        return compose_config(list(overrides))

    return _compose


@pytest.fixture
def nq_file() -> Path:
    """../shared/data/nq-open-oracle.jsonl.gz (`shared_data_file`)."""
    return shared_data_file("nq-open-oracle.jsonl.gz")
