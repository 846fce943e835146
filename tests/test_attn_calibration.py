"""Attention calibration (models/attention/attn_calibration.py): Eq. 5 written out in float64, total document
attention kept, the identity under a zero reference (functions and whole models, through decoding), the dummy
references (per segment and shared) equal to eager attention maps, token spans of real prompts, restoration, and
the models it refuses."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

from data_builders.probes import Layout, kv_probe, mdqa_probe, synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models.attention.attn_calibration import (
    AttnCalibrationConfig,
    Reference,
    ReferenceCache,
    Weighting,
    attn_calibration,
    check_attn_calibration,
    redistribute,
    segment_attention,
    token_spans,
)
from models.attention.ms_poe import MsPoEConfig, ms_poe
from models.build import Attention
from tests.test_ms_poe import PAD, VOCAB, tiny

IDENTITY = AttnCalibrationConfig(layers="all", weighting="proportional", reference="zero")
SEGMENTS = [[(2, 6), (6, 10), (10, 14)], [(1, 5), (5, 12), (12, 18)]]  # token ranges of rows 0 and 1
WIDTH, ROW0_PAD = 24, 4


class StubTokenizer:
    """What the calibration asks of a tokenizer when prompts come as ids: the dummy text's tokens."""

    is_fast = True

    def __call__(self, text, add_special_tokens=False, **kwargs):
        return {"input_ids": [5, 6, 7]}


def random_rows(seed: int, batch=2, heads=3, queries=4, keys=20, dtype=torch.float64):
    """Softmax rows, segment labels with gaps (-1) and an empty segment, and a reference."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(batch, heads, queries, keys, generator=g, dtype=dtype).mul(2).softmax(-1)
    segment_of_key = torch.full((batch, keys), -1)
    segment_of_key[0, 2:6], segment_of_key[0, 7:12], segment_of_key[0, 12:15] = 0, 1, 2
    segment_of_key[1, 0:9], segment_of_key[1, 10:16] = 0, 2  # segment 1 absent from row 1
    reference = torch.rand(batch, heads, 3, generator=g, dtype=dtype) / keys
    return probs, segment_of_key, reference


def eq5_written_out(probs, segment_of_key, reference, weighting, t):
    """Eq. 5 of Hsieh et al. one row at a time, in float64 Python arithmetic."""
    out = probs.clone()
    batch, heads, queries, _ = probs.shape
    for b in range(batch):
        segments = sorted({int(s) for s in segment_of_key[b] if s >= 0})
        tokens = {k: [i for i, s in enumerate(segment_of_key[b].tolist()) if s == k] for k in segments}
        for h in range(heads):
            for q in range(queries):
                row = probs[b, h, q].tolist()
                attn = {k: sum(row[i] for i in tokens[k]) / len(tokens[k]) for k in segments}  # Attn(x_k, k)
                rel = {k: attn[k] - float(reference[b, h, k]) for k in segments}
                if weighting == "softmax":
                    top = max(rel.values())
                    weights = {k: math.exp((rel[k] - top) / t) for k in segments}
                else:
                    weights = {k: max(rel[k], 0.0) for k in segments}
                alpha = {k: w / sum(weights.values()) for k, w in weights.items()}
                total = sum(row[i] for k in segments for i in tokens[k])
                rescaled = {k: alpha[k] / attn[k] for k in segments}
                c = total / sum(rescaled[k] * row[i] for k in segments for i in tokens[k])
                for k in segments:
                    for i in tokens[k]:
                        out[b, h, q, i] = c * rescaled[k] * row[i]
    return out


@pytest.mark.parametrize("weighting,t", [("softmax", 5e-5), ("softmax", 0.02), ("proportional", 1.0)])
def test_redistribution_is_eq5_written_out(weighting, t):
    probs, segment_of_key, reference = random_rows(0)
    if weighting == "proportional":
        reference = reference * 0.2  # every relevance positive: Eq. 5 with weights max(rel, 0) has no empty row
    got = redistribute(probs, segment_of_key, reference, weighting, t)
    torch.testing.assert_close(got, eq5_written_out(probs, segment_of_key, reference, weighting, t),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("weighting", list(Weighting))
def test_each_query_keeps_its_total_document_attention(dtype, tol, weighting):
    probs, segment_of_key, reference = random_rows(1, dtype=dtype)
    got = redistribute(probs, segment_of_key, reference, weighting, 5e-5 if weighting == "softmax" else 1.0)
    inside = (segment_of_key >= 0)[:, None, None, :]
    torch.testing.assert_close((got * inside).sum(-1), (probs * inside).sum(-1), rtol=0, atol=tol)
    assert torch.equal(got * ~inside, probs * ~inside)  # attention outside the documents untouched
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), rtol=0, atol=tol)
    # within a document the tokens keep their proportions (settings under which no document drops to 0)
    got = redistribute(probs, segment_of_key, reference * 0.01, weighting, 0.02 if weighting == "softmax" else 1.0)
    for b, k in ((0, 1), (1, 2)):
        tokens = segment_of_key[b] == k
        torch.testing.assert_close(got[b][..., tokens] / got[b][..., tokens].sum(-1, keepdim=True),
                                   probs[b][..., tokens] / probs[b][..., tokens].sum(-1, keepdim=True),
                                   rtol=0, atol=tol)


def test_document_means_follow_the_softmax_of_calibrated_relevance():
    """Eq. 6: after the rescaling each document's mean attention is proportional to softmax(rel / t)."""
    probs, segment_of_key, reference = random_rows(2)
    t = 0.01
    got = redistribute(probs, segment_of_key, reference, "softmax", t)
    before, after = segment_attention(probs, segment_of_key, 3), segment_attention(got, segment_of_key, 3)
    rel = before[0] - reference[0][:, None, :]
    alpha = (rel / t).softmax(-1)
    torch.testing.assert_close(after[0] / after[0].sum(-1, keepdim=True), alpha, rtol=0, atol=1e-12)
    # the document with the largest calibrated relevance gains, whatever its raw attention
    best = rel.argmax(-1)
    assert bool((after[0].gather(-1, best[..., None]) >= before[0].gather(-1, best[..., None])).all())


