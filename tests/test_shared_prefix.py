"""Prompts that share a long context answered over one cached prefill of it (VaLProbing's sets): the same greedy
answers and log-likelihoods as full passes, in float64, with one prefill per run of shared prompts."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from analysis.evaluation.generate import MIN_SHARED_PREFIX, greedy_generate, shared_prefix_groups
from analysis.evaluation.loglik import answer_logliks
from data_builders.probes import ProbeItem

VOCAB = 64
PAD, EOS = 0, 1


def test_groups_are_runs_sharing_the_minimum_and_keep_a_token_of_their_own():
    a, b = list(range(10, 20)), list(range(30, 40))
    prompts = [a + [1], a + [2, 3], a, b + [4], a + [5]]
    assert shared_prefix_groups(prompts, min_shared=8) == [(9, [0, 1, 2]), (10, [3]), (10, [4])]
    # a run closes when the next prompt shares too little, even if a later one would match again
    assert shared_prefix_groups([a, b, a], min_shared=8) == [(9, [0]), (9, [1]), (9, [2])]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        shared_prefix_groups([a, []])


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    return LlamaForCausalLM(config).double().eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    context = torch.randint(3, VOCAB, (MIN_SHARED_PREFIX + 40,), generator=g).tolist()
    other = torch.randint(3, VOCAB, (MIN_SHARED_PREFIX + 20,), generator=g).tolist()
    questions = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    return [context + questions[0], context + questions[1], context + questions[2], other + questions[3], other]


def _count_long_passes(model, monkeypatch) -> list[int]:
    """The input lengths of the model's forward passes over more than MIN_SHARED_PREFIX tokens."""
    lengths: list[int] = []
    forward = model.forward

    def counted(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > MIN_SHARED_PREFIX:
            lengths.append(ids.shape[1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return lengths


def test_shared_prefix_answers_equal_full_passes(model, tokenizer, monkeypatch):
    prompts = _prompts()
    full = greedy_generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=1, progress=False)
    long_passes = _count_long_passes(model, monkeypatch)
    shared = greedy_generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=1, progress=False,
                             shared_prefix=True)
    assert shared == full and all(full)
    # two runs (the context's three prompts, the other's two): two prefills, every prompt's own pass short
    assert long_passes == [MIN_SHARED_PREFIX + 40, MIN_SHARED_PREFIX + 19]


def test_shared_prefix_logliks_equal_full_passes(model, tokenizer, monkeypatch):
    prompts = _prompts()
    items = [ProbeItem(id=str(i), prompt=p, answers=["x"], position=0, n_positions=1, probe="t",
                       targets=[[5, 6, 7], [9]]) for i, p in enumerate(prompts)]
    full = answer_logliks(model, tokenizer, items, progress=False)
    long_passes = _count_long_passes(model, monkeypatch)
    shared = answer_logliks(model, tokenizer, items, progress=False, shared_prefix=True)
    assert len(long_passes) == 2
    for a, b in zip(shared, full):
        assert a == pytest.approx(b, abs=1e-9)
    assert len({round(v[0], 6) for v in full}) == len(full)  # the prompts' values differ: no constant passes


def test_shared_prefix_refuses_a_batch_context(model, tokenizer):
    with pytest.raises(ValueError, match="batch_context"):
        greedy_generate(model, tokenizer, _prompts(), 2, 1, progress=False, batch_context=lambda rows, width: None,
                        shared_prefix=True)
