"""The position probes read the data formats of Liu et al. 2023, *Lost in the Middle*, as they are.

Facts of the reference (nelson-liu/lost-in-the-middle) checked here, with expected values written out:
- kv records `{"ordered_kv_records": [[key, value], ...], "key": k, "value": v}`; the gold pair is moved
  (pop + insert) to the gold index, the other pairs keep their order; the pairs are laid out one a line
  as `{"k1": "v1",\\n "k2": "v2",\\n ... "kn": "vn"}`; gold positions 0/24/49/74 (75 keys),
  0/34/69/104/139 (140), 0/49/99/149/199/249/299 (300);
- mdqa files `nq-open-<N>_total_documents_gold_at_<K>.jsonl.gz`: `question`, `answers`, `ctxs` (N documents
  with `title`, `text`, `hasanswer`, `isgold`, exactly one gold, at K), asked as they are: the prompt lists
  the documents in file order as `Document [i](Title: <title>) <text>`, position = index of the gold.

All data is generated in tmp_path (seeded) or read from ../shared/data (skipped when absent).
"""
import gzip
import hashlib
import json
import random
import re
import uuid
from pathlib import Path

import pytest
from bm25s.stopwords import STOPWORDS_EN

from analysis.evaluation.comparability import probe_settings
from analysis.evaluation.config import METRICS, EvalConfig, KVProbeConfig, MDQAProbeConfig
from analysis.evaluation.probes import build_probes, run_probe
from data_builders.files import read_jsonl
from data_builders.mdqa import build_mdqa_records, contains_answer, write_jsonl_gz
from data_builders.probes import (
    KV_FILE,
    KV_REFERENCE_POSITIONS,
    MDQA_REFERENCE_POSITIONS,
    NQ_FILE,
    TEMPLATES,
    kv_probe,
    mdqa_probe,
    reference_positions,
)
from data_builders.text import normalize_answer
from scripts import build_mdqa
from tests.conftest import shared_data_file

# Written out here from the reference's EXPERIMENTS.md, not read from the code under test.
KV_POSITIONS = {75: [0, 24, 49, 74], 140: [0, 34, 69, 104, 139], 300: [0, 49, 99, 149, 199, 249, 299]}
MDQA_POSITIONS = {10: [0, 4, 9], 20: [0, 4, 9, 14, 19], 30: [0, 4, 9, 14, 19, 24, 29]}
# The reference's QA instruction (its tests/test_prompting.py gold prompt).
MDQA_INSTRUCTION = ("Write a high-quality answer for the given question using only the provided search results "
                    "(some of which might be irrelevant).")
WRONG = "xqzv"  # a scripted wrong answer that contains no answer of these tests
STOPWORDS = set(STOPWORDS_EN) | {"who", "what", "when", "where", "which", "how", "many", "much", "did", "does",
                                 "do", "is", "was", "were", "s", "first", "name"}


def where(path: Path, line: int) -> str:
    """A regex for the `file:line` an error message must name."""
    return re.escape(f"{path}:{line}") + r"\b"


def write_jsonl(path: Path, lines: list) -> Path:
    """JSON lines (a str is written as it is: a bad or blank line), gzipped when the name ends in .gz."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------- kv


def uuid4(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_records(n_pairs: int, n_records: int, seed: int) -> list[dict]:
    """Records in the reference's kv format; the gold's original index is first, last, then random."""
    rng = random.Random(seed)
    records = []
    for r in range(n_records):
        pairs = [[uuid4(rng), uuid4(rng)] for _ in range(n_pairs)]
        gold = [0, n_pairs - 1][r] if r < 2 else rng.randrange(n_pairs)
        records.append({"ordered_kv_records": pairs, "key": pairs[gold][0], "value": pairs[gold][1]})
    return records


def kv_layout(pairs) -> str:
    """The reference's layout: `{` opens the first line, one space every later one; `,` ends a line, `}` the last."""
    lines = []
    for i, (k, v) in enumerate(pairs):
        lines.append(("{" if i == 0 else " ") + f'"{k}": "{v}"' + ("}" if i == len(pairs) - 1 else ","))
    return "\n".join(lines)


def reference_order(pairs, key: str, value: str, gold_index: int) -> list[tuple[str, str]]:
    """The gold pair popped from where it is and inserted at gold_index; the others keep their order."""
    moved = [tuple(p) for p in pairs]
    gold = moved.pop(moved.index((key, value)))
    moved.insert(gold_index, gold)
    return moved


