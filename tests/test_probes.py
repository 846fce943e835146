import json
import re

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from analysis.evaluation.scoring import normalize_answer
from data_builders.files import read_jsonl
from data_builders.probes import (
    KV_FILE,
    NQ_FILE,
    in2_probe,
    kv_probe,
    mdqa_probe,
    needle_probe,
    reference_positions,
    synthetic_filler,
)
from tests.conftest import shared_data_file

DOC_LINE = re.compile(r"^Document \[(\d+)\]\(Title: (.*?)\) (.*)$")


def parse_kv(prompt: str) -> tuple[list[tuple[str, str]], str]:
    """The pairs (in prompt order) and the queried key of a kv prompt."""
    block = prompt.split("JSON data:\n", 1)[1].split("\n\nKey: ", 1)[0]
    key = re.search(r'Key: "([^"]+)"\nCorresponding value:$', prompt).group(1)
    return list(json.loads(block).items()), key


def parse_docs(prompt: str) -> list[tuple[str, str]]:
    """(title, text) of each document of an mdqa prompt, checking the 1-based numbering."""
    docs = []
    for line in prompt.splitlines():
        m = DOC_LINE.match(line)
        if m:
            assert int(m.group(1)) == len(docs) + 1
            docs.append((m.group(2), m.group(3)))
    return docs


def test_kv_probe_file_places_gold_at_each_position():
    path = shared_data_file(KV_FILE)
    records = read_jsonl(path)
    positions = (0, 24, 49, 74)
    items = kv_probe(path, positions=positions, n_examples=12)
    assert len(items) == 12 * len(positions)
    by_query: dict[str, list] = {}
    for it in items:
        pairs, key = parse_kv(it.prompt)
        rec = records[it.extra["example"]]
        assert key == rec["key"] == it.extra["key"] and it.answers == [rec["value"]]
        assert len(pairs) == 75 and len({k for k, _ in pairs}) == 75
        assert pairs[it.position] == (rec["key"], rec["value"])
        assert sorted(pairs) == sorted(map(tuple, rec["ordered_kv_records"]))  # same 75 pairs
        assert it.n_positions == 75 and it.probe == "kv" and it.label == str(it.position)
        # Without the gold pair, every position shows the same pairs in the same order (paired design).
        by_query.setdefault(it.query, []).append([p for p in pairs if p != (key, rec["value"])])
    assert all(len(v) == len(positions) and all(x == v[0] for x in v) for v in by_query.values())


def test_kv_probe_synthetic_is_seeded():
    items = kv_probe(None, n_pairs=10, positions=(0, 5, 9), n_examples=4, seed=3)
    assert len(items) == 12
    for it in items:
        pairs, key = parse_kv(it.prompt)
        assert len(pairs) == 10 and pairs[it.position] == (key, it.answers[0])
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", key)
    assert [it.prompt for it in kv_probe(None, 10, (0, 5, 9), 4, seed=3)] == [it.prompt for it in items]
    assert [it.prompt for it in kv_probe(None, 10, (0, 5, 9), 4, seed=4)] != [it.prompt for it in items]
    with pytest.raises(ValueError):
        kv_probe(None, n_pairs=10, positions=(0, 10), n_examples=1)


@pytest.mark.parametrize("distractors", ["retrieved", "random"])
def test_mdqa_probe_places_gold_and_answer_free_distractors(distractors):
    path = shared_data_file(NQ_FILE)
    records = read_jsonl(path)
    positions = (0, 4, 9)
    items = mdqa_probe(path, n_docs=10, positions=positions, distractors=distractors, n_examples=40, seed=1)
    assert len(items) == 40 * (len(positions) + 1)
    order: dict[str, set] = {}
    for it in items:
        rec = records[it.extra["example"]]
        assert it.answers == rec["answers"] and it.prompt.endswith(f"Question: {rec['question']}\nAnswer:")
        if it.position == -1:
            assert it.label == "closedbook" and "Document [" not in it.prompt
            continue
        docs = parse_docs(it.prompt)
        assert len(docs) == 10
        gold = rec["ctxs"][0]
        assert docs[it.position] == (gold["title"], gold["text"])
        others = [d for k, d in enumerate(docs) if k != it.position]
        answers = [normalize_answer(a) for a in rec["answers"]]
        for title, text in others:
            assert text != gold["text"]
            # Random passages also avoid the gold's article; retrieved ones, like the reference's, may not.
            assert distractors == "retrieved" or title != gold["title"]
            # No answer as whole words (the reference's hasanswer); a substring check would reject every
            # passage for a one-letter answer.
            words = f" {normalize_answer(f'{title} {text}')} "
            assert not any(a and f" {a} " in words for a in answers)
        assert len(set(others)) == 9
        order.setdefault(it.query, set()).add(tuple(others))
    assert all(len(v) == 1 for v in order.values())  # same distractors, same order, at every position


