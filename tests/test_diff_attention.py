"""Differential attention: paper equations, causality, retrofit exactness, checkpoints, LoRA, init prior."""

import copy
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from models.attention.diff_attention import (
    RETROFIT_WARMUP_STEPS,
    convert_to_diff_attention,
    diff_lambda_stats,
    load_pretrained_with_diff,
    set_diff_step,
)

VOCAB = 100
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # a window shorter than the test sequences, so that the sliding-window path is exercised
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run as fast on one thread, and far steadier when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str = "qwen2", layers: int = 2, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=layers, vocab_size=VOCAB, **{**extra, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def perturb(module: torch.nn.Module, std: float = 0.3, seed: int = 2) -> None:
    """Move every parameter off its initialization, so that no map is uniform and no bias is zero."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * std)


def negative_map_params(model) -> dict[str, torch.nn.Parameter]:
    keys = ("q2_proj", "k2_proj", "diff_lambda", "lambda_proj")
    return {n: p for n, p in model.named_parameters() if any(k in n for k in keys)}


# ---------------------------------------------------------------- the paper's equations, written out


def naive_rope(x, cos, sin):  # x (B, h, L, d), cos/sin (B, L, d)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def causal_softmax(q, k):  # (B, L, d), (B, L, d) -> (B, L, L)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)


def naive_heads(x, linear, n_heads, width):  # -> (B, n_heads, L, width)
    y = x @ linear.weight.T + (linear.bias if linear.bias is not None else 0)
    return y.view(*x.shape[:2], n_heads, width).transpose(1, 2)


def naive_v1(attn, x, cos, sin, layer_number):
    """DIFF V1: H/2 heads, two d-wide maps, 2d-wide values, λ re-parameterization, head RMSNorm."""
    d, config = attn.head_dim, attn.config
    heads, kv_heads = config.num_attention_heads // 2, config.num_key_value_heads // 2
    q1 = naive_rope(naive_heads(x, attn.q_proj, heads, d), cos, sin)
    q2 = naive_rope(naive_heads(x, attn.q2_proj, heads, d), cos, sin)
    k1 = naive_rope(naive_heads(x, attn.k_proj, kv_heads, d), cos, sin)
    k2 = naive_rope(naive_heads(x, attn.k2_proj, kv_heads, d), cos, sin)
    v = naive_heads(x, attn.v_proj, kv_heads, 2 * d)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * (layer_number - 1))
    p = attn.diff_lambda
    lam = torch.exp((p.lambda_q1 * p.lambda_k1).sum()) - torch.exp((p.lambda_q2 * p.lambda_k2).sum())
    lam = lam + lam_init
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)  # GQA: the key/value head this query head reads
        o = (causal_softmax(q1[:, h], k1[:, g]) - lam * causal_softmax(q2[:, h], k2[:, g])) @ v[:, g]
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.head_norm.weight
        outs.append(o * (1 - lam_init))
    return attn.o_proj(torch.cat(outs, dim=-1))


def naive_v2(attn, x, cos, sin, ramp):
    """DIFF V2: 2H query heads sharing the K/V heads, λ = sigmoid(W_λ x) per token and head, no norm."""
    d, heads, kv_heads = attn.head_dim, attn.config.num_attention_heads, attn.config.num_key_value_heads
    q1 = naive_rope(naive_heads(x, attn.q_proj, heads, d), cos, sin)
    q2 = naive_rope(naive_heads(x, attn.q2_proj, heads, d), cos, sin)
    k = naive_rope(naive_heads(x, attn.k_proj, kv_heads, d), cos, sin)
    v = naive_heads(x, attn.v_proj, kv_heads, d)
    lam = ramp * torch.sigmoid(x @ attn.lambda_proj.weight.T)  # (B, L, H)
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        o1, o2 = causal_softmax(q1[:, h], k[:, g]) @ v[:, g], causal_softmax(q2[:, h], k[:, g]) @ v[:, g]
        outs.append(o1 - lam[..., h, None] * o2)
    return attn.o_proj(torch.cat(outs, dim=-1))


def run_attention(model, attn, mask_kind, length=12):
    x = torch.randn(2, length, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    cos, sin = model.model.rotary_emb(x, torch.arange(length)[None])
    mask = None
    if mask_kind == "additive":
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # (1, 1, L, L)
    with torch.no_grad():
        out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
    return x, cos, sin, out


@pytest.mark.parametrize("impl,mask_kind", [("sdpa", None), ("sdpa", "additive"), ("eager", "additive")])
def test_v1_matches_paper_equations(impl, mask_kind):
    model = tiny_model(layers=3, attn_implementation=impl)
    convert_to_diff_attention(model, version="v1", mode="scratch")
    attn = model.model.layers[2].self_attn
    perturb(attn)
    x, cos, sin, out = run_attention(model, attn, mask_kind)
    with torch.no_grad():
        ref = naive_v1(attn, x, cos, sin, layer_number=3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # same parameter count as the standard attention it replaced
    std_attn = tiny_model(layers=3).model.layers[2].self_attn
    diff_only = sum(p.numel() for n, p in attn.named_parameters() if "lambda" in n or "head_norm" in n)
    n_std = sum(p.numel() for p in std_attn.parameters())
    assert sum(p.numel() for p in attn.parameters()) - diff_only == n_std


@pytest.mark.parametrize("impl,mask_kind", [("sdpa", None), ("eager", "additive")])
def test_v2_matches_paper_equations(impl, mask_kind):
    model = tiny_model(layers=2, attn_implementation=impl)
    convert_to_diff_attention(model, version="v2", mode="scratch", lambda_warmup_steps=4)
    set_diff_step(model, 3)
    attn = model.model.layers[1].self_attn
    perturb(attn)
    x, cos, sin, out = run_attention(model, attn, mask_kind)
    with torch.no_grad():
        ref = naive_v2(attn, x, cos, sin, ramp=0.75)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- model-level behaviour


def diff_model(version: str, mode: str, family: str = "qwen2", layers="all"):
    """A converted tiny model with every map away from its initialization and λ fully ramped in."""
    model = tiny_model(family)
    convert_to_diff_attention(model, version=version, mode=mode, layers=layers,
                              lambda_warmup_steps=2 if mode == "retrofit" else 0)
    set_diff_step(model, 2)
    perturb(model, std=0.05)
    return model


@pytest.mark.parametrize("version,mode", [("v1", "scratch"), ("v2", "scratch"), ("v1", "retrofit")])
def test_causality(version, mode):
    model = diff_model(version, mode)
    ids = tokens(length=20)
    changed = ids.clone()
    changed[:, 13] = (changed[:, 13] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :13], b[:, :13])
    assert not torch.allclose(a[:, 13:], b[:, 13:])


@pytest.mark.parametrize("version,mode", [("v1", "scratch"), ("v2", "scratch"), ("v1", "retrofit")])
def test_generate_with_cache_matches_stepwise_argmax(version, mode):
    model = diff_model(version, mode)
    prompt = tokens(batch=1, length=7)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        seq = prompt
        for _ in range(6):  # no cache: re-run the whole prefix every step
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(generated, seq)


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_retrofit_is_exact_at_step_zero(family, version):
    original = tiny_model(family)
    perturb(original, std=0.05)  # a "pretrained" model: attention maps far from uniform
    model = convert_to_diff_attention(copy.deepcopy(original), version=version, mode="retrofit",
                                      lambda_warmup_steps=5)
    ids = tokens(length=20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=0)
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1, :6], **kwargs), original.generate(ids[:1, :6], **kwargs))


def test_retrofit_with_its_defaults_ramps_lambda_in_and_is_exact_at_step_zero():
    original = tiny_model()
    perturb(original, std=0.05)
    model = convert_to_diff_attention(copy.deepcopy(original), mode="retrofit")
    assert model.config.diff_attention["lambda_warmup_steps"] == RETROFIT_WARMUP_STEPS > 0
    ids = tokens(length=20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=0)
    assert convert_to_diff_attention(tiny_model()).config.diff_attention["lambda_warmup_steps"] == 0  # scratch


@pytest.mark.parametrize("family,version", [("qwen2", "v1"), ("llama", "v1"), ("qwen2", "v2")])
def test_retrofit_learns_the_negative_map(family, version):
    model = tiny_model(family)
    perturb(model, std=0.05)
    convert_to_diff_attention(model, version=version, mode="retrofit", lambda_warmup_steps=3)
    model.train()
    negative = negative_map_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = tokens(batch=4, length=24)
    losses = []
    for step in range(8):
        set_diff_step(model, step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grad_norms = {n: p.grad.norm().item() for n, p in negative.items()}
        if step == 0:  # the ramp is 0: the negative map is off and gets no gradient yet
            assert all(g == 0 for g in grad_norms.values()), grad_norms
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # key biases shift every score of a row alike, so softmax gives them no gradient: weights only
    assert all(g > 0 for n, g in grad_norms.items() if not n.endswith("bias")), grad_norms
    assert losses[-1] < losses[0] - 0.1, losses
    assert diff_lambda_stats(model)["diff/layer0/lambda_max"] > 0


def test_warmup_ramp_and_lambda_stats():
    model = tiny_model(layers=3)
    convert_to_diff_attention(model, version="v1", mode="scratch", layers=[0, 2], lambda_warmup_steps=4)
    assert model.config.diff_attention == {"version": "v1", "mode": "scratch", "layers": [0, 2],
                                           "lambda_warmup_steps": 4}
    assert type(model.model.layers[1].self_attn).__name__ == "Qwen2Attention"
    attn = model.model.layers[2].self_attn
    p = attn.diff_lambda
    lam = (torch.exp(p.lambda_q1 @ p.lambda_k1) - torch.exp(p.lambda_q2 @ p.lambda_k2)).item()
    lam += 0.8 - 0.6 * math.exp(-0.3 * 2)
    for step, ramp in [(0, 0.0), (2, 0.5), (4, 1.0), (9, 1.0)]:
        set_diff_step(model, step)
        stats = diff_lambda_stats(model)
        assert set(stats) == {f"diff/layer{i}/lambda_{s}" for i in (0, 2) for s in ("mean", "min", "max")}
        assert stats["diff/layer2/lambda_mean"] == pytest.approx(ramp * lam, abs=1e-6)

    v2 = convert_to_diff_attention(tiny_model(), version="v2")
    assert diff_lambda_stats(v2) == {}  # V2's λ is per token: nothing to report before a forward
    with torch.no_grad():
        v2(tokens())
    stats = diff_lambda_stats(v2)
    low, mean, high = (stats[f"diff/layer1/lambda_{s}"] for s in ("min", "mean", "max"))
    assert 0 < low < mean < high < 1

    with pytest.raises(ValueError, match="lambda_warmup_steps >= 1"):
        convert_to_diff_attention(tiny_model(), version="v1", mode="retrofit", lambda_warmup_steps=0)
    with pytest.raises(ValueError, match="already has diff attention"):
        convert_to_diff_attention(v2)


# ---------------------------------------------------------------- checkpoints and LoRA


@pytest.mark.parametrize("version,mode,layers", [("v1", "scratch", "all"), ("v1", "retrofit", [1]),
                                                 ("v2", "retrofit", "all")])
def test_save_load_roundtrip(tmp_path, version, mode, layers):
    model = diff_model(version, mode, layers=layers)
    set_diff_step(model, 1)  # mid warm-up for retrofit: the ramp must travel with the weights
    ids = tokens()
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2_diff" and config["diff_attention"]["version"] == version
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any("q2_proj" in k for k in f.keys())
    loaded = load_pretrained_with_diff(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    assert diff_lambda_stats(loaded).keys() <= diff_lambda_stats(model).keys()


def test_plain_load_fails_loudly_without_this_module(tmp_path):
    diff_model("v1", "scratch").save_pretrained(tmp_path)
    code = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    # the checkpoint carries its code, which a process runs only when told to
    assert result.returncode != 0 and "trust_remote_code" in result.stderr, result.stderr[-2000:]
    # the base class by name: V1 scratch's halved query/key projections do not fit it
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    # with this module imported, the plain Auto loader rebuilds the diff layers
    assert type(AutoModelForCausalLM.from_pretrained(str(tmp_path))).__name__ == "Qwen2DiffForCausalLM"


# Run in a fresh interpreter (-I: no PYTHONPATH, no script folder on sys.path) from a folder outside
# the repository: loads each checkpoint with its own modeling code and lists any module of this
# project that got imported (the editable install keeps the project importable, so this is checked).
LOAD_ELSEWHERE = """
import json, sys, torch
from transformers import AutoModelForCausalLM
repo, ids, folders = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), sys.argv[3:]
out = {}
for folder in folders:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        out[folder] = {"class": type(model).__module__ + "." + type(model).__name__,
                       "logits": model(ids).logits.tolist()}