def kv_prompt(pairs, key: str) -> str:
    template = (TEMPLATES / "kv_retrieval.txt").read_text(encoding="utf-8").rstrip("\n")
    return template.replace("{kv_records}", kv_layout(pairs)).replace("{key}", key)


def prompt_pairs(prompt: str) -> tuple[list[tuple[str, str]], str]:
    """Every pair of a kv prompt in prompt order (duplicates kept) and the queried key."""
    block = prompt.split("JSON data:\n", 1)[1].split("\n\nKey: ", 1)[0]
    key = re.search(r'\nKey: "([^"]+)"\nCorresponding value:$', prompt).group(1)
    return [tuple(p) for p in json.loads(block, object_pairs_hook=list)], key


def check_kv_items(items, records: list[dict], n_pairs: int, positions: list[int]) -> None:
    """Every record asked at exactly `positions`, all n_pairs pairs in the prompt, gold at the asked index,
    the others in their original order, the prompt byte-identical to the reference's."""
    assert len(items) == len(records) * len(positions)
    by_record: dict[int, list[int]] = {}
    for it in items:
        rec = records[it.extra["example"]]
        key, value = rec["key"], rec["value"]
        pairs, asked = prompt_pairs(it.prompt)
        assert asked == key == it.extra["key"] and it.answers == [value]
        assert len(pairs) == n_pairs and sorted(pairs) == sorted(map(tuple, rec["ordered_kv_records"]))
        assert pairs[it.position] == (key, value)
        original_others = [tuple(p) for p in rec["ordered_kv_records"] if tuple(p) != (key, value)]
        assert [p for p in pairs if p != (key, value)] == original_others
        assert it.prompt == kv_prompt(reference_order(rec["ordered_kv_records"], key, value, it.position), key)
        assert it.n_positions == n_pairs and it.probe == "kv" and it.label == str(it.position)
        assert it.query == f"kv-{it.extra['example']}"
        by_record.setdefault(it.extra["example"], []).append(it.position)
    assert sorted(by_record) == list(range(len(records)))
    assert all(sorted(p) == positions for p in by_record.values())


def test_reference_positions_are_the_published_ones():
    assert {n: list(p) for n, p in KV_REFERENCE_POSITIONS.items()} == KV_POSITIONS
    assert {n: list(p) for n, p in MDQA_REFERENCE_POSITIONS.items()} == MDQA_POSITIONS
    for n, positions in KV_POSITIONS.items():
        assert list(reference_positions(n, "kv")) == positions
    for n, positions in MDQA_POSITIONS.items():
        assert list(reference_positions(n, "mdqa")) == positions


def test_kv_layout_and_template_match_the_reference_prompt(tmp_path):
    # The reference's own example (tests/test_prompting.py): three pairs, the second asked.
    data = [["test key1", "test value1"], ["test key2", "test value2"], ["test key3", "test value3"]]
    path = write_jsonl(tmp_path / "tiny.jsonl", [{"ordered_kv_records": data, "key": "test key2",
                                                  "value": "test value2"}])
    items = kv_probe(path, positions=[1])
    assert [it.prompt for it in items] == ["\n".join([
        "Extract the value corresponding to the specified key in the JSON object below.",
        "",
        "JSON data:",
        '{"test key1": "test value1",',
        ' "test key2": "test value2",',
        ' "test key3": "test value3"}',
        "",
        'Key: "test key2"',
        "Corresponding value:",
    ])]
    # pop + insert: moved to the front, the others keep their order.
    assert kv_probe(path, positions=[0])[0].prompt.split("JSON data:\n")[1].startswith(
        '{"test key2": "test value2",\n "test key1": "test value1",\n "test key3": "test value3"}\n')


@pytest.mark.parametrize("n_pairs, n_records", [(140, 5), (300, 4)])
def test_kv_file_asked_at_reference_positions(tmp_path, n_pairs, n_records):
    records = kv_records(n_pairs, n_records, seed=n_pairs)
    path = write_jsonl(tmp_path / f"kv-retrieval-{n_pairs}_keys.jsonl.gz", records)
    items = kv_probe(path)  # no n_pairs, no positions: every pair, the reference's positions
    check_kv_items(items, records, n_pairs, KV_POSITIONS[n_pairs])


