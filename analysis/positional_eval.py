"""Position-wise accuracy: greedy answers to probes whose gold sits at known positions.

The training loop calls `evaluate_in2` on held-out IN2 records (accuracy by gold depth) and, when
`eval.probes` is set, `evaluate_probes` on key-value / multi-document QA / needle probes. Results go
to the metrics log via `ProbeResult.to_metrics` and to `run_dir/eval/<name>_step<N>.json`.
"""
from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.scoring import best_subspan_em, bootstrap_ci, exact_match, paired_bootstrap_ci, substring_match
from data_builders.files import atomic_write_text
from data_builders.probes import (
    KV_FILE,
    NQ_FILE,
    ProbeItem,
    in2_probe,
    kv_probe,
    mdqa_probe,
    needle_probe,
    nq_filler,
    synthetic_filler,
)

log = logging.getLogger(__name__)

Scorer = Callable[[str, Sequence[str]], float]
GenerateFn = Callable[[Sequence[ProbeItem]], list[str]]

SCORERS: dict[str, Scorer] = {
    "kv": substring_match,
    "mdqa": best_subspan_em,
    "needle": substring_match,
    "in2": exact_match,
}


class Probe(StrEnum):
    kv = "kv"  # key-value retrieval (Liu et al. 2023): the gold pair's index
    mdqa = "mdqa"  # multi-document QA over NQ (needs data_dir): the gold document's index
    needle = "needle"  # a code hidden at a depth of filler text, per context length


@dataclass
class EvalConfig:
    every: int = 50  # held-out loss every N steps (0 = off)
    num_examples: int = 200  # held-out IN2 questions scored for accuracy by depth (at start and end)
    bins: int = 10  # equal-width gold-depth bins of the IN2 accuracy curve
    max_new_tokens: int = 8  # greedy answer length in tokens
    batch_size: int = 16  # prompts per generate call
    probes: list[Probe] = field(default_factory=list)  # extra probes every probe_every steps
    probe_every: int = 0  # steps between probe runs (0 = off)
    probe_examples: int = 20  # queries per probe; each is asked once per gold position
    needle_lens: list[int] = field(default_factory=lambda: [256, 512, 1024])  # needle context lengths, tokens
    data_dir: str | None = None  # folder of the kv / nq files; None = synthetic kv and filler, no mdqa
    chat_template: bool = False  # wrap text prompts in the tokenizer's chat template (instruct models)