def test_zero_reference_proportional_is_the_identity_and_rows_without_documents_stay():
    probs, segment_of_key, reference = random_rows(3)
    same = redistribute(probs, segment_of_key, torch.zeros_like(reference), "proportional", 1.0)
    torch.testing.assert_close(same, probs, rtol=0, atol=1e-15)
    none = torch.full_like(segment_of_key, -1)
    assert torch.equal(redistribute(probs, none, reference, "softmax", 5e-5), probs)
    # proportional with every relevance <= 0 leaves the row as it is
    assert torch.equal(redistribute(probs, segment_of_key, reference + 1.0, "proportional", 1.0), probs)


def batch_inputs(seed: int = 3, pad: int = ROW0_PAD):
    """Two left-padded prompts (row 0 `pad` tokens shorter), their ids without padding, and the segments."""
    ids = torch.randint(1, VOCAB, (2, WIDTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = PAD, 0
    return ids, mask, [ids[0, pad:].tolist(), ids[1].tolist()]


def prefill_and_decode(model, ids, mask, steps: int = 3) -> list[torch.Tensor]:
    """The prefill logits (B, L, V), then each greedy decoding step's (B, V), with a DynamicCache (as generate)."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    outs, new = [], ids
    with torch.no_grad():
        for step in range(steps + 1):
            logits = model(new, attention_mask=mask, position_ids=pos[:, -new.shape[1]:], cache=cache,
                           use_cache=True).logits
            outs.append(logits if step == 0 else logits[:, -1])
            new = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            pos = torch.cat([pos, pos[:, -1:] + 1], dim=1)
    return outs


# eager runs unpadded prompts (see tests/test_ms_poe.py: HF's float32 eager softmax NaNs fully masked pad rows)
@pytest.mark.parametrize("arch,attn,pad", [("qwen2", "sdpa", 4), ("llama", "sdpa", 4), ("mistral", "sdpa", 4),
                                           ("qwen2", "eager", 0)])
def test_zero_reference_equals_the_plain_model_through_decoding(arch, attn, pad):
    model = tiny(arch, attn)
    ids, mask, prompts = batch_inputs(pad=pad)
    plain = prefill_and_decode(model, ids, mask)
    with attn_calibration(model, StubTokenizer(), IDENTITY) as calibration:
        with calibration.batch(prompts, SEGMENTS, WIDTH):
            calibrated = prefill_and_decode(model, ids, mask)
        assert calibration.calibrated_rows > 0  # the rows were recomputed, not skipped
    for a, b in zip(plain, calibrated):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


# (Mistral's 6-token window would show the last queries one document at most, which calibration leaves as it is)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_calibration_changes_only_the_rows_after_the_documents(arch):
    model = tiny(arch)
    ids, mask, prompts = batch_inputs()
    plain = prefill_and_decode(model, ids, mask)
    with attn_calibration(model, StubTokenizer(), AttnCalibrationConfig(layers="all")) as calibration:
        with calibration.batch(prompts, SEGMENTS, WIDTH):
            calibrated = prefill_and_decode(model, ids, mask)
        outside = prefill_and_decode(model, ids, mask)  # outside a batch the layers are the plain ones
    starts = [ROW0_PAD + 14, 18]  # the column after each row's last document
    for row, start in enumerate(starts):
        assert torch.equal(calibrated[0][row, :start], plain[0][row, :start])
        assert (calibrated[0][row, start:] - plain[0][row, start:]).abs().max() > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(outside, plain))


@pytest.mark.parametrize("arch,attn", [("llama", "eager"), ("llama", "sdpa"), ("mistral", "sdpa")])
@pytest.mark.parametrize("spans", [SEGMENTS[1], [(0, 4), (4, 9)], [(1, 5), (18, 22)], [(12, 18), (1, 5)]],
                         ids=["inner", "from-token-0", "within-window", "out-of-order"])
def test_reference_is_the_dummy_attention_of_the_last_token(arch, attn, spans):
    """ref[layer][h, k] = the eager map's mean attention of the last prompt token over segment k's tokens, with
    those tokens replaced by the dummy text's (repeated), every other token in place: the passes that reuse the
    prompt's keys and values before each segment give what a full pass of the swapped prompt gives (Mistral: its
    sliding window too, which sees only the last segment)."""
    model = tiny(arch, attn)
    eager = tiny(arch, "eager")
    eager.load_state_dict(model.state_dict())
    _, _, prompts = batch_inputs(pad=0)
    ids = prompts[1]
    cfg = AttnCalibrationConfig(layers=[1, 2], heads=[0, 3])
    with attn_calibration(model, StubTokenizer(), cfg) as calibration:
        reference = calibration.references(ids, spans)
    assert sorted(reference) == [1, 2] and reference[1].shape == (2, len(spans))
    for k, (a, b) in enumerate(spans):
        dummy = list(ids)
        dummy[a:b] = [[5, 6, 7][i % 3] for i in range(b - a)]
        with torch.no_grad():
            maps = eager(torch.tensor([dummy]), output_attentions=True).attentions
        for layer in (1, 2):
            expected = maps[layer][0, [0, 3], -1, a:b].mean(-1)
            torch.testing.assert_close(reference[layer][:, k], expected.float(), rtol=0, atol=1e-6)


def test_prompt_attention_is_the_last_tokens_mean_attention_over_each_segment():
    """Attn(x_k, k) of the prompt as it is: the eager map's mean weight of the last token over segment k."""
    model = tiny("llama", "eager")
    _, _, prompts = batch_inputs(pad=0)
    ids, spans = prompts[1], SEGMENTS[1]
    with attn_calibration(model, StubTokenizer(), AttnCalibrationConfig(layers=[1, 2], heads=[0, 3])) as calibration:
        own = calibration.prompt_attention(ids, spans)
    with torch.no_grad():
        maps = model(torch.tensor([ids]), output_attentions=True).attentions
    for layer in (1, 2):
        expected = torch.stack([maps[layer][0, [0, 3], -1, a:b].mean(-1) for a, b in spans], dim=-1)
        torch.testing.assert_close(own[layer], expected.float(), rtol=0, atol=1e-6)


def test_alpha_concentration_at_each_temperature():
    """rel spreads of 1e-3: t = 5e-5 gives one document nearly all of α (e^-20 for the rest), t = 5e-3 nearly
    uniform; written out in float64."""
    from scripts.investigations.calibration_reference import alpha_concentration

    own = np.array([[0.0, 1e-3, 0.0, 0.0], [2e-3, 0.0, 0.0, 0.0]])  # two heads, K = 4
    stats = alpha_concentration(own, np.zeros_like(own), [5e-5, 5e-3])
    assert stats["rel_spread_median"] == pytest.approx(1.5e-3) and stats["uniform_alpha"] == 0.25
    sharp, flat = stats["by_temperature"]["5e-05"], stats["by_temperature"]["0.005"]
    tops = [1 / (1 + 3 * math.exp(-d / 5e-5)) for d in (1e-3, 2e-3)]
    assert sharp["mean_max_alpha"] == pytest.approx(np.mean(tops), abs=1e-12) and sharp["share_max_alpha_over_0.9"] == 1
    tops = [math.exp(d / 5e-3) / (math.exp(d / 5e-3) + 3) for d in (1e-3, 2e-3)]
    assert flat["mean_max_alpha"] == pytest.approx(np.mean(tops), abs=1e-12) and flat["share_max_alpha_over_0.9"] == 0


def test_references_are_reused_across_runs_of_the_same_model(tmp_path):
    """reuse_reference: a second run (another temperature) reads the stored reference, measures nothing, and
    calibrates as the first; another model key, prompt or segment layout is measured anew."""
    model = tiny("llama", "eager")
    ids, mask, prompts = batch_inputs(pad=0)
    cfg = AttnCalibrationConfig(layers=[1, 2], heads=[0, 3])
    cache = ReferenceCache(tmp_path, model_key="weights-a")
    with attn_calibration(model, StubTokenizer(), cfg, cache) as calibration:
        first = calibration.references(prompts[1], SEGMENTS[1])
        assert calibration.references_reused == 0 and len(list(tmp_path.glob("*.pt"))) == 1
    for temperature in (5e-5, 5e-3):
        with attn_calibration(model, StubTokenizer(), replace(cfg, temperature=temperature), cache) as calibration:
            calibration.state.measured.clear()
            again = calibration.references(prompts[1], SEGMENTS[1])
            assert calibration.references_reused == 1 and not calibration.state.measured  # no pass ran
            assert all(torch.equal(first[layer], again[layer]) for layer in first)
    for other_cache, other_ids, other_spans in [(ReferenceCache(tmp_path, "weights-b"), prompts[1], SEGMENTS[1]),
                                                (cache, prompts[0], SEGMENTS[1]), (cache, prompts[1], SEGMENTS[0])]:
        with attn_calibration(model, StubTokenizer(), cfg, other_cache) as calibration:
            calibration.references(other_ids, other_spans)
            assert calibration.references_reused == 0
    assert not list(tmp_path.glob(".*.tmp"))  # every file written whole

    fresh = ReferenceCache(tmp_path / "fresh", model_key="weights-a")  # calibrated logits: measured = reused
    with attn_calibration(model, StubTokenizer(), cfg, fresh) as calibration:
        with calibration.batch(prompts, SEGMENTS, WIDTH):
            measured = prefill_and_decode(model, ids, mask)
        assert calibration.references_reused == 0
    with attn_calibration(model, StubTokenizer(), cfg, fresh) as calibration:
        with calibration.batch(prompts, SEGMENTS, WIDTH):
            reused = prefill_and_decode(model, ids, mask)
        assert calibration.references_reused == 2
    assert all(torch.equal(a, b) for a, b in zip(measured, reused))


def test_shared_reference_is_the_dummy_attention_with_every_segment_swapped():
    """reference=dummy_shared: one pass with every segment's tokens replaced by the dummy's; ref[layer][h, k] = the
    eager map's mean attention of the last prompt token over segment k's dummy tokens."""
    model = tiny("llama", "eager")
    _, _, prompts = batch_inputs(pad=0)
    ids, spans = prompts[1], SEGMENTS[1]
    cfg = AttnCalibrationConfig(layers=[1, 2], heads=[0, 3], reference="dummy_shared")
    with attn_calibration(model, StubTokenizer(), cfg) as calibration:
        reference = calibration.references(ids, spans)
    dummy = list(ids)
    for a, b in spans:
        dummy[a:b] = [[5, 6, 7][i % 3] for i in range(b - a)]
    with torch.no_grad():
        maps = model(torch.tensor([dummy]), output_attentions=True).attentions
    for layer in (1, 2):
        expected = torch.stack([maps[layer][0, [0, 3], -1, a:b].mean(-1) for a, b in spans], -1)
        torch.testing.assert_close(reference[layer], expected.float(), rtol=0, atol=1e-6)
    per_segment = AttnCalibrationConfig(layers=[1, 2], heads=[0, 3])
    with attn_calibration(model, StubTokenizer(), per_segment) as calibration:
        assert not torch.allclose(calibration.references(ids, spans)[2], reference[2], atol=1e-4)


def test_restores_the_model_and_refuses_nesting_and_bad_settings():
    model = tiny("qwen2")
    forwards = [type(layer.self_attn).forward for layer in model.model.layers]
    with attn_calibration(model, StubTokenizer(), AttnCalibrationConfig(layers=[2])):
        assert "forward" in model.model.layers[2].self_attn.__dict__
        assert "forward" not in model.model.layers[0].self_attn.__dict__  # last_half of 3 layers would be 1, 2
        with pytest.raises(RuntimeError, match="already installed"):
            with attn_calibration(model, StubTokenizer(), AttnCalibrationConfig(layers=[2])):
                pass
        with pytest.raises(RuntimeError, match="attn_calibration is already installed"):  # one intervention at a time
            with ms_poe(model, MsPoEConfig(layers=[2])):
                pass
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert [type(layer.self_attn).forward for layer in model.model.layers] == forwards
    assert AttnCalibrationConfig(layers="last_half").layer_indices(32) == list(range(16, 32))  # the paper's 16 of 32
    with pytest.raises(ValueError, match="attn_calibration.layers='reference': use last_half, all, or a list"):
        AttnCalibrationConfig(layers="reference").layer_indices(32)  # Ms-PoE's set, not this one's
    with pytest.raises(ValueError, match=r"attn_calibration.layers=\[3\] selects none"):
        check_attn_calibration(model, AttnCalibrationConfig(layers=[3]))
    with pytest.raises(ValueError, match=r"attn_calibration.heads=\[4\] selects none"):
        check_attn_calibration(model, AttnCalibrationConfig(heads=[4]))
    with pytest.raises(ValueError, match="temperature"):
        AttnCalibrationConfig(temperature=0)
    with pytest.raises(ValueError):
        AttnCalibrationConfig(weighting="linear")
    assert AttnCalibrationConfig().reference == Reference.dummy and AttnCalibrationConfig().temperature == 5e-5


def test_check_names_the_reason():
    check_attn_calibration(tiny("qwen2"))  # applies: no error
    check_attn_calibration(tiny("llama", rope=False))  # needs no RoPE
    with pytest.raises(ValueError, match="differential-attention"):
        check_attn_calibration(tiny("qwen2", attention=Attention.diff_v2))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        check_attn_calibration(gpt2)
    flash = tiny("qwen2")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        check_attn_calibration(flash)


def test_token_spans_follow_the_offsets():
    # "ab| c|d|ef" with a special token first: spans "ab c" (0..4) and "def" (5..8); token 3 ("d") straddles nothing
    offsets = [(0, 0), (0, 2), (2, 4), (4, 5), (5, 8)]
    assert token_spans(offsets, [(0, 4), (5, 8)]) == [(1, 3), (4, 5)]
    # a token straddling two spans goes to the first
    assert token_spans([(0, 3), (3, 6), (6, 9)], [(0, 4), (4, 9)]) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="no token of their own"):
        token_spans([(0, 9)], [(0, 4), (4, 9)])
    with pytest.raises(ValueError, match="overlap"):
        token_spans([(0, 9)], [(0, 5), (4, 9)])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_bpe_tokenizer(synthetic_filler(200), 300, tmp_path_factory.mktemp("bpe"))


