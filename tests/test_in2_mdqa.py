"""IN2 samples in the mdqa probe's own format (data.in2.layout=mdqa, data_builders.in2_mdqa) and the mdqa probe's
held-out distractor pool (pool=heldout).

A generated NQ-format file of invented persons (scripts.investigations.synthetic_oracle) stands in for nq-open-oracle, with a
few records written here: a target that is the second alias, and answers that are in their gold only as part of
a longer word (the source keeps them, this layout drops and counts them). The real file is only counted, where
it exists.
"""
from __future__ import annotations

import copy
import json
import logging
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from scipy import stats

from analysis.evaluation.config import EvalConfig, MDQAProbeConfig, MDQAQuestions, check_probes
from analysis.evaluation.generate import encode_prompt
from analysis.evaluation.probes import build_probes
from data_builders.build import build_datasets, build_key, dataset_digest, save_built
from data_builders.config import DataConfig, DataSource, In2Config, TaskMix, config_dict, validate_data
from data_builders.in2 import make_format
from data_builders.in2_mdqa import NO_ALIAS, TOO_LONG, MdqaSplit, _Tokens, assemble_mdqa
from data_builders.mdqa import write_jsonl_gz
from data_builders.probes import HELDOUT_POOL, check_mdqa_pool, mdqa_probe
from data_builders.question_split import EvaluationPart, QuestionSplit, is_evaluation_question
from data_builders.sources import load_source
from data_builders.text import normalize_answer
from scripts.investigations.synthetic_oracle import oracle_records

SPLIT = QuestionSplit()  # the defaults both sides use
N_DOCS = 4
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCUMENT = re.compile(r"^Document \[(\d+)\]\(Title: (.*?)\) (.*)$")


def _on_side(base: str, evaluation: bool) -> str:
    """`base`, or a variant of it, that is (not) an evaluation question under SPLIT."""
    return next(q for q in (base, *(f"{base} (variant {k})" for k in range(200)))
                if is_evaluation_question(q, SPLIT) == evaluation)


def _records() -> list[dict]:
    records = oracle_records(160, seed=3)
    records += [
        # answers[0] is not in the gold, answers[1] is: the target is answers[1]
        {"question": _on_side("In which town does the Vosmarin lighthouse stand?", False),
         "answers": ["Ostbay harbour", "Lindqvist"],
         "ctxs": [{"title": "Vosmarin lighthouse", "text": "The Vosmarin lighthouse stands in Lindqvist by the pier."}]},
        # in the gold only inside a longer word: kept by the source (a substring), dropped here
        {"question": _on_side("Which family built the Kellwater mill?", False), "answers": ["Kell"],
         "ctxs": [{"title": "Kellwater mill", "text": "The Kellwater mill grinds barley for the valley."}]},
        {"question": _on_side("Which family planted the Pommeroy orchard?", True), "answers": ["Pomm"],
         "ctxs": [{"title": "Pommeroy orchard", "text": "The Pommeroy orchard grows apples on the hill."}]},
    ]
    return records


def _contains(text: str, part: str) -> bool:
    return f" {normalize_answer(part)} " in f" {normalize_answer(text)} "


def _config(path: Path, **changes) -> DataConfig:
    base = dict(source=DataSource.nq, path=str(path), context_len=1024, num_train=1200, num_eval=40, vocab_size=400,
                cache=False, in2=In2Config(layout="mdqa", n_docs=N_DOCS))
    return DataConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def nq_fixture(tmp_path_factory) -> Path:
    return write_jsonl_gz(tmp_path_factory.mktemp("nq") / "nq-open-oracle.jsonl.gz", _records())


@pytest.fixture(scope="module")
def bundle(nq_fixture):
    return build_datasets(_config(nq_fixture))


@pytest.fixture(scope="module")
def chat_bundle(nq_fixture, bundle):
    tokenizer = copy.deepcopy(bundle.tokenizer)
    tokenizer.chat_template = CHAT
    cfg = _config(nq_fixture, num_train=60, num_eval=10, in2=In2Config(layout="mdqa", n_docs=N_DOCS, chat_template=True))
    return build_datasets(cfg, tokenizer), tokenizer


