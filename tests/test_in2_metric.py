"""eval.in2_metric: held-out IN2 answers in the mdqa evaluation's format are scored as the mdqa probe scores them,
so a model that answers in sentences does not read 0.00 from its format; the run summary names the metric."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import analysis.evaluation.probes as probes
from analysis.evaluation.config import EvalConfig, In2Metric
from analysis.evaluation.probes import evaluate_in2
from analysis.report.run_summary import accuracy_lines, depth_curve
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer


@pytest.fixture
def sentence_answers(monkeypatch):
    """Generation stubbed: every answer is a sentence holding the gold answer, then a second line."""
    monkeypatch.setattr(probes, "model_generate_fn",
                        lambda *a, **k: lambda items: [f"The answer is {it.answers[0]}.\nMore." for it in items])


def _records(n: int = 4) -> list[dict]:
    return [{"id": i, "input_ids": [40 + i, 41, 42, 43, 44], "prompt_len": 4, "answers": [f"paris{i}"],
             "depth": i / n} for i in range(n)]


@pytest.mark.parametrize("metric, accuracy", [(In2Metric.exact_match, 0.0), (In2Metric.best_subspan_em, 1.0),
                                              (In2Metric.whole_word_subspan_em, 1.0)])
def test_the_in2_metric_decides_what_a_sentence_scores(tmp_path, sentence_answers, metric, accuracy):
    tokenizer = train_bpe_tokenizer(synthetic_filler(100), 300, tmp_path / "bpe")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=320))
    cfg = EvalConfig(num_examples=4, bins=2, in2_metric=metric, loglik=False)
    metrics, result = evaluate_in2(model, tokenizer, _records(), cfg)
    assert metrics["eval/in2/acc_mean"] == accuracy and result.settings["metric"] == metric
    path = result.save_json(tmp_path / "in2_step0.json")
    heading = accuracy_lines([depth_curve(0, path)])[0]
    assert heading == f"## Accuracy by gold depth (held-out IN2, {metric.replace('_', ' ')})"
