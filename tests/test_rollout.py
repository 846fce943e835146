"""Residual-aware rollout from a model's forward pass: captured maps, residual shares, head weights, variants.

References are dense and in float64: the eager implementation's `output_attentions`, the residual stream
recomputed layer by layer, and the explicit product of the N_t matrices.
"""
import copy

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from analysis.measure.prior import spearman, w1_distance
from analysis.measure.rollout import (
    FIXED_RESIDUAL,
    RolloutVariant,
    capture,
    decoder_layers,
    rollout_metrics,
    rollouts,
)
from models.attention.diff_attention import convert_to_diff_attention

L, VOCAB = 16, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL))
    elif kind == "mistral":  # a window shorter than the sequence: the mask must carry it
        model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=6))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
        version, mode = kind.split("_")[1:]
        convert_to_diff_attention(model, version=version, mode=mode)
    return model.double().eval()


def ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, L), generator=torch.Generator().manual_seed(1))


KINDS = ["qwen2", "llama", "mistral", "diff_v1_scratch", "diff_v2_scratch", "diff_v1_retrofit"]


@pytest.mark.parametrize("kind", KINDS)
def test_captured_maps_are_the_eager_output_attentions(kind):
    model = tiny(kind)
    model.set_attn_implementation("eager")
    x = ids()
    cap = capture(model, x, keep_heads=True)
    reference = model(input_ids=x, output_attentions=True).attentions  # per layer (B, nh, L, L)
    assert len(cap.heads) == len(reference) == 3
    for mine, theirs in zip(cap.heads, reference):
        np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=0, atol=1e-12)
    assert np.allclose(cap.mean_maps, np.stack([h.mean(axis=1) for h in cap.heads], axis=1), atol=1e-6)
    if kind == "mistral":  # the window cuts keys more than 5 positions back
        assert np.all(cap.heads[0][:, :, 10, :4] == 0) and np.all(cap.heads[0][:, :, 10, 5:11] > 0)


@pytest.mark.parametrize("kind", ["qwen2", "diff_v1_scratch"])
def test_captured_maps_under_sdpa_match_eager(kind):
    """The default attention runs the forward; the maps are still the model's (up to eager's float32 softmax)."""
    model = tiny(kind)
    x = ids()
    assert model.config._attn_implementation != "eager"
    cap = capture(model, x, keep_heads=True)
    assert model.config._attn_implementation != "eager"  # restored
    model.set_attn_implementation("eager")
    for mine, theirs in zip(cap.heads, model(input_ids=x, output_attentions=True).attentions):
        np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["qwen2", "diff_v2_scratch"])
def test_residual_shares_and_head_weights_by_hand(kind):
    model = tiny(kind)
    x = ids()
    cap = capture(model, x)
    hidden = model(input_ids=x, output_hidden_states=True).hidden_states  # input of layer t at index t
    base = model.model
    cos_sin = base.rotary_emb(hidden[0], torch.arange(L)[None].expand(len(x), L))
    for t, layer in enumerate(decoder_layers(model)):
        x_t = hidden[t]
        inner = {}
        handle = layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: inner.update(o=a[0]))
        a_t = layer.self_attn(hidden_states=layer.input_layernorm(x_t), position_embeddings=cos_sin,
                              attention_mask=None)[0]
        handle.remove()
        share = (a_t.norm(dim=-1) / (x_t.norm(dim=-1) + a_t.norm(dim=-1))).mean(dim=1)  # (B,)
        np.testing.assert_allclose(cap.residual_share[:, t], share.detach().numpy(), rtol=1e-10)
        # Head h's share: the norm of o_proj applied to that head's slice alone (the others zeroed).
        n_heads = cap.head_weights.shape[2]
        o = inner["o"].unflatten(-1, (n_heads, -1))  # (B, L, nh, dv)
        norms = []
        for h in range(n_heads):
            alone = torch.zeros_like(o)
            alone[:, :, h] = o[:, :, h]
            norms.append(torch.nn.functional.linear(alone.flatten(2), layer.self_attn.o_proj.weight).norm(dim=-1))
        strength = torch.stack(norms, dim=-1).mean(dim=1)  # (B, nh)
        np.testing.assert_allclose(cap.head_weights[:, t], (strength / strength.sum(-1, keepdim=True)).detach(),
                                   rtol=1e-10)