def _prompts(ds, tokenizer) -> list[dict]:
    """Each record's prompt as text, its question, slot, documents (title, text) in order and decoded target."""
    out = []
    for r in ds:
        p = r["prompt_len"]
        prompt = tokenizer.decode(r["input_ids"][:p])
        docs = [DOCUMENT.match(line).groups() for line in prompt.splitlines() if line.startswith("Document [")]
        out.append({
            "prompt": prompt, "question": re.search(r"\nQuestion: (.*)\nAnswer:", prompt).group(1),
            "slot": round(r["depth"] * (N_DOCS - 1)), "docs": [(t, x) for _, t, x in docs],
            "numbers": [int(k) for k, _, _ in docs], "target": tokenizer.decode(r["input_ids"][p:-1]).strip(),
            "answers": r["answers"], "record": r,
        })
    return out


def _golds() -> dict[str, tuple[str, str]]:
    return {r["question"]: (r["ctxs"][0]["title"], r["ctxs"][0]["text"]) for r in _records()}


def _evaluation_passages() -> set[tuple[str, str]]:
    return {(r["ctxs"][0]["title"], r["ctxs"][0]["text"]) for r in _records()
            if is_evaluation_question(r["question"], SPLIT)}


def test_a_sample_is_the_mdqa_probes_prompt_byte_for_byte(bundle, nq_fixture, tmp_path):
    """Each training prompt is the mdqa probe's for the same question, pool and gold slot; its token ids are the
    ones the probe's prompt is generated from (analysis.evaluation.generate.encode_prompt)."""
    tokenizer = bundle.tokenizer
    samples = _prompts(bundle.train.select(range(40)), tokenizer)
    data = load_source(_config(nq_fixture), tmp_path / "hf", with_integration=False)
    pool = write_jsonl_gz(tmp_path / "pool.jsonl.gz",
                          [dict(zip(("title", "text"), p.split("\n", 1))) for p in data.train.passages])
    golds, records = _golds(), {r["question"]: r for r in _records()}
    asked = write_jsonl_gz(tmp_path / "asked.jsonl.gz", [records[q] for q in dict.fromkeys(s["question"] for s in samples)])
    items = {(it.extra["question"], it.position): it
             for it in mdqa_probe(asked, n_docs=N_DOCS, positions=range(N_DOCS), pool=pool, closed_book=False)}
    for s in samples:
        probe = items[s["question"], s["slot"]]
        assert s["prompt"] == probe.prompt  # the same bytes
        assert s["record"]["input_ids"][: s["record"]["prompt_len"]] == encode_prompt(tokenizer, probe.prompt)
        assert probe.prompt.startswith("Write a high-quality answer for the given question using only the provided "
                                       "search results (some of which might be irrelevant).\n\nDocument [1](Title: ")
        assert probe.prompt.endswith(f"\n\nQuestion: {s['question']}\nAnswer:")
        assert s["numbers"] == list(range(1, N_DOCS + 1)) and s["docs"][s["slot"]] == golds[s["question"]]


@pytest.fixture(scope="module")
def teacher_bundles(nq_fixture, bundle):
    """The same small build without and with teacher prompts (data.in2.teacher_slot=-1: the last slot)."""
    small = dict(num_train=60, num_eval=10)
    plain = build_datasets(_config(nq_fixture, **small), bundle.tokenizer)
    taught = build_datasets(_config(nq_fixture, **small, in2=In2Config(layout="mdqa", n_docs=N_DOCS, teacher_slot=-1)),
                            bundle.tokenizer)
    return plain, taught


