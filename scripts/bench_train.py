"""Benchmark: tokens/s of train.py's loop against a minimal hand-written loop, same model and data.

Both loops run in this process, one after the other, on the same tiny model (same seed), the same
samples in the same order, the same batch size and optimizer; Jacobian and evaluation are off. The
minimal loop gets its batches pre-collated, so any overhead of ours (data stream, logging, progress
bar, bookkeeping) shows up in the ratio.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import torch

import train
from data_builders.build import build_datasets
from data_builders.collate import BatchStream
from models.build import build_model
from models.training.run_dir import RunDir
from models.training.trainer import warmup_cosine


def _config(steps: int, overrides: list[str]) -> train.TrainConfig:
    return train.as_train_config(train.compose_config([
        "+exp=in2", "jacobian=off", "eval.every=0", "eval.num_examples=4", "logger.mode=disabled",
        f"trainer.max_steps={steps}", f"data.num_train={steps * 8 * 2}", *overrides,
    ]))


def _ours(cfg, skip: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        train.run(cfg, Path(tmp))
        rows = [json.loads(line) for line in RunDir(tmp).metrics.read_text().splitlines()]
    rows = [r for r in rows if "train/wall_s" in r]
    timed = rows[skip:]
    seconds = timed[-1]["train/wall_s"] - rows[skip - 1]["train/wall_s"]
    return sum(r["train/tokens"] for r in timed) / seconds


def _minimal(cfg, skip: int) -> float:
    torch.manual_seed(cfg.seed)
    bundle = build_datasets(cfg.data)
    tok = bundle.tokenizer
    model = build_model(cfg.model, len(tok), tok.pad_token_id)
    model.train()
    t = cfg.trainer
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
    # The same samples in the same order as the loop: a curriculum's split is read in stored order.
    stream = iter(BatchStream(bundle.train, t.micro_batch_size, tok.pad_token_id, cfg.seed,
                              ordered_first_epoch=cfg.data.in2.curriculum > 0))
    batches = [next(stream) for _ in range(t.max_steps)]  # pre-collated: the loop does nothing else
    tokens, start = 0, None
    for step, batch in enumerate(batches):
        if step == skip:
            start = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= skip:
            tokens += int(batch["num_tokens"])
    return tokens / (time.perf_counter() - start)


def bench_train(steps: int = 40, skip: int = 5, repeats: int = 2, overrides: list[str] | None = None) -> list[dict]:
    """One row: our loop's tokens/s over the minimal loop's (best of `repeats`, alternating)."""
    cfg = _config(steps, overrides or [])
    ours, minimal = -math.inf, -math.inf
    for _ in range(repeats):
        minimal = max(minimal, _minimal(cfg, skip))
        ours = max(ours, _ours(cfg, skip))
    return [{
        "name": f"train loop tokens/s ({cfg.model.name}, batch {cfg.trainer.micro_batch_size}, "
                f"context {cfg.data.context_len}, {steps - skip} timed steps)",
        "ours": round(ours, 1), "baseline": round(minimal, 1), "baseline_is": "minimal hand-written loop",
        "ratio": round(ours / minimal, 3), "goal": ">= 0.95",
    }]


if __name__ == "__main__":
    for row in bench_train():
        print(row)