@dataclass
class ProbeResult:
    """Per-query outcomes of one probe run, with accuracy by gold position."""

    probe: str
    # One dict per item: id, query, position, label, prediction, answers, correct (0.0/1.0), extra.
    outcomes: list[dict[str, Any]]

    def _correct(self, position: int) -> np.ndarray:
        return np.array([o["correct"] for o in self.outcomes if o["position"] == position], dtype=float)

    def labels(self) -> dict[int, str]:
        """Metric-key label of each position present, in position order."""
        return dict(sorted({o["position"]: o["label"] for o in self.outcomes}.items()))

    def accuracy_by_position(self) -> dict[int, float]:
        """Mean correctness at each position present (-1 = closed-book baseline, if any)."""
        return {p: float(self._correct(p).mean()) for p in self.labels()}

    def ci_by_position(
        self, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> dict[int, tuple[float, float]]:
        """Percentile bootstrap interval of the accuracy at each position."""
        return {p: bootstrap_ci(self._correct(p), n_boot, alpha, seed) for p in self.labels()}

    def paired_difference(
        self, a: int, b: int, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> tuple[float, tuple[float, float]]:
        """acc(a) - acc(b) over the queries asked at both positions, with its paired bootstrap interval."""
        at_a = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == a}
        at_b = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == b}
        shared = sorted(at_a.keys() & at_b.keys())
        if not shared:
            raise ValueError(f"no query of probe {self.probe!r} was asked at both positions {a} and {b}")
        x, y = np.array([at_a[q] for q in shared]), np.array([at_b[q] for q in shared])
        return float((x - y).mean()), paired_bootstrap_ci(x, y, n_boot, alpha, seed)

    @property
    def mean(self) -> float:
        """Accuracy over all queries with a gold position (the closed-book baseline is left out)."""
        correct = [o["correct"] for o in self.outcomes if o["position"] >= 0]
        return float(np.mean(correct)) if correct else float("nan")

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """{'<prefix>/<probe>/acc@<label>': ..., '<prefix>/<probe>/acc_mean': ...}."""
        labels, key = self.labels(), f"{prefix}/{self.probe}/acc"
        metrics = {f"{key}@{labels[p]}": acc for p, acc in self.accuracy_by_position().items()}
        metrics[f"{key}_mean"] = self.mean
        return metrics

    def save_json(self, path: str | Path) -> Path:
        """Write the summary (accuracy, 95% interval and count per label) and every outcome."""
        labels, cis = self.labels(), self.ci_by_position()
        summary = {
            "probe": self.probe,
            "mean": self.mean,
            "accuracy": {labels[p]: acc for p, acc in self.accuracy_by_position().items()},
            "ci95": {labels[p]: list(ci) for p, ci in cis.items()},
            "n": {labels[p]: int(self._correct(p).size) for p in labels},
            "outcomes": self.outcomes,
        }
        # Atomic: compare and a resumed run read these back, and must never see half a file.
        atomic_write_text(Path(path), json.dumps(summary, indent=1))
        return Path(path)

    @classmethod
    def load_json(cls, path: str | Path) -> ProbeResult:
        """Read back a file written by `save_json`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["probe"], data["outcomes"])


def run_probe(items: Sequence[ProbeItem], generate_fn: GenerateFn, scorer: Scorer) -> ProbeResult:
    """Answer every item with `generate_fn` and score each answer against the item's answers."""
    if not items:
        raise ValueError("run_probe needs at least one item")
    predictions = generate_fn(items)
    if len(predictions) != len(items):
        raise ValueError(f"generate_fn returned {len(predictions)} answers for {len(items)} items")
    outcomes = [
        {
            "id": it.id,
            "query": it.query,
            "position": it.position,
            "label": it.label,
            "prediction": pred,
            "answers": it.answers,
            "correct": float(scorer(pred, it.answers)),
            "extra": it.extra,
        }
        for it, pred in zip(items, predictions)
    ]
    return ProbeResult(items[0].probe, outcomes)


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
) -> list[str]:
    """Greedy continuations of token-id prompts, decoded without special tokens, in prompt order.

    Batches are left-padded (so every row's last prompt token is at the same column) and run with
    the KV cache; generation stops at the model's eos ids and the tokenizer's eos. The model is put
    in eval mode and its previous mode restored.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    # Models trained here end answers with the tokenizer's eos, which a config may not list.
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    # Similar lengths share a batch, so little compute goes to padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for start in tqdm(range(0, len(order), batch_size), desc="generate", disable=not progress):
            rows = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, L)
            mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
            for r, i in enumerate(rows):
                n = len(prompts[i])
                ids[r, width - n :] = torch.tensor(list(prompts[i]), dtype=torch.long)
                mask[r, width - n :] = 1
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                # Hub generation configs may set penalties (Qwen2-Instruct: repetition_penalty=1.05)
                # that generate() would apply; pinned off so this stays plain argmax.
                repetition_penalty=1.0,
                no_repeat_ngram_size=0,
                pad_token_id=pad,
                eos_token_id=eos or None,
            )  # (B, L + new)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(rows, texts):
                outputs[i] = text
    finally:
        model.train(was_training)
    return outputs


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int], chat_template: bool = False
) -> list[int]:
    """Token ids of a probe prompt; token-id prompts pass through untouched."""
    if not isinstance(prompt, str):
        return list(prompt)
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def model_generate_fn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    batch_size: int,
    chat_template: bool = False,
    progress: bool = True,
) -> GenerateFn:
    """A `generate_fn` for `run_probe` that answers items with `greedy_generate` on `model`."""

    def generate(items: Sequence[ProbeItem]) -> list[str]:
        prompts = [encode_prompt(tokenizer, it.prompt, chat_template) for it in items]
        return greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress)

    return generate


def evaluate_in2(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, Any]],
    cfg: EvalConfig,
) -> tuple[dict[str, float], ProbeResult]:
    """Exact-match accuracy on the first `cfg.num_examples` held-out IN2 records, by gold-depth bin.

    Metric keys: `eval/in2/acc_mean` and `eval/in2/acc@<lower bin edge>` (`acc@0.0` ... `acc@0.9` for
    10 bins); a bin without records has no key.
    """
    items = in2_probe(itertools.islice(records, cfg.num_examples), bins=cfg.bins)
    generate = model_generate_fn(model, tokenizer, cfg.max_new_tokens, cfg.batch_size)
    result = run_probe(items, generate, SCORERS["in2"])
    return result.to_metrics("eval"), result


def build_probes(cfg: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[ProbeItem]]:
    """Items of every probe in `cfg.probes` (fixed seed: every step and run sees the same queries)."""
    data_dir = Path(cfg.data_dir) if cfg.data_dir is not None else None
    probes: dict[str, list[ProbeItem]] = {}
    for name in map(Probe, cfg.probes):  # plain strings too: ValueError on an unknown probe
        if name == Probe.kv:
            path = data_dir / KV_FILE if data_dir is not None else None
            probes[name] = kv_probe(path, n_examples=cfg.probe_examples)
        elif name == Probe.mdqa:
            if data_dir is None:
                log.warning("eval.probes has mdqa but eval.data_dir is unset: mdqa is skipped")
                continue
            probes[name] = mdqa_probe(data_dir / NQ_FILE, n_examples=cfg.probe_examples)
        else:
            filler = nq_filler(data_dir / NQ_FILE) if data_dir is not None else synthetic_filler()
            probes[name] = needle_probe(
                filler, context_lens=cfg.needle_lens, tokenizer=tokenizer, n_examples=cfg.probe_examples
            )
    return probes


def evaluate_probes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Mapping[str, Sequence[ProbeItem]],
    cfg: EvalConfig,
) -> tuple[dict[str, float], dict[str, ProbeResult]]:
    """Run the probes from `build_probes` on `model`; metrics of all probes and the result of each."""
    generate = model_generate_fn(model, tokenizer, cfg.max_new_tokens, cfg.batch_size, cfg.chat_template)
    results = {name: run_probe(items, generate, SCORERS[name]) for name, items in probes.items()}
    metrics = {k: v for result in results.values() for k, v in result.to_metrics("eval").items()}
    return metrics, results


def write_eval_json(run_dir: str | Path, step: int, name: str, result: ProbeResult) -> Path:
    """Save `result` as `run_dir/eval/<name>_step<step>.json`."""
    return result.save_json(Path(run_dir) / "eval" / f"{name}_step{step}.json")
