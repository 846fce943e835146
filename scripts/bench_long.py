"""Benchmark: long-context training, each knob against its baseline in the same run.

- logits: extra peak memory of one training step (forward + backward) on one 8K-token sample with a
  32K vocabulary, qwen2_tiny's shape: `models.training.loss.causal_lm_loss` against transformers' own loss
  (every position's logits). An IN2 sample (labels on its answer only), and a language-model
  window (every token labelled: the chunked cross-entropy). Each measurement in a fresh process.
- packing: real tokens per second of training steps on an IN2 mix whose budgets are uniform over
  [L/8, L] (L=2048), packed rows against padded micro-batches of the same token budget (B x L).

    python -m scripts.bench long
    python -m scripts.bench_long          # the same rows, printed
"""
from __future__ import annotations

import math
import time

import torch
import transformers

from data_builders.build import build_datasets
from data_builders.collate import BatchStream
from data_builders.config import DataConfig, In2Config
from models.attention.packed import SDPA_PACKED
from models.training.engines import Precision, TorchEngine
from models.training.loss import IGNORE, causal_lm_loss
from scripts.bench import extra_peak_rss_mib, in_fresh_process

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
            tie_word_embeddings=True)
ANSWER_TOKENS = 24  # an IN2 answer and its eos


def _tiny_model(vocab: int, max_len: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=vocab, max_position_embeddings=max_len, **TINY)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _logits_peak(ours: bool, answer_only: bool, length: int, vocab: int) -> float | None:
    """Extra peak RSS (MiB) of one forward + backward, in this (fresh) process."""
    model = _tiny_model(vocab, length)
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    if answer_only:
        labels[:, :-ANSWER_TOKENS] = IGNORE
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def step() -> None:
        loss = causal_lm_loss(model, batch) if ours else model(**batch).loss
        loss.backward()

    return extra_peak_rss_mib(step)


def bench_logits(length: int = 8192, vocab: int = 32768) -> list[dict]:
    rows = []
    for answer_only, what in ((True, "IN2 sample (answer labelled)"), (False, "LM window (all labelled)")):
        peaks = {}
        for ours in (False, True):
            peaks[ours] = in_fresh_process(_logits_peak, ours, answer_only, length, vocab)
        full_logits_mib = length * vocab * 4 / 2**20
        rows.append({
            "name": f"peak train-step memory, {what}, L={length}, V={vocab}, qwen2_tiny shape",
            "ratio": None if None in peaks.values() else round(peaks[True] / peaks[False], 4),
            "ours_mib": peaks[True], "baseline_mib": peaks[False],
            "baseline_is": "transformers' loss (full logits)", "fp32_logits_mib": round(full_logits_mib),
        })
    return rows


def _tokens_per_s(packing: bool, context_len: int, micro_batch: int, steps: int, skip: int) -> float:
    """Real (not padding) tokens/s of `steps - skip` timed training steps through the loop's engine."""
    data = DataConfig(context_len=context_len, num_train=micro_batch * steps * 4, num_eval=8, num_train_docs=400,
                      num_eval_docs=40, vocab_size=1024, in2=In2Config(context_len_min=context_len // 8))
    bundle = build_datasets(data)
    model = _tiny_model(len(bundle.tokenizer), context_len)
    if packing:
        model.set_attn_implementation(SDPA_PACKED)  # as train.py does
    engine = TorchEngine(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                         lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.device("cpu"),
                         Precision.fp32, grad_accum=1, grad_clip=1.0)
    stream = iter(BatchStream(bundle.train, micro_batch, bundle.tokenizer.pad_token_id, seed=0,
                              pack_len=context_len if packing else None))
    tokens = 0
    for step in range(steps):
        batch = next(stream)
        if step == skip:
            start = time.perf_counter()
        engine.forward_backward(batch)
        engine.optimizer_step()
        if step >= skip:
            tokens += int(batch["num_tokens"])
    return tokens / (time.perf_counter() - start)


def bench_packing(context_len: int = 2048, micro_batch: int = 4, steps: int = 14, skip: int = 2) -> list[dict]:
    padded = _tokens_per_s(False, context_len, micro_batch, steps, skip)
    packed = _tokens_per_s(True, context_len, micro_batch, steps, skip)
    return [{
        "name": f"real tokens/s, IN2 budgets uniform in [L/8, L], L={context_len}, {micro_batch} rows x L per micro-batch",
        "ratio": round(packed / padded, 3), "ours_tok_s": round(packed), "baseline_tok_s": round(padded),
        "baseline_is": f"padded micro-batches of {micro_batch} samples", "goal": ">= 1.5",
    }]


def bench_long() -> list[dict]:
    return bench_logits() + bench_packing()


if __name__ == "__main__":
    for row in bench_long():
        print({k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in row.items()})
