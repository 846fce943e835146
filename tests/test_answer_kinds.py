"""Answer kinds and short-answer scores (analysis.evaluation.answer_kinds) on hand-computed cases."""
import json

import pytest

from analysis.evaluation.answer_kinds import (
    KINDS,
    answer_kind,
    describe_answer,
    gold_segment_index,
    kv_values,
    segment_texts,
    summarize,
    value_kind,
)

CURIE = ("Document [1](Title: Marie Curie) Marie Curie was the first woman to win a Nobel Prize, in 1903, "
         "for her research on radioactivity.")
ROENTGEN = ("Document [2](Title: Wilhelm Roentgen) Wilhelm Conrad Roentgen was a German physicist who, in 1895, "
            "produced and detected X-rays, an achievement that earned him the first Nobel Prize in Physics in 1901.")
CONCAT = "Document [3](Title: Strings) To concatenate strings is to join them end to end."
DOCS = [CURIE, ROENTGEN, CONCAT]
GOLD = 1
ANSWERS = ["Wilhelm Conrad Roentgen", "Wilhelm Roentgen"]
COPIED = "Wilhelm Conrad Roentgen was a German physicist who, in 1895, produced and detected X-rays."


def describe(prediction, gold_index=GOLD, documents=DOCS):
    return describe_answer(prediction, ANSWERS, documents, gold_index)


def test_short_exact_answer_from_the_gold():
    assert describe("Wilhelm Conrad Roentgen") == {
        "kind": "gold", "first_line_words": 3, "short_em": 1.0, "whole_word": 1.0,
        "copies_gold": 0.0,  # 3 normalized words: too short to count as copying
    }


def test_long_sentence_copied_from_the_gold():
    # Normalized: "wilhelm conrad roentgen was german physicist who in 1895 produced and detected xrays", a run of
    # the normalized gold; 14 words as generated ("a" and "X-rays," count there).
    assert describe(COPIED) == {
        "kind": "gold", "first_line_words": 14, "short_em": 0.0, "whole_word": 1.0, "copies_gold": 1.0,
    }


def test_four_copied_words_inside_own_text_copy_but_are_no_span():
    d = describe("I think Roentgen was a German physicist")  # "roentgen was german physicist": 4 gold words
    assert (d["kind"], d["copies_gold"], d["whole_word"]) == ("none", 1.0, 0.0)
    assert describe("Roentgen was German")["copies_gold"] == 0.0  # 3 words only


def test_span_of_a_distractor():
    assert describe("Marie Curie") == {
        "kind": "distractor", "first_line_words": 2, "short_em": 0.0, "whole_word": 0.0, "copies_gold": 0.0,
    }
    assert answer_kind("for her research on radioactivity", DOCS, GOLD) == "distractor"
    assert describe("Marie Curie was the first woman to win")["copies_gold"] == 0.0  # copied, but not the gold


def test_made_up_answer_is_none():
    assert describe("Albert Einstein")["kind"] == "none"
    # Pieces of two documents, and a gold span in the model's own framing: in no single document.
    assert answer_kind("research on radioactivity Wilhelm Conrad Roentgen", DOCS, GOLD) == "none"
    framed = describe("The answer is Wilhelm Conrad Roentgen.")
    assert (framed["kind"], framed["short_em"], framed["whole_word"]) == ("none", 0.0, 1.0)


@pytest.mark.parametrize("prediction", ["", "   ", "\n\n  \n", "...!?", " -- ", "The", "a, an."])
def test_empty(prediction):
    d = describe(prediction)
    assert (d["kind"], d["short_em"], d["whole_word"], d["copies_gold"]) == ("empty", 0.0, 0.0, 0.0)
    assert answer_kind(prediction, DOCS, None) == "empty"


def test_whole_words_only():
    assert answer_kind("cat", DOCS, GOLD) == "none"  # inside "concatenate", not a word of it
    assert answer_kind("concatenate", DOCS, GOLD) == "distractor"
    assert answer_kind("Roent", DOCS, GOLD) == "none"
    assert answer_kind("190", DOCS, GOLD) == "none"  # not "1901" nor "1903"


def test_only_the_first_line_counts():
    d = describe("Albert Einstein\n" + COPIED)
    assert d == {"kind": "none", "first_line_words": 2, "short_em": 0.0, "whole_word": 0.0, "copies_gold": 0.0}
    # Leading blank lines are skipped, as in scoring.first_line.
    assert describe("\n\n  Wilhelm Conrad Roentgen\nMarie Curie")["kind"] == "gold"


