"""Benchmark of IN2 assembly against a naive builder that joins text and re-tokenizes every sample.

Both builders run on the same plans (same pools, questions, layouts and seed) in the same process:
ours gathers token ids from the pre-tokenized pool and writes Arrow records; the naive one joins
the segments' text with the question and answer and tokenizes the whole sample. Throughput is in
sample tokens per second of wall time and per CPU-second (`process_time`, all threads), the
latter being tokens/s per core. Run: `python -m scripts.bench_data`.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from data_builders.config import DataConfig, DataSource, In2Config
from data_builders.in2 import Plan, Prepared, prepare
from data_builders.probes import NQ_FILE

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens) of one call of `fn`, which returns the tokens it produced."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def _naive_text(plan: Plan, prep: Prepared) -> str:
    """The sample as text: pieces of segment text (cut pieces cut proportionally), question, answer."""
    pool, fmt = prep.pools["train"], prep.fmt
    parts = []
    for s, lo, hi in zip(plan.segs, plan.lo, plan.hi):
        text = pool.text[s] + "\n"
        n = pool.unit_len[s]
        parts.append(text[len(text) * lo // n : len(text) * hi // n])
    return "".join(parts) + fmt.question_text(plan.item.question) + fmt.answer_text(plan.item.answers[0])


def bench_case(name: str, cfg: DataConfig, n: int) -> dict:
    """One row: ours and the naive builder on the same `n` training plans of `cfg`."""
    prep = prepare(cfg)
    for _ in prep.plans("train", n):
        pass  # tokenizes the drawn questions once, outside both timings (a pool input like the segments)

    def ours() -> int:
        table = prep.assemble("train", n)
        return int(table.column("input_ids").combine_chunks().value_lengths().to_numpy().sum())

    def naive() -> int:
        tok, eos = prep.tokenizer, prep.tokenizer.eos_token_id
        return sum(len(tok(_naive_text(p, prep), add_special_tokens=False)["input_ids"] + [eos])
                   for p in prep.plans("train", n))

    ours_s, ours_cpu, tokens = _timed(ours)
    naive_s, naive_cpu, naive_tokens = _timed(naive)
    return {
        "name": name,
        "samples": n,
        "tokens": tokens,
        "ours_s": ours_s,
        "ours_tok_s": tokens / ours_s,
        "ours_tok_s_per_core": tokens / ours_cpu,
        "baseline": "join segment text, tokenize each sample",
        "baseline_s": naive_s,
        "baseline_tok_s": naive_tokens / naive_s,
        "baseline_tok_s_per_core": naive_tokens / naive_cpu,
        "ratio": naive_s / ours_s,
        "ratio_per_core": (naive_cpu / naive_tokens) / (ours_cpu / tokens),
    }


def bench_data(scale: float = 1.0) -> list[dict]:
    """Rows for the CPU default (256 tokens), 8K and 32K synthetic contexts, and NQ at 4K-8K when present."""
    base = DataConfig(cache=False)
    seg128 = In2Config(segment_len=128)
    cases = [
        ("synthetic 256 (CPU default)", base, 4000),
        ("synthetic 8K", replace(base, context_len=8192, in2=seg128), 200),
        ("synthetic 32K", replace(base, context_len=32768, in2=seg128, num_train_docs=8000), 50),
    ]
    nq = SHARED_DATA / NQ_FILE
    if nq.exists():
        nq_cfg = replace(base, source=DataSource.nq, path=str(nq), context_len=8192,
                         in2=In2Config(segment_len=128, context_len_min=4096))
        cases.append(("nq 4K-8K", nq_cfg, 200))
    return [bench_case(name, cfg, max(1, int(n * scale))) for name, cfg, n in cases]


if __name__ == "__main__":
    for row in bench_data():
        print(json.dumps(row))