def test_prompt_segments_map_to_the_tokens_of_each_document(tokenizer, nq_file):
    items = (kv_probe(None, n_pairs=6, n_examples=1, query_aware=True)
             + mdqa_probe(nq_file, n_docs=4, n_examples=1, layout=Layout(True)))
    model = tiny("qwen2")
    with attn_calibration(model, tokenizer, IDENTITY) as calibration:
        for item in items:
            if not item.segments:
                assert item.label == "closedbook"
                continue
            ids, spans = calibration.encode(item.prompt, item.segments)
            assert ids == tokenizer(item.prompt)["input_ids"]
            for (a, b), (start, end) in zip(spans, item.segments):
                text = tokenizer.decode(ids[a:b])
                assert text.replace(" ", "") == item.prompt[start:end].replace(" ", "")


def test_reference_agreement_of_the_shared_and_per_segment_references(tokenizer):
    """scripts.investigations.calibration_reference: identical references agree exactly; on a model, both are
    measured over the same layers, heads and segments, and the one-pass reference is not the per-segment one."""
    from scripts.investigations.calibration_reference import agreement, compare_references

    refs = np.random.default_rng(0).random((2, 3, 4, 5))
    same = agreement(refs, refs.copy())
    assert same["mean_abs_diff_relative"] == 0.0 and same["per_head_spearman_median"] == pytest.approx(1.0)
    reversed_order = agreement(refs, refs[..., ::-1])
    assert reversed_order["per_head_spearman_median"] < 1.0 and reversed_order["heads"] == 24
    items = kv_probe(None, n_pairs=4, n_examples=1)
    model = tiny("llama", "eager")
    model.resize_token_embeddings(len(tokenizer))  # the tiny model's 97 ids are fewer than the tokenizer's
    stats = compare_references(model, tokenizer, items, AttnCalibrationConfig(layers=[1, 2]), temperatures=[5e-5, 1.0])
    assert set(stats["alpha"]["by_temperature"]) == {"5e-05", "1"}
    assert 0.25 <= stats["alpha"]["by_temperature"]["1"]["mean_max_alpha"] <= 1
    assert stats["prompts"] == len([i for i in items if i.segments]) and stats["heads"] == stats["prompts"] * 2 * 4
    assert len(stats["mean_by_position"]["dummy"]) == len(stats["mean_by_position"]["dummy_shared"]) == 4
    assert stats["mean_abs_diff_relative"] > 0 and set(stats["seconds"]) == {"dummy", "dummy_shared"}
