"""Ms-PoE (models/ms_poe.py): exact at unit ratios, the reference's head statistic and ratio rule, per-head
RoPE scales, the order held through decoding, exact restoration, and the models it refuses."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

import models.attention.ms_poe as ms_poe_module
from models.attention.ms_poe import MsPoEConfig, assign_ratios, check_ms_poe, ms_poe, ratio_table
from models.build import Attention, AttnImplementation, ModelConfig, build_model

VOCAB, L, PAD = 97, 14, 0
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
INIT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            intermediate_size=64)
# Qwen2 with a sliding window on layers >= 1 (a mix of full and sliding layers), Mistral with a window
# shorter than the prompt: the windowed masks and caches are exercised along with the plain ones.
ARCH_INIT = {
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "llama": {},
    "mistral": dict(sliding_window=6),
}
UNIT = MsPoEConfig(ratio_min=1.0, ratio_max=1.0, layers="all")


def tiny(arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float64,
         **kw) -> torch.nn.Module:
    """A random-init model (float64 unless told) whose query/key weights are scaled up: at the default
    init every attention map is near uniform, and neither RoPE scales nor the outlier statistic would show."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=arch, init={**INIT, **ARCH_INIT[arch]}, attn_implementation=AttnImplementation(attn), **kw)
    model = build_model(cfg, VOCAB, pad_token_id=PAD).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # never stop early: every run decodes the same steps
    return model


