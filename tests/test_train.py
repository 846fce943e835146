"""The training loop end to end at tiny scale: smoke run, save/reload, exact resume, config errors."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_builders.mdqa import write_jsonl_gz
from models.training.distributed import DistInfo
from models.training.renamed_keys import UnknownKeyError
from scripts.investigations.synthetic_oracle import oracle_records
from tests.conftest import CONF_DIR, ROOT, TINY
from train import TrainConfig, as_train_config, compose_config, run, validate


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml"))
# Each experiment at a size that runs two steps in seconds: the tiny model and data, its own settings kept.
# +exp=debias_study fine-tunes a checkpoint (`model.pretrained`): a tiny one, without the random-init keys.
FROM_CHECKPOINT = [o for o in TINY if not o.startswith("model.init.")] + [
    "data.in2.prior_layers=2", "debias.needle_mix.kinds=[needle]", "data.num_eval=8"]
# +exp=mdqa_reader too, with its own mix kind (mdqa rows: two one-fact documents need ~120 tokens here)
READER = [o for o in FROM_CHECKPOINT if not o.startswith("debias.")] + [
    "data.context_len=256", "debias.needle_mix.pool=16"]
# +exp=in2_smol on the tiny model and a synthetic NQ-format file (`synthetic_nq`): no wheel, no ../shared; its
# watch asks one dev question of that file (it has a dozen)
SMOL = ["model=qwen2_tiny", *TINY, "data.in2.context_len_min=64", "data.in2.segment_len=32", "peft.r=4",
        "watch.questions=1", "watch.skip_examples=0"]
# the mdqa layout at three documents: no watch (its slots 0, 4 and 9 are not there)
MDQA3 = ["model=qwen2_tiny", *TINY, "data.context_len=512", "data.in2.n_docs=3", "peft.r=4", "watch=off"]
READS_NQ = ("in2_smol", "debias_study_smol", "in2_smol_mdqa", "in2_smol_distill", "reads_middle", "lift_middle")
SMOKE = {
    "biased_start": TINY,
    "in2_smol": SMOL,
    # three of its whole mdqa documents (data.in2.layout=mdqa: no segment budgets)
    "in2_smol_mdqa": MDQA3,
    # and pos2distill's targets: the random tiny model answers nothing right, so its wrong answers are kept
    "in2_smol_distill": [*MDQA3, "debias.distill.keep_wrong=true", "debias.distill.max_new_tokens=4"],
    "debias_study_smol": [*SMOL, "data.in2.prior_layers=2"],
    # its default arm (debias=none) at in2_smol_mdqa's size; the other arms run in tests/test_probe_study.py
    "reads_middle": MDQA3,
    "lift_middle": MDQA3,  # its default arm (debias=none) too; its arms: tests/test_lift_middle.py
    "debias_study": FROM_CHECKPOINT,
    "mdqa_reader": READER,
    "in2": TINY,
    "in2_diff": TINY,
    "micro100": ["model=qwen2_tiny", "model.init.hidden_size=32", "model.init.num_hidden_layers=2",
                 "model.init.intermediate_size=64", "data.context_len=128", "data.windows.doc_len=256",
                 "data.num_train_docs=400", "data.num_eval_docs=200", "data.vocab_size=400",
                 "jacobian.seq_len=64", "jacobian.n_vanilla=1", "jacobian.n_chunked=1", "jacobian.chunk_len=32",
                 "jacobian.num_probes=2", "logger.mode=disabled"],
}


def test_every_experiment_has_a_smoke_size():
    assert sorted(SMOKE) == EXPERIMENTS


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of one +exp=biased_start step at TINY size (what debias_study starts from)."""
    run_dir = tmp_path_factory.mktemp("biased_start")
    run(compose_config(["+exp=biased_start", *TINY, "trainer.max_steps=1", "trainer.save_every=0"]), run_dir)
    return run_dir / "checkpoints" / "step-1"


STARTS_FROM_CHECKPOINT = ("debias_study", "mdqa_reader")


@pytest.fixture(scope="module")
def synthetic_nq(tmp_path_factory):
    """An NQ-format oracle file of invented persons, standing in for nq-open-oracle.jsonl.gz."""
    return write_jsonl_gz(tmp_path_factory.mktemp("nq") / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))


def _start_from(exp, checkpoint):
    return [f"model.pretrained={checkpoint}"] if exp in STARTS_FROM_CHECKPOINT else []