def dense_rollout(maps: np.ndarray, lambdas: np.ndarray) -> np.ndarray:
    """Last row of N_H ... N_1 by explicit matrix products (float64)."""
    n = maps.shape[-1]
    product = np.eye(n)
    for a, lam in zip(maps, lambdas):
        product = ((1 - lam) * np.eye(n) + lam * a) @ product
    return product[-1]


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "diff_v1_scratch"])
def test_every_variant_equals_the_dense_matrix_product(kind):
    cap = capture(tiny(kind), ids())
    got = rollouts(cap)
    assert set(got) == set(RolloutVariant)
    H = cap.residual_share.shape[1]
    for b in range(2):
        mean, weighted = cap.mean_maps[b].astype(np.float64), cap.weighted_maps[b].astype(np.float64)
        expected = {
            RolloutVariant.attention_only: dense_rollout(mean, np.ones(H)),
            RolloutVariant.fixed_residual: dense_rollout(mean, np.full(H, FIXED_RESIDUAL)),
            RolloutVariant.measured: dense_rollout(mean, cap.residual_share[b]),
            RolloutVariant.measured_heads: dense_rollout(weighted, cap.residual_share[b]),
        }
        for variant, row in expected.items():
            np.testing.assert_allclose(got[variant][b], row, rtol=0, atol=1e-10)
    if not kind.startswith("diff"):  # stochastic maps: every rollout is a distribution over positions
        for rows in got.values():
            np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-6)
            assert np.all(rows >= 0)


def test_rollout_metrics():
    profile = np.linspace(1.0, 3.0, 20) ** 2
    perfect = rollout_metrics(profile, 0.01 * profile)  # the scale is free
    assert perfect["spearman"] == pytest.approx(1.0) and perfect["w1"] == pytest.approx(0.0, abs=1e-12)
    assert perfect["rmse_log10"] == pytest.approx(0.0, abs=1e-12)
    reversed_ = rollout_metrics(profile, profile[::-1].copy())
    assert reversed_["spearman"] == pytest.approx(-1.0) and reversed_["w1"] > 0.1
    # Negative rollout entries (diff attention) are compared by magnitude.
    signed = profile * np.where(np.arange(20) % 2, 1.0, -1.0)
    assert rollout_metrics(profile, signed) == rollout_metrics(profile, np.abs(signed))
    assert rollout_metrics(profile, signed)["w1"] == w1_distance(profile, np.abs(signed))
    assert rollout_metrics(profile, signed)["spearman"] == spearman(profile, np.abs(signed))


def test_capture_leaves_the_model_as_it_was():
    model = tiny("qwen2").train()
    before = copy.deepcopy(model.state_dict())
    capture(model, ids())
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_rollout_study_reports_every_predictor_for_both_models(compose_cfg, tmp_path):
    from analysis.rollout_study import PRIOR_ROWS, main
    from tests.conftest import TINY
    from train import run

    run(compose_cfg(*TINY, "trainer.max_steps=3"), tmp_path / "run")
    out = tmp_path / "study"
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--seq-len", "32", "--n-seq", "1"]) == 0
    text = (out / "rollout_study.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| trained") or
            line.startswith("| random")]
    predictors = [*map(str, RolloutVariant), *PRIOR_ROWS]
    table = [r for r in rows if r[2] in predictors]  # model, set, predictor, three metrics
    assert {(r[0].lstrip("| "), r[1], r[2]) for r in table} == {
        (m, s, p) for m in ("trained (step 3)", "random init") for s in ("vanilla", "chunked") for p in predictors}
    assert all(-1.0 <= float(r[3]) <= 1.0 and float(r[4]) >= 0.0 for r in table)
    assert len([r for r in rows if r[-1].endswith("% |")]) == 4  # a reduction row per model and set
    assert (out / "rollout_study.png").stat().st_size > 0
    rope = text.split("## RoPE invariance at init")[1]
    rope_rows = [line.split(" | ") for line in rope.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rope_rows] == [
        ("| 32", str(s), name) for s in (0, 1, 2) for name in ("vanilla", "chunked")]
    assert all(-1.0 <= float(r[3].rstrip(" |")) <= 1.0 for r in rope_rows)


