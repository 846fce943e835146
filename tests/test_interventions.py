"""Inference interventions: document order, truncation, query-aware prompts of the kv and mdqa probes; the specs."""
from __future__ import annotations

import json

import pytest

from analysis.evaluation.config import EvalConfig
from analysis.evaluation.interventions import (
    AttentionCalibration,
    Intervention,
    MsPoE,
    Reorder,
    Truncate,
    by_final_position,
)
from analysis.evaluation.result import ProbeResult
from data_builders.probes import Layout, Order, arrange_documents, arrangement, kv_probe, mdqa_probe
from models.attention.attn_calibration import AttnCalibrationConfig
from models.attention.ms_poe import MsPoEConfig

# Written out from the reference's tests/test_prompting.py (nelson-liu/lost-in-the-middle), not read from it.
INSTRUCTION = ("Write a high-quality answer for the given question using only the provided search results "
               "(some of which might be irrelevant).")


def test_outside_in_on_ten_items_reads_odd_ranks_then_even_ranks_back():
    assert [r + 1 for r in arrangement(10, Order.outside_in)] == [1, 3, 5, 7, 9, 10, 8, 6, 4, 2]
    assert [r + 1 for r in arrangement(5, Order.outside_in)] == [1, 3, 5, 4, 2]
    # pos(d_2j-1) = j, pos(d_2j) = n - j + 1 (1-based), for every n
    for n in range(1, 13):
        ranks = arrangement(n, Order.outside_in)
        for j in range(1, n // 2 + 1):
            assert ranks.index(2 * j - 2) + 1 == j and ranks.index(2 * j - 1) + 1 == n - j + 1
    assert arrangement(4, Order.descending) == [0, 1, 2, 3] and arrangement(4, Order.ascending) == [3, 2, 1, 0]


def test_truncation_keeps_the_top_ranks_and_reports_where_the_gold_went():
    docs = list("abcdefghij")
    assert arrange_documents(docs, 3, Order.outside_in, None) == (list("acegijhfdb"), 8)
    assert arrange_documents(docs, 3, None, 3) == (list("abc"), -1)  # ranked 4th of 3 kept: gone
    assert arrange_documents(docs, 2, Order.ascending, 3) == (list("cba"), 0)


def test_kv_query_aware_prompt_is_the_reference_prompt(tmp_path):
    data = [["test key1", "test value1"], ["test key2", "test value2"], ["test key3", "test value3"]]
    path = tmp_path / "kv.jsonl"
    path.write_text(json.dumps({"ordered_kv_records": data, "key": "test key2", "value": "test value2"}) + "\n")
    (item,) = kv_probe(path, positions=[1], query_aware=True)
    assert item.prompt == "\n".join([
        "Extract the value corresponding to the specified key in the JSON object below.",
        "",
        'Key: "test key2"',
        "",
        "JSON data:",
        '{"test key1": "test value1",',
        ' "test key2": "test value2",',
        ' "test key3": "test value3"}',
        "",
        'Key: "test key2"',
        "Corresponding value:",
    ])


def _reference_format(tmp_path, n_docs=10, gold=3):
    ctxs = [{"title": f"doc {k}", "text": f"text {k}", "isgold": k == gold} for k in range(n_docs)]
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "test question", "answers": ["x"], "ctxs": ctxs}) + "\n")
    return path


def test_mdqa_query_aware_prompt_is_the_reference_prompt(tmp_path):
    path = tmp_path / "qa.jsonl"
    ctxs = [{"title": "first doc", "text": "first doc text", "isgold": False},
            {"title": "second doc", "text": "second doc text", "isgold": True}]
    path.write_text(json.dumps({"question": "test question", "answers": ["x"], "ctxs": ctxs}) + "\n")
    (item,) = mdqa_probe(path, closed_book=False, layout=Layout(query_aware=True))
    assert item.prompt == (f"{INSTRUCTION}\n\nQuestion: test question\n\n"
                           "Document [1](Title: first doc) first doc text\n"
                           "Document [2](Title: second doc) second doc text\n\nQuestion: test question\nAnswer:")


def test_mdqa_reordered_items_keep_the_gold_rank_as_position(tmp_path):
    path = _reference_format(tmp_path, gold=3)
    plain, reordered = (mdqa_probe(path, closed_book=False, layout=layout)[0]
                        for layout in (Layout(), Layout(order=Order.outside_in)))
    assert plain.position == reordered.position == 3  # rank 4: curves pair by rank
    assert reordered.extra["final_position"] == 8 and "final_position" not in plain.extra
    titles = [line.split("(Title: ")[1].split(")")[0] for line in reordered.prompt.splitlines()
              if line.startswith("Document [")]
    assert titles == [f"doc {r}" for r in (0, 2, 4, 6, 8, 9, 7, 5, 3, 1)]
    (cut,) = mdqa_probe(path, closed_book=False, layout=Layout(keep=3))
    assert cut.extra["final_position"] == -1 and cut.prompt.count("Document [") == 3