def prompts(seed: int = 1, pad: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two prompts, the first `pad` tokens shorter and left-padded: ids, mask, position ids (as generate)."""
    ids = torch.randint(1, VOCAB, (2, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = PAD, 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def logits(model, ids, mask, pos) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos).logits


def generate(model, ids, mask, steps: int = 4):
    return model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)


def decode(model, ids, mask, steps: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding by hand with a DynamicCache: the tokens (B, L + steps) and each step's float64 logits
    (`generate` returns float32 ones)."""
    cache, step_logits = DynamicCache(config=model.config), []
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    new, tokens = ids, ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(new, attention_mask=mask, position_ids=pos[:, -new.shape[1]:], cache=cache, use_cache=True)
            step_logits.append(out.logits[:, -1])
            new = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            pos = torch.cat([pos, pos[:, -1:] + 1], dim=1)
    return tokens, step_logits


def attention_inputs(model, layer: int) -> dict:
    """Records the keyword inputs of `layer`'s attention on each call (hidden states, mask, positions)."""
    seen: dict = {}
    model.model.layers[layer].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.setdefault("calls", []).append(kw), with_kwargs=True)
    return seen


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x (L, d) by angles positions (L,) x theta^(-2i/d), in float64 (HF's half-split layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv_freq  # (L, d/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# eager runs unpadded prompts: HF's eager softmax runs in float32, where a float64 mask's dtype min is -inf,
# so the fully masked rows of pad queries give NaN, which reaches the real tokens of the next layer (in the
# plain model too)
@pytest.mark.parametrize(
    "arch,attn,pad", [("qwen2", "sdpa", 4), ("llama", "sdpa", 4), ("mistral", "sdpa", 4), ("qwen2", "eager", 0)]
)
def test_unit_ratios_are_the_plain_model(arch, attn, pad):
    model = tiny(arch, attn)
    ids, mask, pos = prompts(pad=pad)
    plain, plain_gen, plain_dec = logits(model, ids, mask, pos), generate(model, ids, mask), decode(model, ids, mask)
    with ms_poe(model, UNIT) as state:
        patched, patched_gen = logits(model, ids, mask, pos), generate(model, ids, mask)
        patched_dec = decode(model, ids, mask)
    assert len(state.layers) == INIT["num_hidden_layers"]
    assert torch.equal(patched, plain)  # float64, same arithmetic: bit-identical
    assert torch.equal(patched_dec[0], plain_dec[0])
    for step_patched, step_plain in zip(patched_dec[1], plain_dec[1], strict=True):  # cached decoding steps
        torch.testing.assert_close(step_patched, step_plain, rtol=0, atol=1e-12)
    assert torch.equal(patched_gen.sequences, plain_gen.sequences)
    for step_patched, step_plain in zip(patched_gen.logits, plain_gen.logits, strict=True):
        torch.testing.assert_close(step_patched, step_plain, rtol=0, atol=1e-12)


def test_head_order_is_the_reference_statistic():
    """The order equals a hand computation of `_calculate_outlier` on the last prompt token's attention,
    from the layer's unrotated q/k over each row's real keys; a padded row gets its unpadded order."""
    layer, model = 2, tiny("llama", seed=3)
    ids, mask, pos = prompts(seed=5)
    seen = attention_inputs(model, layer)
    with ms_poe(model, MsPoEConfig(layers=[layer])) as state:
        logits(model, ids, mask, pos)
        order, scores = state.layers[layer].head_order.clone(), state.layers[layer].scores.clone()
        alone = logits(model, ids[:1, 4:], mask[:1, 4:], pos[:1, 4:])  # row 0 without its padding
        order_alone = state.layers[layer].head_order.clone()
    assert alone.shape[0] == 1
    attn, h = model.model.layers[layer].self_attn, seen["calls"][0]["hidden_states"]
    with torch.no_grad():
        for b in range(2):
            real = mask[b].bool()
            x = h[b, real]  # (n, D): the row's real tokens
            q = attn.q_proj(x[-1]).view(HEADS, HEAD_DIM)  # last query, unrotated
            k = attn.k_proj(x).view(-1, KV_HEADS, HEAD_DIM)  # (n, Hkv, d), unrotated
            share = torch.empty(HEADS, dtype=torch.float64)
            for head in range(HEADS):
                w = torch.softmax(k[:, head // (HEADS // KV_HEADS)] @ q[head] / HEAD_DIM ** 0.5, dim=0)
                share[head] = (w > 3 * w.mean()).double().mean()
            torch.testing.assert_close(scores[b], share, rtol=0, atol=1e-12)
            expected = torch.argsort(-share, stable=True)  # the reference's `outlier.argsort()`, outlier = -share
            assert torch.equal(order[b], expected), (b, order[b], share)
    assert torch.equal(order_alone[0], order[0])
    assert not torch.equal(order, torch.arange(HEADS).expand(2, HEADS))  # a non-trivial order was checked


def test_ratio_rule_follows_the_reference():
    table = ratio_table(MsPoEConfig(endpoint=False), HEADS)  # the code's r_k = 1.2 + 0.6 k / H: 1.8 not reached
    torch.testing.assert_close(table, torch.tensor([1.2, 1.35, 1.5, 1.65]))
    torch.testing.assert_close(ratio_table(MsPoEConfig(), HEADS), torch.linspace(1.2, 1.8, HEADS))  # the paper's
    assert torch.equal(ratio_table(UNIT, HEADS), torch.ones(HEADS))
    order = torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]])
    ref, rank = assign_ratios(order, table, "reference"), assign_ratios(order, table, "rank")
    for b in range(2):
        for i in range(HEADS):
            assert ref[b, i] == table[order[b, i]]  # `cos[self.head_order]`: head h reads row order[h]
            assert rank[b, order[b, i]] == table[i]  # the i-th most outlier-rich head gets the i-th ratio

    model = tiny("qwen2", seed=3)
    ids, mask, pos = prompts(seed=5)
    for assignment in ("reference", "rank"):
        with ms_poe(model, MsPoEConfig(layers="all", assignment=assignment, endpoint=False)) as state:
            logits(model, ids, mask, pos)
        for layer in state.layers.values():
            assert torch.equal(layer.ratios, assign_ratios(layer.head_order, table, assignment))
    with ms_poe(model, MsPoEConfig(layers="all", head_type="normal", endpoint=False)) as state:  # order H-1..0
        logits(model, ids, mask, pos)
    for layer in state.layers.values():
        assert layer.scores is None
        assert torch.equal(layer.head_order, torch.arange(HEADS - 1, -1, -1).expand(2, HEADS))
        assert torch.equal(layer.ratios, table.flip(0).expand(2, HEADS))


