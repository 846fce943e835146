"""analysis.evaluation.loglik: the teacher-forced answer log-likelihood against a full forward pass in float64,
the answer's tokenization as a continuation, and items of every kind."""
from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from analysis.evaluation.loglik import answer_logliks, best, continuation_ids, sequence_logprobs
from data_builders.probes import ProbeItem

TEXTS = ["Answer: Paris is the capital of France", "the value of the key is blue", "Document one says Paris"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def model(tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3)
    return Qwen2ForCausalLM(config).double().eval()


def full_forward_logprob(model, prompt: list[int], target: list[int]) -> float:
    """The reference: one forward over prompt + target, the target's tokens scored at the positions before them."""
    ids = torch.tensor([prompt + target])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # (L + T, V)
    return sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(target))


def test_one_prompt_pass_equals_full_forwards_in_float64(model):
    prompt = [5, 9, 12, 40, 7, 3]
    targets = [[17], [8, 30], [44, 2, 19, 60], [8, 30, 30]]  # lengths 1 to 4: the batch is right-padded
    got = sequence_logprobs(model, prompt, targets)
    want = [full_forward_logprob(model, prompt, t) for t in targets]
    assert got == pytest.approx(want, abs=1e-10)
    assert len(set(round(v, 6) for v in got)) == 4  # distinct targets, distinct values: nothing was shared


def test_a_continuation_is_tokenized_as_the_model_would_write_it(tokenizer):
    spaced = continuation_ids(tokenizer, "Answer:", "Paris", chat_template=False)
    assert spaced == tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    assert spaced != tokenizer("Paris", add_special_tokens=False)["input_ids"]  # a byte-level BPE sees the space
    # after a chat template's assistant header, or a prompt that ends in whitespace, the answer starts at once
    assert continuation_ids(tokenizer, "Answer:", " Paris ", chat_template=True) == \
        tokenizer("Paris", add_special_tokens=False)["input_ids"]
    assert continuation_ids(tokenizer, "Answer:\n", "Paris", chat_template=False) == \
        tokenizer("Paris", add_special_tokens=False)["input_ids"]


def test_items_of_every_kind(model, tokenizer):
    text = ProbeItem("mdqa-0@1", "Document one says Paris\nAnswer:", ["Paris", "the capital", "", "France", "x"],
                     1, 3, "mdqa")
    in2 = ProbeItem("eval-0", [5, 9, 12], ["blue"], 0, 10, "in2", targets=[[17, 3]])
    got = answer_logliks(model, tokenizer, [text, in2], progress=False)
    prompt = tokenizer(text.prompt)["input_ids"]
    # the first 3 aliases, the empty one skipped
    want = [full_forward_logprob(model, prompt, tokenizer(" " + a, add_special_tokens=False)["input_ids"])
            for a in ("Paris", "the capital")]
    assert got[0] == pytest.approx(want, abs=1e-10)
    assert got[1] == pytest.approx([full_forward_logprob(model, [5, 9, 12], [17, 3])], abs=1e-10)
    assert not model.training
    with pytest.raises(ValueError, match="eval-1: a token-id prompt needs its answer tokens"):
        answer_logliks(model, tokenizer, [ProbeItem("eval-1", [5, 9], ["blue"], 0, 10, "in2")], progress=False)


def test_best_of_the_aliases():
    assert best([-3.0, -1.5, math.nan]) == -1.5
    assert math.isnan(best([]))