def test_kv_shared_75_key_file_asked_at_reference_positions():
    path = shared_data_file(KV_FILE)
    records = read_jsonl(path)
    assert len(records) == 500
    check_kv_items(kv_probe(path), records, 75, KV_POSITIONS[75])


def test_kv_explicit_smaller_n_pairs_is_honoured(tmp_path):
    records = kv_records(140, 4, seed=7)
    path = write_jsonl(tmp_path / "kv.jsonl", records)
    items = kv_probe(path, n_pairs=10, positions=[0, 5, 9])
    assert len(items) == 4 * 3
    for it in items:
        rec = records[it.extra["example"]]
        gold = (rec["key"], rec["value"])
        pairs, _ = prompt_pairs(it.prompt)
        first_others = [tuple(p) for p in rec["ordered_kv_records"] if tuple(p) != gold][:9]
        assert len(pairs) == 10 == it.n_positions and pairs[it.position] == gold
        assert [p for p in pairs if p != gold] == first_others
        assert it.prompt == kv_prompt(first_others[: it.position] + [gold] + first_others[it.position:], gold[0])
    # Without positions, the default for 10 pairs stays inside them and includes the first and the last.
    positions = sorted({it.position for it in kv_probe(path, n_pairs=10)})
    assert positions[0] == 0 and positions[-1] == 9


def test_kv_mixed_pair_counts_fail_without_n_pairs(tmp_path):
    records = kv_records(140, 2, seed=1) + [kv_records(139, 1, seed=2)[0]]
    path = write_jsonl(tmp_path / "mixed.jsonl.gz", [records[0], "", records[1], records[2]])  # line 2 blank
    with pytest.raises(ValueError, match=where(path, 4) + r".*139 pairs.*140"):
        kv_probe(path)


def test_kv_n_pairs_larger_than_a_record_fails(tmp_path):
    path = write_jsonl(tmp_path / "kv.jsonl", kv_records(140, 1, seed=1) + kv_records(120, 1, seed=2))
    with pytest.raises(ValueError, match=where(path, 2) + r".*120 pairs.*n_pairs=130"):
        kv_probe(path, n_pairs=130)
    with pytest.raises(ValueError, match=where(path, 1) + r".*140 pairs.*n_pairs=141"):
        kv_probe(path, n_pairs=141)


@pytest.mark.parametrize("positions", [[0, 140], [-1, 5]])
def test_kv_position_outside_the_pairs_fails(tmp_path, positions):
    path = write_jsonl(tmp_path / "kv.jsonl", kv_records(140, 2, seed=1))
    bad = [p for p in positions if not 0 <= p < 140]
    with pytest.raises(ValueError, match=where(path, 1) + rf".*{re.escape(str(bad))}.*140 pairs"):
        kv_probe(path, positions=positions)


def test_kv_gold_pair_not_in_records_fails(tmp_path):
    records = kv_records(140, 3, seed=1)
    records[1]["value"] = records[1]["ordered_kv_records"][5][1]  # a value of another pair
    path = write_jsonl(tmp_path / "kv.jsonl", records)
    with pytest.raises(ValueError, match=where(path, 2) + r".*not a pair of its ordered_kv_records"):
        kv_probe(path)


@pytest.mark.parametrize("bad, reason", [('{"ordered_kv_records": [', "not a JSON object"),
                                         ("[1, 2]", "expected a JSON object")], ids=["broken", "array"])
def test_kv_non_json_line_fails(tmp_path, bad, reason):
    records = kv_records(140, 2, seed=1)
    path = write_jsonl(tmp_path / "kv.jsonl.gz", [records[0], bad, records[1]])
    with pytest.raises(ValueError, match=where(path, 2) + f".*{reason}"):
        kv_probe(path)


@pytest.mark.parametrize("field", ["ordered_kv_records", "key", "value"])
def test_kv_missing_field_fails(tmp_path, field):
    records = kv_records(140, 3, seed=1)
    del records[2][field]
    path = write_jsonl(tmp_path / "kv.jsonl", records)
    with pytest.raises(ValueError, match=where(path, 3) + rf".*not a kv record.*{field}"):
        kv_probe(path)


