"""Build multi-document QA files in the reference format (Liu et al. 2023), one per gold position.

    python -m scripts.build_mdqa $POSDEBIAS_DATA/nq-open-oracle.jsonl.gz out=qa_data/20_total_documents
    python -m scripts.build_mdqa ORACLE out=qa_data/10 n_docs=10 positions=[0,4,9] examples=500 pool=passages.jsonl

ORACLE holds one question a line with its gold passage (`question`, `answers`, `ctxs` with one passage,
as the reference's nq-open-oracle.jsonl.gz). For every question, the n_docs-1 distractors are the passages
of `pool` (a JSON-lines file of `title`/`text` records, or of records with `ctxs`; default: ORACLE's own
gold passages) that BM25 ranks highest for the question and that contain no normalized answer, in ranking
order (`distractors=random`: other questions' passages, the easy variant). The gold goes to each of
`positions` (default: the reference's for n_docs). Writes, under `out`,

- `nq-open-<n_docs>_total_documents_gold_at_<K>.jsonl.gz`: the reference's file names and record format
  (`ctxs` with `isgold`, `hasanswer`; retrieved distractors also with `score`, `original_retrieval_index`),
  read as they are by `eval.mdqa.path` / `scripts.eval_checkpoint mdqa.path=...`;
- `README.md`: how they were built, and the data's attribution.

The same inputs and settings give byte-identical files. The key=value arguments are overrides of
`BuildMDQAConfig` (a bad key or type fails naming it).
"""
from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm

from data_builders.files import atomic_write_text, read_jsonl
from data_builders.mdqa import Distractors, build_mdqa_records, passage_pool, write_jsonl_gz
from data_builders.probes import reference_positions, sample_indices
from models.training.renamed_keys import one_line, unknown_override

ATTRIBUTION = (
    "Questions, answers and passages: NaturalQuestions-Open (Kwiatkowski et al. 2019; Wikipedia text, "
    "CC BY-SA 3.0), as distributed by nelson-liu/lost-in-the-middle (Liu et al. 2023, MIT licence for the code)."
)

DISTRACTOR_NOTE = {
    Distractors.retrieved: "the answer-free passages BM25 ranks highest for the question, by score",
    Distractors.random: "other questions' passages at random: not comparable with published curves",
}


@dataclass
class BuildMDQAConfig:
    out: str = "qa_data"  # output folder
    n_docs: int = 20  # documents per question, the gold included
    positions: Optional[list[int]] = None  # gold indices, one file each; None = the reference's for n_docs
    distractors: Distractors = Distractors.retrieved
    pool: Optional[str] = None  # passages to retrieve from; None = the oracle file's gold passages
    examples: Optional[int] = None  # questions (a seeded sample, in file order); None = all
    seed: int = 0  # the sample, and random distractors


def build(oracle: str | Path, cfg: BuildMDQAConfig) -> list[Path]:
    """Write one reference-format file per gold position and a README; the files written."""
    records = read_jsonl(oracle)
    positions = reference_positions(cfg.n_docs, "mdqa") if cfg.positions is None else tuple(cfg.positions)
    chosen = sample_indices(len(records), cfg.examples, random.Random(cfg.seed))
    pool = passage_pool(read_jsonl(cfg.pool)) if cfg.pool is not None else None
    built = build_mdqa_records(records, cfg.n_docs, positions, cfg.distractors, pool, chosen, cfg.seed)
    out = Path(cfg.out)
    written = [write_jsonl_gz(out / f"nq-open-{cfg.n_docs}_total_documents_gold_at_{k}.jsonl.gz", built[k])
               for k in tqdm(positions, desc="write", unit="file")]
    digests = "\n".join(f"| `{p.name}` | {len(built[k])} | `{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}` |"
                        for k, p in zip(positions, written))
    pool_name = cfg.pool or f"the gold passages of {oracle}"
    atomic_write_text(out / "README.md", f"""# Multi-document QA, {cfg.n_docs} documents

Built by `python -m scripts.build_mdqa {oracle} {' '.join(f'{k}={v}' for k, v in vars(cfg).items())}`.
Distractors: {cfg.distractors} ({DISTRACTOR_NOTE[cfg.distractors]}), from {pool_name}.

| file | questions | sha256 (first 16) |
| --- | --- | --- |
{digests}

{ATTRIBUTION}
""")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: the data cannot be built; 2: bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BuildMDQAConfig),
                                                  OmegaConf.from_dotlist(argv[1:])))
    except OmegaConfBaseException as err:
        print(f"error: {unknown_override(argv[1:], BuildMDQAConfig) or one_line(err)}", file=sys.stderr)
        return 2
    try:
        written = build(argv[0], cfg)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