def test_each_head_attends_at_its_own_scale():
    """Eager attention maps of a patched GQA layer equal softmax(rot(q, p/r_h) · rot(k, p/r_h)) computed
    by hand per head (each query head with keys rotated at its own ratio, not its group's first head's).
    float32: see test_unit_ratios_are_the_plain_model on float64 eager with padding."""
    layer, model = 1, tiny("llama", attn="eager", seed=3, dtype=torch.float32)
    theta = model.config.rope_parameters["rope_theta"]
    ids, mask, pos = prompts(seed=5)
    seen = attention_inputs(model, layer)
    with ms_poe(model, MsPoEConfig(layers=[layer], head_type="normal")) as state, torch.no_grad():
        maps = model(ids, attention_mask=mask, position_ids=pos, output_attentions=True).attentions[layer]
    ratios = state.layers[layer].ratios
    assert state.layers[layer].per_head_keys  # ratios differ inside each KV group
    attn, h = model.model.layers[layer].self_attn, seen["calls"][0]["hidden_states"]
    with torch.no_grad():
        for b in range(2):
            real = mask[b].bool()
            x, p = h[b, real], pos[b, real]
            q = attn.q_proj(x).view(-1, HEADS, HEAD_DIM)
            k = attn.k_proj(x).view(-1, KV_HEADS, HEAD_DIM)
            for head in range(HEADS):
                scaled = p.double() / ratios[b, head].double()
                qr = rope(q[:, head], scaled, theta)
                kr = rope(k[:, head // (HEADS // KV_HEADS)], scaled, theta)
                causal = torch.ones(len(p), len(p), dtype=torch.bool).tril()
                expected = (qr @ kr.T / HEAD_DIM ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
                got = maps[b, head][real][:, real]
                torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)


def test_nonunit_ratios_change_the_model_which_is_restored_exactly():
    model = tiny("qwen2")
    ids, mask, pos = prompts()
    plain = logits(model, ids, mask, pos)
    modules = [layer.self_attn for layer in model.model.layers]
    with ms_poe(model) as state:  # defaults: 1.2..1.8 on every layer but the first two
        assert sorted(state.layers) == [2]
        assert "forward" in modules[2].__dict__ and "forward" not in modules[1].__dict__
        changed = logits(model, ids, mask, pos)
        with pytest.raises(RuntimeError, match="already installed"):
            with ms_poe(model):
                pass
    assert (changed - plain).abs().max() > 1e-3  # not vacuous
    assert torch.equal(logits(model, ids, mask, pos), plain)
    for module in modules:
        assert "forward" not in module.__dict__
        assert module.forward.__func__ is type(module).forward

    with pytest.raises(KeyError):  # an error inside the context restores the model too
        with ms_poe(model, MsPoEConfig(layers="all")):
            logits(model, ids, mask, pos)
            raise KeyError("boom")
    assert all("forward" not in module.__dict__ for module in modules)
    assert torch.equal(logits(model, ids, mask, pos), plain)


def test_head_order_is_computed_at_prefill_and_held_while_decoding(monkeypatch):
    model = tiny("qwen2", seed=3)
    ids, mask, _ = prompts(seed=5)
    calls = []
    original = ms_poe_module.outlier_scores
    monkeypatch.setattr(ms_poe_module, "outlier_scores", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    with ms_poe(model, MsPoEConfig(layers="all")) as state:
        out = generate(model, ids, mask, steps=4)
        assert out.sequences.shape[1] == L + 4
        assert len(calls) == len(state.layers)  # once per layer, on the prefill only
        assert all(shape[2] == L for shape in calls)  # from the full prompt
        assert all(layer.num_prefills == 1 for layer in state.layers.values())
        first = {i: layer.head_order for i, layer in state.layers.items()}
        generate(model, ids[:, 3:], mask[:, 3:], steps=2)  # a new prompt: a new prefill, a new order
        assert all(layer.num_prefills == 2 for layer in state.layers.values())
        assert all(state.layers[i].head_order is not first[i] for i in first)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_cached_decoding_matches_a_full_forward(arch):
    """With a fixed head order (head_type="normal": ratios differ inside GQA groups, so keys are cached per
    query head), each cached decoding step's logits equal a cache-free forward over the whole sequence:
    the new query/key use the prefill's ratios and the cached keys were stored rotated consistently."""
    model = tiny(arch)
    ids, mask, _ = prompts()
    with ms_poe(model, MsPoEConfig(layers="all", head_type="normal")) as state:
        tokens, step_logits = decode(model, ids, mask, steps=4)
        assert all(layer.per_head_keys for layer in state.layers.values())
        assert all(layer.num_prefills == 1 for layer in state.layers.values())
        full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
        full = logits(model, tokens, full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0))
        gen = generate(model, ids, mask, steps=4)
    assert torch.equal(gen.sequences, tokens)
    for step, logits_at_step in enumerate(step_logits):
        torch.testing.assert_close(logits_at_step, full[:, L - 1 + step], rtol=0, atol=1e-12)


def test_check_ms_poe_names_the_reason():
    check_ms_poe(tiny("qwen2"))  # applies: no error
    nope = tiny("llama", rope=False)
    with pytest.raises(ValueError, match="no position encoding"):
        check_ms_poe(nope)
    with pytest.raises(ValueError, match="no position encoding"):
        with ms_poe(nope):
            pass
    diff = tiny("qwen2", attention=Attention.diff_v2)
    with pytest.raises(ValueError, match="differential-attention"):
        check_ms_poe(diff)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        check_ms_poe(gpt2)
    with pytest.raises(ValueError, match=r"ms_poe.layers=\[5\] selects none of the 3"):
        with ms_poe(tiny("qwen2"), MsPoEConfig(layers=[5])):
            pass
    with pytest.raises(ValueError, match="ratio_min <= ratio_max"):
        MsPoEConfig(ratio_min=1.8, ratio_max=1.2)