def test_kv_duplicate_key_fails_naming_the_record(tmp_path):
    # The reference's prompt builder rejects duplicate keys; dropping a pair would shift the gold silently.
    records = kv_records(140, 2, seed=3)
    rec = records[1]
    rec["ordered_kv_records"][70] = [rec["key"], uuid4(random.Random(9))]  # the gold's key, another value
    path = write_jsonl(tmp_path / "kv.jsonl", records)
    with pytest.raises(ValueError, match=where(path, 2) + r".*duplicate keys"):
        kv_probe(path)


# --------------------------------------------------------------------------------------------- mdqa

TOPICS = (
    "harbor", "glacier", "orchard", "lantern", "compass", "meadow", "quarry", "falcon", "juniper", "cobalt",
    "tapestry", "sundial", "velvet", "bramble", "dynamo", "ember", "gondola", "hemlock", "indigo", "jasper",
    "pelican", "kettle", "zeppelin", "walrus", "trombone", "saffron", "obsidian", "quiver", "anchor", "harpoon",
)


def synthetic_oracle(n: int = len(TOPICS)) -> list[dict]:
    """Oracle records (one gold passage each) with made-up answers that no other passage holds."""
    records = []
    for k, topic in enumerate(TOPICS[:n]):
        answer = f"zorb{k}ix"
        records.append({
            "question": f"what secret name was given to the {topic} project",
            "answers": [answer, answer.upper()],
            "ctxs": [{"title": f"{topic.title()} project",
                      "text": f"The {topic} project was given the secret name {answer} in its first winter.",
                      "hasanswer": True, "isgold": True}],
        })
    return records


def hand_built(oracle: list[dict], n_questions: int, n_docs: int, gold_at: int) -> list[dict]:
    """Reference-format records built by hand: the next n_docs-1 questions' passages, the gold inserted at gold_at."""
    out = []
    for q in range(n_questions):
        ctxs = [dict(oracle[(q + j) % len(oracle)]["ctxs"][0], hasanswer=False, isgold=False) for j in range(1, n_docs)]
        ctxs.insert(gold_at, dict(oracle[q]["ctxs"][0]))
        out.append({"question": oracle[q]["question"], "answers": oracle[q]["answers"], "ctxs": ctxs})
    return out


def nq_usable(records: list[dict], n: int, seed: int = 0) -> list[int]:
    """A seeded sample of NQ questions whose answers all normalize to words the scripted WRONG misses."""
    ok = [i for i, r in enumerate(records)
          if all(normalize_answer(a) and normalize_answer(a) not in WRONG for a in r["answers"])]
    return sorted(random.Random(seed).sample(ok, n))


def mdqa_file(variant: str, tmp_path: Path, gold_at: int = 9, n_docs: int = 20) -> tuple[Path, list[dict]]:
    """A reference-format file (`nq-open-<n>_total_documents_gold_at_<k>.jsonl.gz`) and its records."""
    if variant == "synthetic":
        records = hand_built(synthetic_oracle(), 6, n_docs, gold_at)
    else:
        oracle = read_jsonl(shared_data_file(NQ_FILE))
        records = build_mdqa_records(oracle, n_docs, [gold_at], chosen=nq_usable(oracle, 12))[gold_at]
    path = tmp_path / f"nq-open-{n_docs}_total_documents_gold_at_{gold_at}.jsonl.gz"
    write_jsonl_gz(path, records)
    return path, records


def qa_prompt(question: str, docs) -> str:
    """The reference's QA prompt over documents in the order given."""
    listed = "\n".join(f"Document [{i}](Title: {d['title']}) {d['text']}" for i, d in enumerate(docs, 1))
    return f"{MDQA_INSTRUCTION}\n\n{listed}\n\nQuestion: {question}\nAnswer:"


def scripted(correct_at: set[int]):
    """A stand-in generator that answers right only when the gold sits at one of `correct_at`."""

    def generate(items):
        return [f"{it.answers[0]}\nmore text" if it.position in correct_at else WRONG for it in items]

    return generate