def test_closed_book():
    for gold_index in (None, -1, 3, 99):  # -1 is closed-book, not the last document
        d = describe("Wilhelm Conrad Roentgen", gold_index=gold_index)
        assert (d["kind"], d["short_em"], d["copies_gold"]) == ("distractor", 1.0, None)
        assert answer_kind("Albert Einstein", DOCS, gold_index) == "none"
    last = [CURIE, CONCAT, ROENTGEN]
    assert answer_kind("Wilhelm Conrad Roentgen", last, -1) == "distractor"
    assert answer_kind("Wilhelm Conrad Roentgen", last, 2) == "gold"
    assert describe("Wilhelm Conrad Roentgen", gold_index=None, documents=[]) == {
        "kind": "none", "first_line_words": 3, "short_em": 1.0, "whole_word": 1.0, "copies_gold": None,
    }
    assert answer_kind(" ", [], None) == "empty"


def test_case_punctuation_and_articles_are_normalized():
    d = describe("WILHELM conrad, Roentgen!!")
    assert (d["kind"], d["short_em"], d["first_line_words"]) == ("gold", 1.0, 3)
    assert answer_kind("X-RAYS", DOCS, GOLD) == "gold"  # "xrays" both sides
    assert answer_kind("the German physicist", DOCS, GOLD) == "gold"  # gold reads "a German physicist"
    # The header is document text, but "[1](Title:" normalizes to the one word "1title".
    assert answer_kind("Marie Curie Marie Curie", DOCS, GOLD) == "distractor"
    assert answer_kind("Title: Marie Curie", DOCS, GOLD) == "none"


def test_gold_wins_over_a_distractor_holding_the_same_span():
    assert answer_kind("the Nobel Prize", DOCS, GOLD) == "gold"  # in the gold and in Curie's document
    assert answer_kind("the Nobel Prize", DOCS, 0) == "gold"
    assert answer_kind("the Nobel Prize", DOCS, 2) == "distractor"


def test_kv_pairs():
    pairs = ['"1a2b-3c4d": "5e6f-7a8b"', '"9c0d-1e2f": "3a4b-5c6d"']
    assert answer_kind("3a4b-5c6d", pairs, 1) == "gold"  # normalized "3a4b5c6d"
    assert answer_kind('"5e6f-7a8b"', pairs, 1) == "distractor"
    assert answer_kind("3a4b-5c6", pairs, 1) == "none"


KV_PAIRS = ['"1a2b-3c4d": "5e6f-7a8b"', '"9c0d-1e2f": "3a4b-5c6d"', '"0f1e-2d3c": "4b5a-6978"']
KV_VALUES = ["5e6f-7a8b", "3a4b-5c6d", "4b5a-6978"]
PREAMBLE = 'The value corresponding to the key "9c0d-1e2f" is:\n\n```json\n{\n  "9c0d-1e2f": "%s"\n}\n```'


def test_kv_values_read_each_pair_and_name_a_text_that_is_not_one():
    assert kv_values(KV_PAIRS) == KV_VALUES
    with pytest.raises(ValueError, match="not a kv pair.*Document"):
        kv_values(KV_PAIRS[:1] + [CURIE])


def test_a_kv_answer_is_the_pair_whose_value_it_names_wherever_in_the_answer():
    # the value below a preamble that repeats the gold key: the first line names no value at all
    assert answer_kind(PREAMBLE % "3A4B-5C6D", KV_PAIRS, 1) == "none"
    assert value_kind(PREAMBLE % "3A4B-5C6D", KV_VALUES, 1) == "gold"  # case ignored
    assert value_kind(PREAMBLE % "4b5a-6978", KV_VALUES, 1) == "distractor"
    assert value_kind(PREAMBLE % "4b5a-69", KV_VALUES, 1) == "none"  # cut short by the token budget
    assert value_kind("5e6f-7a8b or 3a4b-5c6d", KV_VALUES, 1) == "gold"  # the gold wins, as accuracy credits it
    assert value_kind("3a4b-5c6d", KV_VALUES, None) == "distractor"  # no gold: every value is another pair's
    assert value_kind("3a4b-5c6d", KV_VALUES, 3) == "distractor"  # out of range is no gold
    assert value_kind(" \n ", KV_VALUES, 1) == "empty"


