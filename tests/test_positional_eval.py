import json
import logging
from dataclasses import replace

import pytest
import torch
from datasets import Dataset
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from analysis.evaluation.config import METRICS, EvalConfig, NeedleProbeConfig, Probe
from analysis.evaluation.generate import FirstLineComplete, encode_prompt, greedy_generate, model_generate_fn
from analysis.evaluation.loglik import sequence_logprobs
from analysis.evaluation.probes import build_probes, evaluate_in2, evaluate_probes, run_probe
from analysis.evaluation.result import CI_METHOD, ProbeResult, write_eval_json
from data_builders.probes import KV_FILE, NQ_FILE, ProbeItem, in2_probe, kv_probe, mdqa_probe
from tests.conftest import SHARED_DATA, shared_data_file

SENTENCES = [
    "the cat sat on the mat near the door",
    "a dog ran in the park after the rain",
    "the secret code of the red door is blue",
    "question : what is the code of the door ?",
    "answer : the code is green and the cat is blue",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[EOS]", "[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


@pytest.fixture(scope="module")
def model(tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def scripted(correct_at: set[int], right: str = "{}", wrong: str = "wrong"):
    """A stand-in generator that answers right only when the gold sits at one of `correct_at`."""

    def generate(items):
        return [right.format(it.answers[0]) if it.position in correct_at else wrong for it in items]

    return generate


def in2_records(n: int, seed_ids: int = 4) -> list[dict]:
    """Minimal IN2-schema records with depths spread evenly over [0, 1)."""
    return [
        {
            "input_ids": [seed_ids + k % 7, 5, 6, 7, 9, 1],
            "labels": [-100, -100, -100, -100, 9, 1],
            "prompt_len": 4,
            "gold_spans": [[0, 1]],
            "depth": (k + 0.5) / n,
            "context_tokens": 3,
            "task": "fine_grained",
            "answers": ["Blue"],
            "source": "synthetic",
            "id": f"eval-{k}",
        }
        for k in range(n)
    ]


def test_eval_config_is_a_structured_config():
    cfg = OmegaConf.structured(EvalConfig)
    assert cfg.every == 50 and cfg.bins == 10 and cfg.probes == [] and cfg.data_dir is None
    cfg = OmegaConf.merge(cfg, {"probes": ["kv"], "data_dir": "/data"})
    assert cfg.probes == ["kv"] and cfg.data_dir == "/data"
    assert OmegaConf.to_object(cfg).probes == [Probe.kv]
    with pytest.raises(Exception):
        OmegaConf.merge(cfg, {"no_such_key": 1})
    with pytest.raises(ValidationError, match="Invalid value 'needel', expected one of"):
        OmegaConf.merge(cfg, {"probes": ["needel"]})


def _kv_items() -> list[ProbeItem]:
    return kv_probe(None, n_examples=6, seed=1)


@pytest.mark.parametrize("source", ["synthetic", "file"])
def test_kv_run_gives_scripted_curve(source):
    items = kv_probe(shared_data_file(KV_FILE), n_examples=10) if source == "file" else _kv_items()
    gen = scripted({0, 74}, right='"{}"', wrong="00000000-0000-4000-8000-000000000000")
    result = run_probe(items, gen, METRICS["substring_match"])
    assert result.accuracy_by_position() == {0: 1.0, 24: 0.0, 49: 0.0, 74: 1.0}
    assert result.mean == 0.5
    assert result.ci_by_position()[0] == (1.0, 1.0) and result.ci_by_position()[24] == (0.0, 0.0)
    diff = result.paired_difference(0, 24)
    assert (diff.value, diff.low, diff.high) == (1.0, 1.0, 1.0) and diff.n == len(items) // 4  # each question
    assert result.to_metrics() == {
        "eval/kv/acc@0": 1.0,
        "eval/kv/acc@24": 0.0,
        "eval/kv/acc@49": 0.0,
        "eval/kv/acc@74": 1.0,
        "eval/kv/acc_mean": 0.5,
    }


def test_mdqa_run_gives_scripted_curve():
    items = mdqa_probe(shared_data_file(NQ_FILE), n_docs=10, n_examples=15, seed=2)  # the reference's positions 0, 4, 9
    result = run_probe(items, scripted({0, 9}, right="I think it is {}."), METRICS["best_subspan_em"])
    assert result.accuracy_by_position() == {-1: 0.0, 0: 1.0, 4: 0.0, 9: 1.0}
    metrics = result.to_metrics("eval")
    assert metrics["eval/mdqa/acc@closedbook"] == 0.0 and metrics["eval/mdqa/acc@9"] == 1.0
    assert metrics["eval/mdqa/acc_mean"] == pytest.approx(2 / 3)  # closed-book left out


def test_in2_run_gives_scripted_curve():
    items = in2_probe(in2_records(40), bins=10)
    result = run_probe(items, scripted({0, 9}, right=" {}\nQuestion: next", wrong="Red"), METRICS["exact_match"])
    metrics = result.to_metrics()
    assert metrics == {
        **{f"eval/in2/acc@{b / 10}": float(b in (0, 9)) for b in range(10)},
        "eval/in2/acc_mean": 0.2,
    }
    assert list(metrics)[:3] == ["eval/in2/acc@0.0", "eval/in2/acc@0.1", "eval/in2/acc@0.2"]


def test_run_probe_checks_generator_output():
    with pytest.raises(ValueError):
        run_probe(_kv_items(), lambda items: ["x"], METRICS["substring_match"])
    with pytest.raises(ValueError):
        run_probe([], lambda items: [], METRICS["substring_match"])


def test_save_and_load_json(tmp_path):
    result = run_probe(_kv_items(), scripted({24}), METRICS["substring_match"])
    path = write_eval_json(tmp_path, 300, "kv", result)
    assert path == tmp_path / "eval" / "kv_step300.json"
    saved = json.loads(path.read_text())
    assert saved["accuracy"] == {"0": 0.0, "24": 1.0, "49": 0.0, "74": 0.0} and saved["mean"] == 0.25
    assert saved["n"] == {"0": 6, "24": 6, "49": 6, "74": 6} and saved["ci95"]["24"] == [1.0, 1.0]
    assert saved["ci_method"] == CI_METHOD  # how ci95 was made, said once
    assert saved["metric"] == "substring_match" and saved["settings"]["metric"] == "substring_match"
    loaded = ProbeResult.load_json(path)
    assert loaded.outcomes == result.outcomes and loaded.to_metrics() == result.to_metrics()
    assert loaded.settings == result.settings


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Step-by-step argmax over the full sequence: no cache, no padding."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == eos:
            break
        ids.append(nxt)
    return ids[len(prompt):]


def test_greedy_generate_matches_uncached_argmax_loop(model, tokenizer, monkeypatch):
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES]
    prompts = [ids[0][:3], ids[4], ids[1][:1], ids[3][:6], ids[2][:4]]  # lengths 3, 11, 1, 6, 4
    # Penalties a hub generation config may carry must not turn greedy decoding into something else.
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.5)
    monkeypatch.setattr(model.generation_config, "no_repeat_ngram_size", 1)
    model.train()
    out = greedy_generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2, progress=False)
    assert model.training  # mode restored
    model.eval()
    expected = [
        tokenizer.decode(reference_greedy(model, p, 6, tokenizer.eos_token_id), skip_special_tokens=True)
        for p in prompts
    ]
    assert out == expected
    assert any(out)  # the comparison is not between empty strings