def test_mdqa_template_matches_the_reference_prompt(tmp_path):
    docs = [{"title": "first doc", "text": "first doc text", "hasanswer": False, "isgold": False},
            {"title": "second doc", "text": "second doc text", "hasanswer": True, "isgold": True}]
    path = write_jsonl(tmp_path / "two.jsonl", [{"question": "test question", "answers": ["x"], "ctxs": docs}])
    items = mdqa_probe(path)
    assert [(it.position, it.label, it.prompt) for it in items] == [
        (1, "1", f"{MDQA_INSTRUCTION}\n\nDocument [1](Title: first doc) first doc text\n"
                 "Document [2](Title: second doc) second doc text\n\nQuestion: test question\nAnswer:"),
        (-1, "closedbook", "Question: test question\nAnswer:"),
    ]


@pytest.mark.parametrize("variant", ["synthetic", "nq"])
def test_mdqa_gold_at_9_of_20_is_scored_at_position_9(tmp_path, variant):
    path, records = mdqa_file(variant, tmp_path)
    assert [[c["isgold"] for c in r["ctxs"]].index(True) for r in records] == [9] * len(records)
    items = mdqa_probe(path)
    gold_items = [it for it in items if it.position >= 0]
    closed = [it for it in items if it.position < 0]
    assert len(gold_items) == len(closed) == len(records)
    for it in gold_items:
        rec = records[it.extra["example"]]
        assert it.position == 9 and it.n_positions == 20 and it.label == "9" and it.probe == "mdqa"
        assert it.answers == rec["answers"] and it.extra["file"] == path.name
        assert it.prompt == qa_prompt(rec["question"], rec["ctxs"])  # the 20 documents in file order
    for it in closed:
        assert it.label == "closedbook" and it.prompt == f"Question: {records[it.extra['example']]['question']}\nAnswer:"
    result = run_probe(items, scripted({9}), METRICS["best_subspan_em"])
    assert result.accuracy_by_position() == {-1: 0.0, 9: 1.0}
    assert result.to_metrics("eval") == {"eval/mdqa/acc@closedbook": 0.0, "eval/mdqa/acc@9": 1.0,
                                         "eval/mdqa/acc_mean": 1.0}
    # The same items scored right everywhere but at 9 are wrong exactly at 9.
    assert run_probe(items, scripted({-1, 0}), METRICS["best_subspan_em"]).accuracy_by_position() == {-1: 1.0, 9: 0.0}


def test_mdqa_gold_at_k_files_pair_by_query_across_a_glob(tmp_path):
    oracle = synthetic_oracle()
    files = {k: write_jsonl_gz(tmp_path / f"nq-open-20_total_documents_gold_at_{k}.jsonl.gz",
                               hand_built(oracle, 5, 20, k)) for k in (0, 9, 19)}
    items = mdqa_probe(str(tmp_path / "nq-open-20_total_documents_gold_at_*.jsonl.gz"))
    by_query: dict[str, dict[int, object]] = {}
    for it in items:
        by_query.setdefault(it.query, {})[it.position] = it
    assert sorted(by_query) == [f"mdqa-{q}" for q in range(5)]
    for q, at in by_query.items():
        assert sorted(at) == [-1, 0, 9, 19]
        question = oracle[int(q.split("-")[1])]["question"]
        others = set()
        for pos, it in at.items():
            assert it.extra["question"] == question
            if pos < 0:
                continue
            rec = read_jsonl(files[pos])[it.extra["example"]]
            assert it.extra["file"] == files[pos].name and it.prompt == qa_prompt(question, rec["ctxs"])
            others.add(tuple(c["text"] for c in rec["ctxs"] if not c["isgold"]))
        assert len(others) == 1  # the same distractors in the same order at every position
    result = run_probe(items, scripted({0}), METRICS["best_subspan_em"])
    assert result.accuracy_by_position() == {-1: 0.0, 0: 1.0, 9: 0.0, 19: 0.0}
    assert result.paired_difference(0, 19).value == 1.0


def test_mdqa_files_with_different_question_orders_are_not_paired(tmp_path):
    oracle = synthetic_oracle()
    write_jsonl_gz(tmp_path / "nq-open-20_total_documents_gold_at_0.jsonl.gz", hand_built(oracle, 3, 20, 0))
    write_jsonl_gz(tmp_path / "nq-open-20_total_documents_gold_at_9.jsonl.gz", hand_built(oracle, 3, 20, 9)[::-1])
    with pytest.raises(ValueError, match=r"gold_at_9.jsonl.gz:1 and .*gold_at_0.jsonl.gz:1: record 0 holds "
                                         r"different questions"):
        mdqa_probe(str(tmp_path / "*.jsonl.gz"))