def test_teacher_prompts_are_the_probes_prompt_with_the_gold_at_the_teacher_slot(teacher_bundles, nq_fixture,
                                                                                 tmp_path):
    """Each sample's teacher prompt is the mdqa probe's prompt for its question with the gold at the teacher slot,
    the same documents, the distractors in their order, byte for byte and token for token; nothing else changes."""
    plain, taught = teacher_bundles
    tokenizer, teacher = taught.tokenizer, N_DOCS - 1
    for name in ("train", "eval"):
        added = getattr(taught, name).remove_columns(["teacher_prompt_ids", "gold_slot"])
        assert dataset_digest(added) == dataset_digest(getattr(plain, name))
    samples = _prompts(taught.train, tokenizer)
    data = load_source(_config(nq_fixture), tmp_path / "hf", with_integration=False)
    pool = write_jsonl_gz(tmp_path / "pool.jsonl.gz",
                          [dict(zip(("title", "text"), p.split("\n", 1))) for p in data.train.passages])
    records = {r["question"]: r for r in _records()}
    asked = write_jsonl_gz(tmp_path / "asked.jsonl.gz", [records[q] for q in dict.fromkeys(s["question"] for s in samples)])
    items = {(it.extra["question"], it.position): it
             for it in mdqa_probe(asked, n_docs=N_DOCS, positions=[teacher], pool=pool, closed_book=False)}
    at_teacher = 0
    for s in samples:
        r, probe = s["record"], items[s["question"], teacher]
        assert r["gold_slot"] == s["slot"]
        assert tokenizer.decode(r["teacher_prompt_ids"]) == probe.prompt
        assert r["teacher_prompt_ids"] == encode_prompt(tokenizer, probe.prompt)
        docs = [DOCUMENT.match(line).groups()[1:] for line in probe.prompt.splitlines() if line.startswith("Document [")]
        gold = s["docs"][s["slot"]]
        assert docs[teacher] == gold and [d for d in docs if d != gold] == [d for d in s["docs"] if d != gold]
        if s["slot"] == teacher:  # the sample's own prompt
            at_teacher += 1
            assert r["teacher_prompt_ids"] == r["input_ids"][: r["prompt_len"]]
    assert 0 < at_teacher < len(samples)


def test_the_teacher_slot_enters_the_fingerprint_only_when_set(monkeypatch):
    mdqa = DataConfig(source=DataSource.nq, path="nq.jsonl.gz", in2=In2Config(layout="mdqa", n_docs=4))
    on = replace(mdqa, in2=In2Config(layout="mdqa", n_docs=4, teacher_slot=-1))
    assert build_key(on, None) != build_key(mdqa, None)
    assert build_key(on, None) == build_key(replace(mdqa, in2=In2Config(layout="mdqa", n_docs=4, teacher_slot=3)), None)
    off = build_key(mdqa, None)
    import data_builders.build as build

    def before_the_setting(cfg):
        settings = config_dict(cfg)
        del settings["in2"]["teacher_slot"]
        return settings

    monkeypatch.setattr(build, "config_dict", before_the_setting)
    assert build_key(mdqa, None) == off  # off: the fingerprint of a config without the key


def test_the_teacher_slot_is_checked_naming_the_key(nq_fixture):
    validate_data(_config(nq_fixture, in2=In2Config(layout="mdqa", n_docs=N_DOCS, teacher_slot=0)))
    for slot in (N_DOCS, -2):
        with pytest.raises(ValueError, match=rf"data\.in2\.teacher_slot={slot} must be a slot in \[0, "
                                             rf"data\.in2\.n_docs={N_DOCS}\) or -1"):
            validate_data(_config(nq_fixture, in2=In2Config(layout="mdqa", n_docs=N_DOCS, teacher_slot=slot)))
    with pytest.raises(ValueError, match=r"data\.in2\.teacher_slot=-1: .* only data\.in2\.layout=mdqa has"):
        validate_data(DataConfig(in2=In2Config(teacher_slot=-1)))


