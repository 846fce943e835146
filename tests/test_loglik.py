"""analysis.evaluation.loglik: the teacher-forced answer log-likelihood against a full forward pass in float64,
the answer's tokenization as a continuation, items of every kind, and the scores read off the greedy answers' own
prefill."""
from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from analysis.evaluation import loglik as loglik_module
from analysis.evaluation.generate import _left_padded, _length_batches, model_generate_fn
from analysis.evaluation.loglik import (
    answer_logliks,
    answers_and_logliks,
    best,
    continuation_ids,
    prefill_and_score,
    sequence_logprobs,
    shares_prefill,
)
from data_builders.probes import ProbeItem
from models.attention.ms_poe import MsPoEConfig, ms_poe

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


@pytest.fixture(scope="module")
def windowed(tokenizer) -> MistralForCausalLM:
    """A sliding window of 4 tokens, shorter than the prompts: a windowed cache layer keeps only its window."""
    torch.manual_seed(1)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.3, sliding_window=4)
    return MistralForCausalLM(config).double().eval()


@pytest.mark.parametrize("which", ["model", "windowed"])
def test_a_batch_prefill_scores_every_row_as_a_full_forward_in_float64(which, request):
    model = request.getfixturevalue(which)
    # rows of different lengths (left padding: a row's positions start at its first token), one of a single token
    # (nothing of it in the prefill), and 0 to 3 targets of 1 to 4 tokens (alias j of every row is one pass)
    prompts = [[5, 9, 12, 40, 7, 3], [11, 4], [6], [20, 21, 22, 23]]
    targets = [[[17], [8, 30], [44, 2, 19, 60]], [[9, 9]], [], [[3], [50, 51, 52]]]
    ids, mask = _left_padded(prompts, pad=0)
    cache, got = prefill_and_score(model, ids, mask, targets)
    want = [[full_forward_logprob(model, p, t) for t in ts] for p, ts in zip(prompts, targets)]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-10)
    assert cache.get_seq_length() == ids.shape[1] - 1  # the targets cropped off: generate continues the prompts
    one_token = [[5], [7]]  # a batch one column wide has no prefill
    _, got = prefill_and_score(model, *_left_padded(one_token, pad=0), [[[17, 3]], [[4]]])
    assert got == [pytest.approx([full_forward_logprob(model, [5], [17, 3])], abs=1e-10),
                   pytest.approx([full_forward_logprob(model, [7], [4])], abs=1e-10)]


ITEMS = [ProbeItem("mdqa-0@1", "Document one says Paris\nAnswer:", ["Paris", "the capital"], 1, 3, "mdqa"),
         ProbeItem("kv-0@0", "the value of the key is", ["blue"], 0, 3, "kv"),
         ProbeItem("eval-0", [5, 9, 12], ["blue"], 0, 10, "in2", targets=[[17, 3], [8]]),
         ProbeItem("eval-1", [5, 9, 12, 40, 7, 3, 11], ["red"], 0, 10, "in2", targets=[[30]])]


@pytest.mark.parametrize("which", ["model", "windowed"])
def test_answers_and_logliks_from_one_prefill_equal_the_two_passes(which, request, tokenizer, monkeypatch):
    model = request.getfixturevalue(which)
    widths: list[int] = []  # the tokens of every pass: one pass over the prompts, then only new tokens
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    generate, loglik = answers_and_logliks(model, tokenizer, max_new_tokens=6, batch_size=3, progress=False)
    try:
        texts = generate(ITEMS)
    finally:
        hook.remove()
    prompts = [loglik_module.encode_prompt(tokenizer, it.prompt) for it in ITEMS]
    batch_widths = [max(len(prompts[i]) for i in rows) for rows in _length_batches(prompts, 3, None)]
    assert len(batch_widths) == 2 and widths[0] == batch_widths[0] - 1  # a batch's first pass: all but its last column
    assert batch_widths[1] - 1 in widths and not set(batch_widths) & set(widths)  # no second pass over a prompt
    assert texts == model_generate_fn(model, tokenizer, 6, 3, progress=False)(ITEMS)
    assert any(texts)  # the comparison saw answers, not empty strings
    want = answer_logliks(model, tokenizer, ITEMS, progress=False)
    with monkeypatch.context() as patch:  # the answers' pass scored them: nothing is computed again
        patch.setattr(loglik_module, "answer_logliks", lambda *a, **k: pytest.fail("scored twice"))
        got = loglik(ITEMS)
    for values, expected in zip(got, want):
        assert values == pytest.approx(expected, abs=1e-10)
    # items the answers did not come before are scored on their own
    assert loglik(ITEMS[:2]) == answer_logliks(model, tokenizer, ITEMS[:2], progress=False)


def test_no_shared_prefill_under_an_attention_intervention_or_a_cache_of_the_config(model, tokenizer):
    assert shares_prefill(model)
    model.generation_config.cache_implementation = "static"
    try:
        assert not shares_prefill(model)
    finally:
        model.generation_config.cache_implementation = None
    with ms_poe(model, MsPoEConfig(layers="all")):
        assert not shares_prefill(model)  # its head order comes from the first pass's last query
        with pytest.raises(ValueError, match="cannot continue a prefill of their own"):
            answers_and_logliks(model, tokenizer, 4, 2)
    assert shares_prefill(model)