def test_mdqa_records_of_different_document_counts_fail(tmp_path):
    records = hand_built(synthetic_oracle(), 2, 20, 9) + hand_built(synthetic_oracle(), 1, 10, 9)
    records[2]["question"] += " (ten documents)"
    path = write_jsonl_gz(tmp_path / "mixed.jsonl.gz", records)
    with pytest.raises(ValueError, match=where(path, 3) + r": 10 documents, but .*:1 has another count"):
        mdqa_probe(path)


def test_mdqa_two_gold_flags_fail(tmp_path):
    records = hand_built(synthetic_oracle(), 3, 20, 9)
    records[1]["ctxs"][3]["isgold"] = True
    path = write_jsonl_gz(tmp_path / "nq-open-20_total_documents_gold_at_9.jsonl.gz", records)
    with pytest.raises(ValueError, match=where(path, 2) + r".*2 documents are flagged isgold"):
        mdqa_probe(path)


def test_mdqa_n_docs_and_positions_must_agree_with_the_file(tmp_path):
    path, _ = mdqa_file("synthetic", tmp_path)
    with pytest.raises(ValueError, match=where(path, 1) + r".*20 documents, but n_docs=10"):
        mdqa_probe(path, n_docs=10)
    with pytest.raises(ValueError, match=where(path, 1) + r".*gold is at index 9, not among positions \[0, 4\]"):
        mdqa_probe(path, positions=[0, 4])
    # Settings that agree are accepted.
    assert {it.position for it in mdqa_probe(path, n_docs=20, positions=[9, 19])} == {-1, 9}


@pytest.mark.parametrize("bad, reason", [("{oops", "not a JSON object"),
                                         ({"answers": ["x"], "ctxs": []}, "question"),
                                         ({"question": "q", "answers": "x"}, "answers"),
                                         ({"question": "q", "answers": ["x"], "ctxs": [{"title": "t"}]}, "ctxs\\[0\\]")],
                         ids=["not_json", "no_question", "answers_not_list", "ctx_without_text"])
def test_mdqa_bad_record_fails_naming_its_line(tmp_path, bad, reason):
    records = hand_built(synthetic_oracle(), 2, 20, 9)
    path = write_jsonl(tmp_path / "nq-open-20_total_documents_gold_at_9.jsonl", [records[0], bad, records[1]])
    with pytest.raises(ValueError, match=where(path, 2) + f".*{reason}"):
        mdqa_probe(path)


def test_mdqa_records_without_gold_are_asked_at_minus_one(tmp_path):
    records = hand_built(synthetic_oracle(), 4, 20, 9)
    for rec in records:
        for c in rec["ctxs"]:
            c["isgold"] = False
    path = write_jsonl_gz(tmp_path / "nq-open-20_total_documents_nogold.jsonl.gz", records)
    items = mdqa_probe(path, closed_book=False)
    assert [(it.position, it.label, it.n_positions) for it in items] == [(-1, "nogold", 20)] * 4
    assert [it.prompt for it in items] == [qa_prompt(r["question"], r["ctxs"]) for r in records]
    # With the closed-book baseline too, two kinds of item would share position -1: refused, not mixed.
    with pytest.raises(ValueError, match=r"closed_book=false"):
        mdqa_probe(path)


def test_mdqa_closed_book_file_gives_closedbook_items(tmp_path):
    oracle = synthetic_oracle(4)
    records = [{"question": r["question"], "answers": r["answers"]} for r in oracle[:3]]
    records.append({"question": oracle[3]["question"], "answers": oracle[3]["answers"], "ctxs": []})
    path = write_jsonl(tmp_path / "nq-open-closedbook.jsonl", records)
    for closed_book in (True, False):  # the baseline is not asked twice
        items = mdqa_probe(path, closed_book=closed_book)
        assert [(it.position, it.label, it.n_positions, it.query) for it in items] == [
            (-1, "closedbook", 0, f"mdqa-{i}") for i in range(4)]
        assert [it.prompt for it in items] == [f"Question: {r['question']}\nAnswer:" for r in records]


# ------------------------------------------------------------------------------ retrieved distractors


def words(text: str) -> set[str]:
    return set(normalize_answer(text).split()) - STOPWORDS


@pytest.fixture(scope="module")
def nq_oracle() -> list[dict]:
    return read_jsonl(shared_data_file(NQ_FILE))