def _data_for(exp, request):
    """+exp=in2_smol and its study read NQ: the synthetic file, so that no ../shared is needed."""
    if exp not in READS_NQ:
        return []
    return [f"data.path={request.getfixturevalue('synthetic_nq')}"]


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_composes_converts_and_validates(compose_cfg, exp, request):
    cfg = as_train_config(compose_cfg(f"+exp={exp}", *_start_from(exp, "/some/checkpoint"), *_data_for(exp, request)))
    assert isinstance(cfg, TrainConfig) and cfg.exp_name == exp
    validate(cfg, DistInfo())


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_runs_two_steps(compose_cfg, tmp_path, exp, request):
    start = _start_from(exp, request.getfixturevalue("tiny_checkpoint")) if exp in STARTS_FROM_CHECKPOINT else []
    cfg = compose_cfg(f"+exp={exp}", *SMOKE[exp], *start, *_data_for(exp, request), "trainer.max_steps=2",
                      "trainer.save_every=0")
    run(cfg, tmp_path)
    assert set(_losses(tmp_path)) == {1, 2}
    assert (tmp_path / "checkpoints" / "step-2" / "trainer_state.json").is_file()


def test_in2_diff_is_in2_with_differential_attention(compose_cfg):
    def flat(cfg, prefix=""):
        items = OmegaConf.to_container(cfg, resolve=False).items() if prefix == "" else cfg.items()
        out = {}
        for key, value in items:
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    in2, diff = flat(compose_cfg("+exp=in2")), flat(compose_cfg("+exp=in2_diff"))
    changed = {k for k in in2.keys() | diff.keys() if in2.get(k) != diff.get(k)}
    assert changed == {"exp_name", "model.attention"}
    assert diff["model.attention"] == "diff_v1"