def test_describe_reads_a_kv_answers_kind_on_the_whole_answer_and_the_rest_on_its_first_line():
    d = describe_answer(PREAMBLE % "3a4b-5c6d", ["3a4b-5c6d"], KV_PAIRS, 1, values=KV_VALUES)
    assert (d["kind"], d["first_line_words"], d["short_em"], d["whole_word"]) == ("gold", 8, 0.0, 0.0)
    assert describe_answer("3a4b-5c6d", ["3a4b-5c6d"], KV_PAIRS, 1, values=KV_VALUES)["short_em"] == 1.0
    assert describe_answer(PREAMBLE % "3a4b-5c6d", ["3a4b-5c6d"], KV_PAIRS, 1)["kind"] == "none"  # without values


def test_describe_is_json():
    for prediction in ("Wilhelm Conrad Roentgen", COPIED, ""):
        for gold_index in (GOLD, None):
            d = describe(prediction, gold_index)
            assert json.loads(json.dumps(d)) == d
            assert isinstance(d["first_line_words"], int) and isinstance(d["short_em"], float)


def test_summarize_by_hand():
    descriptions = [
        describe("Wilhelm Conrad Roentgen"),  # gold, 3 words, em 1, ww 1, copies 0
        describe(COPIED),  # gold, 14, 0, 1, 1
        describe("Marie Curie"),  # distractor, 2, 0, 0, 0
        describe("Albert Einstein"),  # none, 2, 0, 0, 0
        describe("Wilhelm Conrad Roentgen", gold_index=None),  # distractor, 3, 1, 1, None
        describe(""),  # empty, 0, 0, 0, 0
    ]
    s = summarize(descriptions)
    assert s == pytest.approx({
        "n": 6, "share_gold": 2 / 6, "share_distractor": 2 / 6, "share_none": 1 / 6, "share_empty": 1 / 6,
        "median_first_line_words": 2.5,  # of 0 2 2 3 3 14
        "short_em": 2 / 6, "whole_word": 3 / 6, "copies_gold": 1 / 5, "n_copies_gold": 5,
    })
    assert sum(s[f"share_{k}"] for k in KINDS) == pytest.approx(1.0)
    assert json.loads(json.dumps(s)) == s


def test_summarize_edge_cases():
    assert summarize([]) == {
        "n": 0, "share_gold": None, "share_distractor": None, "share_none": None, "share_empty": None,
        "median_first_line_words": None, "short_em": None, "whole_word": None, "copies_gold": None,
        "n_copies_gold": 0,
    }
    closed = summarize([describe("Marie Curie", gold_index=None)])
    assert (closed["copies_gold"], closed["n_copies_gold"], closed["share_distractor"]) == (None, 0, 1.0)
    with pytest.raises(ValueError, match="unknown answer kinds"):
        summarize([{**describe("Marie Curie"), "kind": "golden"}])


def test_segment_texts():
    prompt = "Docs:\nDocument [1] alpha\nDocument [2] beta\nQuestion?"
    assert segment_texts(prompt, [(6, 24), (25, 42)]) == ["Document [1] alpha", "Document [2] beta"]
    assert segment_texts(prompt, [(0, 0)]) == [""]
    assert segment_texts(prompt, None) == segment_texts(prompt, []) == []
    for bad in [(-1, 3), (5, 4), (40, 60)]:
        with pytest.raises(ValueError, match="not a span"):
            segment_texts(prompt, [bad])
    with pytest.raises(TypeError):
        segment_texts([1, 2, 3], [(0, 1)])


def test_gold_segment_index():
    assert gold_segment_index(3) == 3
    assert gold_segment_index(3, {"final_position": 7}) == 7
    assert gold_segment_index(3, {"final_position": -1}) is None  # truncated away
    assert gold_segment_index(-1, {}) is None  # closed-book


def test_summarize_answers_whose_documents_were_not_known():
    """IN2 prompts are token ids: their answers have a length and short-answer scores, no kind."""
    got = summarize([{"first_line_words": 3, "short_em": 1.0, "whole_word": 1.0},
                     {"first_line_words": 5, "short_em": 0.0, "whole_word": 1.0}])
    assert got["n"] == 2 and got["median_first_line_words"] == 4.0 and got["short_em"] == 0.5
    assert all(got[f"share_{kind}"] is None for kind in KINDS) and got["copies_gold"] is None