def test_retrieved_distractors_of_every_built_record(nq_oracle):
    chosen = sorted(random.Random(0).sample(range(len(nq_oracle)), 200))
    gold_indices = [0, 9, 19]
    built = build_mdqa_records(nq_oracle, 20, gold_indices, "retrieved", None, chosen)
    assert sorted(built) == gold_indices and all(len(built[k]) == len(chosen) for k in gold_indices)
    substring_hits = 0
    for n, i in enumerate(chosen):
        source = nq_oracle[i]
        gold = source["ctxs"][0]
        answers = [a for a in map(normalize_answer, source["answers"]) if a]
        distractor_lists = set()
        for k in gold_indices:
            rec = built[k][n]
            assert rec["question"] == source["question"] and rec["answers"] == source["answers"]
            ctxs = rec["ctxs"]
            assert len(ctxs) == 20 and [c["isgold"] for c in ctxs].index(True) == k
            assert [c["isgold"] for c in ctxs].count(True) == 1
            assert (ctxs[k]["title"], ctxs[k]["text"], ctxs[k]["hasanswer"]) == (gold["title"], gold["text"], True)
            others = ctxs[:k] + ctxs[k + 1:]
            assert len({(c["title"], c["text"]) for c in others}) == 19
            for c in others:
                assert c["isgold"] is False and c["hasanswer"] is False and c["text"] != gold["text"]
                assert not contains_answer(normalize_answer(f"{c['title']} {c['text']}"), answers)
                assert not contains_answer(normalize_answer(c["text"]), answers)
            scores = [c["score"] for c in others]
            ranks = [c["original_retrieval_index"] for c in others]
            assert scores == sorted(scores, reverse=True)
            assert all(a < b for a, b in zip(ranks, ranks[1:]))
            distractor_lists.add(tuple((c["title"], c["text"]) for c in others))
        assert len(distractor_lists) == 1  # the same distractors, same order, at every gold index
        substring_hits += sum(any(a in normalize_answer(f"{c['title']} {c['text']}") for a in answers)
                              for c in built[0][n]["ctxs"][1:])
    # A stricter sanity figure than the whole-word rule: answers as character substrings (e.g. "1901" in
    # "19011"). Reported, not asserted to be zero.
    print(f"\nretrieved distractors holding a normalized answer as a substring: {substring_hits} "
          f"of {19 * len(chosen)}")
    assert substring_hits < 0.05 * 19 * len(chosen)


def test_retrieved_distractors_are_topical(nq_oracle):
    chosen = sorted(random.Random(1).sample(range(len(nq_oracle)), 200))
    retrieved = build_mdqa_records(nq_oracle, 20, [0], "retrieved", None, chosen)[0]
    drawn = build_mdqa_records(nq_oracle, 20, [0], "random", None, chosen, seed=0)[0]

    def share(records):  # the top distractor (index 1: the gold is at 0) shares a non-stopword with the question
        return sum(bool(words(nq_oracle[i]["question"]) & words(f"{r['ctxs'][1]['title']} {r['ctxs'][1]['text']}"))
                   for i, r in zip(chosen, records)) / len(chosen)

    topical, by_chance = share(retrieved), share(drawn)
    assert topical >= 0.6 and by_chance <= topical / 2, (topical, by_chance)


def test_random_distractors_follow_the_seed(nq_oracle):
    chosen = sorted(random.Random(2).sample(range(len(nq_oracle)), 50))
    a = build_mdqa_records(nq_oracle, 10, [0, 9], "random", None, chosen, seed=0)
    assert a == build_mdqa_records(nq_oracle, 10, [0, 9], "random", None, chosen, seed=0)
    b = build_mdqa_records(nq_oracle, 10, [0, 9], "random", None, chosen, seed=1)
    assert [r["ctxs"] for r in a[0]] != [r["ctxs"] for r in b[0]]
    for built in (a, b):
        for k in (0, 9):
            for n, i in enumerate(chosen):
                ctxs = built[k][n]["ctxs"]
                assert [c["isgold"] for c in ctxs].index(True) == k and ctxs[k]["text"] == nq_oracle[i]["ctxs"][0]["text"]


