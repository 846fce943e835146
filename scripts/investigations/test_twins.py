"""Which of issue 39's 200 test questions had near duplicates in the grid's training data, and does leaving them
out change the reported numbers? (issue 65; docs/LIFT_MIDDLE.md)

    python -m scripts.investigations.test_twins --out docs/lift_middle/test_twins.json

The grid's training data is rebuilt as `+exp=reads_middle` built it (its cache, or a build of ~2 minutes): every
training sample's documents (its gold and its BM25 distractors, all training passages) and question, read back from
its prompt. A test question is touched when a training document's word 5-grams overlap its gold passage's at Jaccard
>= 0.5 (`data_builders.question_split.near_duplicate_passages`), or a trained question shares an answer with it and
its words at Jaccard >= 0.8 (`question_twins`). Then each kept test evaluation (docs/reads_middle_grid/kept) is read
again with and without the touched questions: accuracy at gold 0, 4 and 9 and its change against the starting model,
and the log p contrast change (gold 4 − gold 9), per run.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from analysis.evaluation.result import LOGLIK, ProbeResult, contrast_change, paired_delta
from data_builders.build import build_datasets
from data_builders.files import read_jsonl_lines
from data_builders.probes import mdqa_probe
from data_builders.question_split import (
    EvaluationPart,
    QuestionSplit,
    near_duplicate_passages,
    question_twins,
)
from data_builders.tokenizer import load_tokenizer
from models.wheel_models import local_pretrained
from train import as_train_config, compose_config

ROOT = Path(__file__).resolve().parents[2]
KEPT = ROOT / "docs" / "reads_middle_grid" / "kept" / "evals" / "mdqa_test"
DOCUMENT = re.compile(r"Document \[\d+\]\(Title: (.*?)\) (.*?)(?=\nDocument \[\d+\]|\n\nQuestion:|\nQuestion:)", re.S)
QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)


def training_samples(cfg: Any) -> list[dict[str, Any]]:
    """The grid's training samples: id, question, answers and the texts of their documents."""
    tokenizer = load_tokenizer(local_pretrained(cfg.model.pretrained), False)
    bundle = build_datasets(cfg.data, tokenizer)
    out = []
    for row in bundle.train:
        text = tokenizer.decode(row["input_ids"][: row["prompt_len"]], skip_special_tokens=True)
        question = QUESTION.search(text)
        out.append({"id": row["id"], "question": question.group(1).strip() if question else "",
                    "answers": list(row["answers"]), "documents": [body for _, body in DOCUMENT.findall(text)]})
    return out


def test_questions(nq: Path, split: QuestionSplit) -> list[dict[str, Any]]:
    items = mdqa_probe(nq, n_docs=10, positions=[0], heldout=split, part=EvaluationPart.test, n_examples=200, seed=0,
                       closed_book=False)
    gold = {rec["question"]: rec["ctxs"][0]["text"] for _, rec in read_jsonl_lines(nq)}
    return [{"query": str(it.query), "question": it.extra["question"], "answers": list(it.answers),
             "gold": gold[it.extra["question"]]} for it in items]


def touched(tests: list[dict[str, Any]], train: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    documents = sorted({d for s in train for d in s["documents"]})
    where = {}
    for s in train:
        for d in s["documents"]:
            where.setdefault(d, []).append(s["id"])
    out: dict[str, dict[str, Any]] = {}
    for t in tests:
        near = near_duplicate_passages(documents, [t["gold"]], 0.5, 5)
        twins = question_twins([(s["question"], s["answers"]) for s in train], [(t["question"], t["answers"])], 0.8)
        if near or twins:
            out[t["query"]] = {"question": t["question"], "answers": t["answers"],
                               "passages": [{"jaccard": round(j, 3), "in_samples": where[documents[i]][:5]}
                                            for i, j in sorted(near.items(), key=lambda kv: -kv[1])],
                               "question_twins": sorted(train[k]["id"] for k in twins)}
    return out


def without(result: ProbeResult, queries: set[str]) -> ProbeResult:
    return ProbeResult(result.probe, [o for o in result.outcomes if str(o.get("query", o["id"])) not in queries],
                       result.settings)


def numbers(base: ProbeResult, run: ProbeResult) -> dict[str, float]:
    out = {}
    for position in (0, 4, 9):
        delta, _ = paired_delta(base, run, [position])
        out[f"accuracy@{position}"] = run.accuracy_by_position()[position]
        out[f"change@{position}"] = delta.value
    out["loglik_contrast_change"] = contrast_change(base, run, 4, 9, LOGLIK).value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.investigations.test_twins",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cfg = as_train_config(compose_config(["+exp=reads_middle"]))
    split = cfg.data.nq_split
    train = training_samples(cfg)
    tests = test_questions(Path(cfg.data.path), split)
    found = touched(tests, train)
    base = ProbeResult.load_json(KEPT / "base" / "eval" / "mdqa_step0.json")
    runs = {folder.name: ProbeResult.load_json(next((folder / "eval").glob("mdqa_step*.json")))
            for folder in sorted(KEPT.glob("run-*"))}
    queries = set(found)
    report = {"training_samples": len(train), "test_questions": len(tests), "touched": found,
              "numbers": {name: {"all": numbers(base, run), "without_touched": numbers(without(base, queries),
                                                                                       without(run, queries))}
                          for name, run in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{len(found)} of {len(tests)} test questions touched; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
