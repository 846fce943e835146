"""models.training.loss: the loss without full logits equals the full-logits loss, value and gradients (fp64)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from models.training.loss import IGNORE, causal_lm_loss

VOCAB = 300


def tiny(tie: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(config).double().train()


def batch(answer_only: bool) -> dict[str, torch.Tensor]:
    """Two right-padded rows; labels on a few answer tokens at other positions per row, or on every token."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 40), generator=gen)  # (B, L)
    mask = torch.ones_like(ids)
    mask[1, 31:] = 0  # row 1 is 31 tokens long
    labels = ids.clone()
    if answer_only:
        labels.fill_(IGNORE)
        labels[0, 35:40] = ids[0, 35:40]
        labels[1, 24:31] = ids[1, 24:31]
    labels[mask == 0] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def full_logits_loss(model, b) -> torch.Tensor:
    """The reference: every position's logits, the mean next-token NLL over the labels, in the model's dtype
    (transformers' own loss would upcast fp64 logits only to fp32)."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]  # (B, L-1, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=IGNORE)


def loss_and_grads(model, b, ours: bool, chunk: int = 16):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, b, chunk=chunk) if ours else full_logits_loss(model, b)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("answer_only", [True, False], ids=["answer-only logits", "chunked dense"])
@pytest.mark.parametrize("tie", [False, True])
def test_loss_and_gradients_equal_the_full_logits_loss(answer_only, tie):
    model, b = tiny(tie), batch(answer_only)
    want, want_grads = loss_and_grads(model, b, ours=False)
    got, got_grads = loss_and_grads(model, b, ours=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-8, atol=1e-14, msg=name)


def test_answer_only_never_builds_the_full_logits(monkeypatch):
    model, b = tiny(), batch(answer_only=True)
    shapes = []
    model.lm_head.register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    causal_lm_loss(model, b)
    assert shapes == [(2, 5 + 7, VOCAB)]  # both rows at the union of their answers' positions


def test_dense_logits_exist_one_chunk_at_a_time():
    model, b = tiny(), batch(answer_only=False)
    shapes = []
    model.lm_head.register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    causal_lm_loss(model, b, chunk=16).backward()
    assert shapes[0] == (2, 0, VOCAB)  # the model's own head keeps no position
    # 78 positions: 5 chunks of at most 16 in the forward, recomputed (in reverse order) in the backward
    assert shapes[1:6] == [(16, VOCAB)] * 3 + [(15, VOCAB)] * 2 and sorted(shapes[6:]) == sorted(shapes[1:6])


def test_through_peft_adapters():
    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    for answer_only in (True, False):
        b = batch(answer_only)
        want, want_grads = loss_and_grads(model, b, ours=False)
        got, got_grads = loss_and_grads(model, b, ours=True)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-8, atol=1e-14, msg=name)