def _word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits at spaces and punctuation: counts add up
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _needle_context(prompt: str) -> str:
    return prompt.split("\n\nQuestion: ", 1)[0]


@pytest.mark.parametrize("use_tokenizer", [False, True])
def test_needle_probe_depths_and_lengths(use_tokenizer):
    filler = synthetic_filler(400, seed=1)
    tok = _word_tokenizer(filler) if use_tokenizer else None
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    lens = (400, 1200)  # many sentences each, so the nearest boundary is near the depth
    items = needle_probe(filler, depths, lens, tokenizer=tok, n_examples=3, seed=2)
    assert len(items) == 3 * len(lens) * len(depths)
    by_query: dict[str, list] = {}
    for it in items:
        context = _needle_context(it.prompt)
        code = it.answers[0]
        needle = re.search(rf"The secret code of (\w+) is {code}\.", context)
        assert needle and context.count(code) == 1 and re.fullmatch(r"\d{5}", code)
        word = needle.group(1)
        assert it.prompt.endswith(f"What is the secret code of {word}?\nAnswer: The secret code of {word} is")
        length = len(tok.encode(context, add_special_tokens=False)) if tok else len(context) + 1
        assert length == it.extra["realised_len"] <= it.extra["context_len"]
        assert it.label == str(it.extra["depth"]) == str(depths[it.position])
        assert abs(it.extra["realised_depth"] - it.extra["depth"]) < 0.1
        by_query.setdefault(it.query, []).append((it.position, needle.start(), context, code))
    for variants in by_query.values():
        variants.sort()
        starts = [start for _, start, _, _ in variants]
        assert starts == sorted(starts) and starts[0] == 0  # deeper needle, later in the context
        assert variants[-1][2].endswith(f" is {variants[-1][3]}.")  # depth 1: after the last sentence
        fillers = {re.sub(r" ?The secret code of \w+ is \d{5}\.", "", c).strip() for _, _, c, _ in variants}
        assert len(fillers) == 1  # the same filler at every depth


def test_needle_probe_rejects_too_short_length():
    with pytest.raises(ValueError):
        needle_probe(["A rather long sentence that will not fit at all."], context_lens=(40,), n_examples=1)


def test_in2_probe_bins_by_depth():
    depths = [0.0, 0.05, 0.1, 0.34, 0.5, 0.99, 1.0]
    records = [
        {
            "input_ids": [5, 6, 7, 8, 9, 2],
            "labels": [-100, -100, -100, -100, 9, 2],
            "prompt_len": 4,
            "gold_spans": [[0, 2]],
            "depth": d,
            "context_tokens": 3,
            "task": "fine_grained",
            "answers": ["x"],
            "source": "synthetic",
            "id": f"eval-{k}",
        }
        for k, d in enumerate(depths)
    ]
    items = in2_probe(records, bins=10)
    assert [it.position for it in items] == [0, 0, 1, 3, 5, 9, 9]
    assert [it.label for it in items] == ["0.0", "0.0", "0.1", "0.3", "0.5", "0.9", "0.9"]
    assert all(it.prompt == [5, 6, 7, 8] and it.n_positions == 10 and it.probe == "in2" for it in items)
    assert items[3].extra == {"depth": 0.34, "context_tokens": 3, "task": "fine_grained", "source": "synthetic"}
    assert items[0].targets == [[9]]  # the labelled answer tokens, without the final eos
    assert [it.label for it in in2_probe(records[:2], bins=20)] == ["0.0", "0.05"]


def test_synthetic_oracle_feeds_the_mdqa_probe(tmp_path):
    from scripts.investigations.synthetic_oracle import main as synthetic_oracle

    path = tmp_path / "oracle.jsonl.gz"
    assert synthetic_oracle([str(path), "--n", "30", "--seed", "5"]) == 0
    first = path.read_bytes()
    assert synthetic_oracle([str(path), "--n", "30", "--seed", "5"]) == 0 and path.read_bytes() == first
    items = mdqa_probe(path, n_docs=6, n_examples=4, closed_book=False)
    assert len(items) == 4 * len(reference_positions(6, "mdqa"))
    for item in items:
        (a, b) = item.segments[item.position]
        gold = item.prompt[a:b]
        assert item.answers[0] in gold and gold.split("(Title: ")[1].split(")")[0] in item.extra["question"]
        assert sum(item.answers[0] in item.prompt[s:e] for s, e in item.segments) == 1
        assert gold.count(". ") == 0  # one-fact passages by default


def test_documents_cut_to_fewer_facts_keep_their_persons_and_values():
    from data_builders.synthetic import generate_documents

    full, short = generate_documents(20, 3), generate_documents(20, 3, facts=2)
    for a, b in zip(full, short):
        assert (a.entity, a.qa[:2]) == (b.entity, b.qa) and a.text.startswith(b.text) and b.text.count(".") == 2
