"""Padding-free packing: per-sample losses equal the unpacked ones (fp64), and the packed stream is exact."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from data_builders.collate import BatchStream, collate, collate_packed, pack_in_order
from models.attention.diff_attention import convert_to_diff_attention
from models.attention.packed import SDPA_PACKED
from models.training.distributed import DistInfo
from models.training.loss import IGNORE, causal_lm_loss
from train import as_train_config, compose_config, validate

VOCAB = 200


def samples(n: int = 7, seed: int = 0) -> list[dict[str, list[int]]]:
    """Samples of 9-30 tokens whose last few tokens (the answer) carry the labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(9, 31, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        answer = int(torch.randint(2, 6, (1,), generator=gen))
        out.append({"input_ids": ids, "labels": [IGNORE] * (length - answer) + ids[-answer:]})
    return out


def tiny(attention: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, attn_implementation=attention.split("+")[0])
    model = Qwen2ForCausalLM(config)
    if attention.endswith("+diff"):
        convert_to_diff_attention(model, "v1", "scratch")
    return model.double().eval()


def token_nll(model, batch) -> torch.Tensor:
    """(B, L-1) next-token NLL, 0 where unlabelled."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    targets = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
    return nll * (targets != IGNORE)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "sdpa+diff", "sdpa_packed", "sdpa_packed+diff"])
@torch.no_grad()
def test_per_sample_losses_equal_the_unpacked_ones(attention):
    model, rows = tiny(attention), samples()
    rtol = 1e-6 if attention == "eager" else 1e-10  # eager attention takes its softmax in fp32
    packs = pack_in_order([len(r["input_ids"]) for r in rows], range(len(rows)), 64)
    assert max(len(p) for p in packs) > 1  # several samples share a row: the test can see leaks
    packed = collate_packed([[rows[i] for i in p] for p in packs], 64, pad_id=0)
    assert "attention_mask" not in packed
    nll = token_nll(model, packed)  # (R, 63)
    for r, pack in enumerate(packs):
        start = 0
        for i in pack:
            alone = token_nll(model, collate([rows[i]], pad_id=0))[0].sum()
            n = len(rows[i]["input_ids"])
            torch.testing.assert_close(nll[r, start:start + n - 1].sum(), alone, rtol=rtol, atol=0)
            assert nll[r, start + n - 1] == 0  # a sample's last token predicts nothing across the boundary
            start += n
    # the loss the loop trains on: the token-weighted mean over the pack's labels
    padded_mean = sum(token_nll(model, collate([r], 0)).sum() for r in rows) / sum(
        sum(lab != IGNORE for lab in r["labels"][1:]) for r in rows)
    torch.testing.assert_close(causal_lm_loss(model, packed), padded_mean, rtol=rtol, atol=0)


def test_packs_fill_in_order_and_never_exceed_pack_len():
    lengths = [5, 7, 3, 9, 2, 10, 1]
    packs = pack_in_order(lengths, [6, 0, 1, 2, 3, 4, 5], 12)
    assert packs == [[6, 0], [1, 2], [3, 4], [5]]
    assert all(sum(lengths[i] for i in p) <= 12 for p in packs)
    with pytest.raises(ValueError, match="sample 3 has 9 tokens, more than data.pack_len=8"):
        pack_in_order(lengths, range(7), 8)


def test_packed_stream_shards_resumes_and_counts_tokens():
    from datasets import Dataset

    rows = samples(60, seed=3)
    data = Dataset.from_list(rows)
    stream = BatchStream(data, 2, 0, seed=1, pack_len=64)
    batches = iter(stream)
    first = [next(batches) for _ in range(5 * stream.per_epoch(0) // 2)]  # into epoch 1 and beyond
    # epoch 0: every sample once, except those of the packs left over at its end
    seen = []
    for batch in first[: stream.per_epoch(0)]:
        assert batch["input_ids"].shape == (2, 64)
        for row, pos in zip(batch["input_ids"], batch["position_ids"]):
            starts = (pos == 0).nonzero().flatten().tolist() + [64]
            seen += [tuple(row[a:b].tolist()) for a, b in zip(starts, starts[1:])]
    real = {tuple(r["input_ids"]) for r in rows}
    assert len(real & set(seen)) >= len(rows) - 2 * 2  # at most a leftover micro-batch's packs
    first_packs = BatchStream(data, 2, 0, seed=1, pack_len=64)._units(0)[:2]
    assert int(first[0]["num_tokens"]) == sum(len(rows[i]["input_ids"]) for pack in first_packs for i in pack) < 2 * 64
    # exact resume: a new stream at the saved position continues with the same batches
    resumed = BatchStream(data, 2, 0, seed=1, pack_len=64)
    resumed.position = 3
    again = iter(resumed)
    for expected in first[3:]:
        got = next(again)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    # two ranks with accumulation 1 see the packs one process sees with accumulation 2
    single = iter(BatchStream(data, 1, 0, seed=1, pack_len=64))
    ranks = [iter(BatchStream(data, 1, 0, seed=1, rank=r, world_size=2, pack_len=64)) for r in (0, 1)]
    for _ in range(4):
        for r in ranks:
            assert torch.equal(next(r)["input_ids"], next(single)["input_ids"])


def test_a_pack_len_below_the_sample_budget_fails_at_start_up():
    from data_builders.config import DataConfig, validate_data

    with pytest.raises(ValueError, match=r"data.pack_len=100 is shorter than data.context_len=256"):
        validate_data(DataConfig(context_len=256, packing=True, pack_len=100))


def test_packed_sdpa_attends_sample_by_sample_and_masks_padded_batches(monkeypatch):
    """`sdpa_packed` runs causal SDPA on each sample of a packed row (no L x L mask), and is plain SDPA,
    mask and all, on a padded batch."""
    import models.attention.packed as packed_attention

    calls = []
    sdpa = packed_attention.sdpa_attention_forward
    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", lambda m, q, k, v, mask, **kw: (
        calls.append((q.shape[2], mask is None)), sdpa(m, q, k, v, mask, **kw))[1])
    model, rows = tiny(SDPA_PACKED), samples()
    packs = pack_in_order([len(r["input_ids"]) for r in rows], range(len(rows)), 64)
    with torch.no_grad():
        token_nll(model, collate_packed([[rows[i] for i in p] for p in packs], 64, pad_id=0))
        per_layer = [len(rows[i]["input_ids"]) for p in packs for i in p] + [
            64 - sum(len(rows[i]["input_ids"]) for i in p) for p in packs if sum(len(rows[i]["input_ids"]) for i in p) < 64]
        assert sorted(calls) == sorted([(n, True) for n in per_layer] * 2)  # 2 layers
        calls.clear()
        token_nll(model, collate(rows[:3], pad_id=0))
        assert calls == [(max(len(r["input_ids"]) for r in rows[:3]), False)] * 2


def with_teacher(rows: list[dict[str, list[int]]]) -> list[dict]:
    """The rows with a teacher sequence (pos2distill's batches): the answer after another, shorter prompt."""
    return [r | {"teacher_input_ids": r["input_ids"][2:], "teacher_labels": r["labels"][2:], "gold_slot": 0}
            for r in rows]


@torch.no_grad()
def test_padding_to_a_multiple_adds_only_masked_columns_and_changes_no_loss():
    """trainer.pad_to_multiple_of: the widths are rounded up (student and teacher), the added columns are padding
    with no label and no attention, and the loss the loop trains on is the same to float64 rounding."""
    model, rows = tiny("sdpa"), with_teacher(samples(4))
    plain = collate(rows, pad_id=0, depths=False, teacher=True)
    rounded = collate(rows, pad_id=0, depths=False, teacher=True, pad_to_multiple_of=16)
    for key, pad in (("input_ids", 0), ("labels", IGNORE), ("attention_mask", 0), ("teacher_input_ids", 0),
                     ("teacher_labels", IGNORE), ("teacher_attention_mask", 0)):
        width = plain[key].shape[1]
        assert rounded[key].shape[1] == -(-width // 16) * 16 > width, key
        assert torch.equal(rounded[key][:, :width], plain[key]) and (rounded[key][:, width:] == pad).all(), key
    assert rounded["num_tokens"] == plain["num_tokens"]
    torch.testing.assert_close(causal_lm_loss(model, rounded), causal_lm_loss(model, plain), rtol=1e-12, atol=0)
    assert collate(rows[:1], pad_id=0, pad_to_multiple_of=len(rows[0]["input_ids"]))["input_ids"].shape[1] == len(
        rows[0]["input_ids"])  # a width that is a multiple already stays


def test_the_stream_pads_to_a_multiple_and_the_setting_is_checked_at_start_up():
    rows = samples(8)
    stream = iter(BatchStream(rows, 2, pad_id=0, seed=0, pad_to_multiple_of=8))
    plain = iter(BatchStream(rows, 2, pad_id=0, seed=0))
    for _ in range(4):
        a, b = next(stream), next(plain)
        width = b["input_ids"].shape[1]
        assert a["input_ids"].shape[1] % 8 == 0 and torch.equal(a["input_ids"][:, :width], b["input_ids"])
    with pytest.raises(ValueError, match=r"trainer.pad_to_multiple_of=0 must be >= 1"):
        validate(as_train_config(compose_config(["trainer.pad_to_multiple_of=0"])), DistInfo())
    with pytest.raises(ValueError, match=r"trainer.pad_to_multiple_of=64 with data.packing=true"):
        validate(as_train_config(compose_config(["trainer.pad_to_multiple_of=64", "data.packing=true"])), DistInfo())
