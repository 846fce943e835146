"""Write a multi-document-QA oracle file of invented persons (data_builders.synthetic), for tiny models' mdqa probes.

    python -m scripts.investigations.synthetic_oracle data/synthetic-oracle.jsonl.gz --n 300 --seed 777

Each line is one question in the reference's oracle format (`question`, `answers`, `ctxs` with the one gold
passage, titled with the person's name), as `nq-open-oracle.jsonl.gz`: `eval.mdqa.path`,
`scripts.eval_checkpoint mdqa.path=...` and `analysis.compare --mdqa-path` add the distractors (BM25 over the
file's other passages, none holding the answer) and place the gold at each position. Models trained here on
synthetic IN2 data (`+exp=mdqa_reader`) can answer these; NaturalQuestions is beyond them. A person's facts
are drawn at random, so a name that also occurs in training data carries other facts: nothing is leaked.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path
from typing import Any, Sequence

from data_builders.synthetic import generate_documents


def oracle_records(n: int, seed: int, facts: int = 1) -> list[dict[str, Any]]:
    """`n` records: one question (of its `facts`, chosen with `seed`) about each of `n` invented persons."""
    rng = random.Random(seed)
    records = []
    for doc in generate_documents(n, seed, prefix="oracle", facts=facts):
        qa = rng.choice(doc.qa)
        records.append({"question": qa.question, "answers": list(qa.answers),
                        "ctxs": [{"title": doc.entity, "text": doc.text}]})
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.investigations.synthetic_oracle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON-lines file to write (.gz: gzipped)")
    parser.add_argument("--n", type=int, default=300, help="questions, one per invented person (default 300)")
    parser.add_argument("--seed", type=int, default=777, help="persons and questions (default 777)")
    parser.add_argument("--facts", type=int, default=1, choices=range(1, 6), metavar="{1..5}",
                        help="sentences per passage (default 1, as the mdqa rows of debias.needle_mix.kinds=[mdqa])")
    args = parser.parse_args(argv)
    if args.n < 2:
        parser.error(f"--n {args.n}: an mdqa probe needs at least two passages")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in oracle_records(args.n, args.seed, args.facts)).encode("utf-8")
    if args.out.suffix == ".gz":
        data = gzip.compress(data, mtime=0)  # the same arguments write the same bytes
    args.out.write_bytes(data)
    print(f"wrote {args.n} questions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