@pytest.mark.parametrize("layout", [Layout(query_aware=True), Layout(order=Order.ascending, keep=5)])
def test_closed_book_items_are_untouched(tmp_path, layout):
    path = _reference_format(tmp_path)
    plain = [it for it in mdqa_probe(path) if it.label == "closedbook"]
    changed = [it for it in mdqa_probe(path, layout=layout) if it.label == "closedbook"]
    assert [it.prompt for it in plain] == [it.prompt for it in changed] == ["Question: test question\nAnswer:"]
    assert all("final_position" not in it.extra for it in changed)  # no document, so no place it went


def test_curve_by_final_position_leaves_out_closed_book_items(tmp_path):
    items = mdqa_probe(_reference_format(tmp_path, gold=3), layout=Layout(order=Order.outside_in, keep=5))
    outcomes = [{"id": it.id, "query": it.query, "position": it.position, "label": it.label, "prediction": "",
                 "answers": it.answers, "correct": float(it.position >= 0), "extra": it.extra} for it in items]
    # a closed-book outcome carrying a stale final position (as files written before the fix do) stays out too
    outcomes.append({**outcomes[-1], "id": "stale", "extra": {**outcomes[-1]["extra"], "final_position": 0}})
    final = by_final_position(ProbeResult("mdqa", outcomes))
    assert final.accuracy_by_position() == {3: 1.0}  # 4th of the 5 kept, outside-in (ranks 1,3,5,4,2): index 3


def test_specs_parse_and_name_the_probes_each_changes():
    assert Intervention.parse("truncate:5:outside_in") == Truncate(5, Order.outside_in)
    assert Intervention.parse("reorder") == Reorder(Order.outside_in)
    assert Intervention.parse("reorder").tag == "reorder-outside_in"
    assert Intervention.parse("attn_calibration").changes(["kv", "mdqa", "needle"]) == ["kv", "mdqa"]  # documents
    assert Intervention.parse("ms_poe").changes(["needle", "in2"]) == ["needle", "in2"]  # the model: every probe
    for bad in ("attn_calibration:1", "truncate", "truncate:0", "none", "shuffle", "reorder:sideways"):
        with pytest.raises(ValueError):
            Intervention.parse(bad)
    with pytest.raises(ValueError, match=r"applies to \['kv', 'mdqa'\] only"):
        Intervention.from_settings("attn_calibration", ["kv", "needle"])


def test_compare_and_eval_checkpoint_spellings_make_the_same_intervention():
    calibration = AttnCalibrationConfig(layers="all")
    assert (Intervention.parse("attn_calibration", calibration=calibration)
            == Intervention.from_settings("attn_calibration", ["kv"], calibration=calibration)
            == AttentionCalibration(calibration))
    assert Intervention.parse("ms_poe") == MsPoE(MsPoEConfig())  # the defaults without settings
    assert Intervention.from_settings("truncate", ["mdqa"], Order.ascending, 3) == Truncate(3, Order.ascending)
    assert Intervention.from_settings("reorder", ["mdqa"]).tag == "reorder-outside_in"  # order defaults
    assert Intervention.from_settings("none", ["kv", "needle"]).tag == "none"
    for name, order, keep, message in [("truncate", None, None, "keep=K"), ("ms_poe", None, 2, "truncate's setting"),
                                       ("query_aware", Order.ascending, None, "reorder|truncate")]:
        with pytest.raises(ValueError, match=message):
            Intervention.from_settings(name, ["kv"] if name == "query_aware" else ["mdqa"], order, keep)


def test_each_intervention_sets_its_probe_settings():
    cfg = EvalConfig()
    assert Intervention.parse("reorder:ascending").configure(cfg).mdqa.order == Order.ascending
    truncated = Intervention.parse("truncate:4").configure(cfg).mdqa
    assert (truncated.keep, truncated.order) == (4, None)
    aware = Intervention.parse("query_aware").configure(cfg)
    assert aware.kv.query_aware and aware.mdqa.query_aware and not cfg.kv.query_aware
    assert Intervention.parse("ms_poe").configure(cfg) == cfg == Intervention.from_settings("none", []).configure(cfg)
