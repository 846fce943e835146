"""What a probe's numbers were made with, and whether they sit next to the published curves.

kv and mdqa are set up as Liu et al. 2023 (Lost in the Middle) did by default: their prompts, data formats,
gold positions, 100-token greedy budget and metrics (`best_subspan_em` on the answer's first line), and
retrieved (BM25) distractors. `probe_settings` is saved with every result; `describe_settings` is its one
line in tables and reports, ending with whether the numbers are comparable with the reference's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from analysis.evaluation.config import (
    EvalConfig,
    Probe,
    QAMetric,
    probe_budget,
    probe_source,
    valprobing_files,
)
from data_builders.mdqa import Distractors
from data_builders.probes import ProbeItem
from data_builders.valprobing import shape_of

REFERENCE = "Liu et al. 2023, Lost in the Middle (github.com/nelson-liu/lost-in-the-middle)"
VALPROBING_REFERENCE = "An et al. 2024, VaLProbing (github.com/microsoft/FILM)"


def probe_settings(name: str, cfg: EvalConfig, items: Sequence[ProbeItem]) -> dict[str, Any]:
    """What a probe's numbers depend on, saved with them: budget, data, positions, and whether the setup is the
    reference's (kv, mdqa: its metric, 100 new tokens, its data or distractor recipe), so comparable with
    published curves."""
    positions = sorted({it.position for it in items if it.position >= 0})
    settings: dict[str, Any] = {"max_new_tokens": probe_budget(name, cfg), "queries": len({it.query for it in items}),
                                "positions": positions, "chat_template": cfg.chat_template}
    if name == "mdqa":
        settings["answer_cut"] = "first line of the stripped generation"
    if name in ("kv", "mdqa"):
        source = probe_source(name, cfg)
        settings["source"] = str(source) if source is not None else "synthetic UUID pairs"
        settings["slots"] = sorted({it.n_positions for it in items if it.position >= 0})
        settings["reference"] = REFERENCE
        built = {it.extra.get("distractors") for it in items if it.position >= 0} - {None}
        if name == "mdqa":
            settings["distractors"] = "as in the file" if not built else sorted(built)[0]
            if cfg.mdqa.questions.held_out:  # a subset: another split asks other questions
                settings["questions"] = f"heldout (share {cfg.mdqa.split.share}, salt {cfg.mdqa.split.salt})"
                if cfg.mdqa.questions.part is not None:
                    settings["questions"] += f", {cfg.mdqa.questions} part (dev share {cfg.mdqa.dev_share})"
        probe_cfg = getattr(cfg, name)
        settings["query_aware"] = probe_cfg.query_aware
        moved = name == "mdqa" and (cfg.mdqa.order is not None or cfg.mdqa.keep is not None)
        if moved:
            settings["order"] = None if cfg.mdqa.order is None else str(cfg.mdqa.order)
            settings["keep"] = cfg.mdqa.keep
        comparable = settings["max_new_tokens"] == 100 and not moved and (name == "kv" or (
            cfg.mdqa.metric == QAMetric.best_subspan_em and settings["distractors"] != Distractors.random))
        settings["comparable_with_reference"] = comparable
    if name == "needle":
        settings["lengths"] = sorted({it.extra["context_len"] for it in items})
        settings["depths"] = sorted({it.extra["depth"] for it in items})
    task = Probe(name).valprobing_task
    if task is not None:
        v = cfg.valprobing
        shape = shape_of(v.preset, v.pieces, v.sets, v.bin_width, v.max_prompt_tokens)
        settings.update({
            "source": str(valprobing_files(replace(cfg, probes=[name]))[task][1]), "preset": v.preset,
            "pieces": shape.pieces[task], "sets": shape.sets, "bin_width": shape.bin_width, "seed": v.seed,
            "skipped": shape.pieces[task] * shape.sets - len(items), "reference": VALPROBING_REFERENCE,
            # FILM's released 32K prompts are built from other draws of the pieces: the numbers are of the same
            # probe, not of the same items
            "comparable_with_reference": False})
    return settings


def describe_settings(settings: Mapping[str, Any]) -> str:
    """One line for tables and reports: metric, budget, source, positions, and comparability."""
    if not settings:
        return "not recorded (an eval JSON written before results named their metric and settings)"
    parts = [f"metric {settings.get('metric', '?')}", f"{settings.get('max_new_tokens', '?')} new tokens"]
    if "answer_cut" in settings:
        parts.append(f"scored on the {settings['answer_cut']}")
    if settings.get("intervention", "none") != "none":
        parts.append(f"intervention {settings['intervention']}")
    if settings.get("query_aware"):
        parts.append("query-aware prompts")
    if "order" in settings:
        parts.append(f"documents {settings['order'] or 'in rank order'}"
                     + (f", top {settings['keep']} kept" if settings.get("keep") is not None else ""))
    for key in ("source", "questions", "distractors", "slots", "positions", "lengths", "depths", "preset", "pieces",
                "sets", "bin_width", "skipped"):
        if key in settings:
            parts.append(f"{key} {settings[key]}")
    if "comparable_with_reference" in settings:
        parts.append("comparable with the reference's published numbers: "
                     + ("yes" if settings["comparable_with_reference"] else "no"))
    return "; ".join(parts)
