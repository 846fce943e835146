"""Inference-time interventions on the position curve: they change no weights (`scripts.eval_checkpoint intervention=`).

- `reorder`: the mdqa documents, ranked by the probe's retriever (the file's order: BM25 score order with
  the gold inserted at its position, as Liu et al. built theirs; rank 1 = best), laid out by `order`:
  `outside_in` (the default: pos(d_2j-1) = j, pos(d_2j) = n - j + 1, the best at both ends), `descending`,
  `ascending` (Liu et al. 2024, Sec. 5; `data_builders.probes.arrangement`).
- `truncate`: the top `keep` ranked documents only (laid out by `order` when set), to measure accuracy
  against the context's width.
- `query_aware`: Liu et al.'s query-aware contextualization, the question (or key) before the documents
  (or pairs) too, with the reference's prompt text (templates `*_query_aware.txt`).
- `ms_poe`: Multi-scale Positional Encoding (Zhang et al. 2024), per-head RoPE position compression
  (`models.attention.ms_poe`).
- `attn_calibration`: found-in-the-middle attention calibration (Hsieh et al. 2024): each document's (kv: each
  pair's) attention minus that of a dummy document at its position, and the attention after the documents
  redistributed among them by that calibrated relevance, total document attention kept
  (`models.attention.attn_calibration`).

Positions of reordered or truncated mdqa items stay the gold's rank, so their curves pair with the
un-intervened ones; each outcome keeps its final position (`extra["final_position"]`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, Iterable, Iterator, Optional

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.config import EvalConfig
from analysis.evaluation.result import ProbeResult
from analysis.evaluation.scoring import paired_bootstrap_ci
from data_builders.probes import Order
from models.attention.attn_calibration import (
    AttnCalibration,
    AttnCalibrationConfig,
    attn_calibration,
    check_attn_calibration,
)
from models.attention.attn_calibration import resolve_layers as resolve_calibrated_layers
from models.attention.ms_poe import MsPoEConfig, check_ms_poe, ms_poe, resolve_layers


class Intervention(StrEnum):
    none = "none"
    reorder = "reorder"
    truncate = "truncate"
    query_aware = "query_aware"
    ms_poe = "ms_poe"
    attn_calibration = "attn_calibration"


# The probes each intervention changes (ms_poe changes the model: every probe; attn_calibration needs the
# documents or pairs of a prompt).
APPLIES_TO = {Intervention.reorder: {"mdqa"}, Intervention.truncate: {"mdqa"},
              Intervention.query_aware: {"kv", "mdqa"}, Intervention.attn_calibration: {"kv", "mdqa"}}


def check_intervention(name: Intervention | str, probes: Iterable[str], order: Optional[Order],
                       keep: Optional[int]) -> None:
    """Fail at start-up, naming the setting, on an intervention that cannot apply to the probes asked."""
    name = Intervention(name)
    probes = [str(p) for p in probes]
    if name in APPLIES_TO and (untouched := [p for p in probes if p not in APPLIES_TO[name]]):
        raise ValueError(f"intervention={name} applies to {sorted(APPLIES_TO[name])} only; "
                         f"probes={untouched} would be asked as they are: leave them out")
    if name == Intervention.truncate and (keep is None or keep < 1):
        raise ValueError(f"intervention=truncate needs keep=K >= 1, the documents kept (got keep={keep})")
    if name != Intervention.truncate and keep is not None:
        raise ValueError(f"keep={keep} is truncate's setting, but intervention={name}")
    if name not in (Intervention.reorder, Intervention.truncate) and order is not None:
        raise ValueError(f"order={order} lays out documents for intervention=reorder|truncate, not {name}")


def intervened(cfg: EvalConfig, name: Intervention | str, order: Optional[Order], keep: Optional[int]) -> EvalConfig:
    """`cfg` with a prompt-level intervention set in its probe settings (ms_poe and none: unchanged)."""
    name = Intervention(name)
    if name == Intervention.reorder:
        return replace(cfg, mdqa=replace(cfg.mdqa, order=order or Order.outside_in))
    if name == Intervention.truncate:
        return replace(cfg, mdqa=replace(cfg.mdqa, order=order, keep=keep))
    if name == Intervention.query_aware:
        return replace(cfg, kv=replace(cfg.kv, query_aware=True), mdqa=replace(cfg.mdqa, query_aware=True))
    return cfg


def check_model_intervention(name: Intervention | str, model: PreTrainedModel, ms_poe_cfg: MsPoEConfig,
                             calibration_cfg: AttnCalibrationConfig) -> None:
    """Raise ValueError naming why the intervention cannot change `model` (before anything is answered)."""
    name = Intervention(name)
    if name == Intervention.ms_poe:
        check_ms_poe(model)
        resolve_layers(ms_poe_cfg.layers, model.config.num_hidden_layers)
    elif name == Intervention.attn_calibration:
        check_attn_calibration(model, calibration_cfg)


@contextmanager
def model_intervention(name: Intervention | str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       ms_poe_cfg: MsPoEConfig, calibration_cfg: AttnCalibrationConfig,
                       batch_tokens: int | None = None) -> Iterator[Optional[AttnCalibration]]:
    """The context in which the model answers: Ms-PoE installed, attention calibration installed (yielded: pass
    it to `answer_probes`), or the model as it is (None). Each checks the model as it installs; call
    `check_model_intervention` first to fail before any other work."""
    if Intervention(name) == Intervention.ms_poe:
        with ms_poe(model, ms_poe_cfg):
            yield None
    elif Intervention(name) == Intervention.attn_calibration:
        with attn_calibration(model, tokenizer, calibration_cfg, batch_tokens) as calibration:
            yield calibration
    else:
        yield None


def intervention_settings(name: Intervention | str, model: PreTrainedModel, ms_poe_cfg: MsPoEConfig,
                          calibration_cfg: AttnCalibrationConfig, calibration: Optional[AttnCalibration] = None
                          ) -> dict[str, Any]:
    """What a result's settings record of the intervention it was made with: its name and, for the ones that
    change the model, their settings (layers resolved) and, for attn_calibration, the query rows recalibrated
    (summed over layers: 0 would mean it never acted)."""
    name = Intervention(name)
    settings: dict[str, Any] = {}
    num_layers = model.config.num_hidden_layers
    if name == Intervention.ms_poe:
        settings["ms_poe"] = {**asdict(ms_poe_cfg), "layers": resolve_layers(ms_poe_cfg.layers, num_layers)}
    elif name == Intervention.attn_calibration:
        settings["attn_calibration"] = {
            **asdict(calibration_cfg), "layers": resolve_calibrated_layers(calibration_cfg.layers, num_layers),
            "calibrated_rows": None if calibration is None else calibration.calibrated_rows}
    return settings


def tag(name: Intervention | str, order: Optional[Order], keep: Optional[int]) -> str:
    """A folder-safe name of the intervention and its setting: reorder-outside_in, truncate-5, ms_poe, ..."""
    name = Intervention(name)
    if name == Intervention.reorder:
        return f"reorder-{order or Order.outside_in}"
    if name == Intervention.truncate:
        return f"truncate-{keep}" + (f"-{order}" if order is not None else "")
    return str(name)


@dataclass(frozen=True)
class Spec:
    """One intervention with its settings, as `analysis.compare --interventions` names it: `reorder`,
    `reorder:ascending`, `truncate:5`, `truncate:5:outside_in`, `query_aware`, `ms_poe`, `attn_calibration`."""

    name: Intervention
    order: Optional[Order] = None
    keep: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> Spec:
        name, *args = text.strip().split(":")
        try:
            intervention = Intervention(name)
            if intervention == Intervention.truncate:
                if not args or int(args[0]) < 1:
                    raise ValueError("truncate needs the documents kept, K >= 1: truncate:K")
                spec = cls(intervention, Order(args[1]) if len(args) > 1 else None, int(args[0]))
            elif intervention == Intervention.reorder:
                spec = cls(intervention, Order(args[0]) if args else Order.outside_in)
            else:
                if args:
                    raise ValueError(f"{name} takes no setting")
                spec = cls(intervention)
        except (ValueError, IndexError) as err:
            raise ValueError(f"intervention {text!r}: {err} (known: reorder[:{'|'.join(Order)}], "
                             "truncate:K[:order], query_aware, ms_poe, attn_calibration)") from err
        if intervention == Intervention.none:
            raise ValueError("intervention 'none' is the plain evaluation, always reported")
        return spec

    @property
    def tag(self) -> str:
        return tag(self.name, self.order, self.keep)

    def probes(self, probes: Iterable[str]) -> list[str]:
        """The probes it changes among `probes` (ms_poe: every one)."""
        return [str(p) for p in probes if self.name not in APPLIES_TO or str(p) in APPLIES_TO[self.name]]


def by_final_position(result: ProbeResult) -> ProbeResult:
    """A reordered or truncated mdqa result with each item at the gold's final position (truncated-away golds
    and closed-book items left out): the curve a reader of the laid-out prompt sees."""
    outcomes = [{**o, "position": o["extra"]["final_position"], "label": str(o["extra"]["final_position"])}
                for o in result.outcomes if o["position"] >= 0 and o["extra"].get("final_position", -1) >= 0]
    return ProbeResult(result.probe, outcomes, {**result.settings, "positions": "final"})


def paired_delta(plain: ProbeResult, other: ProbeResult, n_boot: int = 1000, seed: int = 0
                 ) -> tuple[float, tuple[float, float], int]:
    """Mean accuracy of `other` minus `plain` over the items both asked (by id, closed-book left out), with its
    paired 95% bootstrap interval, and the number of items."""
    before = {o["id"]: o["correct"] for o in plain.outcomes if o["position"] >= 0}
    after = {o["id"]: o["correct"] for o in other.outcomes if o["position"] >= 0}
    shared = sorted(before.keys() & after.keys())
    if not shared:
        return math.nan, (math.nan, math.nan), 0
    x, y = np.array([after[i] for i in shared]), np.array([before[i] for i in shared])
    return float((x - y).mean()), paired_bootstrap_ci(x, y, n_boot, 0.05, seed), len(shared)
