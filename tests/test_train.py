"""The training loop end to end at tiny scale: smoke run, save/reload, exact resume, config errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import CONF_DIR, ROOT, TINY
from train import run


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.parametrize("exp", sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml")))
def test_every_experiment_composes(compose_cfg, exp):
    cfg = compose_cfg(f"+exp={exp}")
    assert cfg.exp_name == exp
    assert cfg.trainer.max_steps > 0


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


def test_resume_matches_uninterrupted_run(compose_cfg, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_cfg(*TINY, "trainer.max_steps=4"), full)
    run(compose_cfg(*TINY, "trainer.max_steps=4", "trainer.save_every=2"), part)
    # Drop everything after step 2 as if the run had been killed there, then resume.
    shutil.rmtree(part / "checkpoints" / "step-4")
    lines = [line for line in (part / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run(compose_cfg(*TINY, "trainer.max_steps=4", "trainer.resume_from=latest"), part)
    expected, resumed = _losses(full), _losses(part)
    assert [resumed[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]  # bitwise on CPU


def test_unknown_key_fails_naming_it(compose_cfg):
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_cfg("trainer.lrr=0.1")


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
                      "eval.probe_examples=1", "eval.needle_lens=[64,96]")
    metrics = run(cfg, tmp_path)
    assert "eval/needle/acc_mean" in metrics and "eval/kv/acc@0" in metrics
    assert (tmp_path / "eval" / "needle_step2.json").is_file()
    assert (tmp_path / "plots" / "kv_accuracy_step2.png").stat().st_size > 0


@pytest.mark.parametrize("exp", sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml")))
def test_group_choice_on_the_command_line_wins_over_an_experiment(compose_cfg, exp):
    assert compose_cfg(f"+exp={exp}", "jacobian=off").jacobian.every == 0


def test_resume_keeps_the_start_accuracy_curve(compose_cfg, tmp_path, monkeypatch):
    """Resuming into a new run directory still plots (and keeps) the step-0 accuracy by depth."""
    import analysis.plots

    first, second = tmp_path / "first", tmp_path / "second"
    run(compose_cfg(*TINY, "trainer.max_steps=2"), first)
    curves = {}
    monkeypatch.setattr(analysis.plots, "plot_depth_accuracy", lambda c, path, **kw: curves.update(c))
    run(compose_cfg(*TINY, "trainer.max_steps=3", f"trainer.resume_from={first / 'checkpoints' / 'step-2'}"), second)
    assert list(curves) == ["step 0", "step 3"]
    step0 = json.loads((first / "eval" / "in2_step0.json").read_text())
    assert json.loads((second / "eval" / "in2_step0.json").read_text()) == step0
    assert len(curves["step 0"]) == len(curves["step 3"]) > 0


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_gradient_checkpointing_gives_the_same_losses(compose_cfg, tmp_path, monkeypatch, peft):
    """Recomputing activations in the backward changes memory, not the numbers (LoRA: frozen inputs)."""
    import models.build

    built = []
    build_model = models.build.build_model
    monkeypatch.setattr(models.build, "build_model", lambda *a, **kw: built.append(build_model(*a, **kw)) or built[-1])
    args = (*TINY, "trainer.max_steps=3", "jacobian=off", f"peft={peft}")
    run(compose_cfg(*args), tmp_path / "plain")
    run(compose_cfg(*args, "model.gradient_checkpointing=true"), tmp_path / "checkpointed")
    assert [m.is_activation_checkpointing for m in built] == [False, True]
    plain, checkpointed = _losses(tmp_path / "plain"), _losses(tmp_path / "checkpointed")
    assert list(plain) == [1, 2, 3]
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    assert plain[3] != plain[1]  # the parameters moved: gradients reached them through the recomputation


def test_bad_jacobian_cadence_fails_at_start_up_naming_the_key(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="jacobian.chart_every=0 must be >= 1"):
        run(compose_cfg(*TINY, "jacobian.chart_every=0"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jacobian_scalars_are_logged_at_the_step_jacobian_npz_records(compose_cfg, tmp_path):
    """Step s means the weights after s updates, in metrics.jsonl as in jacobian.npz (once per step)."""
    import numpy as np

    from analysis.topology import prefixed, topology_metrics

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


def test_profile_chart_draws_at_most_chart_points_with_both_ends():
    from types import SimpleNamespace

    import numpy as np

    from analysis.prior import prior_profile
    from analysis.topology import prefixed, topology_metrics
    from train import CHART_POINTS, profile_charts

    rho = prior_profile(1000, 4, 0.3)
    metrics = prefixed(topology_metrics(rho, 4), "vanilla")
    table = profile_charts({"vanilla": SimpleNamespace(profile=rho[None])}, metrics, 4, 7)["jacobian/vanilla/profile"].table
    measured = [(x, y) for x, key, y in table.data if key == "measured"]
    assert len(measured) == CHART_POINTS < 1000
    assert measured[0] == (0.0, pytest.approx(np.log10(rho[0]))) and measured[-1] == (1.0, pytest.approx(np.log10(rho[-1])))


def test_offline_wandb_run_logs_profile_charts(compose_cfg, tmp_path):
    """The wandb path (offline, no account): profile line charts and scalars reach the run files."""
    run(compose_cfg(*TINY, "trainer.max_steps=2", "logger.mode=offline", "jacobian=hutchinson",
                    "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/jacobian/*/profile_*.table.json"))
    assert {p.parent.name for p in tables} == {"vanilla", "chunked"}
    chart = json.loads(tables[0].read_text())
    assert len(chart["data"]) == 2 * 64  # two curves over every position of L = 64 (<= CHART_POINTS)
