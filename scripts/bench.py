"""Run the named benchmarks and print one table; `--write` also rewrites BENCHMARKS.md.

    python -m scripts.bench                 # every benchmark but the real-model ones
    python -m scripts.bench train prior     # some of them
    python -m scripts.bench --write         # and record the table in BENCHMARKS.md (its sections below stay)
    python -m scripts.bench hf_trainer      # a real model against transformers.Trainer, 5 paired runs (~21 min)
    python -m scripts.bench loglik          # the answer log-likelihood against a bare forward (SmolLM2, mdqa)
    python -m scripts.bench measure         # the per-step measurement (default run, SmolLM2): share, error (~22 min)
    python -m scripts.bench precision       # bf16 against fp32, SmolLM2 training and evaluation (~21 min)
    python -m scripts.bench watch           # the watch's share of the SmolLM2 recipe's training time (~15 min)

Every row is a ratio against a baseline measured in the same process and run, because the machines
are shared and noisy: an absolute time alone means little.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar

import torch

from analysis.command_line import CommandParser

# name -> (module, function); each function returns a list of row dicts with at least `name`.
BENCHMARKS = {
    "train": ("scripts.bench_train", "bench_train"),
    "prior": ("scripts.bench_prior", "bench_prior"),
    "jacobian": ("scripts.bench_jacobian", "bench_jacobian"),
    "diff": ("scripts.bench_diff", "bench_diff"),
    "data": ("scripts.bench_data", "bench_data"),
    "long": ("scripts.bench_long", "bench_long"),
    "hf_trainer": ("scripts.bench_hf_trainer", "bench_hf_trainer"),
    "loglik": ("scripts.bench_loglik", "bench_loglik"),
    "measure": ("scripts.bench_measure", "bench_measure"),
    "precision": ("scripts.bench_precision", "bench_precision"),
    "watch": ("scripts.bench_watch", "bench_watch"),
}
# Run only when named: they fetch a model and take many minutes; each writes its own section of BENCHMARKS.md.
REAL_MODEL = {
    "hf_trainer": "Real model: SmolLM2-135M-Instruct against transformers.Trainer",
    "loglik": "Real model: the answer log-likelihood against a bare forward pass (SmolLM2, mdqa)",
    "measure": "The per-step Jacobian and rollouts: their share of the training wall time (default run, SmolLM2 "
               "recipe), their error against exact",
    "precision": "Real model: bf16 against fp32 on this CPU (SmolLM2: training under autocast, evaluation in bf16 weights)",
    "watch": "The watch on the task's own prompts: its share of the SmolLM2 recipe's training wall time (issue 64)",
}
ROOT = Path(__file__).resolve().parents[1]
CLEAR_REFS = Path("/proc/self/clear_refs")
T = TypeVar("T")


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def in_fresh_process(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a freshly spawned interpreter (what a peak-memory measurement needs, see below)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def extra_peak_rss_mib(op: Callable[[], object]) -> float | None:
    """Peak RSS that `op()` adds to this process, in MiB; None without /proc.

    Run it in a fresh process (spawn): memory an earlier operation freed into the allocator's cache
    would otherwise be reused unseen.
    """
    if not CLEAR_REFS.exists():
        return None
    gc.collect()
    CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS")
    op()
    return (_status_kb("VmHWM") - before) / 1024


def _fmt(value) -> str:
    """A table cell: floats to 4 significant digits, a | escaped (it would end the cell)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def table(rows: list[tuple[str, dict]]) -> str:
    """Markdown table: benchmark, row name, ratio, and every other field of the row."""
    lines = ["| benchmark | what | ratio | details |", "| --- | --- | --- | --- |"]
    for bench, row in rows:
        details = "; ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("name", "ratio"))
        lines.append(f"| {bench} | {_fmt(row['name'])} | {_fmt(row.get('ratio'))} | {details} |")
    return "\n".join(lines)


def write_table(out: str, command: str, section: str | None) -> None:
    """BENCHMARKS.md with `out`: the main table (its `## ...` sections kept), or, for a real-model benchmark, its
    section `## <section>` (replaced, the rest kept)."""
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    made = (f"Made by:\n\n```\n{command.strip()}\n```\n\non {platform.machine()}, {torch.get_num_threads()} torch "
            f"threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.\n\n{out}\n")
    main, _, sections = old.partition("\n## ")
    sections = [s for s in sections.split("\n## ") if s] if sections else []
    if section is not None:
        sections = [s for s in sections if not s.startswith(section)]
        sections.append(f"{section}\n\nRatios against a baseline measured in the same run. {made}")
    else:
        main = ("# Benchmarks\n\nRatios against a baseline measured in the same run (see each benchmark's module "
                f"in `scripts/`). {made}")
    path.write_text(main.rstrip("\n") + "\n" + "".join(f"\n## {s.rstrip(chr(10))}\n" for s in sections))


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md with this table")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    names = args.names or [n for n in BENCHMARKS if n not in REAL_MODEL]
    real = {REAL_MODEL[n] for n in names if n in REAL_MODEL}
    if args.write and real and (len(real) > 1 or len(real) < len(names)):
        parser.error("--write records one real-model benchmark at a time (each has its own section)")
    rows = []
    for name in names:
        module, func = BENCHMARKS[name]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rows += [(name, row) for row in getattr(importlib.import_module(module), func)()]
        print(f"  {name} took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = table(rows)
    print(out)
    if args.write:
        write_table(out, "python -m scripts.bench " + " ".join(sys.argv[1:]), real.pop() if real else None)


if __name__ == "__main__":
    main()
