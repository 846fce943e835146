"""The NQ question split (data_builders.question_split): one rule for the IN2 data and the mdqa probe.

Synthetic NQ-format files (invented persons, scripts.investigations.synthetic_oracle) stand in for nq-open-oracle; the
real file is only counted, where it exists.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import compare
from analysis.evaluation.config import EvalConfig, MDQAProbeConfig, MDQAQuestions
from analysis.evaluation.probes import build_probes
from data_builders.build import load_prebuilt
from data_builders.config import FieldMap
from data_builders.probes import mdqa_probe
from data_builders.question_split import (
    DEV_SHARE,
    EvaluationPart,
    QuestionSplit,
    evaluation_part,
    is_evaluation_question,
    split_card,
)
from data_builders.sources import file_source
from data_builders.text import normalize_answer
from models.training.distributed import DistInfo
from scripts import eval_checkpoint
from scripts.build_dataset import main as build_main
from scripts.investigations.synthetic_oracle import oracle_records
from train import as_train_config, validate

SPLIT = QuestionSplit()  # the defaults both sides use


def _on_side(base: str, evaluation: bool) -> str:
    """`base`, or a variant of it, that is (not) an evaluation question under SPLIT."""
    return next(q for q in (base, *(f"{base} (variant {k})" for k in range(200)))
                if is_evaluation_question(q, SPLIT) == evaluation)


def _records() -> list[dict]:
    """Invented-person questions, plus two training-side questions whose gold is an evaluation question's:
    one shares a kept evaluation question's passage, one a passage whose evaluation question is skipped
    (its answer is not in it) but which the mdqa probe still asks."""
    records = oracle_records(160, seed=3)
    kept = next(r for r in records if is_evaluation_question(r["question"], SPLIT))
    unanswerable = next(r for r in records if not is_evaluation_question(r["question"], SPLIT))
    records.remove(unanswerable)
    records += [
        {**kept, "question": _on_side(f"Which fact about {kept['ctxs'][0]['title']} is true?", False)},
        {**unanswerable, "question": _on_side(f"Who is {unanswerable['ctxs'][0]['title']}?", True),
         "answers": ["nobody at all"]},
        {**unanswerable, "question": _on_side(unanswerable["question"], False)},
    ]
    return records


def _write(path: Path, records: list[dict]) -> Path:
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode(), mtime=0))
    return path


def _evaluation(records: list[dict]) -> list[dict]:
    return [r for r in records if is_evaluation_question(r["question"], SPLIT)]


def _contains(text: str, part: str) -> bool:
    return f" {normalize_answer(part)} " in f" {normalize_answer(text)} "


@pytest.fixture(scope="module")
def nq_fixture(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("nq") / "nq-open-oracle.jsonl.gz", _records())


@pytest.fixture(scope="module")
def built(nq_fixture, tmp_path_factory) -> Path:
    """An IN2 build of the synthetic NQ file through scripts.build_dataset (train.py's data overrides)."""
    out = tmp_path_factory.mktemp("built") / "in2_nq"
    build_main(["data=in2_nq", f"data.path={nq_fixture}", "data.context_len=256", "data.in2.context_len_min=null",
                "data.in2.segment_len=32", "data.in2.tasks.short_qa=0", "data.num_train=120", "data.num_eval=24",
                "data.vocab_size=400", "data.cache=false", f"out={out}"])
    return out


def test_the_split_is_deterministic_and_independent_of_record_order(tmp_path, nq_fixture):
    records = _records()
    shuffled = random.Random(7).sample(records, len(records))
    questions = [r["question"] for r in records]
    assert split_card(questions, SPLIT) == split_card([r["question"] for r in shuffled], SPLIT)
    card, n_eval = split_card(questions, SPLIT), len(_evaluation(records))
    assert card["questions"] == {"evaluation": n_eval, "training": len(records) - n_eval}
    assert 0 < n_eval < len(records) // 3
    assert split_card(questions, QuestionSplit(salt="another")) != card  # the salt draws another set
    # spelling variants are one question; PYTHONHASHSEED has no say
    assert is_evaluation_question(questions[0].upper() + "  ", SPLIT) == is_evaluation_question(questions[0], SPLIT)
    code = ("import json, sys; from data_builders.question_split import QuestionSplit, split_card; "
            "print(split_card(json.load(sys.stdin), QuestionSplit())['fingerprint'])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(questions), capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == card["fingerprint"]
    # the IN2 source holds out the same questions, whatever the file's order
    sources = [file_source("nq", str(_write(tmp_path / f"{name}.jsonl.gz", recs)), FieldMap(), 4000, 400, 0,
                           tmp_path / "hf") for name, recs in (("plain", records), ("shuffled", shuffled))]
    held = [{q.question for q in s.heldout.questions} for s in sources]
    assert held[0] == held[1] and held[0] <= {r["question"] for r in _evaluation(records)}
    assert sources[0].split == sources[1].split == card


def test_no_evaluation_question_or_gold_passage_reaches_a_training_sample(built, nq_fixture):
    bundle = load_prebuilt(built)
    texts = {split: [bundle.tokenizer.decode(ids) for ids in ds["input_ids"]]
             for split, ds in (("train", bundle.train), ("eval", bundle.eval))}
    evaluation = _evaluation(_records())
    persons = {r["ctxs"][0]["title"] for r in evaluation}
    for text in texts["train"]:
        assert not any(_contains(text, r["question"]) or _contains(text, r["ctxs"][0]["text"]) for r in evaluation)
        assert not any(_contains(text, name) for name in persons)  # not even a cut piece of their passages
    # the scan can fail: held-out samples hold evaluation questions and their gold passages
    asked = [r for r in evaluation if any(_contains(t, r["question"]) for t in texts["eval"])]
    assert asked and all(any(_contains(t, r["ctxs"][0]["text"]) for t in texts["eval"]) for r in asked)
    assert all(any(name in t for name in persons) for t in texts["eval"])
    skipped = json.loads((built / "build.json").read_text())["skipped"]["source"]
    assert skipped["evidence_of_an_evaluation_question"] == 2 and skipped["answer_not_in_evidence"] == 1


def test_mdqa_heldout_asks_only_evaluation_questions(nq_fixture, tmp_path):
    evaluation = {r["question"] for r in _evaluation(_records())}
    items = mdqa_probe(nq_fixture, n_docs=4, closed_book=False, heldout=SPLIT)
    assert {it.extra["question"] for it in items} == evaluation  # n_examples=None: every one of them
    everything = {it.extra["question"] for it in mdqa_probe(nq_fixture, n_docs=4, closed_book=False)}
    assert everything > evaluation
    cfg = EvalConfig(probes=["mdqa"], probe_examples=5,
                     mdqa=MDQAProbeConfig(path=str(nq_fixture), n_docs=4, questions=MDQAQuestions.heldout))
    asked = {it.extra["question"] for it in build_probes(cfg, None)["mdqa"]}
    assert len(asked) == 5 and asked <= evaluation
    # the same side as the IN2 source's held-out questions
    source = file_source("nq", str(nq_fixture), FieldMap(), 4000, 400, 0, tmp_path / "hf")
    assert {q.question for q in source.heldout.questions} <= evaluation
    assert not {q.question for q in source.train.questions} & evaluation


def test_the_dataset_card_records_the_rule_and_the_counts(built):
    records = _records()
    n_eval = len(_evaluation(records))
    split = json.loads((built / "build.json").read_text())["split"]
    assert split == split_card([r["question"] for r in records], SPLIT)
    assert split["questions"] == {"evaluation": n_eval, "training": len(records) - n_eval}
    card = (built / "README.md").read_text()
    assert "## Evaluation questions" in card and split["rule"] in card and split["fingerprint"] in card
    assert f"share {SPLIT.share} and salt `{SPLIT.salt}`" in card
    assert f"{n_eval} are evaluation questions and {len(records) - n_eval} are on the training side" in card


def test_the_sides_disagreeing_fail_at_start_up_naming_the_keys(compose_cfg, nq_fixture, built, tmp_path, capsys):
    probe = ["eval.probes=[mdqa]", "eval.probe_every=10", f"eval.mdqa.path={nq_fixture}"]

    def check(*overrides: str) -> None:
        validate(as_train_config(compose_cfg(*overrides, *probe)), DistInfo())

    nq = ("data=in2_nq", f"data.path={nq_fixture}")
    with pytest.raises(ValueError, match=r"data\.source=nq .* eval\.mdqa\.questions=all .* set "
                                         r"eval\.mdqa\.questions=heldout"):
        check(*nq)
    with pytest.raises(ValueError, match=r"eval\.mdqa\.split \(share=0\.2, .*\) differs from data\.nq_split "
                                         r"\(share=0\.15"):
        check(*nq, "eval.mdqa.questions=heldout", "eval.mdqa.split.share=0.2")
    with pytest.raises(ValueError, match=r"eval\.mdqa\.split \(share=0\.15, salt='posdebias-nq'\) differs from "
                                         r"data\.nq_split \(share=0\.15, salt='x'\)"):
        check(*nq, "data.nq_split.salt=x", "eval.mdqa.questions=heldout")
    check(*nq, "eval.mdqa.questions=heldout")
    check(*nq, "data.nq_split.share=0.3", "eval.mdqa.questions=heldout", "eval.mdqa.split.share=0.3")
    check()  # synthetic IN2 data holds no NQ question: every one may be asked
    with pytest.raises(ValueError, match=r"data\.nq_split\.share=1\.5 must be in \(0, 1\)"):
        check(*nq, "data.nq_split.share=1.5", "eval.mdqa.questions=heldout")
    with pytest.raises(ValueError, match="data.source=nq"):  # a prebuilt folder is checked by its build.json
        check(f"data.prebuilt={built}")
    # eval_checkpoint: a run trained on NQ is refused before any model is loaded
    run = tmp_path / "run"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(json.dumps({"data": {"source": "nq", "path": str(nq_fixture)}}))
    args = [str(run), "probes=[mdqa]", f"mdqa.path={nq_fixture}"]
    assert eval_checkpoint.main(args) == 1
    assert "the run's data.source=nq trains on NQ-open questions that mdqa.questions=all" in capsys.readouterr().err
    assert eval_checkpoint.main([*args, "mdqa.questions=heldout", "mdqa.split.salt=x"]) == 1
    assert "mdqa.split (share=0.15, salt='x') differs from the run's data.nq_split" in capsys.readouterr().err
    # analysis.compare: the same check, per PATH, before any tokenizer or model is loaded
    compare_args = [str(run), "--probes", "mdqa", "--mdqa-path", str(nq_fixture), "--out", str(tmp_path / "cmp")]
    assert compare.main(compare_args) == 1
    err = capsys.readouterr().err
    assert f"{run}: the run's data.source=nq trains on NQ-open questions that mdqa.questions=all" in err
    assert "(here: --mdqa-questions heldout, which asks the evaluation questions of the default split" in err


def test_nq_open_oracle_counts(nq_file):
    """The real file under the defaults: 390 of the 2,655 questions are evaluation questions."""
    with gzip.open(nq_file, "rt") as f:
        questions = [json.loads(line)["question"] for line in f]
    card = split_card(questions, SPLIT)
    assert card["questions"] == {"evaluation": 390, "training": 2265}
    assert card["fingerprint"] == "3e96ee94b311b0336fdfd7be56b29158e9a5cb1de3d5c0b576d1d98b4b1d81ae"


def test_the_evaluation_questions_split_into_a_fixed_dev_and_test_part():
    """Settings are chosen on dev and reported on test: a question's part follows from its text alone, about
    dev_share of them are dev, and widening the evaluation set keeps every question's part."""
    split, wider = QuestionSplit(share=0.5), QuestionSplit(share=0.8)
    questions = [f"who wrote book number {k}?" for k in range(2000)]
    held = [q for q in questions if is_evaluation_question(q, split)]
    parts = [evaluation_part(q, split) for q in held]
    assert abs(parts.count(EvaluationPart.dev) / len(held) - DEV_SHARE) < 0.05
    assert parts == [evaluation_part(q, wider) for q in held]  # the salt, not the share, decides the part
    assert evaluation_part("Who Wrote Book Number 7?", split) == evaluation_part("who wrote book number 7", split)
    assert [evaluation_part(q, split, 0.2) for q in held].count(EvaluationPart.dev) < parts.count(EvaluationPart.dev)
