"""The GPU check: the real-user path on one CUDA device, as one command and one table.

    python -m scripts.gpu_check                 # on a CUDA machine: the runs below at their real sizes
    python -m scripts.gpu_check --dry-run       # the same sequence at tiny sizes on the CPU (part of CI)
    python -m scripts.gpu_check --only "pytest -m gpu" "in2 bf16" --timeout 120   # some checks, each bounded

In order, each in its own process (a crash in one is a row, not the end of the check):

1. `pytest -m gpu`: the tests of device-specific paths (collectives on the device, bf16 master
   weights, Jacobian and diff attention on CUDA against the CPU);
2. `in2 bf16`: 20 steps of `+exp=in2 model=qwen2_0.5b_init trainer=gpu` (bf16 autocast, fp32 masters);
3. `zero3 lora`: the same through the `deepspeed` launcher on 1 GPU with ZeRO-3 and LoRA;
4. `micro100`: `+exp=micro100` at the paper's scale (Qwen2-0.5B architecture at random init,
   L = 2048, 10 vanilla + 10 chunked sequences, the Jacobian before each of 100 updates);
5. `jacobian k=8`: `scripts.bench_jacobian` on the device: a hutchinson profile with its 8 probes in
   one batched backward, and looped one VJP at a time, each against a batch-1 training step (the
   goal on a GPU: batched <= 1.0x).

It prints (and with --out writes as `gpu_check.md`) one table: exit status, wall time, median step
time, tokens/s, peak memory, the step-0 Spearman (a monotonicity score) and W1 (at the W1-optimal a,
and at the log-fit a) of the vanilla profile against the prior, its last-token mass against the
prior's, and the Jacobian's cost in training steps.
Runs go to `--out` (default: a temporary folder). Record the table in BENCHMARKS.md with the date.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from analysis.command_line import CommandParser
from models.training.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["logger.mode=disabled", "eval.every=0", "eval.num_examples=20", "trainer.save_every=0"]
# Dry run: the tests' tiny model and data (tests/conftest.py TINY), so the sequence takes ~2 min on 2 cores.
TINY_MODEL = ["model=qwen2_tiny", "model.init.hidden_size=32", "model.init.num_hidden_layers=2",
              "model.init.intermediate_size=64", "data.vocab_size=400"]
TINY_IN2 = [*TINY_MODEL, "data.context_len=128", "data.in2.segment_len=64", "data.in2.context_len_min=72",
            "data.num_train=320", "data.num_eval=8", "data.num_train_docs=200", "data.num_eval_docs=80",
            "data.in2.heldout_doc_len=256", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"]
TINY_MICRO = [*TINY_MODEL, "data.context_len=128", "data.windows.doc_len=256", "data.num_train_docs=400",
              "data.num_eval_docs=200", "jacobian.seq_len=64", "jacobian.n_vanilla=1", "jacobian.n_chunked=1",
              "jacobian.chunk_len=32", "jacobian.num_probes=2", "trainer.max_steps=3"]


@dataclass
class Check:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # where train.py writes metrics.jsonl (None: not a training run)
    bench_json: Path | None = None  # where a benchmark writes its rows


def checks(out: Path, dry_run: bool) -> list[Check]:
    """The sequence of the module docstring, at real sizes or (dry run) tiny ones on the CPU."""
    device = ["trainer=cpu"] if dry_run else ["trainer=gpu"]
    in2 = ["+exp=in2", "trainer.max_steps=20", *QUIET, *(TINY_IN2 if dry_run else ["model=qwen2_0.5b_init"])]
    zero3 = ["+exp=in2", "trainer=zero3", "peft=lora", "trainer.max_steps=20", *QUIET,
             *(TINY_IN2 + ["trainer.device=cpu", "trainer.precision=fp32"] if dry_run else ["model=qwen2_0.5b_init"])]
    micro = ["+exp=micro100", *device, "logger.mode=disabled", *(TINY_MICRO if dry_run else [])]
    ds_env = {"DS_ACCELERATOR": "cpu"} if dry_run else {}

    def train(name: str, args: list[str], launcher: list[str], env: dict[str, str] | None = None) -> Check:
        run_dir = out / name.replace(" ", "_")
        return Check(name, [*launcher, "train.py", *args, f"hydra.run.dir={run_dir}"], env or {}, run_dir)

    return [
        Check("pytest -m gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]),
        train("in2 bf16", [*in2, *device], [sys.executable]),
        train("zero3 lora", zero3, ["deepspeed", "--num_gpus", "1", "--master_port", "29533"], ds_env),
        train("micro100", micro, [sys.executable]),
        Check("jacobian k=8", [sys.executable, "-m", "scripts.bench_jacobian", "--device", "cpu" if dry_run else "cuda",
                               *(["--tiny"] if dry_run else []), "--json", str(out / "jacobian.json")],
              bench_json=out / "jacobian.json"),
    ]


def summarize(check: Check, returncode: int | str, wall_s: float) -> dict[str, str]:
    """One table row from a finished check (and its metrics.jsonl, for training runs)."""
    row = {"check": check.name, "exit": str(returncode), "wall s": f"{wall_s:.0f}"}
    if check.bench_json is not None and check.bench_json.is_file():
        ratios = {r["name"]: r["ratio"] for r in json.loads(check.bench_json.read_text())}
        row.update({"hutchinson k8 / train step": f"{ratios['hutchinson_k8']:.2f}",
                    "looped / train step": f"{ratios['hutchinson_k8_looped']:.2f}"})
    metrics = RunDir(check.run_dir).metrics if check.run_dir else None
    if metrics is None or not metrics.is_file():
        return row
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    walls = [r["train/wall_s"] for r in rows if "train/wall_s" in r]
    steps = [b - a for a, b in zip(walls, walls[1:])]
    tokens = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]
    peaks = [r["train/peak_mem_mib"] for r in rows if "train/peak_mem_mib" in r]
    start = next((r for r in rows if r["step"] == 0 and "prior/vanilla/spearman" in r), {})
    row.update({
        "step s (median)": f"{statistics.median(steps):.3f}" if steps else "",
        "tokens/s (median)": f"{statistics.median(tokens):.0f}" if tokens else "",
        "peak MiB": f"{max(peaks):.0f}" if peaks else "",
        "step-0 Spearman": f"{start['prior/vanilla/spearman']:.3f}" if start else "",
        "step-0 W1": f"{start['prior/vanilla/w1']:.4f}" if start else "",
        "step-0 W1 (log fit)": f"{start['prior/vanilla/w1_logfit']:.4f}" if start else "",
        "step-0 last-token mass (measured / prior)":
            f"{start['valley/vanilla/anchor_mass']:.3f} / {start['prior/vanilla/anchor_mass']:.3f}" if start else "",
    })
    return row


def table(rows: list[dict[str, str]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(row.get(c, "") for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same sequence at tiny sizes on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs and gpu_check.md")
    parser.add_argument("--only", nargs="+", default=None, metavar="CHECK", help="run these checks (by name) only")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a check may run before it is stopped (its row says so: exit 'timeout')")
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch  # only to say early, before minutes of runs, that there is no device

        if not torch.cuda.is_available():
            parser.error("no CUDA device is visible; --dry-run runs the sequence on the CPU")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    every = checks(out, args.dry_run)
    unknown = sorted(set(args.only or ()) - {c.name for c in every})
    if unknown:
        parser.error(f"--only: no check named {', '.join(map(repr, unknown))}; the checks: "
                     f"{', '.join(repr(c.name) for c in every)}")
    rows = []
    for check in (c for c in every if args.only is None or c.name in args.only):
        print(f"== {check.name}: {' '.join(check.command)}", flush=True)
        begin = time.perf_counter()
        log = out / f"{check.name.replace(' ', '_')}.log"
        with open(log, "w") as f:
            try:
                returncode = subprocess.run(check.command, cwd=ROOT, env={**os.environ, **check.env}, stdout=f,
                                            stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                returncode = "timeout"
        rows.append(summarize(check, returncode, time.perf_counter() - begin))
        if returncode != 0:
            print(f"   failed (exit {returncode}); its output: {log}", flush=True)
    result = table(rows)
    print(result)
    (out / "gpu_check.md").write_text(result + "\n")
    return max((int(row["exit"] != "0") for row in rows), default=0)


if __name__ == "__main__":
    sys.exit(main())