def test_greedy_generate_caps_padded_tokens_per_batch(model, tokenizer, monkeypatch):
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES]
    prompts = [ids[0][:3], ids[4], ids[1][:1], ids[3][:6], ids[2][:4]]  # lengths 3, 11, 1, 6, 4
    unbounded = greedy_generate(model, tokenizer, prompts, max_new_tokens=4, batch_size=4, progress=False)
    shapes = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: shapes.append(tuple(kw["input_ids"].shape)) or generate(**kw))
    capped = greedy_generate(model, tokenizer, prompts, max_new_tokens=4, batch_size=4, progress=False,
                             batch_tokens=8)
    assert capped == unbounded  # the same answers, in prompt order
    # Ascending lengths 1, 3, 4 | 6 | 11: a batch grows while rows x width stays within 8, a longer prompt alone.
    assert shapes == [(2, 3), (1, 4), (1, 6), (1, 11)]


def test_first_line_complete_stops_rows_after_their_first_non_blank_line():
    class Decoder:
        texts = {1: "\n", 2: " Paris", 3: "\nmore", 4: " Par"}

        def batch_decode(self, rows, skip_special_tokens):
            return ["".join(self.texts[int(t)] for t in row) for row in rows]

    stop = FirstLineComplete(Decoder(), prompt_width=1)
    ids = torch.tensor([[9, 1, 1], [9, 2, 3], [9, 1, 4], [9, 2, 4]])  # prompt column, then new tokens
    assert stop(ids, None).tolist() == [False, True, False, False]