def test_chat_template_samples_are_the_probes_chat_prompts(chat_bundle):
    bundle, tokenizer = chat_bundle
    for s in _prompts(bundle.train, tokenizer):
        r = s["record"]
        text = s["prompt"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        assert r["input_ids"][: r["prompt_len"]] == encode_prompt(tokenizer, text, chat_template=True)
        assert s["prompt"].endswith("\nAnswer:<|im_end|>\n<|im_start|>assistant\n")
        assert s["target"] == tokenizer.decode(r["input_ids"][r["prompt_len"]:], skip_special_tokens=True)
        head = len(tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"])
        context = tokenizer.decode(r["input_ids"][head: head + r["context_tokens"]])
        assert context.startswith("Write a high-quality") and context.endswith(s["docs"][-1][1])


def test_records_gold_span_and_labels(bundle):
    eos = bundle.tokenizer.eos_token_id
    for s in _prompts(bundle.train.select(range(100)), bundle.tokenizer):
        r = s["record"]
        ids, labels, p = r["input_ids"], r["labels"], r["prompt_len"]
        assert ids[-1] == eos and labels[:p] == [-100] * p and labels[p:] == ids[p:]
        assert r["task"] == "fine_grained" and r["depths"] == [r["depth"]] and r["source"] == "nq"
        (start, end), = r["gold_spans"]
        title, text = s["docs"][s["slot"]]
        assert bundle.tokenizer.decode(ids[start:end]).strip() == f"Document [{s['slot'] + 1}](Title: {title}) {text}"
        assert end <= r["context_tokens"] <= p


def test_the_gold_slot_is_uniform_over_the_slots(bundle):
    slots = Counter(round(d * (N_DOCS - 1)) for d in bundle.train["depth"])
    counts = [slots[k] for k in range(N_DOCS)]
    assert counts == bundle.stats["gold_slots"]["train"] and sum(counts) == 1200
    assert stats.chisquare(counts).pvalue > 1e-3, counts
    assert set(bundle.train["depth"]) == {k / (N_DOCS - 1) for k in range(N_DOCS)}


def test_no_distractor_holds_an_answer_alias_or_comes_from_the_heldout_split(bundle):
    evaluation, golds = _evaluation_passages(), _golds()
    for s in _prompts(bundle.train, bundle.tokenizer):
        assert not is_evaluation_question(s["question"], SPLIT)
        distractors = [d for k, d in enumerate(s["docs"]) if k != s["slot"]]
        assert len(distractors) == N_DOCS - 1 and golds[s["question"]] not in distractors
        for title, text in distractors:
            assert not any(_contains(f"{title} {text}", a) for a in s["answers"]), (s["question"], title)
        assert not set(s["docs"]) & evaluation
    # the held-out samples ask evaluation questions over held-out passages only
    for s in _prompts(bundle.eval, bundle.tokenizer):
        assert is_evaluation_question(s["question"], SPLIT) and set(s["docs"]) <= evaluation


def test_the_target_is_an_alias_the_gold_holds_as_whole_words(bundle):
    seen = set()
    for s in _prompts(bundle.train, bundle.tokenizer):
        title, text = s["docs"][s["slot"]]
        assert s["target"] in s["answers"] and _contains(f"{title} {text}", s["target"])
        assert s["target"] == next(a for a in s["answers"] if _contains(f"{title} {text}", a))  # the first such
        seen.add((s["question"], s["target"]))
    assert (_on_side("In which town does the Vosmarin lighthouse stand?", False), "Lindqvist") in seen


def test_questions_without_such_an_alias_are_dropped_and_counted(bundle, nq_fixture, tmp_path, caplog):
    asked = {s["question"] for s in _prompts(bundle.train, bundle.tokenizer) + _prompts(bundle.eval, bundle.tokenizer)}
    assert _on_side("Which family built the Kellwater mill?", False) not in asked
    assert _on_side("Which family planted the Pommeroy orchard?", True) not in asked
    # written out independently: the questions the source keeps whose aliases are never whole words of their gold
    expected = {"train": 0, "eval": 0}
    for r in _records():
        gold = f"{r['ctxs'][0]['title']} {r['ctxs'][0]['text']}"
        if any(normalize_answer(a) in normalize_answer(gold) for a in r["answers"]) and not any(
                _contains(gold, a) for a in r["answers"]):
            expected["eval" if is_evaluation_question(r["question"], SPLIT) else "train"] += 1
    assert expected == {"train": 1, "eval": 1}
    assert {k: bundle.stats["skipped"][k].get(NO_ALIAS, 0) for k in expected} == expected
    assert bundle.stats["skipped"]["source"]["answer_not_in_evidence"] == 0  # the source kept them
    save_built(bundle, tmp_path / "built")
    card = json.loads((tmp_path / "built" / "build.json").read_text())
    assert card["skipped"]["train"][NO_ALIAS] == 1 and card["gold_slots"] == bundle.stats["gold_slots"]
    with caplog.at_level(logging.INFO, logger="data_builders.in2_mdqa"):
        build_datasets(_config(nq_fixture, num_train=8, num_eval=4), bundle.tokenizer)
    assert f"1 {NO_ALIAS}" in caplog.text


def test_samples_longer_than_the_budget_are_dropped_and_counted(nq_fixture, bundle, tmp_path):
    cfg = _config(nq_fixture)
    data = load_source(cfg, tmp_path / "hf", with_integration=False)
    tokens = _Tokens(bundle.tokenizer, make_format(bundle.tokenizer, cfg))
    lengths = sorted(len(x) for x in bundle.train["input_ids"])
    budget = lengths[len(lengths) // 2]
    skipped: dict[str, int] = {}
    table, _ = assemble_mdqa(MdqaSplit(data.train, N_DOCS, {}), tokens, 100, replace(cfg, context_len=budget), 0,
                             "train", skipped)
    assert table.num_rows == 100 and skipped[TOO_LONG] > 0
    assert max(len(x) for x in table.column("input_ids").to_pylist()) <= budget
    with pytest.raises(ValueError, match=r"data\.context_len=50 tokens"):
        assemble_mdqa(MdqaSplit(data.train, N_DOCS, {}), tokens, 5, replace(cfg, context_len=50), 0, "train", {})


def test_same_seed_same_bytes(bundle, nq_fixture):
    again = build_datasets(_config(nq_fixture), bundle.tokenizer)
    assert [dataset_digest(again.train), dataset_digest(again.eval)] == [dataset_digest(bundle.train),
                                                                         dataset_digest(bundle.eval)]
    other = build_datasets(_config(nq_fixture, seed=1), bundle.tokenizer)
    assert dataset_digest(other.train) != dataset_digest(bundle.train)


def test_the_fingerprint_holds_the_layout_where_it_is_used():
    mdqa = DataConfig(source=DataSource.nq, path="nq.jsonl.gz", in2=In2Config(layout="mdqa"))
    assert build_key(mdqa, None) != build_key(replace(mdqa, in2=In2Config(layout="mdqa", n_docs=3)), None)
    segments = replace(mdqa, in2=In2Config())
    assert build_key(segments, None) != build_key(mdqa, None)
    # the segment layout does not read n_docs: its fingerprints stay those of builds made before the setting
    assert build_key(segments, None) == build_key(replace(mdqa, in2=In2Config(n_docs=3)), None)


def test_the_layout_settings_are_checked_at_start_up_naming_the_key(nq_fixture, compose_cfg):
    validate_data(_config(nq_fixture))
    bad = [
        (dict(in2=In2Config(layout="mdqaa")), r"data\.in2\.layout='mdqaa' is not known \(known: segments, mdqa\)"),
        (dict(in2=In2Config(layout="mdqa", n_docs=1)), r"data\.in2\.n_docs=1 must be >= 2"),
        (dict(source=DataSource.synthetic), r"data\.in2\.layout=mdqa .* needs data\.source=nq"),
        (dict(filler_path=str(nq_fixture)), r"data\.filler_path=.* has no titles"),
        (dict(in2=In2Config(layout="mdqa", context_len_min=512, tasks=TaskMix(0.9, 0.0, 0.1))),
         r"does not use data\.in2\.context_len_min=512, data\.in2\.tasks\.fine_grained=0\.9, "
         r"data\.in2\.tasks\.short_qa=0\.1"),
    ]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_data(_config(nq_fixture, **changes))
    compose_cfg("data=in2_nq_mdqa")
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("data=in2_nq_mdqa", "data.in2.layout=mdqax")
    message = str(err.value.__cause__ or err.value)
    assert "data.in2.layout" in message and "mdqa" in message.split("expected one of")[1]


def test_the_heldout_pool_retrieves_from_evaluation_passages_only(nq_fixture):
    evaluation = _evaluation_passages()

    def documents(items) -> set[tuple[str, str]]:
        return {tuple(DOCUMENT.match(line).groups()[1:]) for it in items for line in it.prompt.splitlines()
                if line.startswith("Document [")}

    held = mdqa_probe(nq_fixture, n_docs=N_DOCS, closed_book=False, heldout=SPLIT, pool=HELDOUT_POOL)
    asked = {r["question"] for r in _records() if is_evaluation_question(r["question"], SPLIT)}
    assert held and {it.extra["question"] for it in held} == asked
    assert documents(held) <= evaluation
    # without it, the file's every passage is retrieved from: the check above can fail
    assert documents(mdqa_probe(nq_fixture, n_docs=N_DOCS, closed_book=False, heldout=SPLIT)) - evaluation
    # through the eval config (eval.mdqa.pool) too
    cfg = EvalConfig(probes=["mdqa"], probe_examples=5, mdqa=MDQAProbeConfig(
        path=str(nq_fixture), n_docs=N_DOCS, questions=MDQAQuestions.heldout, pool=HELDOUT_POOL))
    assert documents(build_probes(cfg, None)["mdqa"]) <= evaluation
    check_probes(cfg)  # a rule, not a file: the start-up check takes it
    with pytest.raises(ValueError, match=r"eval\.mdqa\.pool=heldout .* set eval\.mdqa\.questions=heldout"):
        check_probes(replace(cfg, mdqa=replace(cfg.mdqa, questions=MDQAQuestions.all)))


def test_a_bad_pool_fails_naming_the_key(nq_fixture):
    check_mdqa_pool(HELDOUT_POOL, "retrieved", SPLIT)
    check_mdqa_pool(None, "random", None)
    check_mdqa_pool(str(nq_fixture), "retrieved", None)
    with pytest.raises(ValueError, match=r"eval\.mdqa\.pool='heldot' is neither a passage file .* nor 'heldout'"):
        check_mdqa_pool("heldot", "retrieved", SPLIT)
    with pytest.raises(ValueError, match=r"eval\.mdqa\.pool=heldout .* set eval\.mdqa\.questions=heldout"):
        check_mdqa_pool(HELDOUT_POOL, "retrieved", None)
    with pytest.raises(ValueError, match=r"eval\.mdqa\.pool=heldout .* set eval\.mdqa\.distractors=retrieved"):
        check_mdqa_pool(HELDOUT_POOL, "random", SPLIT)
    # the probe itself refuses them before reading any file, naming its own key (scripts.eval_checkpoint's mdqa.*)
    with pytest.raises(ValueError, match=r"^mdqa\.pool='heldot'"):
        mdqa_probe(nq_fixture, n_docs=N_DOCS, heldout=SPLIT, pool="heldot")
    with pytest.raises(ValueError, match=r"^mdqa\.pool=heldout .* set mdqa\.questions=heldout"):
        mdqa_probe(nq_fixture, n_docs=N_DOCS, pool=HELDOUT_POOL)


def test_the_experiment_composes_with_the_layout(compose_cfg):
    cfg = compose_cfg("+exp=in2_smol_mdqa")
    assert cfg.data.in2.layout == "mdqa" and cfg.data.in2.n_docs == 10 and cfg.data.num_train >= 600
    assert cfg.data.in2.chat_template and cfg.eval.chat_template and cfg.data.source == "nq"


def test_nq_open_oracle_questions_left_out(nq_file, tmp_path):
    """The real file under the defaults: how many questions have no alias as whole words of their gold."""
    cfg = DataConfig(source=DataSource.nq, path=str(nq_file), cache=False, in2=In2Config(layout="mdqa"))
    data = load_source(cfg, tmp_path / "hf", with_integration=False)
    counts = {}
    for name, part in (("train", data.train), ("eval", data.heldout)):
        skipped: dict[str, int] = {}
        split = MdqaSplit(part, 10, skipped)
        counts[name] = (len(split.questions), skipped.get(NO_ALIAS, 0))
        first = sum(q.target == q.answers[0] for q in split.questions)
        assert 0.85 < first / len(split.questions) < 1  # the rest train on a later alias, which their gold holds
    assert counts == {"train": (2234, 15), "eval": (386, 4)}


def test_the_dev_and_test_parts_divide_the_heldout_questions(nq_fixture):
    def asked(**kwargs) -> set[str]:
        return {it.extra["question"] for it in mdqa_probe(nq_fixture, n_docs=N_DOCS, closed_book=False, **kwargs)}

    held = asked(heldout=SPLIT)
    dev, test = asked(heldout=SPLIT, part=EvaluationPart.dev), asked(heldout=SPLIT, part=EvaluationPart.test)
    assert dev | test == held and not dev & test and dev and test
    with pytest.raises(ValueError, match="dev part is a part of the evaluation questions"):
        mdqa_probe(nq_fixture, n_docs=N_DOCS, part=EvaluationPart.dev)
    # through the eval config: eval.mdqa.questions=dev
    cfg = EvalConfig(probes=["mdqa"], mdqa=MDQAProbeConfig(path=str(nq_fixture), n_docs=N_DOCS,
                                                           questions=MDQAQuestions.dev, closed_book=False))
    assert {it.extra["question"] for it in build_probes(cfg, None)["mdqa"]} == dev