project = sorted(name for name, module in sys.modules.items()
                 if (getattr(module, "__file__", None) or "").startswith(repo + "/")
                 and "/.venv/" not in module.__file__)
print(json.dumps({"models": out, "project_modules": project}))
"""


def test_checkpoint_loads_away_from_the_repo_with_trust_remote_code(tmp_path):
    """save_pretrained copies the modeling code: a folder copied anywhere loads without this project."""
    cases = {"qwen2-v1-scratch": ("qwen2", "v1", "scratch"), "llama-v1-retrofit": ("llama", "v1", "retrofit"),
             "mistral-v2-retrofit": ("mistral", "v2", "retrofit")}
    ids = tokens(batch=2, length=12)
    elsewhere, expected = tmp_path / "elsewhere", {}
    for name, (family, version, mode) in cases.items():
        model = diff_model(version, mode, family)
        set_diff_step(model, 1)  # mid warm-up for retrofit: the ramp must travel too
        with torch.no_grad():
            expected[name] = model(ids).logits
        model.save_pretrained(tmp_path / "saved" / name)
        config = json.loads((tmp_path / "saved" / name / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == f"diff_attention.{type(model).__name__}"
        shutil.copytree(tmp_path / "saved" / name, elsewhere / name)
    shutil.rmtree(tmp_path / "saved")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-I", "-c", LOAD_ELSEWHERE, repo, json.dumps(ids.tolist()),
                             *cases], capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["project_modules"] == []
    for name in cases:
        assert got["models"][name]["class"].startswith("transformers_modules."), got["models"][name]["class"]
        torch.testing.assert_close(torch.tensor(got["models"][name]["logits"]), expected[name], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- the closed-form prior at initialization


def jacobian_profile(model, ids):
    """rho(j) = ||d h_L / d e_j||_F exactly: one VJP per output coordinate, batched as copies of the input."""
    dim = model.config.hidden_size
    emb = model.get_input_embeddings()(ids).detach().expand(dim, -1, -1).clone()  # (D, L, D)
    emb.requires_grad_(True)
    # copy c of the input differentiates output coordinate c
    last = model.model(inputs_embeds=emb).last_hidden_state[:, -1]  # (D, D)
    last.diagonal().sum().backward()
    return emb.grad.pow(2).sum(dim=(0, 2)).sqrt()  # (L,)


def prior_profile(a: float, n_layers: int, length: int) -> torch.Tensor:
    """Last row of ((1-a) I + a M)^H by H vector steps (DESIGN: the closed-form prior)."""
    v = torch.zeros(length, dtype=torch.float64)
    v[-1] = 1.0
    i = torch.arange(1, length + 1, dtype=torch.float64)
    for _ in range(n_layers):
        v = (1 - a) * v + a * (v / i).flip(0).cumsum(0).flip(0)
    return v


def fitted_a(rho: torch.Tensor, n_layers: int) -> float:
    """The a whose prior best fits log rho with a free scale (grid search)."""
    log_rho = rho.double().log()
    errors = {}
    for a in torch.linspace(0.01, 0.99, 99).tolist():
        residual = log_rho - prior_profile(a, n_layers, len(rho)).log()
        errors[a] = (residual - residual.mean()).pow(2).mean().item()
    return min(errors, key=errors.get)


def test_init_jacobian_profile():
    """At step 0, V2 moves the profile toward recency (smaller fitted a); V1 flattens it (see module doc)."""
    n_layers, length = 3, 48
    ids = tokens(batch=1, length=length)
    rho = {}
    for kind in ("standard", "v1", "v2"):
        model = tiny_model(layers=n_layers, seed=5)
        if kind != "standard":
            convert_to_diff_attention(model, version=kind, mode="scratch")
        rho[kind] = jacobian_profile(model, ids)
    last = {k: (r[-1] / r.sum()).item() for k, r in rho.items()}
    middle = {k: (r[length // 4: 3 * length // 4].sum() / r.sum()).item() for k, r in rho.items()}
    primacy = {k: (r[:4].mean() / r[length // 4: 3 * length // 4].mean()).item() for k, r in rho.items()}
    # both diff variants are less primacy-heavy than standard attention at initialization
    assert primacy["v1"] < primacy["standard"] and primacy["v2"] < primacy["standard"], primacy
    # V2: (1 - λ)·M with λ ≈ 1/2 mixes less, so more of the profile sits on the last token
    assert last["v2"] > 1.5 * last["standard"], last
    assert fitted_a(rho["v2"], n_layers) < fitted_a(rho["standard"], n_layers)
    # V1: the per-head RMSNorm amplifies the averaged values, so mixing grows and the middle gains mass
    assert last["v1"] < last["standard"] and middle["v1"] > middle["standard"], (last, middle)


def test_bench_diff_rows():
    """The benchmark builds every variant through the project's builder and reports ratios to standard."""
    from scripts.bench_diff import VARIANTS, bench_diff

    rows = bench_diff(seq_len=64, shapes=("qwen2_tiny",), repeats=1)
    assert [row["name"] for row in rows] == [f"{name} qwen2_tiny L=64" for name, _, _ in VARIANTS]
    assert rows[0]["ratio"] == 1.0 and rows[0]["mem_ratio"] == 1.0
    assert all(row["ratio"] > 0 and row["mem_mb"] > 0 for row in rows)
    assert rows[1]["params"] != rows[0]["params"]  # V1 adds λ and the per-head norm: the swap happened


