"""Answer records (analysis.evaluation.answer_record, keyed by analysis.evaluation.reuse): the key follows what the
weights compute and every setting, a recorded evaluation is read back without generating, a killed one continues
with the answers an uninterrupted one gives, and a run reads another run's step-0 answers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import analysis.evaluation.probes as probes
from analysis.evaluation.answer_record import RECORD_SUBDIR, AnswerRecord, chunks_of
from analysis.evaluation.config import EvalConfig, probe_metric
from analysis.evaluation.probes import evaluate_in2, evaluate_probes
from analysis.evaluation.reuse import function_digest
from data_builders.probes import ProbeItem, kv_probe, synthetic_filler
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


@pytest.fixture
def tokenizer(tmp_path):
    tok = train_bpe_tokenizer(synthetic_filler(100), 300, tmp_path / "bpe")
    assert len(tok) <= VOCAB
    return tok


@pytest.fixture
def answered(monkeypatch) -> list[int]:
    """The number of items each answering call got (one call a chunk), with or without the log-likelihood."""
    calls: list[int] = []
    real, real_with_loglik = probes.model_generate_fn, probes.answers_and_logliks

    def counted(generate):
        return lambda items: calls.append(len(items)) or generate(items)

    def with_loglik(*args, **kwargs):
        generate, loglik = real_with_loglik(*args, **kwargs)
        return counted(generate), loglik

    monkeypatch.setattr(probes, "model_generate_fn", lambda *args, **kwargs: counted(real(*args, **kwargs)))
    monkeypatch.setattr(probes, "answers_and_logliks", with_loglik)
    return calls


def _record_files(cache) -> list[Path]:
    return sorted((cache / RECORD_SUBDIR).glob("*.jsonl"))


def test_chunks_partition_the_items_in_order_and_keep_a_group_whole():
    items = [ProbeItem(str(i), f"q{i}", ["a"], i, 12, "p", extra={"set": i // 5}) for i in range(12)]
    assert chunks_of(items, 5) == [range(0, 5), range(5, 10), range(10, 12)]
    assert chunks_of(items, 100, group=lambda it: it.extra["set"]) == [range(0, 5), range(5, 10), range(10, 12)]
    assert chunks_of(items[:3], 1) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="chunk size 0"):
        chunks_of(items, 0)


def test_a_second_evaluation_of_the_same_weights_reads_every_answer_back(tmp_path, tokenizer, answered):
    cfg = EvalConfig(num_examples=6, bins=3, max_new_tokens=3)
    cache = tmp_path / "cache"
    metrics, first = evaluate_in2(_model(0), tokenizer, _records(), cfg, cache)
    assert answered == [6] and len(_record_files(cache)) == 1
    again_metrics, again = evaluate_in2(_model(0), tokenizer, _records(), cfg, cache)
    assert answered == [6]  # nothing generated: read back
    assert again.outcomes == first.outcomes and again_metrics == metrics
    # other weights, other questions, another budget: each is asked, not read
    evaluate_in2(_model(1), tokenizer, _records(), cfg, cache)
    evaluate_in2(_model(0), tokenizer, _records(5), cfg, cache)
    evaluate_in2(_model(0), tokenizer, _records(), EvalConfig(num_examples=6, bins=3, max_new_tokens=4), cache)
    assert len(answered) == 4 and len(_record_files(cache)) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same weights in another precision
        evaluate_in2(_model(0), tokenizer, _records(), cfg, cache)
    assert len(answered) == 5
    evaluate_in2(_model(0), tokenizer, _records(), cfg)  # without a record folder: always asked
    assert len(answered) == 6


def test_a_killed_evaluation_continues_where_it_stopped_with_the_same_answers(
        tmp_path, tokenizer, answered, monkeypatch):
    monkeypatch.setattr(probes, "chunks_of", lambda items, group=None: chunks_of(items, 4, group))
    cfg = EvalConfig(num_examples=10, bins=5, max_new_tokens=3)
    _, whole = evaluate_in2(_model(0), tokenizer, _records(10), cfg)  # no record: the uninterrupted answers
    cache = tmp_path / "cache"
    evaluate_in2(_model(0), tokenizer, _records(10), cfg, cache)
    assert answered == [4, 4, 2, 4, 4, 2]
    [path] = _record_files(cache)
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4  # the header and 3 chunks
    path.write_bytes(b"".join(lines[:2]) + lines[2][:25])  # killed while writing the second chunk
    _, resumed = evaluate_in2(_model(0), tokenizer, _records(10), cfg, cache)
    assert answered[6:] == [4, 2]  # the first chunk read back, the torn one and the last answered
    assert json.dumps(resumed.outcomes) == json.dumps(whole.outcomes)
    assert path.read_bytes() == b"".join(lines)  # the torn line cut off, the chunks appended in order of answer


def test_a_record_line_of_other_items_is_answered_again(tmp_path, tokenizer, answered, caplog):
    cfg = EvalConfig(num_examples=6, bins=3, max_new_tokens=3)
    cache = tmp_path / "cache"
    _, first = evaluate_in2(_model(0), tokenizer, _records(), cfg, cache)
    [path] = _record_files(cache)
    header, chunk = path.read_text().splitlines()
    row = json.loads(chunk)
    row["ids"][0] = "someone else's"
    path.write_text(header + "\n" + json.dumps(row) + "\n")
    with caplog.at_level(logging.WARNING, logger="analysis.evaluation.answer_record"):
        _, again = evaluate_in2(_model(0), tokenizer, _records(), cfg, cache)
    assert f"{path}:2: a chunk of other items" in caplog.text
    assert answered == [6, 6] and again.outcomes == first.outcomes


def test_an_intervention_that_changes_no_weight_is_part_of_the_key(tmp_path, tokenizer, answered):
    items = {"kv": [ProbeItem(f"q{i}@0", f"Key {i} is", ["7"], 0, 1, "kv") for i in range(3)]}
    cfg = EvalConfig(loglik=False)
    cache = tmp_path / "cache"
    evaluate_probes(_model(0), tokenizer, items, cfg, record_dir=cache)
    evaluate_probes(_model(0), tokenizer, items, cfg, record_dir=cache, record_settings={"intervention": "ms_poe"})
    evaluate_probes(_model(0), tokenizer, items, cfg, record_dir=cache)
    assert answered == [3, 3]


def test_a_run_reads_the_step0_answers_of_an_earlier_run_of_the_same_weights(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    overrides = ["+exp=in2", *TINY, "trainer.max_steps=1", "trainer.save_every=0"]
    run(compose_config(overrides), tmp_path / "first")
    with caplog.at_level(logging.INFO, logger="analysis.evaluation.probes"):
        run(compose_config([*overrides, "debias=group_dro"]), tmp_path / "second")  # same seed: same init
    assert "in2: 8 of 8 answers read back" in caplog.text
    step0 = [json.loads((tmp_path / r / "eval" / "in2_step0.json").read_text()) for r in ("first", "second")]
    assert step0[0]["outcomes"] == step0[1]["outcomes"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="analysis.evaluation.probes"):
        run(compose_config([*overrides, "seed=1"]), tmp_path / "third")  # another random init: asked again
        run(compose_config([*overrides, "seed=1", "eval.resume=false"]), tmp_path / "fourth")  # no record read
    assert "read back" not in caplog.text


def test_what_an_answer_is_is_described_again_when_it_is_read_back(tmp_path):
    # a kv record made when a kv answer's kind was read on its first line: read back, its kind is the value it names
    items = kv_probe(n_pairs=3, positions=[1], n_examples=2)
    answer = 'The value of the key "{key}" is:\n\n```json\n"{value}"\n```'
    predictions = [answer.format(key=it.extra["key"], value=it.answers[0]) for it in items]
    ids = [it.id for it in items]
    record = AnswerRecord(tmp_path / "record.jsonl", "k", [ids])
    stale = [{"id": it.id, "query": it.query, "position": it.position, "label": it.label, "prediction": p,
              "answers": it.answers, "correct": 1.0, "extra": {**it.extra, "answer": {"kind": "none"}},
              "loglik": -2.5} for it, p in zip(items, predictions)]
    record.append(0, stale)

    def never(chunk):
        raise AssertionError("a recorded chunk was answered again")

    result = probes.run_probe(items, never, probe_metric("kv", EvalConfig()), record=record)
    assert [o["extra"]["answer"]["kind"] for o in result.outcomes] == ["gold", "gold"]
    assert [o["extra"]["answer"]["first_line_words"] for o in result.outcomes] == [7, 7]
    # what is costly and recorded stays as it was
    assert [(o["prediction"], o["correct"], o["loglik"]) for o in result.outcomes] == [(p, 1.0, -2.5)
                                                                                       for p in predictions]
