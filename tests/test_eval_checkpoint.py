"""scripts/eval_checkpoint on any model: a hub id (read offline from a hub cache), chat templates, load options."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from analysis import compare
from analysis.evaluation import generate as generation
from analysis.evaluation import loglik
from analysis.evaluation.checkpoints import load_model, resolve_target
from analysis.evaluation.config import EvalConfig, NeedleProbeConfig, Probe
from analysis.evaluation.probes import build_probes
from analysis.evaluation.result import ProbeResult, fingerprint
from analysis.evaluation.reuse import function_digest, item_digest
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models.build import DType
from scripts import eval_checkpoint
from tests.conftest import ROOT

HUB_ID = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
CHAT_TEMPLATE = ("{% for m in messages %}" + USER + "{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")
# Six needle prompts of 64 tokens and 4 answer tokens: a CLI run is a few seconds.
ARGS = ["probes=[needle]", "examples=2", "needle.lengths=[64]", "needle.depths=[0.0,0.5,1.0]", "max_new_tokens=4",
        "device=cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A `save_pretrained` folder: a random tiny Qwen2 saved in bfloat16, a BPE tokenizer with a chat template."""
    corpus = synthetic_filler(200) + [f"The secret code of word{i} is {10007 * i % 100000:05d}." for i in range(50)]
    tokenizer = train_bpe_tokenizer(corpus, 300, tmp_path_factory.mktemp("bpe"))
    tokenizer.add_tokens([USER, ASSISTANT], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("models") / "tiny"
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hub_cache(model_dir, tmp_path_factory) -> Path:
    """An HF_HUB_CACHE holding the model of `model_dir` as the hub id org/tiny at revision main."""
    hub = tmp_path_factory.mktemp("hf") / "hub"
    repo = hub / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return hub


@pytest.fixture
def generate_calls(monkeypatch, tmp_path) -> list[dict]:
    """Replace generation with a stub that records what reaches the model: prompts, attention, dtype. The stub's
    answers are recorded in a cache of this test's own, where no real evaluation reads them back."""
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "stub-cache"))
    calls: list[dict] = []

    def fake_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress=True, first_line_only=False,
                      batch_tokens=None, shared_prefix=False, prefill=None):
        calls.append({"prompts": [list(p) for p in prompts], "attn": model.config._attn_implementation,
                      "dtype": model.dtype, "shared_prefix": shared_prefix})
        return [""] * len(prompts)

    monkeypatch.setattr(generation, "greedy_generate", fake_generate)
    monkeypatch.setattr(loglik, "greedy_generate", fake_generate)  # answers that share their prefill (no loglik)
    return calls


def test_hub_id_is_read_offline_from_the_hub_cache(model_dir, hub_cache, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "scripts.eval_checkpoint", HUB_ID, *ARGS], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = work / "eval_org_tiny"  # step 0: a hub model was never trained here
    assert f"wrote {Path('eval_org_tiny') / 'eval'}" in run.stdout and "needle" in run.stdout
    with Image.open(out / "plots" / "needle_accuracy_step0.png") as im:
        assert im.format == "PNG"
    hub_metrics = json.loads((out / "eval" / "metrics_step0.json").read_text())
    assert "eval/needle/acc_mean" in hub_metrics

    # The same model evaluated from its local folder gives the same answers, item by item.
    local_out = tmp_path / "local"
    assert eval_checkpoint.main([str(model_dir), *ARGS, f"out={local_out}"]) == 0
    hub = ProbeResult.load_json(out / "eval" / "needle_step0.json")
    local = ProbeResult.load_json(local_out / "eval" / "needle_step0.json")
    assert len(hub.outcomes) == 6 and hub.outcomes == local.outcomes
    assert (out / "plots" / "needle_grid_step0.png").is_file()
    assert hub_metrics == json.loads((local_out / "eval" / "metrics_step0.json").read_text())


def test_missing_hub_id_offline_fails_naming_it(tmp_path, monkeypatch, capsys):
    # transformers reads these at call time through huggingface_hub.constants (the env only at import).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.chdir(tmp_path)
    assert eval_checkpoint.main(["org/no-such-model", *ARGS]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: org/no-such-model: ")
    assert "no local folder of that name, and as a hub id it is not in the hub cache" in err
    assert "HF_HUB_OFFLINE is set" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "eval_org_no-such-model").exists()


