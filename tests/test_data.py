"""Sources, segment pools and the assembly benchmark (data_builders.sources, pools, synthetic; bench_data)."""
from __future__ import annotations

import gzip
import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data_builders import pools
from data_builders.build import build_datasets, dataset_digest
from data_builders.config import (
    DataConfig,
    DataFormat,
    DataSource,
    FieldMap,
    In2Config,
    TaskMix,
    WindowsConfig,
    ignored_settings,
    validate_data,
)
from data_builders.pools import build_pool, cut_points
from data_builders.sources import file_source, load_filler, synthetic_source
from data_builders.synthetic import generate_documents, integration_questions
from data_builders.text import normalize_answer
from data_builders.tokenizer import train_bpe_tokenizer
from scripts.bench_data import bench_case


def write_jsonl(path: Path, records: list, blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def qa_records(n: int) -> list[dict]:
    """Small extractive QA records with distinct answers: one evidence passage each."""
    return [
        {
            "query": f"What does the keeper of tower {k} guard?",
            "answers": [f"relic{k}x"],
            "passages": f"Tower {k} stands on a hill. Its keeper guards the relic{k}x every night. "
                        f"Visitors come by boat in spring.",
            "titles": f"Tower {k}",
        }
        for k in range(n)
    ]


def test_generate_documents_unchanged():
    """The default CPU task learns from these exact sentences and questions."""
    docs = generate_documents(2, 0)
    assert docs[0].text == (
        "Vorkeslo lives in Pallis. Vorkeslo plays the trumpet. Vorkeslo works as a miner. "
        "Vorkeslo keeps a turtle at home. The favourite colour of Vorkeslo is green."
    )
    assert docs[0].qa[0].question == "Where does Vorkeslo live?" and docs[0].qa[0].answers == ("Pallis",)
    assert docs[1].doc_id == "syn-0-1" and docs[1].entity == "Torvorven"


_COMPARED = {"same city": "city", "same job": "job", "favourite colour": "colour", "same pet": "pet",
             "same instrument": "instrument"}
_COUNTED = {r"live in (\w+)\?": "city", r"work as a (\w+)\?": "job", r"have (\w+) as their": "colour",
            r"keep a (\w+) at home\?": "pet", r"play the (\w+)\?": "instrument"}


def test_integration_questions_are_answerable_from_their_documents():
    docs = generate_documents(400, 3)
    facts = [{qa.attribute: qa.answers[0] for qa in d.qa} for d in docs]
    questions = integration_questions(docs, 90, seed=5)
    assert [q.kind for q in questions[:3]] == ["two_hop", "comparison", "count"]
    assert integration_questions(docs, 90, seed=5) == questions
    for q in questions:
        texts = [docs[k].text for k in q.docs]
        assert len(set(q.docs)) == len(q.docs) == (3 if q.kind == "count" else 2)
        if q.kind == "two_hop":
            a, b = texts
            assert q.extractive and q.answers[0] in b and q.answers[0] not in a
            assert q.forbid[0] in a and q.forbid[0] in b  # the shared fact that names the second person
            assert docs[q.docs[0]].entity in q.question
        elif q.kind == "comparison":
            attr = next(at for key, at in _COMPARED.items() if key in q.question)
            same = facts[q.docs[0]][attr] == facts[q.docs[1]][attr]
            assert not q.extractive and q.answers == ("yes" if same else "no",)
        else:
            (value, attr), = [(m[1], at) for rx, at in _COUNTED.items() if (m := re.search(rx, q.question))]
            assert not q.extractive and q.answers == (str(sum(facts[k][attr] == value for k in q.docs)),)
    assert {int(q.answers[0]) for q in questions if q.kind == "count"} == {0, 1, 2, 3}
    assert {q.answers[0] for q in questions if q.kind == "comparison"} == {"yes", "no"}


def test_synthetic_source_splits_disjoint_entities():
    data = synthetic_source(300, 80, seed=0, with_integration=True)
    assert len(data.heldout.passages) == 80 and len(data.train.passages) == 300
    assert not set(data.train.passages) & set(data.heldout.passages)
    tasks = {q.task for q in data.train.questions}
    assert tasks == {"fine_grained", "integration"}
    assert all(q.whole for q in data.train.questions if q.task == "integration")
    plain = synthetic_source(300, 80, 0, with_integration=False)
    assert {q.task for q in plain.train.questions} == {"fine_grained"}


def test_nq_source_uses_oracle_passage_and_splits_by_question(tmp_path, nq_file):
    data = file_source("nq", str(nq_file), FieldMap(), 10_000, 300, seed=0, cache_dir=tmp_path)
    kept = len(data.train.questions) + len(data.heldout.questions)
    assert kept + sum(data.skipped.values()) == 2655
    assert kept > 2500 and "Kwiatkowski" in data.attribution[0] and "CC BY-SA 3.0" in data.attribution[0]
    assert not set(data.train.passages) & set(data.heldout.passages)
    with gzip.open(nq_file, "rt") as f:
        first = json.loads(f.readline())
    gold = f"{first['ctxs'][0]['title']}\n{first['ctxs'][0]['text']}"
    split = data.train if gold in data.train.passages else data.heldout
    q = next(q for q in split.questions if q.question == first["question"])
    assert split.passages[q.evidence[0]] == gold and q.task == "fine_grained"
    for q in data.heldout.questions:
        passage = normalize_answer(data.heldout.passages[q.evidence[0]])
        assert any(normalize_answer(a) in passage for a in q.answers)


def test_missing_data_file_fails_naming_the_path(tmp_path):
    missing = tmp_path / "nope" / "nq-open-oracle.jsonl.gz"
    for cfg in (
        DataConfig(source=DataSource.nq, path=str(missing)),
        DataConfig(source=DataSource.hf, path=str(missing)),
        DataConfig(filler_path=str(missing)),
    ):
        with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
            build_datasets(cfg)


def nq_records(n: int) -> list[dict]:
    """Records in the lost-in-the-middle NQ format: the oracle passage is ctxs[0]."""
    return [
        {
            "question": f"who keeps the lighthouse on island {k}",
            "answers": [f"keeper{k}z"],
            "ctxs": [{"title": f"Island {k}", "text": f"The lighthouse of island {k} is kept by keeper{k}z."}],
        }
        for k in range(n)
    ]


def test_malformed_jsonl_line_fails_naming_file_and_line(tmp_path):
    """A truncated record stops the build with one message naming the file and its 1-based line."""
    lines = [json.dumps(r) for r in nq_records(200)]
    lines[137] = lines[137][: len(lines[137]) // 2]  # line 138, cut mid-record
    plain = tmp_path / "data.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    packed = tmp_path / "packed.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    nq_fields = FieldMap(question="question", answers="answers", evidence="ctxs.0.text")
    for run, path in (
        (lambda: build_datasets(DataConfig(source=DataSource.nq, path=str(plain), cache=False)), plain),
        (lambda: file_source("hf", str(packed), nq_fields, 100, 10, 0, tmp_path / "hf"), packed),
    ):
        with pytest.raises(ValueError) as err:
            run()
        message = str(err.value)  # the message alone says where: no chained traceback needed
        assert message.startswith(f"{path}: line 138 is not valid JSON: "), message
        assert err.value.__suppress_context__ and err.value.__cause__ is None


def test_record_missing_a_mapped_field_names_field_file_and_line(tmp_path):
    records = qa_records(6)
    del records[2]["answers"]
    path = write_jsonl(tmp_path / "qa.jsonl", records, blank_after=1)  # record 2 is on line 4
    fields = FieldMap(question="query", answers="answers", evidence="passages", title="titles")
    with pytest.raises(KeyError) as err:
        file_source("hf", str(path), fields, 100, 2, 0, tmp_path / "hf")
    message = str(err.value)
    assert "'answers'" in message and str(path) in message and "line 4" in message

    nested = [{"q": r["query"], "a": r["answers"], "ctxs": [{"text": r["passages"]}]} for r in qa_records(4)]
    nested[3]["ctxs"] = []
    path = write_jsonl(tmp_path / "nested.jsonl", nested)
    with pytest.raises(KeyError, match=r"nested\.jsonl, line 4: .* no field 'ctxs\.0\.text'"):
        file_source("hf", str(path), FieldMap("q", "a", "ctxs.0.text"), 100, 2, 0, tmp_path / "hf")


def test_answer_not_in_evidence_is_skipped_and_counted(tmp_path):
    records = qa_records(30)
    records[4]["answers"] = ["a word nowhere in the passage"]
    records[7]["answers"] = ["!!"]  # normalizes to nothing: cannot be checked
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    fields = FieldMap(question="query", answers="answers", evidence="passages", title="titles")
    data = file_source("hf", str(path), fields, 100, 5, 0, tmp_path / "hf")
    assert data.skipped["answer_not_in_evidence"] == 1 and data.skipped["empty_answer"] == 1
    questions = {q.question for q in data.train.questions + data.heldout.questions}
    assert records[4]["query"] not in questions and len(questions) == 28


def test_filler_text_file_becomes_distractor_passages(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("The river runs slowly.\nIt never stops.\n\nA second paragraph here.\n\n\n")
    expected = ["The river runs slowly.\nIt never stops.", "A second paragraph here."]
    assert load_filler(str(txt), "text", tmp_path) == expected
    txt.write_text("".join(f"Paragraph {k} follows the quiet river to the sea.\n\n" for k in range(60)))
    cfg = DataConfig(filler_path=str(txt), context_len=512, num_train=20, num_eval=4, num_train_docs=100,
                     num_eval_docs=20, vocab_size=400, cache=False)
    bundle = build_datasets(cfg)
    assert any("quiet river" in bundle.tokenizer.decode(ids) for ids in bundle.train["input_ids"])
    assert "Filler text from" in bundle.stats["attribution"][-1]
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", [{"body": "Some text."}, {"other": 1}])
    with pytest.raises(KeyError, match=r"corpus\.jsonl, line 2: .* no field 'body'"):
        load_filler(str(jsonl), "body", tmp_path)


def test_cut_points_prefer_sentence_ends():
    tok = train_bpe_tokenizer(["One two three four five. Six seven eight. Nine ten eleven twelve."] * 3, 300)
    text = "One two three four five. Six seven eight.\nNine ten eleven twelve. " + "word " * 40 + "end."
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = np.asarray(enc["offset_mapping"])[:, 1]
    ranges = cut_points(ends, text, 16)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(enc["input_ids"])
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, nothing lost
    assert all(0 < e - s <= 16 for s, e in ranges)
    first = text[: ends[ranges[0][1] - 1]]
    assert first.endswith((".", ".\n"))  # the first cut closes a sentence or a line
    assert cut_points(ends[:5], text, 16) == [(0, 5)] and cut_points(ends[:0], text, 16) == []


def test_pool_is_cached_by_fingerprint(tmp_path, monkeypatch):
    passages = [d.text for d in generate_documents(50, 1)] + ["A much longer passage. " * 30]
    tok = train_bpe_tokenizer(passages, 400)
    first = build_pool(passages, tok, 24, [198], tmp_path)
    assert len(first.first) == len(passages) + 1 and len(first) > len(passages)
    assert all(first.seg_len <= 24) and (first.units[first.offsets[1:] - 1] == 198).all()
    long_segs = first.segments_of(len(passages) - 1)
    joined = np.concatenate([first.segment_ids(s) for s in long_segs])
    assert joined.tolist() == tok(passages[-1], add_special_tokens=False)["input_ids"]

    def fail(*args, **kwargs):
        raise AssertionError("the pool was tokenized again")

    monkeypatch.setattr(pools, "_segment_batch", fail)
    again = build_pool(passages, tok, 24, [198], tmp_path)
    assert again.fingerprint == first.fingerprint and (again.units == first.units).all()
    with pytest.raises(AssertionError, match="tokenized again"):
        build_pool(passages, tok, 25, [198], tmp_path)  # another segment length: another pool


SMALL = DataConfig(context_len=128, num_train=64, num_eval=8, num_train_docs=200, num_eval_docs=80, vocab_size=400,
                   in2=In2Config(segment_len=64, heldout_doc_len=256))


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_cached_build_cut_short_is_built_again_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    first = build_datasets(SMALL)
    digest, rows = dataset_digest(first.train), len(first.train)
    del first  # it maps the file that is cut next: reading it then would be a bus error
    arrow = next((tmp_path / "cache" / "in2").glob("*/train/*.arrow"))
    cut_short(arrow)
    with caplog.at_level(logging.WARNING, logger="data_builders.build"):
        again = build_datasets(SMALL)
    assert f"the dataset cache {arrow.parents[1]} is damaged ({arrow} has" in caplog.text
    assert "building it again" in caplog.text
    assert dataset_digest(again.train) == digest and len(again.train) == rows
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_builders.build"):
        build_datasets(SMALL)  # the entry made again is whole
    assert "damaged" not in caplog.text


def test_a_cached_segment_pool_cut_short_is_made_again_and_logged(tmp_path, monkeypatch, caplog):
    passages = [d.text for d in generate_documents(50, 1)]
    tok = train_bpe_tokenizer(passages, 400)
    first = build_pool(passages, tok, 24, [198], tmp_path)
    (cached,) = (tmp_path / "pools").glob("*.arrow")
    cut_short(cached)
    with caplog.at_level(logging.WARNING, logger="data_builders.pools"):
        again = build_pool(passages, tok, 24, [198], tmp_path)
    assert f"the segment pool cache {cached} is damaged" in caplog.text and "building it again" in caplog.text
    assert (again.units == first.units).all() and again.fingerprint == first.fingerprint


def test_data_whose_every_answer_is_empty_says_so_naming_the_field(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{**r, "answers": [""]} for r in qa_records(20)])
    fields = FieldMap(question="query", evidence="passages", title="titles")
    with pytest.raises(ValueError, match=r"every one of its 20 records has an empty answer \(field 'answers', "
                                         r"data\.fields\.answers\)") as err:
        file_source("hf", str(path), fields, 100, 5, 0, tmp_path / "hf")
    assert "num_eval_docs" not in str(err.value)


def test_duplicate_records_are_counted_not_blamed_on_num_eval_docs(tmp_path):
    fields = FieldMap(question="query", evidence="passages", title="titles")
    path = write_jsonl(tmp_path / "qa.jsonl", qa_records(1) * 200)
    with pytest.raises(ValueError, match="its 200 records are 1 distinct record and 199 duplicates of it") as err:
        file_source("hf", str(path), fields, 100, 5, 0, tmp_path / "hf")
    assert "num_eval_docs" not in str(err.value)
    path = write_jsonl(tmp_path / "few.jsonl", qa_records(3) * 10)  # three passages, all held out
    with pytest.raises(ValueError, match=r"0 training and 30 held-out questions after the split \(27 of its 30 "
                                         r"records are duplicates\); adjust data\.num_eval_docs=5"):
        file_source("hf", str(path), fields, 100, 5, 0, tmp_path / "hf")


def test_lm_windows_split_documents_and_check_their_ranges():
    cfg = DataConfig(format=DataFormat.lm_windows, context_len=64, num_train=6, num_eval=3, num_train_docs=200,
                     num_eval_docs=40, vocab_size=300, windows=WindowsConfig(doc_len=128, train_docs=[0, 5],
                                                                             eval_docs=[5, 7]))
    bundle = build_datasets(cfg)
    assert len(bundle.train) == 6 and len(bundle.eval) == 3 and len(bundle.heldout_docs) == 2
    assert all(len(ids) == 64 for ids in [*bundle.train["input_ids"], *bundle.eval["input_ids"]])
    assert all(len(d) >= 128 for d in bundle.heldout_docs)
    assert bundle.stats["config"]["format"] == "lm_windows" and bundle.stats["documents"] >= 7
    for change, message in (
        (dict(doc_len=32), r"data\.windows\.doc_len=32 must be >= data\.context_len=64"),
        (dict(train_docs=[0, 6]), r"data\.windows\.train_docs=\[0, 6\] and .*=\[5, 7\] overlap"),
        (dict(eval_docs=[7, 7]), r"data\.windows\.eval_docs=\[7, 7\] must be a non-empty"),
    ):
        with pytest.raises(ValueError, match=message):
            validate_data(replace(cfg, windows=replace(cfg.windows, **change)))
    with pytest.raises(ValueError, match=r"data\.windows\.train_docs=\[0, 5\] and .* within the \d+ documents"):
        build_datasets(replace(cfg, windows=WindowsConfig(doc_len=128, train_docs=[0, 5], eval_docs=[5, 10_000])))


def test_bench_data_rows():
    cfg = DataConfig(context_len=2048, num_train_docs=300, num_eval_docs=60, cache=False,
                     in2=In2Config(segment_len=64, tasks=TaskMix(0.8, 0.2, 0.0)))
    row = bench_case("smoke", cfg, 20)
    assert row["tokens"] == 20 * 2048 and row["ours_tok_s"] > 0 and row["baseline_tok_s_per_core"] > 0
    assert row["ratio"] > 2  # gathering ids beats re-tokenizing (about 20x at this length)


def test_settings_of_the_other_format_are_reported_as_ignored():
    cfg = DataConfig(format=DataFormat.lm_windows, context_len=128)
    cfg.in2.curriculum, cfg.in2.tasks.integration = 0.5, 0.2
    validate_data(cfg)  # not an error: build_datasets logs them as ignored
    assert ignored_settings(cfg) == ["data.in2.curriculum=0.5", "data.in2.tasks.integration=0.2"]
    assert ignored_settings(DataConfig(format=DataFormat.lm_windows, context_len=128)) == []
