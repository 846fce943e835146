"""Memory and speed of SmolLM2 + LoRA forward and backward passes over batches of varied widths, in fp32 or under
bf16 autocast, with or without rounding the widths up (`trainer.pad_to_multiple_of`); docs/READS_MIDDLE.md, "bf16
twin".

    python -m scripts.investigations.probe_bf16_widths --precision bf16 --passes 25    # memory grows with new widths
    python -m scripts.investigations.probe_bf16_widths --precision bf16 --passes 30 --multiple 64    # it levels off
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python -m scripts.investigations.probe_bf16_widths --precision bf16 --passes 12
                                                                                       # the cause

Each pass is 2 sequences of random tokens, their length drawn (seeded) from 900-1900 like +exp=reads_middle's
prompts, rounded up to `--multiple`. It prints each pass's width, seconds and the process's resident memory after it.
"""
from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from models.wheel_models import ensure_model


def resident_gib() -> float:
    """This process's resident memory (Linux: /proc/self/statm's second field, in 4 KiB pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--passes", type=int, default=25)
    parser.add_argument("--multiple", type=int, default=1, help="round every width up to a multiple of this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(ensure_model("smollm2-135m-instruct"), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]))
    model.train()
    rng = random.Random(args.seed)
    for n in range(args.passes):
        width = -(-rng.randint(900, 1900) // args.multiple) * args.multiple
        ids = torch.randint(0, model.config.vocab_size, (2, width))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        print(f"{args.precision} pass {n:3d} width {width} {time.perf_counter() - start:6.2f} s "
              f"resident {resident_gib():.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