@pytest.mark.parametrize("path", ["./nope", "no/such/folder", "/no-such-dir/tiny", "~/no-such-dir", "../nope"])
def test_missing_local_path_says_no_such_file(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert eval_checkpoint.main([path, *ARGS]) == 1
    assert f"error: {path}: no such file or directory" in capsys.readouterr().err


def test_resolve_target_hub_ids_and_local_folders_first(model_dir, tmp_path, monkeypatch):
    for hub_id in ("org/name", "gpt2", "Qwen/Qwen2-0.5B-Instruct"):
        target = resolve_target(hub_id)
        assert (target.hub_id, target.checkpoint, target.run_dir, target.step) == (hub_id, hub_id, None, None)
    assert resolve_target("Qwen/Qwen2-0.5B-Instruct").slug == "Qwen_Qwen2-0.5B-Instruct"
    assert resolve_target("org/name", "short").label == "short"  # analysis.compare's labels stay
    # A folder of that name wins over the hub.
    shutil.copytree(model_dir, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    local = resolve_target("org/name")
    assert local.hub_id is None and local.checkpoint == Path("org/name") and local.label == "name"


def test_chat_template_attention_and_dtype_reach_the_model(model_dir, tmp_path, generate_calls):
    chat = [*ARGS, "chat_template=true", "attn_implementation=eager", "dtype=auto", f"out={tmp_path / 'chat'}"]
    assert eval_checkpoint.main([str(model_dir), *chat]) == 0
    assert eval_checkpoint.main([str(model_dir), *ARGS, f"out={tmp_path / 'plain'}"]) == 0
    (templated,), (plain,) = generate_calls[:1], generate_calls[1:]
    assert (templated["attn"], templated["dtype"]) == ("eager", torch.bfloat16)  # auto = as saved
    assert plain["attn"] != "eager" and plain["dtype"] == torch.float32  # the defaults
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    user, assistant = tokenizer.convert_tokens_to_ids([USER, ASSISTANT])
    assert len(templated["prompts"]) == len(plain["prompts"]) == 6
    for wrapped, bare in zip(templated["prompts"], plain["prompts"]):
        assert user not in bare and wrapped == [user, *bare, assistant]


def test_chat_template_without_one_fails(model_dir, tmp_path, generate_calls, capsys):
    folder = tmp_path / "no-template"
    shutil.copytree(model_dir, folder)
    for f in folder.glob("chat_template*"):
        f.unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(folder).chat_template is None

    assert eval_checkpoint.main([str(folder), *ARGS, "chat_template=true", f"out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert f"{folder}: chat_template=true, but its tokenizer has no chat template" in err
    assert not generate_calls and not (tmp_path / "out").exists()


def _reference_mdqa(path: Path, n_records: int = 2, n_docs: int = 10, gold: int = 4) -> Path:
    records = [{"question": f"question {i}", "answers": [f"answer {i}"],
                "ctxs": [{"title": f"title {i}.{k}", "text": f"text {k}", "isgold": k == gold} for k in range(n_docs)]}
               for i in range(n_records)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_reorder_intervention_writes_beside_the_plain_results(model_dir, tmp_path, generate_calls):
    mdqa = _reference_mdqa(tmp_path / "qa.jsonl")
    args = ["probes=[mdqa]", f"mdqa.path={mdqa}", "examples=2", "max_new_tokens=2", "device=cpu",
            "mdqa.closed_book=false", f"out={tmp_path / 'run'}"]
    assert eval_checkpoint.main([str(model_dir), *args]) == 0
    assert eval_checkpoint.main([str(model_dir), *args, "intervention=reorder"]) == 0
    plain = ProbeResult.load_json(tmp_path / "run" / "eval" / "mdqa_step0.json")
    moved = ProbeResult.load_json(tmp_path / "run" / "interventions" / "reorder-outside_in" / "eval" / "mdqa_step0.json")
    assert [o["position"] for o in moved.outcomes] == [o["position"] for o in plain.outcomes] == [4, 4]  # the rank
    assert [o["extra"]["final_position"] for o in moved.outcomes] == [2, 2]  # rank 5 of 10, outside-in: position 3
    assert moved.settings["intervention"] == "reorder-outside_in" and moved.settings["order"] == "outside_in"
    assert plain.settings["intervention"] == "none" and not moved.settings["comparable_with_reference"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = tokenizer.decode(generate_calls[1]["prompts"][0])
    assert first.index("title 0.0") < first.index("title 0.2") < first.index("title 0.4") < first.index("title 0.1")


@pytest.mark.parametrize("args, message", [
    (["probes=[kv]", "intervention=reorder"], "applies to ['mdqa'] only"),
    (["probes=[mdqa]", "intervention=truncate"], "keep=K"),
    (["probes=[needle]", "intervention=query_aware"], "needle"),
    (["probes=[mdqa]", "keep=3"], "truncate's setting"),
])
def test_interventions_that_cannot_apply_fail_before_loading(model_dir, args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_checkpoint.main([str(model_dir), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_ms_poe_intervention_answers_through_the_patched_model(model_dir, tmp_path):
    out = tmp_path / "run"
    assert eval_checkpoint.main([str(model_dir), *ARGS, "intervention=ms_poe", "ms_poe.layers=all", f"out={out}"]) == 0
    result = ProbeResult.load_json(out / "interventions" / "ms_poe" / "eval" / "needle_step0.json")
    assert result.settings["intervention"] == "ms_poe" and len(result.outcomes) == 6
    assert result.settings["ms_poe"]["layers"] == [0, 1]
    # the default layers (all but the first two) leave nothing to patch in a 2-layer model: said before answering
    assert eval_checkpoint.main([str(model_dir), *ARGS, "intervention=ms_poe", f"out={tmp_path / 'x'}"]) == 1


@pytest.mark.parametrize("chat", [False, True])
def test_attn_calibration_answers_kv_with_its_pairs_calibrated(model_dir, tmp_path, chat):
    out = tmp_path / "run"
    args = ["probes=[kv]", "examples=2", "kv.n_pairs=4", "max_new_tokens=3", "device=cpu", f"chat_template={chat}",
            "intervention=attn_calibration", f"out={out}"]
    assert eval_checkpoint.main([str(model_dir), *args]) == 0
    result = ProbeResult.load_json(out / "interventions" / "attn_calibration" / "eval" / "kv_step0.json")
    recorded = result.settings["attn_calibration"]
    assert result.settings["intervention"] == "attn_calibration" and len(result.outcomes) == 2 * 4  # every pair position
    assert recorded["layers"] == [1] and recorded["temperature"] == 5e-5  # last_half of 2 layers
    # every prompt's rows after its pairs, in the one calibrated layer: the prefill's and each decoding step's
    assert recorded["calibrated_rows"] >= 8 * 3
    assert eval_checkpoint.main([str(model_dir), *args[:-1], "attn_calibration.heads=[9]",
                                 f"out={tmp_path / 'x'}"]) == 1  # said before answering


def test_attn_calibration_temperature_sweep_measures_the_references_once(model_dir, tmp_path, monkeypatch):
    """attn_calibration.reuse_reference=true: the second run (another t) reads every prompt's reference from
    <POSDEBIAS_CACHE>/calibration_references and answers as a run that measured it would."""
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    args = ["probes=[kv]", "examples=2", "kv.n_pairs=4", "max_new_tokens=3", "device=cpu",
            "intervention=attn_calibration"]
    stored = tmp_path / "cache" / "calibration_references"

    def answers(name, *extra):
        assert eval_checkpoint.main([str(model_dir), *args, *extra, f"out={tmp_path / name}"]) == 0
        path = tmp_path / name / "interventions" / "attn_calibration" / "eval" / "kv_step0.json"
        return [o["prediction"] for o in ProbeResult.load_json(path).outcomes]

    first = answers("t1", "attn_calibration.reuse_reference=true")
    assert len(list(stored.glob("*.pt"))) == 2 * 4  # one reference per prompt (2 questions x 4 positions)
    written = {p: p.stat().st_mtime_ns for p in stored.glob("*.pt")}
    answers("t2", "attn_calibration.reuse_reference=true", "attn_calibration.temperature=5e-3")
    assert {p: p.stat().st_mtime_ns for p in stored.glob("*.pt")} == written  # read, not measured again
    assert answers("t1-measured") == first  # no reuse: the same answers from freshly measured references


def test_compare_wraps_prompts_in_the_chat_template_when_asked(model_dir, tmp_path, generate_calls, capsys):
    needle = ["--probes", "needle", "--examples", "2", "--needle-lens", "64", "--needle-depths", "0.0,0.5,1.0",
              "--max-new-tokens", "4", "--device", "cpu"]
    assert compare.main([str(model_dir), *needle, "--out", str(tmp_path / "chat"), "--chat-template"]) == 0
    assert compare.main([str(model_dir), *needle, "--out", str(tmp_path / "plain")]) == 0  # no run: plain
    (templated,), (plain,) = generate_calls[:1], generate_calls[1:]
    user, assistant = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids([USER, ASSISTANT])
    assert len(templated["prompts"]) == len(plain["prompts"]) == 6
    for wrapped, bare in zip(templated["prompts"], plain["prompts"]):
        assert user not in bare and wrapped == [user, *bare, assistant]
    assert "prompts: in the chat template" in (tmp_path / "chat" / "report.md").read_text()

    folder = tmp_path / "no-template"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for f in folder.glob("chat_template*"):
        f.unlink()
    assert compare.main([str(folder), *needle, "--out", str(tmp_path / "none"), "--chat-template"]) == 1
    assert f"{folder}: chat templates asked for, but its tokenizer has none" in capsys.readouterr().err
    assert len(generate_calls) == 2


def test_eval_json_records_the_checkpoint_and_the_items_it_asked(model_dir, tmp_path, generate_calls):
    out = tmp_path / "out"
    assert eval_checkpoint.main([str(model_dir), *ARGS, f"out={out}"]) == 0
    data = json.loads((out / "eval" / "needle_step0.json").read_text())
    weights = function_digest(load_model(resolve_target(model_dir), "cpu", DType.float32))  # as evaluated
    assert data["checkpoint"] == {"path": str(model_dir.resolve()), "digest": weights}
    needle = NeedleProbeConfig(lengths=[64], depths=[0.0, 0.5, 1.0])
    cfg = EvalConfig(probes=[Probe.needle], probe_examples=2, needle=needle)
    items = build_probes(cfg, AutoTokenizer.from_pretrained(model_dir))["needle"]
    digests = [o["item_digest"] for o in data["outcomes"]]
    assert sorted(digests) == sorted(item_digest(it) for it in items) and len(set(digests)) == 6
    saved = ProbeResult.load_json(out / "eval" / "needle_step0.json")
    assert data["items_fingerprint"] == fingerprint(digests) == saved.fingerprint


@pytest.mark.parametrize("mark", [".hydra/config.yaml", "checkpoints/step-3/config.json"])
def test_out_in_another_runs_directory_is_refused_and_left_as_it_is(model_dir, tmp_path, generate_calls, capsys, mark):
    """Issue 66: out=<another run> replaced that run's own eval JSONs and metrics with another checkpoint's."""
    other = tmp_path / "other"
    (other / mark).parent.mkdir(parents=True)
    (other / mark).write_text("{}\n")
    (other / "eval").mkdir()
    theirs = other / "eval" / "needle_step0.json"
    theirs.write_text('{"the other run": "its answers"}')
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    assert eval_checkpoint.main([str(model_dir), *ARGS, f"out={other}"]) == 1
    held = ".hydra/config.yaml" if mark.startswith(".hydra") else "checkpoints"
    assert capsys.readouterr().err == (f"error: out={other}: the run directory of another run (it holds {held}), whose "
                                       "own eval files this would replace: give out=<a new folder>\n")
    assert theirs.read_text() == '{"the other run": "its answers"}' and not generate_calls
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before  # nothing written, not even a lock


def test_out_holding_another_checkpoints_answers_is_refused(model_dir, tmp_path, generate_calls, capsys):
    out = tmp_path / "evals"
    assert eval_checkpoint.main([str(model_dir), *ARGS, f"out={out}"]) == 0
    written = (out / "eval" / "needle_step0.json").read_bytes()
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    model = Qwen2ForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(other)
    capsys.readouterr()
    assert eval_checkpoint.main([str(other), *ARGS, f"out={out}"]) == 1
    (said,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert said.startswith(f"error: out={out}: {out / 'eval' / 'needle_step0.json'} holds the answers of another "
                           f"checkpoint ({model_dir.resolve()}, weights digest ")
    assert said.endswith("): give out=<a new folder>, or delete that file to replace it")
    assert (out / "eval" / "needle_step0.json").read_bytes() == written and len(generate_calls) == 1
    # the same checkpoint loaded otherwise (another dtype: another digest) replaces its own answers
    assert eval_checkpoint.main([str(model_dir), *ARGS, "dtype=bfloat16", f"out={out}"]) == 0
    assert eval_checkpoint.main([str(other), *ARGS, f"out={tmp_path / 'other-evals'}"]) == 0


def test_answers_false_gives_the_log_likelihood_alone(model_dir, tmp_path, generate_calls):
    assert eval_checkpoint.main([str(model_dir), *ARGS, "answers=false", f"out={tmp_path / 'out'}"]) == 0
    result = ProbeResult.load_json(tmp_path / "out" / "eval" / "needle_step0.json")
    assert not generate_calls  # nothing was generated
    assert all(math.isnan(o["correct"]) and math.isfinite(o["loglik"]) for o in result.outcomes)


def test_answers_false_without_the_log_likelihood_measures_nothing(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        eval_checkpoint.main([str(model_dir), *ARGS, "answers=false", "loglik=false", f"out={tmp_path / 'out'}"])
    assert stop.value.code == 2 and "answers=false with loglik=false would measure nothing" in capsys.readouterr().err