def test_model_generate_fn_text_and_token_prompts(model, tokenizer):
    text = SENTENCES[0]
    items = [
        ProbeItem("a", text, ["x"], 0, 1, "t"),
        ProbeItem("b", tokenizer(text)["input_ids"], ["x"], 0, 1, "t"),
    ]
    out = model_generate_fn(model, tokenizer, max_new_tokens=4, batch_size=2, progress=False)(items)
    assert out[0] == out[1]


def test_encode_prompt_chat_template(tokenizer, monkeypatch):
    template = "{{ messages[0]['content'] }}{% if add_generation_prompt %} answer :{% endif %}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    expected = tokenizer("the cat answer :")["input_ids"]
    assert encode_prompt(tokenizer, "the cat", chat_template=True) == expected
    assert encode_prompt(tokenizer, "the cat") == tokenizer("the cat")["input_ids"]
    assert encode_prompt(tokenizer, [3, 4], chat_template=True) == [3, 4]  # token ids pass through


def test_evaluate_in2_on_tiny_model(model, tokenizer):
    records = in2_records(20)
    beyond = [dict(r, id=f"beyond-{r['id']}") for r in in2_records(5)]  # past num_examples: not asked
    cfg = EvalConfig(num_examples=20, max_new_tokens=3, batch_size=8)
    metrics, result = evaluate_in2(model, tokenizer, Dataset.from_list(records + beyond), cfg)
    assert [o["id"] for o in result.outcomes] == [r["id"] for r in records]
    direct = greedy_generate(model, tokenizer, [r["input_ids"][:4] for r in records], 3, 8, progress=False)
    assert [o["prediction"] for o in result.outcomes] == direct
    bins = {f"@{b / 10}" for b in range(10)}
    assert set(metrics) == {f"eval/in2/{name}{key}" for name in ("acc", "loglik") for key in {"_mean", *bins}}
    # the log-likelihood of the answer tokens the record trains on (9), teacher-forced after its prompt
    assert [o["loglik"] for o in result.outcomes] == pytest.approx(
        [sequence_logprobs(model, r["input_ids"][:4], [[9]])[0] for r in records], abs=1e-5)
    assert result.outcomes[0]["extra"]["answer"]["first_line_words"] == len(direct[0].split("\n")[0].split())
    _, plain = evaluate_in2(model, tokenizer, Dataset.from_list(records), replace(cfg, loglik=False))
    assert not plain.has_loglik and "loglik" not in plain.settings


def test_build_and_evaluate_probes_without_data(model, tokenizer, caplog):
    needle = NeedleProbeConfig(lengths=[40], depths=[0.0, 0.25, 0.5, 0.75, 1.0], max_new_tokens=2)
    cfg = EvalConfig(probes=["kv", "mdqa", "needle"], probe_examples=2, needle=needle)
    with caplog.at_level(logging.WARNING):
        probes = build_probes(cfg, tokenizer)
    assert "mdqa is skipped" in caplog.text
    assert set(probes) == {"kv", "needle"} and len(probes["kv"]) == 8 and len(probes["needle"]) == 10
    metrics, results = evaluate_probes(model, tokenizer, {"needle": probes["needle"]}, cfg)
    assert set(metrics) == {f"eval/needle/{name}{key}" for name in ("acc", "loglik")
                            for key in ("_mean", *(f"@{d}" for d in (0.0, 0.25, 0.5, 0.75, 1.0)))}
    assert len(results["needle"].outcomes) == 10
    with pytest.raises(ValueError):
        build_probes(EvalConfig(probes=["nope"]), tokenizer)


def test_build_probes_from_data_dir(tokenizer):
    shared_data_file(KV_FILE), shared_data_file(NQ_FILE)
    cfg = EvalConfig(probes=["kv", "mdqa"], probe_examples=3, data_dir=str(SHARED_DATA))
    probes = build_probes(cfg, tokenizer)
    # kv: 3 queries x the 75-key file's 4 reference positions; mdqa: x 20 documents' 5 positions + closed-book
    assert len(probes["kv"]) == 12 and len(probes["mdqa"]) == 18
