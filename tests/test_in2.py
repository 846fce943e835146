"""IN2 assembly (data_builders.in2, through data_builders.build): record invariants, uniform and independent
depths, determinism, start-up failures, prebuilt folders, NQ and IN2-length builds, and the build_dataset CLI."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException
from scipy import stats

from data_builders import build
from data_builders.build import build_datasets, dataset_digest, load_prebuilt, save_built
from data_builders.collate import BatchStream
from data_builders.config import DataConfig, DataSource, FieldMap, In2Config, TaskMix, as_data_config
from data_builders.sources import file_source, normalize, synthetic_source
from data_builders.tokenizer import default_cache_dir, train_bpe_tokenizer
from scripts.build_dataset import main as build_main

SMALL = dict(num_train_docs=1000, num_eval_docs=200, cache=False)
RECORD_KEYS = {"input_ids", "labels", "prompt_len", "gold_spans", "depth", "depths", "context_tokens", "task",
               "answers", "source", "id"}


def extractive(record: dict) -> bool:
    """Synthetic yes/no and count answers are not written in the context."""
    return not (record["answers"][0] in ("yes", "no") or record["answers"][0].isdigit())


def check_records(records, tokenizer, gold_texts=None, all_extractive: bool = False, head: int = 0) -> None:
    """Schema, labels, spans; answers inside a gold span and in no distractor; golds decode to segments."""
    eos = tokenizer.eos_token_id
    for r in records:
        assert set(r) == RECORD_KEYS
        ids, labels, p = r["input_ids"], r["labels"], r["prompt_len"]
        assert len(ids) == len(labels) and ids[-1] == eos and 0 < p < len(ids) - 1
        assert labels[:p] == [-100] * p and labels[p:] == ids[p:]
        spans = r["gold_spans"]
        assert len(spans) == len(r["depths"]) and r["depth"] == r["depths"][0]
        assert all(0.0 <= d <= 1.0 for d in r["depths"])
        ordered = sorted(spans)
        assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))  # golds never overlap
        assert head <= ordered[0][0] and ordered[-1][1] <= head + r["context_tokens"] <= p
        golds = [tokenizer.decode(ids[s:e]) for s, e in spans]
        if gold_texts is not None:
            assert all(normalize(g) in gold_texts(r) for g in golds), golds
        if all_extractive or extractive(r):
            answers = [a for a in map(normalize, r["answers"]) if a]
            assert any(a in normalize(g) for g in golds for a in answers)
            bounds = [head] + [x for s in ordered for x in s] + [head + r["context_tokens"]]
            for lo, hi in zip(bounds[::2], bounds[1::2]):
                text = normalize(tokenizer.decode(ids[lo:hi]))
                assert not any(a in text for a in answers), (r["id"], r["answers"])


def synthetic_texts(cfg: DataConfig):
    """gold_texts callback: a synthetic gold segment is a whole document of the source."""
    data = synthetic_source(cfg.num_train_docs, cfg.num_eval_docs, cfg.seed, cfg.in2.tasks.integration > 0)
    docs = {normalize(p) for p in data.train.passages + data.heldout.passages}
    return lambda record: docs


@pytest.fixture(scope="module")
def default_build():
    """The CPU default task, 10,000 training samples (fine-grained only)."""
    cfg = DataConfig(num_train=10_000, num_eval=100, **SMALL)
    return cfg, build_datasets(cfg)


@pytest.fixture(scope="module")
def mixed_build():
    """All three tasks at 1K tokens: enough integration samples to test their placement."""
    cfg = DataConfig(context_len=1024, num_train=4000, num_eval=60, in2=In2Config(tasks=TaskMix(0.3, 0.6, 0.1)),
                     **SMALL)
    return cfg, build_datasets(cfg)


def test_default_build_is_fine_grained_with_valid_records(default_build):
    cfg, bundle = default_build
    assert len(bundle.train) == 10_000 and len(bundle.eval) == 100
    assert set(bundle.train["task"]) == {"fine_grained"} and set(bundle.eval["task"]) == {"fine_grained"}
    assert all(len(ids) == cfg.context_len for ids in bundle.train.select(range(100))["input_ids"])
    gold_texts = synthetic_texts(cfg)
    check_records(bundle.train.select(range(1500)), bundle.tokenizer, gold_texts)
    check_records(bundle.eval, bundle.tokenizer, gold_texts)
    assert bundle.heldout_docs and all(len(d) == cfg.in2.heldout_doc_len for d in bundle.heldout_docs)
    assert bundle.stats["tasks"]["train"] == {"fine_grained": 10_000}


def test_fine_grained_depth_is_uniform(default_build):
    _, bundle = default_build
    depth = np.asarray(bundle.train["depth"])
    assert stats.kstest(depth, "uniform").pvalue > 0.01
    per_decile, _ = np.histogram(depth, bins=10, range=(0, 1))
    assert per_decile.min() > 800  # every decile covered, about 1,000 each
    assert len(np.unique(depth)) > 150  # token resolution, not one value per slot


def test_mixed_tasks_and_independent_integration_golds(mixed_build):
    cfg, bundle = mixed_build
    counts = bundle.stats["tasks"]["train"]
    assert counts == {"fine_grained": 1200, "integration": 2400, "short_qa": 400}
    assert "short_qa" not in bundle.stats["tasks"]["eval"]  # held-out samples are for accuracy by depth
    check_records(bundle.train.select(range(600)), bundle.tokenizer, synthetic_texts(cfg))

    rows = bundle.train.filter(lambda r: r["task"] == "integration")
    pairs = np.asarray([d[:2] for d in rows["depths"]])  # (n, 2): first two golds of each sample
    assert len(pairs) == 2400 and min(len(d) for d in rows["depths"]) >= 2
    assert abs(np.corrcoef(pairs.T)[0, 1]) < 0.1
    grid, _, _ = np.histogram2d(pairs[:, 0], pairs[:, 1], bins=4, range=[[0, 1], [0, 1]])
    assert stats.chi2_contingency(grid).pvalue > 0.01
    for column in pairs.T:
        assert stats.kstest(column, "uniform").pvalue > 0.01

    short = bundle.train.filter(lambda r: r["task"] == "short_qa")
    for r in short.select(range(20)):  # the question with its evidence only
        assert r["depth"] == 0.0 and r["context_tokens"] == sum(e - s + 1 for s, e in r["gold_spans"])


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    cfg = DataConfig(context_len=512, num_train=300, num_eval=20, num_train_docs=300, num_eval_docs=60,
                     in2=In2Config(tasks=TaskMix(0.5, 0.4, 0.1)), cache=False)
    a, b, c = build_datasets(cfg), build_datasets(cfg), build_datasets(replace(cfg, seed=1))
    assert dataset_digest(a.train) == dataset_digest(b.train) and a.train._fingerprint == b.train._fingerprint
    assert a.stats["fingerprint"] == b.stats["fingerprint"] != c.stats["fingerprint"]
    assert dataset_digest(a.train) != dataset_digest(c.train)
    save_built(a, tmp_path / "a")
    save_built(b, tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a" / "train").glob("*.arrow"))
    same = [(tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files]
    assert files and all(same)


def test_bad_settings_fail_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"data\.in2\.segment_len=300 must be positive and smaller than the smallest"):
        build_datasets(DataConfig(in2=In2Config(segment_len=300)))
    with pytest.raises(ValueError, match=r"smallest context length \(1024\)"):
        build_datasets(DataConfig(context_len=8192, in2=In2Config(context_len_min=1024, segment_len=2000)))
    with pytest.raises(ValueError, match=r"data\.in2\.tasks must be non-negative"):
        build_datasets(DataConfig(in2=In2Config(tasks=TaskMix(0, 0, 0))))
    with pytest.raises(ValueError, match=r"data\.in2\.curriculum ramps budgets up from data\.in2\.context_len_min"):
        build_datasets(DataConfig(in2=In2Config(curriculum=0.5)))
    with pytest.raises(ValueError, match=r"data\.in2\.curriculum=1.5 must be a share"):
        build_datasets(DataConfig(in2=In2Config(context_len_min=96, curriculum=1.5)))
    with pytest.raises(ValueError, match=r"data\.source='wiki' is not known \(known: synthetic, nq, hf\)"):
        build_datasets(DataConfig(source="wiki"))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing"))):
        build_datasets(DataConfig(prebuilt=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"data\.in2\.tasks\.integration > 0, but .* no usable integration questions"):
        build_datasets(DataConfig(source=DataSource.hf, path=str(_qa_file(tmp_path)), fields=QA_FIELDS,
                                  num_eval_docs=10, num_train=20, num_eval=4, in2=In2Config(tasks=TaskMix(0, 1, 0)),
                                  vocab_size=300, cache=False))
    with pytest.raises(ValueError, match="num_eval_docs=400"):
        build_datasets(DataConfig(source=DataSource.hf, path=str(_qa_file(tmp_path)), fields=QA_FIELDS, cache=False))


def test_choice_typos_fail_at_composition(compose_cfg):
    """data.source and data.format are enums: Hydra rejects a typo before any code runs."""
    for override, expected in (
        ("data.source=wiki", "Invalid value 'wiki', expected one of [synthetic, nq, hf]"),
        ("data.format=lm", "Invalid value 'lm', expected one of [in2, lm_windows]"),
    ):
        with pytest.raises(ConfigCompositionException, match=re.escape(f"Error merging override {override}")) as err:
            compose_cfg(override)
        assert expected in str(err.value.__cause__)  # Hydra prints it under its own line


def test_curriculum_ramps_training_budgets_and_training_reads_them_in_order():
    base = dict(context_len=256, num_train=400, num_eval=40, **SMALL)
    plain = build_datasets(DataConfig(in2=In2Config(context_len_min=96), **base))
    ramped = build_datasets(DataConfig(in2=In2Config(context_len_min=96, curriculum=0.5), **base))
    lengths = np.array([len(ids) for ids in ramped.train["input_ids"]])  # a sample fills its budget
    caps = np.round(96 + 160 * np.minimum(1.0, (np.arange(400) + 1) / 200) ** 2)  # the ramp spans 0.5 x 400
    assert (lengths <= caps).all() and lengths.min() >= 96
    assert lengths[:100].mean() < 120 < 150 < lengths[200:].mean()
    assert dataset_digest(ramped.eval) == dataset_digest(plain.eval)  # held-out questions unchanged

    stream = BatchStream(ramped.train, 4, ramped.tokenizer.pad_token_id, seed=0, ordered_first_epoch=True)
    batches = iter(stream)
    for k in range(stream.per_epoch(0)):  # epoch 0: stored order, so short contexts come first
        batch = next(batches)
        rows = [ramped.train[i]["input_ids"] for i in range(4 * k, 4 * k + 4)]
        assert [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])] == rows
    epoch1 = torch.cat([next(batches)["attention_mask"].sum(1) for _ in range(stream.per_epoch(1))])
    assert sorted(epoch1.tolist()) == sorted(lengths.tolist()) and epoch1.tolist() != lengths.tolist()


def test_a_chat_template_adds_its_own_tokens_to_the_shortest_budget_never_to_the_longest():
    # An instruct model's template (SmolLM2's: 30 tokens with its default system line) would leave a
    # 72-token minimum no room for a question and its evidence: the minimum counts from after it.
    base = dict(context_len=256, num_train=200, num_eval=20, **SMALL)
    tokenizer = build_datasets(DataConfig(in2=In2Config(context_len_min=72), **base)).tokenizer
    tokenizer.chat_template = ("<|system|>You are a helpful assistant who answers from the documents given. "
                               "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>")
    chat = build_datasets(DataConfig(in2=In2Config(context_len_min=72, chat_template=True), **base), tokenizer)
    template = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                                 return_dict=False))
    lengths = np.array([len(ids) for ids in chat.train["input_ids"]])
    assert template > 20
    assert lengths.min() >= 72 + template and lengths.max() <= 256


QA_FIELDS = FieldMap(question="query", answers="answers", evidence="passages", title="titles")


def _qa_file(tmp_path: Path, n: int = 60, pairs: bool = False) -> Path:
    """A JSON-lines QA file; with `pairs`, every other record needs two passages (an integration question)."""
    records = []
    for k in range(n):
        passage = (f"Tower {k} stands on a hill by the sea. Its keeper guards the relic{k}x every night. "
                   f"Visitors come by boat in spring and leave before the autumn storms.")
        record = {"query": f"What does the keeper of tower {k} guard?", "answers": [f"relic{k}x"],
                  "passages": passage, "titles": f"Tower {k}"}
        if pairs and k % 2:
            record.update(query=f"What does the keeper of tower {k} guard, seen from tower {k + 1000}?",
                          passages=[passage, f"From tower {k + 1000} one sees tower {k} across the bay."],
                          titles=[f"Tower {k}", f"Tower {k + 1000}"])
        records.append(record)
    records[5]["answers"] = ["not in the passage"]
    path = tmp_path / ("pairs.jsonl" if pairs else "qa.jsonl")
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_hf_source_with_field_mapping_and_integration(tmp_path):
    path = _qa_file(tmp_path, 80, pairs=True)
    cfg = DataConfig(source=DataSource.hf, path=str(path), fields=QA_FIELDS, context_len=400,
                     num_train=200, num_eval=20, num_eval_docs=20, vocab_size=400, cache=False,
                     in2=In2Config(segment_len=48, tasks=TaskMix(0.5, 0.4, 0.1)))
    bundle = build_datasets(cfg)
    assert bundle.stats["skipped"]["source"]["answer_not_in_evidence"] == 1
    assert bundle.stats["tasks"]["train"] == {"fine_grained": 100, "integration": 80, "short_qa": 20}
    passages = {normalize(t) for t in _passages(cfg.path)}
    check_records(bundle.train, bundle.tokenizer, lambda r: "".join(passages), all_extractive=True)
    two = bundle.train.filter(lambda r: r["task"] == "integration")
    assert all(len(s) == 2 for s in two["gold_spans"])
    r = two[0]
    assert "across the bay" in bundle.tokenizer.decode(r["input_ids"][slice(*r["gold_spans"][1])])


def _passages(path: str) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        titles = r["titles"] if isinstance(r["titles"], list) else [r["titles"]]
        passages = r["passages"] if isinstance(r["passages"], list) else [r["passages"]]
        out += [f"{t}\n{p}" for t, p in zip(titles, passages)]
    return out


def test_chat_template_wraps_the_prompt(tmp_path):
    cfg = DataConfig(num_train=50, num_eval=10, num_train_docs=300, num_eval_docs=60, cache=False,
                     in2=In2Config(instruction="Answer briefly.", chat_template=True))
    tok = train_bpe_tokenizer([d for d in synthetic_source(300, 60, 0, False).train.passages], 500)
    with pytest.raises(ValueError, match=r"data\.in2\.chat_template=true, but the tokenizer has no chat template"):
        build_datasets(cfg, tok)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    bundle = build_datasets(cfg, tok)
    r = bundle.train[0]
    prompt = tok.decode(r["input_ids"][: r["prompt_len"]])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "\n\nAnswer briefly.\nQuestion: " in prompt
    answer = tok.decode(r["input_ids"][r["prompt_len"]:], skip_special_tokens=True)
    assert answer == r["answers"][0]
    head = len(tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"])
    check_records(bundle.train, tok, head=head)


def test_cache_and_prebuilt_round_trip(tmp_path, monkeypatch):
    cfg = DataConfig(num_train=400, num_eval=20, num_train_docs=300, num_eval_docs=60)
    first = build_datasets(cfg)

    def rebuild(*args, **kwargs):
        raise AssertionError("an identical build was assembled again instead of read from the cache")

    monkeypatch.setattr(build, "build_in2", rebuild)
    again = build_datasets(cfg)
    assert again.train.cache_files  # read back from the cache folder
    assert dataset_digest(again.train) == dataset_digest(first.train) == first.stats["digest"]["train"]

    save_built(first, tmp_path / "built")
    loaded = build_datasets(DataConfig(prebuilt=str(tmp_path / "built")))
    assert dataset_digest(loaded.eval) == dataset_digest(first.eval)
    assert loaded.heldout_docs == first.heldout_docs
    r = loaded.train[0]
    assert loaded.tokenizer.decode(r["input_ids"]) == first.tokenizer.decode(r["input_ids"])
    other = train_bpe_tokenizer(["something else entirely"] * 5, 300)
    with pytest.raises(ValueError, match="another tokenizer"):
        load_prebuilt(tmp_path / "built", other)


def test_nq_builds_at_4k_and_8k_with_a_card(tmp_path, nq_file):
    """NQ oracle passages at 4K and 8K tokens with a tiny BPE, through the CLI: records, card, attribution."""
    out = tmp_path / "nq"
    build_main(["data=in2_nq", f"data.path={nq_file}", "data.context_len=8192", "data.in2.context_len_min=null",
                "data.in2.context_lens=[4096,8192]", "data.num_train=24", "data.num_eval=8",
                "data.vocab_size=512",
                "data.in2.tasks.fine_grained=0.8", "data.in2.tasks.short_qa=0.2", "data.cache=false", f"out={out}"])
    bundle = load_prebuilt(out)
    assert {len(ids) for ids in bundle.eval["input_ids"]} <= {4096, 8192}
    train = bundle.train
    lengths = {len(ids) for ids, t in zip(train["input_ids"], train["task"]) if t == "fine_grained"}
    assert lengths == {4096, 8192}
    passages = " ".join(normalize(p) for p in _nq_passages(nq_file))
    check_records(bundle.train, bundle.tokenizer, lambda r: passages, all_extractive=True)
    check_records(bundle.eval, bundle.tokenizer, lambda r: passages, all_extractive=True)
    assert bundle.stats["source"] == "nq"
    assert bundle.stats["tasks"]["train"] == {"fine_grained": 19, "short_qa": 5}
    card = (out / "README.md").read_text()
    for attribution in ("CC BY-SA 3.0", "Kwiatkowski et al. 2019", "nelson-liu/lost-in-the-middle"):
        assert attribution in card
    assert "Answer the question with a short answer" in card  # the decoded prompt example


def _nq_passages(path: Path) -> list[str]:
    data = file_source("nq", str(path), FieldMap(), 10_000, 400, 0, default_cache_dir() / "hf")
    return data.train.passages + data.heldout.passages


@pytest.mark.slow
def test_nq_depth_uniform_over_many_samples(nq_file):
    cfg = DataConfig(source=DataSource.nq, path=str(nq_file), context_len=8192, num_train=3000, num_eval=100,
                     vocab_size=1024, cache=False, in2=In2Config(context_lens=[4096, 8192], segment_len=128))
    bundle = build_datasets(cfg)
    depth = np.asarray(bundle.train["depth"])
    assert stats.kstest(depth, "uniform").pvalue > 0.01
    passages = " ".join(normalize(p) for p in _nq_passages(nq_file))
    check_records(bundle.train.select(range(300)), bundle.tokenizer, lambda r: passages, all_extractive=True)


def test_in2_film_preset_lengths(compose_cfg):
    """The FILM preset (4K-32K, all three tasks) on the synthetic source, a few samples."""
    composed = compose_cfg("data=in2_film", "data.num_train=12", "data.num_eval=4",
                           "data.num_train_docs=3000", "data.num_eval_docs=1000", "data.vocab_size=512",
                           "data.cache=false")
    cfg = as_data_config(composed.data)
    assert (cfg.in2.context_len_min, cfg.context_len, cfg.in2.segment_len) == (4096, 32768, 128)
    bundle = build_datasets(cfg)
    lengths = [len(ids) for ids, t in zip(bundle.train["input_ids"], bundle.train["task"]) if t != "short_qa"]
    assert all(4096 <= n <= 32768 for n in lengths) and max(lengths) > 8192
    assert set(bundle.train["task"]) == {"fine_grained", "integration", "short_qa"}
    check_records(bundle.train, bundle.tokenizer, synthetic_texts(cfg))


def test_every_data_preset_composes(compose_cfg):
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "data").glob("*.yaml"))
    assert {"in2_synthetic", "in2_nq", "in2_film", "hf_example"} <= set(presets)
    for preset in presets:
        cfg = compose_cfg(f"data={preset}", "data.path=some/file.jsonl")
        assert as_data_config(cfg.data).name == preset


def test_build_dataset_cli_writes_a_card(tmp_path, compose_cfg):
    out = tmp_path / "built"
    path = _qa_file(tmp_path)
    build_main(["data=hf_example", f"data.path={path}", "data.context_len=512", "data.in2.context_len_min=256",
                "data.in2.segment_len=48", "data.num_train=40", "data.num_eval=8", "data.num_eval_docs=10",
                "data.vocab_size=400", "data.in2.tasks.integration=0", f"out={out}"])
    card = (out / "README.md").read_text()
    assert "| source | answer_not_in_evidence | 1 |" in card and "fingerprint" in card
    assert all((out / "plots" / name).stat().st_size > 0 for name in ("lengths.png", "depths.png"))
    built = json.loads((out / "build.json").read_text())
    assert built["config"]["seed"] == 0 and built["tasks"]["train"] == {"fine_grained": 36, "short_qa": 4}
    cfg = compose_cfg(f"data.prebuilt={out}")
    bundle = build_datasets(cfg.data)
    assert len(bundle.train) == 40
    assert bundle.tokenizer.decode(bundle.train[0]["input_ids"]).endswith("<|endoftext|>")
    with pytest.raises(FileExistsError):
        build_main(["data=hf_example", f"data.path={path}", f"out={tmp_path}"])
