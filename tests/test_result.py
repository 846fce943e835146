"""ProbeResult's intervals and paired differences through analysis.stats: paired by question id, whole questions
resampled, duplicate ids refused."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from analysis import stats
from analysis.evaluation.result import (
    SAMPLE_SIZE,
    Checkpoint,
    ProbeResult,
    fingerprint,
    paired_delta,
    pairing_mismatch,
)


def outcome(question: int, position: int, correct: float, query: str | None = None, **fields: float) -> dict:
    return {"id": f"mdqa-{question}@{position}", "query": query or f"question {question}", "position": position,
            "label": "closedbook" if position < 0 else str(position), "prediction": "", "answers": ["x"],
            "correct": correct, "extra": {}, **fields}


def test_intervals_by_position_are_stats_mean_intervals_of_any_score():
    rng = np.random.default_rng(0)
    correct, loglik = rng.integers(0, 2, (40, 2)).astype(float), rng.normal(-2.0, 1.0, (40, 2))  # (Q, positions)
    result = ProbeResult("mdqa", [outcome(q, p, correct[q, k], loglik=loglik[q, k])
                                  for q in range(40) for k, p in enumerate((0, 9))])
    expected = stats.mean_interval(correct[:, 1])
    assert result.ci_by_position()[9] == (expected.low, expected.high)  # N_BOOT, ALPHA, RNG_SEED by default
    nats = stats.Score("loglik", rate=False)
    assert result.accuracy_by_position(nats)[0] == pytest.approx(loglik[:, 0].mean())
    low, high = result.ci_by_position(score=nats)[0]
    assert low < loglik[:, 0].mean() < high < 0
    diff = result.paired_difference(0, 9, score=nats)
    assert diff.value == pytest.approx((loglik[:, 0] - loglik[:, 1]).mean()) and diff.n == 40


def test_paired_difference_pairs_by_question_id_not_by_query_text():
    # Two questions asked with the same text: pairing by text kept one of them (the second overwrote the first).
    result = ProbeResult("mdqa", [outcome(0, 0, 1.0, "same"), outcome(0, 9, 0.0, "same"),
                                  outcome(1, 0, 1.0, "same"), outcome(1, 9, 1.0, "same")])
    diff = result.paired_difference(0, 9)
    assert diff.n == 2 and diff.value == 0.5
    twice = ProbeResult("mdqa", [*result.outcomes, {**outcome(1, 0, 0.0), "id": "mdqa-1@again"}])
    with pytest.raises(ValueError, match=r"questions at position 0: item id 'mdqa-1' occurs more than once"):
        twice.paired_difference(0, 9)
    with pytest.raises(ValueError, match="no question of probe 'mdqa' was asked at both positions 0 and 4"):
        result.paired_difference(0, 4)


def test_paired_delta_over_several_positions_resamples_whole_questions():
    rng = np.random.default_rng(1)
    positions, n_questions = (0, 4, 9), 60
    gain = rng.integers(0, 2, n_questions).astype(float)  # (Q,): each question's delta, the same at every position
    plain = ProbeResult("mdqa", [outcome(q, p, 0.0) for q in range(n_questions) for p in (-1, *positions)])
    other = ProbeResult("mdqa", [outcome(q, p, gain[q]) for q in range(n_questions) for p in (-1, *positions)])
    delta, items = paired_delta(plain, other)
    assert items == 3 * n_questions and delta.n == n_questions  # closed-book left out; 60 questions resampled
    deltas = np.repeat(gain, len(positions))  # (Q * 3,): mdqa-q@0, @4, @9 of each question
    clusters = np.repeat([f"mdqa-{q}" for q in range(n_questions)], len(positions))  # (Q * 3,)
    # The draws are of the sorted cluster labels, so the items' order does not change the interval.
    by_question = stats.paired_interval(deltas, np.zeros(deltas.size), clusters)
    assert (delta.value, delta.low, delta.high) == (by_question.value, by_question.low, by_question.high)
    by_item = stats.paired_interval(deltas, np.zeros(deltas.size))
    assert by_item.high - by_item.low < 0.7 * (delta.high - delta.low)  # ~1/sqrt(3): items counted as independent
    at_four, items = paired_delta(plain, other, {4})
    assert items == n_questions and at_four.value == pytest.approx(gain.mean())


def test_paired_delta_refuses_a_duplicate_id_naming_the_result():
    plain = ProbeResult("kv", [outcome(q, 0, 0.0) for q in range(3)])
    other = ProbeResult("kv", [*(outcome(q, 0, 1.0) for q in range(3)), outcome(1, 0, 0.0)])
    with pytest.raises(ValueError, match=r"^arm: item id 'mdqa-1@0' occurs more than once"):
        paired_delta(plain, other, where=("plain", "arm"))
    nothing, items = paired_delta(plain, ProbeResult("kv", [outcome(7, 0, 1.0)]))
    assert items == 0 and math.isnan(nothing.value) and not nothing.resolved


def test_the_json_records_the_checkpoint_and_the_items_and_old_files_still_load(tmp_path):
    outcomes = [{**outcome(q, p, 1.0), "item_digest": f"{q}{p}" * 8} for q in range(2) for p in (0, 9)]
    result = ProbeResult("mdqa", outcomes, {"metric": "best_subspan_em"}, Checkpoint("/runs/a/checkpoints/step-3", "d" * 64))
    data = json.loads(result.save_json(tmp_path / "mdqa_step3.json").read_text())
    assert data["checkpoint"] == {"path": "/runs/a/checkpoints/step-3", "digest": "d" * 64}
    assert data["items_fingerprint"] == fingerprint(o["item_digest"] for o in reversed(outcomes))  # any order
    back = ProbeResult.load_json(tmp_path / "mdqa_step3.json")
    assert back.checkpoint == result.checkpoint and back.fingerprint == result.fingerprint
    for key in ("checkpoint", "items_fingerprint"):  # a file written before results recorded them
        del data[key]
    for o in data["outcomes"]:
        del o["item_digest"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = ProbeResult.load_json(tmp_path / "old.json")
    assert old.checkpoint is None and old.fingerprint is None and old.accuracy_by_position() == {0: 1.0, 9: 1.0}


def test_a_file_that_is_no_result_fails_naming_it(tmp_path):
    (tmp_path / "notes.txt").write_text("a note\n")
    (tmp_path / "metrics_step3.json").write_text(json.dumps({"eval/kv/acc_mean": 0.5}))
    with pytest.raises(ValueError, match=r"notes.txt: not an evaluation result, not even JSON \(Expecting value"):
        ProbeResult.load_json(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match=r"metrics_step3.json: not an evaluation result: no per-item outcomes in it"):
        ProbeResult.load_json(tmp_path / "metrics_step3.json")


def test_pairing_mismatch_names_the_settings_and_items_that_differ():
    def made(settings: dict, digests: dict[int, str]) -> ProbeResult:
        return ProbeResult("kv", [{**outcome(q, 0, 1.0), **({"item_digest": digests[q]} if q in digests else {})}
                                  for q in range(3)], {"metric": "kv_em", **settings})

    where = ("A/kv_step3.json", "B/kv_step3.json")
    plain = made({"slots": [10], "positions": [0, 9], "source": "/a/kv-75.jsonl.gz", "prefill": "x", "queries": 3},
                 {0: "a", 1: "b"})
    assert pairing_mismatch(plain, plain, where) is None
    elsewhere = made({"slots": [10], "positions": [0, 9], "source": "/b/kv-75.jsonl.gz", "prefill": "y"},
                     {0: "a", 1: "b"})
    assert pairing_mismatch(plain, elsewhere, where) is None  # the same file on another machine, computed otherwise
    more = made({"slots": [20], "positions": [0, 19]}, {})
    assert pairing_mismatch(plain, more, where) == ("kv slots: [10] in A/kv_step3.json, [20] in B/kv_step3.json; "
                                                    "positions: [0, 9] in A/kv_step3.json, [0, 19] in B/kv_step3.json")
    other = made({"slots": [10]}, {0: "a", 1: "c", 2: "z"})
    assert pairing_mismatch(plain, other, where) == ("kv: 1 of the 3 item ids both asked (first mdqa-1@0) hold another "
                                                     "prompt or other answers in B/kv_step3.json than in A/kv_step3.json")
    assert pairing_mismatch(plain, other, where, items=False) is None
    reordered = made({"slots": [5], "order": "outside_in", "intervention": "truncate-5"}, {0: "x", 1: "y"})
    assert pairing_mismatch(plain, reordered, where) is None  # an intervention's prompts differ by design
    fewer = made({"queries": 2}, {})  # fewer questions of one sample: pairs on the ids both asked where asked to
    assert pairing_mismatch(plain, fewer, where) == "kv queries: 3 in A/kv_step3.json, 2 in B/kv_step3.json"
    assert pairing_mismatch(plain, fewer, where, free=SAMPLE_SIZE) is None
