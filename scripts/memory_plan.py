"""The numbers of docs/MEMORY_PLAN.md: measured on this CPU (tiny model), and computed (7B/8B on 8 GPUs).

    python -m scripts.memory_plan measure                  # CPU: extra peak RSS of one train step vs L
    python -m scripts.memory_plan measure --lengths 1024 2048 4096 8192 16384
    python -m scripts.memory_plan plan                     # the computed per-GPU tables (no torch needed)

`measure` runs every (knob, L) in a fresh spawned process, one at a time (scripts.bench_long's
`_logits_peak`, scripts.bench's `extra_peak_rss_mib`: the peak RSS one forward + backward adds).
`plan` evaluates the formulas of the document; nothing in it is measured.
"""
from __future__ import annotations

import argparse
import time

from analysis.command_line import CommandParser

GiB, MiB = 2**30, 2**20

# ---------------------------------------------------------------------------------------------- measured


def _packed_peak(packed_attention: bool, length: int, vocab: int, checkpointing: bool = False,
                 samples: int = 4) -> float | None:
    """Extra peak RSS (MiB) of one forward + backward of one packed row of `length` tokens holding
    `samples` equal samples (answer = last ANSWER_TOKENS of each), through `causal_lm_loss`:
    `sdpa_packed` (each sample on its own) or transformers' sdpa with its block-diagonal mask; with
    `checkpointing` under gradient checkpointing as model.gradient_checkpointing=true sets it."""
    import torch

    from data_builders.collate import collate_packed
    from models.attention.packed import SDPA_PACKED
    from models.training.loss import IGNORE, causal_lm_loss
    from scripts.bench import extra_peak_rss_mib
    from scripts.bench_long import ANSWER_TOKENS, _tiny_model

    model = _tiny_model(vocab, length)
    if packed_attention:
        model.set_attn_implementation(SDPA_PACKED)  # as train.py does with data.packing and sdpa
    if checkpointing:  # as models.build does
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(samples):
        ids = torch.randint(0, vocab, (length // samples,), generator=g)
        labels = ids.clone()
        labels[:-ANSWER_TOKENS] = IGNORE
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    batch = collate_packed([rows], length, pad_id=0)
    batch.pop("num_tokens")

    def step() -> None:
        causal_lm_loss(model, batch).backward()

    return extra_peak_rss_mib(step)


def _fresh(fn, *args) -> tuple[float | None, float]:
    """(fn(*args), wall seconds) in a fresh spawned process."""
    from scripts.bench import in_fresh_process  # torch only for measurements: `plan` needs none

    start = time.perf_counter()
    value = in_fresh_process(fn, *args)
    return value, time.perf_counter() - start


def measure(lengths: list[int], vocab: int, what: list[str]) -> None:
    from scripts.bench_long import ANSWER_TOKENS, _logits_peak

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f}"

    if "logits" in what:
        print(f"Extra peak RSS (MiB) of one forward + backward, qwen2_tiny shape, V={vocab}, one sample of L tokens")
        print("| L | fp32 S×V logits | (a) transformers' loss (full logits) | (b) answer-only "
              f"({ANSWER_TOKENS} labels) | (c) LM window, chunked CE | b/a | c/a |")
        print("|---|---|---|---|---|---|---|")
        for n in lengths:
            full, _ = _fresh(_logits_peak, False, True, n, vocab)
            answer, _ = _fresh(_logits_peak, True, True, n, vocab)
            window, _ = _fresh(_logits_peak, True, False, n, vocab)
            ratio = (lambda x: "n/a" if None in (x, full) else f"{x / full:.3f}")
            print(f"| {n // 1024}K | {n * vocab * 4 / MiB:.0f} | {fmt(full)} | {fmt(answer)} | {fmt(window)} "
                  f"| {ratio(answer)} | {ratio(window)} |", flush=True)
    if "packing" in what:
        print(f"\nExtra peak RSS (MiB) of one forward + backward, one packed row of L tokens = 4 samples of L/4 "
              f"(answer-only loss), qwen2_tiny shape, V={vocab}")
        print("| L | bool mask L² | sdpa + block mask | sdpa_packed | difference | ratio "
              "| checkpointed: sdpa + mask | sdpa_packed | difference |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in lengths:
            cells = []
            for ckpt in (False, True):
                masked, _ = _fresh(_packed_peak, False, n, vocab, ckpt)
                packed, _ = _fresh(_packed_peak, True, n, vocab, ckpt)
                cells += [fmt(masked), fmt(packed), "n/a" if None in (masked, packed) else f"{masked - packed:.0f}"]
                if not ckpt:
                    cells.append("n/a" if None in (masked, packed) else f"{packed / masked:.3f}")
            print(f"| {n // 1024}K | {n * n / MiB:.0f} | " + " | ".join(cells) + " |", flush=True)


# ---------------------------------------------------------------------------------------------- computed

MODELS = {  # ℓ, h, d_kv (KV heads x head dim), I, V, P, sliding window
    "Mistral-7B": dict(L=32, h=4096, dkv=1024, I=14336, V=32000, P=7_241_732_096, swa=4096),
    "Llama-3-8B": dict(L=32, h=4096, dkv=1024, I=14336, V=128256, P=8_030_261_248, swa=None),
}
N, CTX, FRAG, PREFETCH, REDUCE, LOSS_CHUNK, ANSWER = 8, 1.5 * GiB, 0.15, 5e7, 5e7, 1024, 24
USABLE = 79.0  # GiB of an 80 GB GPU left to the process (79.6 GiB total)


def lora(m: dict, r: int = 8) -> int:
    return m["L"] * r * (6 * m["h"] + 2 * m["dkv"])  # q, k, v, o adapters


def a_fwd(m: dict, kv_expanded: bool, full_ft: bool = False) -> int:
    """Bytes per token one layer saves for its backward (bf16); a full fine-tune also saves the MLP's and
    the down-projection's inputs, for their weights' gradients."""
    h, dkv, mlp = m["h"], m["dkv"], m["I"]
    return 2 * (7 * h + 2 * (h if kv_expanded else dkv) + 3 * mlp) + (2 * (h + mlp) if full_ft else 0)


def a_bwd(m: dict) -> int:
    return 2 * (3 * m["I"] + 4 * m["h"])


def jac(m: dict, S: int = 256, B: int = 2, k: int = 4, chunk: int = 64) -> float:
    """jacobian.seq_len S, B = n_vanilla + n_chunked (both sets share one batched profile), num_probes k;
    the defaults are +exp=in2's (the hutchinson defaults are B = 4, k = 8)."""
    n, h, L = min(k, chunk), m["h"], m["L"]
    mask = bool(m["swa"]) and S >= m["swa"]
    cache = 4 * m["dkv"]  # the prefix's K, V concatenated with the last token's (bf16)
    return B * S * (L * (a_fwd(m, mask) + cache) + n * (a_bwd(m) + 10 * h)) + mask * B * S * S * (1 + 2 * L)


def plan(m: dict, S: int, *, loss: str = "answer", attn: str = "sdpa", packed: bool = False, peft: str = "lora",
         offload: bool = False, sp: int = 1, r: int = 8, J: float | None = None) -> dict[str, float]:
    """Per-GPU GiB of one configuration. loss: full (transformers' loss) | answer (IN2 labels) | chunked
    (every token labelled); attn: sdpa | flash_attention_2; packed: data.packing with pack_len = S;
    peft: lora | none (full fine-tune); offload: trainer=zero3_offload; sp: sequence-parallel degree
    (computed only, not in the code)."""
    h, L, V, P, swa = m["h"], m["L"], m["V"], m["P"], m["swa"]
    # A mask tensor exists with sdpa when a sliding window is shorter than S, or for a packed row on a
    # sliding-window model (sdpa_packed falls back to transformers' mask there); never with flash-attn 2.
    mask = attn == "sdpa" and bool(swa) and (S >= swa or packed)
    Ss = S / sp  # tokens per rank (Ulysses: all S during attention, but for 1/sp of the heads)
    full_ft = peft == "none"
    P_layer = 2 * h * h + 2 * h * m["dkv"] + 3 * h * m["I"] + 2 * h
    trained = P if full_ft else lora(m, r)
    t = dict(
        weights=0.0 if offload else 2 * P / N,
        # LoRA: bf16 copy whole + sharded fp32 master, grad, Adam m, v; full: fp32 master, m, v, bf16 grad
        trained=(0.0 if offload else 14 * P / N) if full_ft else trained * (2 + 16 / N),
        gather=2 * (max(P_layer, V * h) + PREFETCH + min(REDUCE, trained)),
        ckpt=L * Ss * h * 2,
        mask=3 * S * S / sp if mask else 0.0,
        layer=Ss * (a_fwd(m, mask, full_ft) + a_bwd(m)),
        logits={"full": Ss * 12 * V, "answer": ANSWER * 12 * V, "chunked": LOSS_CHUNK * 12 * V}[loss] + Ss * 4 * h,
    )
    t["step"] = t["ckpt"] + t["mask"] + max(t["layer"], t["logits"])
    t["jac"] = jac(m) if J is None else J
    t["total"] = CTX + (1 + FRAG) * (t["weights"] + t["trained"] + t["gather"] + max(t["step"], t["jac"]))
    return {k: v / GiB for k, v in t.items()}


def _k(S: int) -> str:
    return f"{S // 1024}K"


def _fits(total: float) -> str:
    return f"{total:.1f}" + ("" if total <= USABLE else " ✗")


def print_plan() -> None:
    mistral, llama = MODELS["Mistral-7B"], MODELS["Llama-3-8B"]
    cols = ["weights", "trained", "gather", "ckpt", "mask", "layer", "logits", "step", "jac", "total"]
    for name, m in MODELS.items():
        print(f"{name}, ZeRO-3 + LoRA r=8, sdpa, IN2 (answer-only logits), micro-batch 1, +exp=in2 Jacobian; GiB/GPU\n")
        print("| S | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for S in (4096, 8192, 16384, 32768, 131072):
            t = plan(m, S)
            print(f"| {_k(S)} | " + " | ".join(f"{t[c]:.2f}" for c in cols[:-1]) + f" | **{_fits(t['total'])}** |")
        print()

    fa = dict(attn="flash_attention_2")
    knobs = [
        ("LoRA, transformers' loss (full logits), sdpa", dict(loss="full")),
        ("LoRA, answer-only logits (default), sdpa", dict()),
        ("LoRA, answer-only, flash_attention_2", fa),
        ("LoRA, answer-only, packed rows, sdpa (→ sdpa_packed)", dict(packed=True)),
        ("LoRA, answer-only, packed rows, flash_attention_2", dict(packed=True, **fa)),
        ("LoRA, LM window (chunked CE), flash_attention_2", dict(loss="chunked", **fa)),
        ("LoRA, LM window, transformers' loss, flash_attention_2", dict(loss="full", **fa)),
        ("full fine-tune, answer-only, flash_attention_2", dict(peft="none", **fa)),
        ("full fine-tune, zero3_offload, answer-only, flash_attention_2", dict(peft="none", offload=True, **fa)),
        ("SP 2 (computed only), LoRA, answer-only, flash_attention_2", dict(sp=2, **fa)),
        ("SP 4 (computed only), LoRA, answer-only, flash_attention_2", dict(sp=4, **fa)),
        ("SP 2 (computed only), full fine-tune, flash_attention_2", dict(sp=2, peft="none", **fa)),
        ("SP 4 (computed only), full fine-tune, flash_attention_2", dict(sp=4, peft="none", **fa)),
    ]
    print(f"Total GiB per GPU, ZeRO-3 on 8 GPUs, micro-batch 1, r=8, f=15 %; ✗: above {USABLE:.0f} GiB\n")
    print("| knobs | Mistral-7B 32K | Mistral-7B 128K | Llama-3-8B 32K | Llama-3-8B 128K |")
    print("|---|---|---|---|---|")
    for name, kw in knobs:
        cells = [_fits(plan(m, S, **kw)["total"]) for m in (mistral, llama) for S in (32768, 131072)]
        print(f"| {name} | " + " | ".join(cells) + " |")

    print("\nJacobian: M_jac (GiB) and the total at S = 32K (LoRA, answer-only, flash_attention_2)\n")
    print("| jacobian.seq_len | B_j | num_probes | M_jac Mistral | total Mistral | M_jac Llama | total Llama |")
    print("|---|---|---|---|---|---|---|")
    for S, B, k, note in ((256, 2, 4, " (+exp=in2)"), (256, 4, 8, " (defaults)"), (1024, 4, 8, ""),
                          (2048, 4, 8, ""), (2048, 4, 64, ""), (2048, 20, 8, " (micro100's)"),
                          (4096, 2, 8, ""), (4096, 1, 8, ""), (8192, 2, 8, "")):
        cells = []
        for m in (mistral, llama):
            J = jac(m, S, B, k)
            cells += [f"{J / GiB:.1f}", _fits(plan(m, 32768, J=J, **fa)["total"])]
        print(f"| {S}{note} | {B} | {k} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="CPU measurements (a fresh process per number)")
    m.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    m.add_argument("--vocab", type=int, default=32768)
    m.add_argument("--what", nargs="+", choices=["logits", "packing"], default=["logits", "packing"])
    sub.add_parser("plan", help="the computed tables")
    args = parser.parse_args(argv)
    if args.cmd == "measure":
        measure(args.lengths, args.vocab, args.what)
    else:
        print_plan()


if __name__ == "__main__":
    main()