def test_in2_on_a_pretrained_model_gets_pretrained_settings():
    out = subprocess.run([sys.executable, "train.py", "--cfg", "job", "+exp=in2", "model=qwen2_0.5b"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    cfg = OmegaConf.create(out.stdout)
    assert cfg.model.pretrained == "Qwen/Qwen2-0.5B" and cfg.model.init == {}
    assert cfg.trainer.lr <= 1e-4 and cfg.data.in2.answer_lead is False
    assert cfg.model.diff.mode == "retrofit"
    tiny = OmegaConf.create(subprocess.run([sys.executable, "train.py", "--cfg", "job", "+exp=in2"], cwd=ROOT,
                                           capture_output=True, text=True, check=True).stdout)
    assert tiny.model.init.initializer_range == 0.06 and tiny.trainer.lr == 3e-3 and tiny.data.in2.answer_lead


CHOICES = {
    "logger.mode": "offline", "trainer.precision": "bf16", "trainer.device": "cuda", "model.attention": "diff_v1",
    "model.diff.mode": "retrofit", "model.dtype": "bfloat16", "peft.method": "lora", "jacobian.estimator": "exact",
    "jacobian.target": "pre_norm", "data.source": "nq", "data.format": "lm_windows",
}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_typo_in_a_choice_fails_at_composition_naming_key_and_choices(compose_cfg, key):
    compose_cfg(f"{key}={CHOICES[key]}")  # the right spelling composes
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(f"{key}={CHOICES[key]}x")
    message = str(err.value.__cause__ or err.value)
    assert key in message and CHOICES[key] in message.split("expected one of")[1]


def test_a_typo_in_a_list_of_choices_fails(compose_cfg):
    with pytest.raises(ConfigCompositionException, match="neddle"):
        compose_cfg("eval.probes=[kv,neddle]")


def _wall_s(cmd: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    begin = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kwargs)
    return time.perf_counter() - begin, out


def test_a_typo_on_the_command_line_fails_right_after_the_imports(tmp_path):
    """Composition rejects it before any work: the run costs what importing train.py costs (torch,
    transformers: 5-8 s on 2 idle cores), not the data build and model that +exp=in2 would start with."""
    imports, _ = _wall_s([sys.executable, "-c", "import train"], check=True)
    typo, out = _wall_s([sys.executable, "train.py", "+exp=in2", "logger.mode=ofline", f"hydra.run.dir={tmp_path}"])
    assert out.returncode != 0 and "logger.mode" in out.stderr and "offline, online, disabled" in out.stderr
    assert typo - imports < 5, f"the typo took {typo:.1f} s to report, importing train.py {imports:.1f} s"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing was built


def test_the_cli_names_the_new_name_of_a_renamed_key_in_a_config_file(tmp_path):
    """Hydra refuses an old key set by an experiment file with a report of its own (`Key 'alpha' not in
    'DebiasConfig'`); train.py adds the line naming the new key and the file, for a sweep too."""
    (tmp_path / "conf" / "exp").mkdir(parents=True)
    (tmp_path / "conf" / "exp" / "old_prior.yaml").write_text("# @package _global_\ndebias:\n  alpha: 0.5\n")
    out = subprocess.run([sys.executable, "train.py", "-m", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                          "+exp=old_prior", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == "error: debias.alpha was renamed: use debias.prior_alpha, in exp/old_prior.yaml"
    assert not (tmp_path / "sweep").exists()


def test_unknown_model_init_key_fails_before_any_work(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="rope_thetaa.*Qwen2Config"):
        run(compose_cfg(*TINY, "+model.init.rope_thetaa=1"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_init_with_pretrained_weights_is_an_error(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="model.init .* model.pretrained"):
        run(compose_cfg(*TINY, "model.pretrained=some/model"), tmp_path / "run")


def test_the_cli_run_writes_its_log_to_train_log(tmp_path):
    subprocess.run([sys.executable, "train.py", *TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path}"],
                   cwd=ROOT, capture_output=True, text=True, check=True)
    assert "global batch = 4 micro x 1 accumulation x 1 data-parallel ranks" in (tmp_path / "train.log").read_text()


def test_smoke_three_steps(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "trainer.max_steps=3", "jacobian=hutchinson", "jacobian.seq_len=64",
                      "jacobian.chunk_len=32", "jacobian.num_probes=2")
    metrics = run(cfg, tmp_path)
    assert set(_losses(tmp_path)) == {1, 2, 3}
    assert all(torch.isfinite(torch.tensor(v)) for v in _losses(tmp_path).values())
    assert "eval/in2/acc_mean" in metrics
    ckpt = tmp_path / "checkpoints" / "step-3"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file()
    assert (tmp_path / "plots" / "in2_accuracy_by_depth.png").stat().st_size > 0
    assert (tmp_path / "jacobian.npz").is_file()
    AutoTokenizer.from_pretrained(ckpt)  # the checkpoint carries its tokenizer


def test_save_reload_identical_logits(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "trainer.max_steps=2")
    run(cfg, tmp_path)
    ckpt = tmp_path / "checkpoints" / "step-2"
    from models.build import build_model

    reload_cfg = compose_cfg(*TINY, f"model.pretrained={ckpt}")
    tok = AutoTokenizer.from_pretrained(ckpt)
    a = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    b = build_model(reload_cfg.model, len(tok), tok.pad_token_id).eval()
    ids = torch.tensor([tok("Where does Kamir live? Answer:")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_nested_init_values_reach_the_model_config(compose_cfg):
    """A dict under model.init (rope_parameters) arrives as a plain dict, which HF configs type-check."""
    from models.build import build_model

    cfg = compose_cfg("+model.init.rope_parameters={rope_type:default,rope_theta:500.0}")
    model = build_model(cfg.model, 64)
    assert model.config.rope_parameters["rope_theta"] == 500.0


@pytest.mark.parametrize("batching", [[], ["data.packing=true", "trainer.micro_batch_size=2"]],
                         ids=["padded", "packed"])
def test_resume_matches_uninterrupted_run(compose_cfg, tmp_path, batching):
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_cfg(*TINY, *batching, "trainer.max_steps=4"), full)
    run(compose_cfg(*TINY, *batching, "trainer.max_steps=4", "trainer.save_every=2"), part)
    # Drop everything after step 2 as if the run had been killed there, then resume.
    shutil.rmtree(part / "checkpoints" / "step-4")
    lines = [line for line in (part / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run(compose_cfg(*TINY, *batching, "trainer.max_steps=4", "trainer.resume_from=latest"), part)
    expected, resumed = _losses(full), _losses(part)
    assert [resumed[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]  # bitwise on CPU


def test_unknown_key_fails_naming_it_and_the_closest_key(compose_cfg):
    with pytest.raises(UnknownKeyError, match=r"trainer.lrr: no such setting .*did you mean trainer.lr\?"):
        compose_cfg("trainer.lrr=0.1")


@pytest.mark.parametrize("override, expected", [
    ("+exp=in3", "+exp=in3: no such option of the config group exp; did you mean +exp=in2?"),
    ("model=smollm", "did you mean model=smollm2_135m?"),
    ("debias=[depth_sampling,grup_dro]", "debias=grup_dro: no such option of the config group debias; did you mean "
     "debias=group_dro?"),
    ("data.in2.n_doc=3", "data.in2.n_doc: no such setting in data.in2 (In2Config); did you mean data.in2.n_docs?"),
])
def test_a_mistyped_preset_or_key_fails_naming_the_closest(compose_cfg, override, expected):
    with pytest.raises(UnknownKeyError, match=re.escape(expected)):
        compose_cfg(override)


def test_unknown_key_in_cli_fails_naming_it():
    out = subprocess.run([sys.executable, "train.py", "+exp=in2", "trainer.not_a_key=1"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "not_a_key" in out.stderr


def test_cli_prints_resolved_config():
    out = subprocess.run([sys.executable, "train.py", "--cfg", "job", "+exp=in2"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert "exp_name: in2" in out.stdout and "max_steps:" in out.stdout


def test_diff_attention_run_logs_lambda_and_restores(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "+exp=in2_diff", "trainer.max_steps=2", "jacobian=off")
    run(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("diff/layer0/lambda_mean" in r for r in rows)
    ckpt = tmp_path / "checkpoints" / "step-2"
    from models.build import build_model

    tok = AutoTokenizer.from_pretrained(ckpt)
    restored = build_model(compose_cfg(*TINY, "+exp=in2_diff", f"model.pretrained={ckpt}").model, len(tok),
                           tok.pad_token_id).eval()
    assert type(restored.model.layers[0].self_attn).__name__ == "Qwen2DiffAttention"
    again = build_model(compose_cfg(*TINY, f"model.pretrained={ckpt}").model, len(tok), tok.pad_token_id).eval()
    ids = torch.tensor([tok("Which pet does Kamir keep?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, again(ids).logits)


def test_position_probes_during_training(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "trainer.max_steps=2", "eval.probes=[needle,kv]", "eval.probe_every=2",
                      "eval.probe_examples=1", "eval.needle.lengths=[64,96]", "eval.needle.depths=[0.0,1.0]",
                      "eval.kv.max_new_tokens=4")
    metrics = run(cfg, tmp_path)
    assert "eval/needle/acc_mean" in metrics and "eval/kv/acc@0" in metrics
    assert (tmp_path / "eval" / "needle_step2.json").is_file()
    assert (tmp_path / "plots" / "kv_accuracy_step2.png").stat().st_size > 0
    assert (tmp_path / "plots" / "needle_grid_step2.png").stat().st_size > 0


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_group_choice_on_the_command_line_wins_over_an_experiment(compose_cfg, exp):
    assert compose_cfg(f"+exp={exp}", "jacobian=off").jacobian.every == 0


def test_no_held_out_questions_turn_the_depth_accuracy_off(compose_cfg, tmp_path):
    """eval.num_examples=0: a run without the IN2 evaluation, not a crash after the model has loaded."""
    metrics = run(compose_cfg(*TINY, "trainer.max_steps=2", "eval.num_examples=0"), tmp_path)
    assert set(_losses(tmp_path)) == {1, 2} and not any(k.startswith("eval/in2/") for k in metrics)
    assert not list((tmp_path / "eval").glob("in2_*.json")) and "Accuracy by gold depth" not in (
        tmp_path / "summary.md").read_text()


def test_resume_keeps_the_start_accuracy_curve(compose_cfg, tmp_path, monkeypatch):
    """Resuming into a new run directory still plots (and keeps) the step-0 accuracy by depth."""
    from analysis import during_training

    first, second = tmp_path / "first", tmp_path / "second"
    run(compose_cfg(*TINY, "trainer.max_steps=2"), first)
    curves = {}
    monkeypatch.setattr(during_training, "plot_depth_accuracy", lambda c, path, **kw: curves.update(c))
    run(compose_cfg(*TINY, "trainer.max_steps=3", f"trainer.resume_from={first / 'checkpoints' / 'step-2'}"), second)
    assert list(curves) == ["step 0", "step 3"]
    step0 = json.loads((first / "eval" / "in2_step0.json").read_text())
    assert json.loads((second / "eval" / "in2_step0.json").read_text()) == step0
    assert len(curves["step 0"]) == len(curves["step 3"]) > 0


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_gradient_checkpointing_gives_the_same_losses(compose_cfg, tmp_path, monkeypatch, peft):
    """Recomputing activations in the backward changes memory, not the numbers (LoRA: frozen inputs)."""
    import train

    built = []
    build_model = train.build_model
    monkeypatch.setattr(train, "build_model", lambda *a, **kw: built.append(build_model(*a, **kw)) or built[-1])
    args = (*TINY, "trainer.max_steps=3", "jacobian=off", f"peft={peft}")
    run(compose_cfg(*args), tmp_path / "plain")
    run(compose_cfg(*args, "model.gradient_checkpointing=true"), tmp_path / "checkpointed")
    assert [m.is_activation_checkpointing for m in built] == [False, True]
    plain, checkpointed = _losses(tmp_path / "plain"), _losses(tmp_path / "checkpointed")
    assert list(plain) == [1, 2, 3]
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    assert plain[3] != plain[1]  # the parameters moved: gradients reached them through the recomputation


def test_flex_attention_on_the_cpu_fails_at_start_up(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="flex_attention has no backward on the CPU"):
        run(compose_cfg(*TINY, "model.attn_implementation=flex_attention", "trainer.device=cpu"), tmp_path)
    assert not (tmp_path / "tokenizer").exists()  # nothing was built


def test_packed_training_runs_on_rows_of_pack_len_tokens(compose_cfg, tmp_path, monkeypatch):
    import train

    seen = []
    step = train.optimizer_step
    monkeypatch.setattr(train, "optimizer_step", lambda run, batches, number: step(run, iter(
        seen.append(b) or b for b in batches), number))
    run(compose_cfg(*TINY, "data.packing=true", "data.pack_len=256", "trainer.micro_batch_size=1",
                    "trainer.max_steps=2"), tmp_path)
    assert seen and all(b["input_ids"].shape == (1, 256) and "attention_mask" not in b for b in seen)
    assert all((b["position_ids"] == 0).sum() >= 2 for b in seen)  # several samples (or one and a tail) per row
    assert all(math.isfinite(v) for v in _losses(tmp_path).values())


def test_bad_jacobian_cadence_fails_at_start_up_naming_the_key(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="jacobian.chart_every=0 must be >= 1"):
        run(compose_cfg(*TINY, "jacobian.chart_every=0"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_settings_without_a_meaning_here_fail_at_start_up(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="eval.probes has in2: the held-out IN2 records are scored"):
        run(compose_cfg(*TINY, "eval.probes=[in2]", "eval.probe_every=1"), tmp_path)
    with pytest.raises(ValueError, match="model.dtype=auto keeps the dtype pretrained weights were saved in"):
        run(compose_cfg(*TINY, "model.dtype=auto"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_probe_file_fails_at_start_up_naming_the_key(compose_cfg, tmp_path):
    missing = tmp_path / "kv-retrieval-140_keys.jsonl.gz"
    with pytest.raises(FileNotFoundError, match=f"eval.kv.path={missing}: "):
        run(compose_cfg(*TINY, "eval.probes=[kv]", "eval.probe_every=1", f"eval.kv.path={missing}"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"eval.mdqa.path=.*\*.jsonl.gz: "):
        run(compose_cfg(*TINY, "eval.probes=[mdqa]", "eval.probe_every=1", f"eval.mdqa.path={tmp_path}/*.jsonl.gz"),
            tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jacobian_scalars_are_logged_at_the_step_jacobian_npz_records(compose_cfg, tmp_path):
    """Step s means the weights after s updates, in metrics.jsonl as in jacobian.npz (once per step)."""
    import numpy as np

    from analysis.measure.topology import prefixed, topology_metrics

    run(compose_cfg(*TINY, "trainer.max_steps=2", "jacobian=hutchinson", "jacobian.seq_len=64",
                    "jacobian.chunk_len=32", "jacobian.num_probes=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["prior/vanilla/alpha"] for r in rows if "prior/vanilla/alpha" in r}
    assert sorted(logged) == [0, 1, 2] and len([r for r in rows if "prior/vanilla/alpha" in r]) == 3
    with np.load(tmp_path / "jacobian.npz") as z:
        steps, vanilla = z["steps"], z["vanilla"].astype(np.float64)
    n_layers = compose_cfg(*TINY).model.init.num_hidden_layers
    for i, step in enumerate(steps):
        expected = prefixed(topology_metrics(vanilla[:, i].mean(axis=0), n_layers), "vanilla")["prior/vanilla/alpha"]
        assert logged[int(step)] == pytest.approx(expected, rel=1e-3, abs=1e-6)


def test_offline_wandb_run_logs_profile_charts(compose_cfg, tmp_path):
    """The wandb path (offline, no account): profile line charts and scalars reach the run files."""
    run(compose_cfg(*TINY, "trainer.max_steps=2", "logger.mode=offline", "jacobian=hutchinson",
                    "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/jacobian/*/profile_*.table.json"))
    assert {p.parent.name for p in tables} == {"vanilla", "chunked"}
    chart = json.loads(tables[0].read_text())
    # The profile, its prior and the four rollouts, over every position of L = 64 (<= CHART_POINTS).
    assert len(chart["data"]) == 6 * 64
    assert {row[1] for row in chart["data"]} >= {"measured", "rollout, measured", "rollout, attention_only"}


def _wandb_home(monkeypatch, folder):
    """wandb's settings, cache (its service's debug logs) and data folders under `folder`, never $HOME."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(folder / "wandb-home" / var.lower()))


def _wandb_run_ids(run_dir):
    """Run ids of the offline wandb runs in a run directory (`wandb/offline-run-<time>-<id>`)."""
    return [p.name.split("-")[3] for p in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_resume_into_a_new_run_directory_continues_the_wandb_run(compose_cfg, tmp_path, monkeypatch):
    """The checkpoint carries the wandb run id: a run resumed from it elsewhere logs to the same run."""
    _wandb_home(monkeypatch, tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    run(compose_cfg(*TINY, "trainer.max_steps=2", "trainer.save_every=1", "logger.mode=offline"), first)
    ckpt = first / "checkpoints" / "step-1"
    run_id = json.loads((ckpt / "trainer_state.json").read_text())["wandb_run_id"]
    assert _wandb_run_ids(first) == [run_id]
    run(compose_cfg(*TINY, "trainer.max_steps=2", "logger.mode=offline", f"trainer.resume_from={ckpt}"), second)
    assert _wandb_run_ids(second) == [run_id]
    assert json.loads((second / "checkpoints" / "step-2" / "trainer_state.json").read_text())["wandb_run_id"] == run_id
    # Accuracy by depth reaches wandb as a table (comparable across runs) and as the PNG of the run directory.
    media = next((second / "wandb").glob("offline-run-*")) / "files" / "media"
    assert list(media.glob("table/eval/in2/accuracy_by_position_table_*.table.json"))
    assert list(media.glob("images/eval/in2/accuracy_plot_*.png"))


def test_the_cli_names_a_wandb_run_from_its_overrides_and_groups_it_by_sweep(tmp_path, monkeypatch):
    _wandb_home(monkeypatch, tmp_path)
    quiet = [o for o in TINY if not o.startswith("logger.")]
    subprocess.run([sys.executable, "train.py", "-m", *quiet, "trainer.max_steps=1", "seed=3",
                    "logger.mode=offline", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                   cwd=ROOT, capture_output=True, text=True, check=True)
    stored = json.loads((tmp_path / "sweep" / "0" / "wandb_run.json").read_text())
    assert stored["group"] == "default/sweep"
    assert stored["name"].startswith("default model.init.hidden_size=32,") and "logger" not in stored["name"]


def test_a_wandb_mode_in_the_environment_that_is_no_mode_fails_at_start_up(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    cfg = compose_cfg(*[o for o in TINY if not o.startswith("logger.mode")])
    with pytest.raises(ValueError, match="WANDB_MODE='ofline' is not one of"):
        run(cfg, tmp_path)
    assert not (tmp_path / "tokenizer").exists()


def test_debias_study_starts_from_the_newest_biased_start_run(tmp_path, monkeypatch):
    from models.training.launch import newest_run_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"\+exp=biased_start"):
        newest_run_checkpoint("biased_start")
    for run_dir, steps in (("outputs/biased_start/2026-01-01_00-00-00", (5, 10)),
                           ("outputs/biased_start/multirun_2026-01-02_00-00-00/0", (20,))):
        for step in steps:
            (tmp_path / run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
            (tmp_path / run_dir / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text("{}")
            time.sleep(0.01)
    assert newest_run_checkpoint("biased_start").endswith("multirun_2026-01-02_00-00-00/0/checkpoints/step-20")