def test_build_mdqa_cli_is_byte_reproducible(tmp_path, capsys):
    oracle = shared_data_file(NQ_FILE)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert build_mdqa.main([str(oracle), f"out={out}", "examples=50", "n_docs=10"]) == 0
        assert f"wrote {out}" in capsys.readouterr().out
    names = [f"nq-open-10_total_documents_gold_at_{k}.jsonl.gz" for k in MDQA_POSITIONS[10]]
    for out in outs:
        assert sorted(p.name for p in out.glob("*.jsonl.gz")) == sorted(names)
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    readme = (outs[0] / "README.md").read_text(encoding="utf-8")
    for fact in ("NaturalQuestions", "Kwiatkowski et al. 2019", "CC BY-SA 3.0", "nelson-liu/lost-in-the-middle",
                 "Liu et al. 2023"):
        assert fact in readme
    for name in names:
        assert hashlib.sha256((outs[0] / name).read_bytes()).hexdigest()[:16] in readme
    # The written files are read back as they are: 50 questions, paired across the three files.
    items = mdqa_probe(str(outs[0] / "*.jsonl.gz"), closed_book=False)
    assert len(items) == 50 * 3 and {it.n_positions for it in items} == {10}
    assert sorted({it.position for it in items}) == MDQA_POSITIONS[10]
    assert all(len({it.position for it in items if it.query == q}) == 3 for q in {it.query for it in items})


# ------------------------------------------------------------------------------ eval config, settings


def test_build_probes_kv_uses_reference_positions_and_records_settings(tmp_path):
    records = kv_records(140, 3, seed=5)
    path = write_jsonl(tmp_path / "kv-retrieval-140_keys.jsonl.gz", records)
    cfg = EvalConfig(probes=["kv"], kv=KVProbeConfig(path=str(path)))
    items = build_probes(cfg, None)["kv"]
    check_kv_items(items, records, 140, KV_POSITIONS[140])
    settings = probe_settings("kv", cfg, items)
    assert settings["source"] == str(path) and settings["slots"] == [140]
    assert settings["positions"] == KV_POSITIONS[140] and settings["queries"] == 3
    assert settings["max_new_tokens"] == 100 and settings["comparable_with_reference"] is True
    assert "Liu et al. 2023" in settings["reference"] and "metric" not in settings
    result = run_probe(items, scripted({0, 139}), METRICS["substring_match"], settings)
    assert result.settings["metric"] == "substring_match" and result.settings["slots"] == [140]
    assert result.accuracy_by_position() == {0: 1.0, 34: 0.0, 69: 0.0, 104: 0.0, 139: 1.0}
    cheap = EvalConfig(probes=["kv"], kv=KVProbeConfig(path=str(path), max_new_tokens=16))
    assert probe_settings("kv", cheap, items)["comparable_with_reference"] is False


def mdqa_settings(path: Path, **mdqa) -> dict:
    cfg = EvalConfig(probes=["mdqa"], mdqa=MDQAProbeConfig(path=str(path), **mdqa))
    return probe_settings("mdqa", cfg, build_probes(cfg, None)["mdqa"])


def test_mdqa_settings_say_when_comparable_with_reference(tmp_path):
    given, _ = mdqa_file("synthetic", tmp_path)
    settings = mdqa_settings(given)
    assert settings["comparable_with_reference"] is True and settings["distractors"] == "as in the file"
    assert settings["slots"] == [20] and settings["positions"] == [9] and settings["source"] == str(given)
    assert settings["max_new_tokens"] == 100 and settings["queries"] == 6
    assert mdqa_settings(given, metric="whole_word_subspan_em")["comparable_with_reference"] is False
    assert mdqa_settings(given, max_new_tokens=32)["comparable_with_reference"] is False

    oracle = write_jsonl(tmp_path / "oracle.jsonl", synthetic_oracle())
    built = mdqa_settings(oracle, n_docs=10)
    assert built["comparable_with_reference"] is True and built["distractors"] == "retrieved"
    assert built["slots"] == [10] and built["positions"] == MDQA_POSITIONS[10]
    drawn = mdqa_settings(oracle, n_docs=10, distractors="random")
    assert drawn["comparable_with_reference"] is False and drawn["distractors"] == "random"
    assert mdqa_settings(oracle, n_docs=10, metric="whole_word_subspan_em")["comparable_with_reference"] is False
    assert mdqa_settings(oracle, n_docs=10, max_new_tokens=200)["comparable_with_reference"] is False
