"""Cost of the per-step Jacobian profile relative to one training step, on CPU.

    python scripts/bench_jacobian.py      # needs the project importable (pip install -e .)

Model: random-init Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 256, vocab 1024), one
sequence of L=512 tokens. Rows:

- ``train_step``: forward + backward + AdamW step with the LM loss over all positions;
- ``hutchinson_k8``: one ``jacobian_profile`` with 8 probes (the default logging cost);
- ``exact``: the exact profile (d = 128 VJPs in batches of 64), for reference.

Time: best of ``repeats`` runs after one warm-up, the three interleaved so that load from other
processes hits them alike. Memory: CPU tensors bypass tracemalloc, so each operation runs once in a
fresh spawned process and we read the kernel's peak resident set size (VmHWM, reset through
/proc/self/clear_refs just before the operation) minus the resident size before it: the extra RAM
the operation needs on top of the loaded model, allocator overhead included (Linux only; None elsewhere).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from analysis.command_line import CommandParser
from analysis.measure.jacobian import jacobian_profile
from scripts.bench import extra_peak_rss_mib, in_fresh_process


@dataclass(frozen=True)
class BenchSetup:
    hidden: int = 128
    layers: int = 4
    seq_len: int = 512
    vocab: int = 1024
    num_probes: int = 8
    exact_chunk: int = 64
    device: str = "cpu"


TINY = BenchSetup(hidden=32, layers=2, seq_len=64, vocab=128)  # the CPU dry run of scripts/gpu_check.py


def _build(setup: BenchSetup) -> tuple[transformers.PreTrainedModel, torch.Tensor]:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        hidden_size=setup.hidden, num_hidden_layers=setup.layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * setup.hidden, vocab_size=setup.vocab,
        max_position_embeddings=setup.seq_len,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(setup.device)
    ids = torch.randint(0, setup.vocab, (1, setup.seq_len)).to(setup.device)  # (1, L)
    return model, ids


def _operations(model: torch.nn.Module, ids: torch.Tensor, setup: BenchSetup) -> dict[str, Callable]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {
        "train_step": train_step,
        f"hutchinson_k{setup.num_probes}": lambda: jacobian_profile(model, ids, num_probes=setup.num_probes),
        # the same probes one VJP at a time: what batching them into one backward saves
        f"hutchinson_k{setup.num_probes}_looped": lambda: jacobian_profile(model, ids, num_probes=setup.num_probes,
                                                                           chunk=1),
        "exact": lambda: jacobian_profile(model, ids, "exact", chunk=setup.exact_chunk),
    }


def _peak_mb(name: str, setup: BenchSetup) -> float | None:
    """Extra peak RSS of one run of ``name`` in this (fresh) process, in MiB; None without /proc."""
    model, ids = _build(setup)
    return extra_peak_rss_mib(_operations(model, ids, setup)[name])


def bench_jacobian(setup: BenchSetup = BenchSetup(), repeats: int = 7, exact_repeats: int = 2) -> list[dict]:
    """Time and extra peak RSS of a hutchinson and an exact profile against one training step.

    Rows: ``name``, ``ratio`` (best time over the training step's best), ``seconds``,
    ``extra_peak_rss_mib`` (None without /proc) and the setup. The exact profile (~d/k times the
    hutchinson cost) runs only in the first ``exact_repeats`` timed rounds.
    """
    model, ids = _build(setup)
    ops = _operations(model, ids, setup)
    best = {name: float("inf") for name in ops}
    cuda = setup.device.startswith("cuda")
    for rep in range(repeats + 1):  # round 0 is the warm-up
        for name, op in ops.items():
            if name == "exact" and rep > exact_repeats:
                continue
            t0 = time.perf_counter()
            op()
            if cuda:
                torch.cuda.synchronize()  # kernels run asynchronously: time them to their end
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
    peaks = {name: None for name in ops}  # host RSS says nothing about device memory
    for name in ops if not cuda else ():  # a fresh process each: no allocator cache from an earlier one hides a peak
        peaks[name] = in_fresh_process(_peak_mb, name, setup)
    n_params = sum(p.numel() for p in model.parameters())
    rows = [
        dict(
            name=name, ratio=best[name] / best["train_step"], seconds=best[name],
            extra_peak_rss_mib=peaks[name], params=n_params, threads=torch.get_num_threads(), **asdict(setup),
        )
        for name in ops
    ]
    # batched and looped probes are the same estimator: same probes, same profile up to rounding
    batched, looped = (ops[f"hutchinson_k{setup.num_probes}{kind}"]().profile for kind in ("", "_looped"))
    for row in rows:
        if row["name"].endswith("_looped"):
            row["max_rel_diff_to_batched"] = float(abs(looped / batched - 1).max())
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(description="Hutchinson and exact Jacobian profiles against a train step.")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the dry run of scripts/gpu_check.py)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    setup = replace(TINY if args.tiny else BenchSetup(), device=args.device)
    rows = bench_jacobian(setup, repeats=2 if args.tiny else 7, exact_repeats=1 if args.tiny else 2)
    print(f"{'operation':<20}{'seconds':>10}{'x train':>10}{'peak MiB':>10}")
    for r in rows:
        peak = "n/a" if r["extra_peak_rss_mib"] is None else f"{r['extra_peak_rss_mib']:.1f}"
        print(f"{r['name']:<20}{r['seconds']:>10.4f}{r['ratio']:>10.2f}{peak:>10}")
    print(json.dumps(rows))
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