# ---------------------------------------------------------------- LoRA runs on a diff retrofit, end to end


def test_lora_run_trains_the_new_maps_and_its_checkpoint_merges(tmp_path):
    """`peft=lora` on a retrofit: q2/k2 get adapters and λ trains in full; the run keeps the converted
    base, and the checkpoint loads (ramp restored) and merges to what base + adapters compute."""
    from safetensors.torch import load_file

    from models.training.checkpoint import load_checkpoint_model
    from tests.conftest import TINY
    from train import compose_config, run

    run(compose_config([*TINY, "trainer.max_steps=1"]), tmp_path / "pretrained")
    pretrained = tmp_path / "pretrained" / "checkpoints" / "step-1"
    no_init = [o for o in TINY if not o.startswith("model.init.")]
    run_dir = tmp_path / "lora"
    run(compose_config([*no_init, "model=hf", f"model.pretrained={pretrained}", "model.attention=diff_v1",
                        "model.diff.lambda_warmup_steps=2", "peft=lora", "trainer.lr=1e-2",
                        "trainer.warmup_steps=0", "trainer.max_steps=4"]), run_dir)
    ckpt = run_dir / "checkpoints" / "step-4"
    adapters = load_file(ckpt / "adapter_model.safetensors")
    q2_b = [v for k, v in adapters.items() if "q2_proj.lora_B" in k]
    assert q2_b and all(v.abs().max() > 0 for v in q2_b), "the negative map's adapters never moved"
    assert any("k2_proj.lora_A" in k for k in adapters)
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base_model").eval()  # the converted base, at step 0
    assert base.config.diff_attention["mode"] == "retrofit"
    trained_lambda = {k: v for k, v in adapters.items() if "diff_lambda" in k}
    base_lambda = dict(base.named_parameters())
    assert trained_lambda and all(not torch.equal(v, base_lambda[k.replace("base_model.model.", "")
                                                                  .replace(".modules_to_save.default", "")])
                                  for k, v in trained_lambda.items() if "modules_to_save" in k)

    peft_model = load_checkpoint_model(ckpt, merge_lora=False)
    merged = load_checkpoint_model(ckpt)
    assert all(float(m.lambda_ramp) == 1.0 for m in merged.modules() if hasattr(m, "lambda_ramp"))
    ids = tokens(batch=2, length=20) % base.config.vocab_size
    with torch.no_grad():
        want = peft_model(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, atol=1e-5, rtol=0)
        assert (want - base(ids).logits).abs().max() > 1e-3  # the adapters changed the function
    # merged weight = base weight + (alpha / r) B A, for the zero-initialized negative query
    attn, scale = merged.model.layers[0].self_attn, 16 / 8
    a = next(v for k, v in adapters.items() if "layers.0.self_attn.q2_proj.lora_A" in k)
    b = next(v for k, v in adapters.items() if "layers.0.self_attn.q2_proj.lora_B" in k)
    torch.testing.assert_close(attn.q2_proj.weight, base.model.layers[0].self_attn.q2_proj.weight + scale * b @ a,
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------- attention kernels


@pytest.mark.parametrize("impl", ["eager", "flex_attention"])
def test_model_attn_implementation_reaches_the_diff_layers_and_computes_the_same(impl):
    """`model.attn_implementation` is passed to transformers and kept by the conversion; every kernel
    computes what sdpa computes, padding included (flex forward only: its backward needs a GPU)."""
    from models.build import ModelConfig, build_model

    init = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2)
    ids = tokens(batch=2, length=20)
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    for attention in ("diff_v1", "diff_v2"):
        logits = {}
        for kernel in ("sdpa", impl):
            torch.manual_seed(0)
            model = build_model(ModelConfig(init=init, attention=attention, attn_implementation=kernel), VOCAB).eval()
            assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "q2_proj")} == {kernel}
            with torch.no_grad():
                logits[kernel] = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(logits[impl][0], logits["sdpa"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[impl][1, :14], logits["sdpa"][1, :14], atol=1e-5, rtol=0)


def test_flash_attention_without_its_package_fails_at_start_up():
    from models.build import ModelConfig, validate_model

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: nothing to refuse")
    with pytest.raises(ValueError, match="flash_attention_2 needs the flash-attn package"):
        validate_model(ModelConfig(attn_implementation="flash_attention_2", dtype="bfloat16"))
