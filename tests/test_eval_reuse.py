"""Reusing a step-0 evaluation (analysis.evaluation.reuse): the key follows what the weights compute, a hit
gives the stored answers without generating, and a run reads another run's step-0 answers."""
from __future__ import annotations

import json
import logging

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import analysis.evaluation.probes as probes
from analysis.evaluation.config import EvalConfig
from analysis.evaluation.probes import evaluate_in2
from analysis.evaluation.reuse import CACHE_SUBDIR, function_digest
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models.peft_setup import PeftConfig, PeftMethod, apply_peft
from tests.conftest import TINY
from train import compose_config, run

VOCAB = 320


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


def _lora(seed: int) -> torch.nn.Module:
    model = _model(0)
    torch.manual_seed(seed)  # the adapters' A: drawn from this seed
    return apply_peft(model, PeftConfig(method=PeftMethod.lora, r=4))


def test_the_digest_follows_the_weights():
    assert function_digest(_model(0)) == function_digest(_model(0))
    changed = _model(0)
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-6
    assert function_digest(changed) != function_digest(_model(0))
    assert function_digest(_model(1)) != function_digest(_model(0))


def test_lora_adapters_with_zero_b_do_not_change_the_digest_until_b_moves():
    a, b = _lora(1), _lora(2)
    lora_a = [n for n, _ in a.named_parameters() if ".lora_A." in n]
    assert lora_a and any(not torch.equal(dict(a.named_parameters())[n], dict(b.named_parameters())[n])
                          for n in lora_a)  # the seeds drew different A
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():  # and the two compute the same function, bit for bit
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert function_digest(a) == function_digest(b)
    with torch.no_grad():
        next(p for n, p in b.named_parameters() if ".lora_B." in n)[0, 0] = 0.5
    assert function_digest(a) != function_digest(b)


def _records(n: int = 6) -> list[dict]:
    return [{"id": i, "input_ids": [40 + i, 41, 42, 43, 44, 45, 46, 47], "prompt_len": 6, "answers": ["x"],
             "depth": i / n} for i in range(n)]


def test_a_second_evaluation_of_the_same_weights_reads_the_stored_answers(tmp_path, monkeypatch):
    tokenizer = train_bpe_tokenizer(synthetic_filler(100), 300, tmp_path / "bpe")
    assert len(tokenizer) <= VOCAB
    cfg = EvalConfig(num_examples=6, bins=3, max_new_tokens=3)
    answered = []
    real_run_probe = probes.run_probe
    monkeypatch.setattr(probes, "run_probe", lambda *a, **k: answered.append(1) or real_run_probe(*a, **k))

    metrics, first = evaluate_in2(_model(0), tokenizer, _records(), cfg, reuse_dir=tmp_path / "cache")
    assert len(answered) == 1 and len(list((tmp_path / "cache" / CACHE_SUBDIR).glob("*.json"))) == 1
    again_metrics, again = evaluate_in2(_model(0), tokenizer, _records(), cfg, reuse_dir=tmp_path / "cache")
    assert len(answered) == 1  # nothing generated: read back
    assert again.outcomes == first.outcomes and again_metrics == metrics
    # other weights, other questions, another budget: each is asked, not read
    evaluate_in2(_model(1), tokenizer, _records(), cfg, reuse_dir=tmp_path / "cache")
    evaluate_in2(_model(0), tokenizer, _records(5), cfg, reuse_dir=tmp_path / "cache")
    evaluate_in2(_model(0), tokenizer, _records(), EvalConfig(num_examples=6, bins=3, max_new_tokens=4),
                 reuse_dir=tmp_path / "cache")
    assert len(answered) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same weights in another precision
        evaluate_in2(_model(0), tokenizer, _records(), cfg, reuse_dir=tmp_path / "cache")
    assert len(answered) == 5
    evaluate_in2(_model(0), tokenizer, _records(), cfg)  # without reuse_dir: always asked
    assert len(answered) == 6


def test_a_run_reads_the_step0_answers_of_an_earlier_run_of_the_same_weights(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    overrides = ["+exp=in2", *TINY, "trainer.max_steps=1", "trainer.save_every=0", "eval.reuse_step0=true"]
    run(compose_config(overrides), tmp_path / "first")
    with caplog.at_level(logging.INFO, logger="analysis.evaluation.reuse"):
        run(compose_config([*overrides, "debias=group_dro"]), tmp_path / "second")  # same seed: same init
    assert "evaluation reused" in caplog.text
    step0 = [json.loads((tmp_path / r / "eval" / "in2_step0.json").read_text()) for r in ("first", "second")]
    assert step0[0]["outcomes"] == step0[1]["outcomes"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="analysis.evaluation.reuse"):
        run(compose_config([*overrides, "seed=1"]), tmp_path / "third")  # another random init: asked again
    assert "evaluation reused" not in caplog.text