def test_rollout_study_of_a_checkpoint_alone_at_two_lengths_with_hutchinson(compose_cfg, tmp_path):
    """The real-model form: several lengths in one table (a row label per length), Hutchinson profiles, and
    neither random-init rows nor the RoPE check."""
    from analysis.rollout_study import PRIOR_W1_ROW, main
    from tests.conftest import TINY
    from train import run

    run(compose_cfg(*TINY, "trainer.max_steps=2"), tmp_path / "run")
    out = tmp_path / "study"
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--seq-len", "16,32", "--n-seq", "1",
                 "--estimator", "hutchinson", "--num-probes", "4", "--no-random-init"]) == 0
    text = (out / "rollout_study.md").read_text()
    assert "Hutchinson (4 probes per sequence" in text and "random" not in text and "RoPE" not in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| trained")]
    assert {(r[0].lstrip("| "), r[1]) for r in rows if r[2] == PRIOR_W1_ROW} == {
        (f"trained (step 2), L={L}", s) for L in (16, 32) for s in ("vanilla", "chunked")}


def test_training_logs_rollout_metrics_at_every_measured_step(compose_cfg, tmp_path):
    import json

    from analysis.measure.jacobian import read_jacobian
    from analysis.measure.rollout import ROLLOUT_METRICS, mean_rollout, record_name, rollout_metrics
    from models.training.run_dir import ROLLOUT
    from tests.conftest import TINY
    from train import run

    run(compose_cfg(*TINY, "trainer.max_steps=2", "jacobian=hutchinson", "jacobian.seq_len=64",
                    "jacobian.chunk_len=32", "jacobian.num_probes=2"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = {f"rollout/{s}/{v}/{m}" for s in ("vanilla", "chunked") for v in RolloutVariant for m in ROLLOUT_METRICS}
    measured = [r for r in rows if "prior/vanilla/alpha" in r]
    assert [r["step"] for r in measured] == [0, 1, 2] and all(keys <= set(r) for r in measured)
    # rollout.npz holds every sequence's rollouts at the jacobian.npz steps; the logged metrics are theirs.
    jac_steps, profiles = read_jacobian(tmp_path / "jacobian.npz")
    steps, rolls = read_jacobian(tmp_path / ROLLOUT)
    assert steps.tolist() == jac_steps.tolist() == [0, 1, 2]
    assert set(rolls) == {record_name(s, v) for s in ("vanilla", "chunked") for v in RolloutVariant}
    for k, row in enumerate(measured):
        profile = profiles["vanilla"][:, k].astype(np.float64).mean(axis=0)
        expected = rollout_metrics(profile, mean_rollout(rolls[record_name("vanilla", "measured")][:, k]))
        for m in ROLLOUT_METRICS:
            assert row[f"rollout/vanilla/measured/{m}"] == pytest.approx(expected[m], rel=1e-4, abs=1e-5)
    assert (tmp_path / "plots" / "jacobian_step0_vs_prior_vanilla.png").stat().st_size > 0
    # jacobian.rollout=false: neither the metrics nor the file.
    off = tmp_path / "off"
    run(compose_cfg(*TINY, "trainer.max_steps=1", "jacobian=hutchinson", "jacobian.seq_len=64",
                    "jacobian.chunk_len=32", "jacobian.num_probes=2", "jacobian.rollout=false"), off)
    assert not (off / ROLLOUT).exists() and "rollout/" not in (off / "metrics.jsonl").read_text()


def test_study_curves_keep_the_jacobian_apart_from_the_measured_lambda_rollout():
    from analysis.measure.jacobian import Estimator, JacobianConfig, measure_sets
    from analysis.rollout_study import JACOBIAN, PRIOR_ROWS, study_model

    model, seqs = tiny("qwen2").float(), {"vanilla": ids()}
    cfg = JacobianConfig(estimator=Estimator.exact, seq_len=L)
    rows, curves = study_model("tiny", model, seqs, cfg)
    assert list(curves["vanilla"]) == [JACOBIAN, *map(str, RolloutVariant), *PRIOR_ROWS]
    np.testing.assert_allclose(curves["vanilla"][JACOBIAN], measure_sets(model, seqs, cfg)["vanilla"].profile.mean(0))
    assert not np.allclose(curves["vanilla"][JACOBIAN], curves["vanilla"]["measured"])
    assert len(rows) == len(RolloutVariant) + len(PRIOR_ROWS)
