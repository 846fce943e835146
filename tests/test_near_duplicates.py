"""Issue 65: the question split keeps out of training the near duplicates of the evaluation questions, not only their
exact gold passages."""
from __future__ import annotations

import random

import pytest

from data_builders.question_split import (
    NearDuplicates,
    QuestionSplit,
    check_near_duplicates,
    is_evaluation_question,
    jaccard,
    near_duplicate_passages,
    question_twins,
    shingles,
)
from data_builders.sources import _Record, _split_records

WORDS = [f"w{k}" for k in range(300)]


def text(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_the_indexed_search_finds_exactly_what_comparing_every_pair_finds():
    rng = random.Random(0)
    evaluation = [text(rng) for _ in range(20)]
    passages = [text(rng) for _ in range(60)]
    for k in range(0, 20, 3):  # near copies: a few words changed
        words = evaluation[k].split()
        words[rng.randrange(len(words))] = "changed"
        passages.append(" ".join(words))
    for threshold in (0.05, 0.3, 0.5, 0.9):
        brute = {i: max(jaccard(shingles(p, 5), shingles(e, 5)) for e in evaluation) for i, p in enumerate(passages)}
        assert near_duplicate_passages(passages, evaluation, threshold, 5) == pytest.approx(
            {i: j for i, j in brute.items() if j >= threshold})


def test_case_and_whitespace_do_not_hide_a_copy():
    gold = "The 2018 Olympic men's figure skating was won by Yuzuru Hanyu of Japan,\nwith Shoma Uno second."
    copy = "the  2018 olympic MEN'S figure skating was won by yuzuru hanyu of japan, with shoma uno second."
    assert near_duplicate_passages([copy, "an unrelated passage about rivers"], [gold], 0.5, 5) == {0: 1.0}


def test_a_twin_shares_an_answer_and_nearly_the_whole_question():
    evaluation = [("who won the medals in men's figure skating 2018", ["Yuzuru Hanyu", "Hanyu"])]
    training = [("Who won the medals in men's figure skating 2018?", ["Yuzuru Hanyu"]),  # a twin
                ("who won the medals in men's figure skating 2018", ["Nathan Chen"]),  # another answer
                ("who won the medals in women's curling 2018", ["Hanyu"])]  # the answer, another question
    assert question_twins(training, evaluation, 0.8) == {0}


def test_the_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"data.near_duplicates.passage_jaccard=1.5 must be in \(0, 1\]"):
        check_near_duplicates(NearDuplicates(passage_jaccard=1.5))


def records_with_twins(split: QuestionSplit) -> tuple[list[_Record], str]:
    """Distinct questions with their passages, and a training twin of one evaluation question (its passage the same
    but for whitespace and case, its question the same but for a question mark)."""
    rng = random.Random(1)
    records = [_Record(f"question {k} about {text(rng, 4)}", (f"answer{k}",),
                       (f"{text(rng, 30)} answer{k} {text(rng, 30)}",), ()) for k in range(400)]
    evaluation = next(r for r in records if is_evaluation_question(r.question, split))
    passage = evaluation.evidence[0]
    twin = _Record(evaluation.question + "?", evaluation.answers, ("  " + passage.upper().replace(" ", "  "),), ())
    assert not is_evaluation_question(twin.question + " again", split)
    records.append(_Record(twin.question + " again", twin.answers, twin.evidence, ()))  # a training question
    return records, twin.evidence[0]


def test_the_split_keeps_the_twins_out_of_training_and_counts_them():
    split = QuestionSplit(share=0.15)
    records, twin_passage = records_with_twins(split)
    exact = _split_records(iter(records), [], 1000, 1000, 0, split)
    assert twin_passage in exact[0].passages  # the exact rule alone: the twin trains
    near = NearDuplicates(passage_jaccard=0.5, question_jaccard=0.8)
    train, held, skipped, _ = _split_records(iter(records), [], 1000, 1000, 0, split, near)
    assert twin_passage not in train.passages and twin_passage not in held.passages
    assert skipped["near_duplicate_passages"] == 1 and skipped["kept_out_passages"] == 1
    assert len(train.questions) == len(exact[0].questions) - 1
    assert held.questions == exact[1].questions  # the evaluation side is untouched
