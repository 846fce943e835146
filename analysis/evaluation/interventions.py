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

Each is a kind of `Intervention` (`Reorder`, `Truncate`, `QueryAware`, `MsPoE`, `AttentionCalibration`; the
plain evaluation is `NoIntervention`) that says which probes it changes, the probe settings it makes, how it is
installed on a model and what its results record. Positions of reordered or truncated mdqa items stay the
gold's rank, so their curves pair with the un-intervened ones; each outcome keeps its final position
(`extra["final_position"]`).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, ClassVar, Iterable, Iterator, Optional

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.config import EvalConfig, Probe
from analysis.evaluation.result import ProbeResult
from analysis.evaluation.reuse import computation_key
from data_builders.probes import Order
from data_builders.tokenizer import default_cache_dir
from models.attention.attn_calibration import (
    AttnCalibration,
    AttnCalibrationConfig,
    ReferenceCache,
    attn_calibration,
    check_attn_calibration,
)
from models.attention.ms_poe import MsPoEConfig, check_ms_poe, ms_poe

log = logging.getLogger(__name__)

REFERENCE_SUBDIR = "calibration_references"  # attn_calibration.reuse_reference: <POSDEBIAS_CACHE>/<this>


class InterventionName(StrEnum):
    """`scripts.eval_checkpoint intervention=`: the kinds below by name (none: the plain evaluation)."""

    none = "none"
    reorder = "reorder"
    truncate = "truncate"
    query_aware = "query_aware"
    ms_poe = "ms_poe"
    attn_calibration = "attn_calibration"


@dataclass(frozen=True)
class Intervention:
    """One intervention with its settings: the probes it changes, the probe settings it makes, the model it
    installs on, what its results record. Each kind below is a subclass; `parse` reads compare's texts,
    `from_settings` eval_checkpoint's keys."""

    name: ClassVar[InterventionName]
    applies_to: ClassVar[frozenset[str] | None] = None  # the probes it changes; None: every probe

    @classmethod
    def parse(cls, text: str, ms_poe: MsPoEConfig | None = None, calibration: AttnCalibrationConfig | None = None
              ) -> Intervention:
        """`analysis.compare --interventions`' spelling: `reorder`, `reorder:ascending`, `truncate:5`,
        `truncate:5:outside_in`, `query_aware`, `ms_poe`, `attn_calibration`; `ms_poe`, `calibration`: the
        settings of the ones that change the model (None: their defaults)."""
        name, *args = text.strip().split(":")
        try:
            if (kind := KINDS.get(name)) is None:  # StrEnum keys: the text finds its kind
                raise ValueError(f"{name!r} is not a valid Intervention")
            settings = kind._text_settings(args)
        except (ValueError, IndexError) as err:
            raise ValueError(f"intervention {text!r}: {err} (known: reorder[:{'|'.join(Order)}], "
                             "truncate:K[:order], query_aware, ms_poe, attn_calibration)") from err
        if kind is NoIntervention:
            raise ValueError("intervention 'none' is the plain evaluation, always reported")
        return kind._with(**settings, ms_poe=ms_poe, calibration=calibration)

    @classmethod
    def from_settings(cls, name: InterventionName | str, probes: Iterable[str], order: Optional[Order] = None,
                      keep: Optional[int] = None, ms_poe: MsPoEConfig | None = None,
                      calibration: AttnCalibrationConfig | None = None) -> Intervention:
        """`scripts.eval_checkpoint`'s `intervention=`, `order=`, `keep=`, `ms_poe.*`, `attn_calibration.*` as an
        intervention; fails at start-up, naming the setting, on one that cannot apply to the probes asked."""
        kind = KINDS[InterventionName(name)]
        kind.check(probes)
        takes = {f.name for f in fields(kind)}
        if "keep" in takes and (keep is None or keep < 1):
            raise ValueError(f"intervention={kind.name} needs keep=K >= 1, the documents kept (got keep={keep})")
        if "keep" not in takes and keep is not None:
            raise ValueError(f"keep={keep} is truncate's setting, but intervention={kind.name}")
        if "order" not in takes and order is not None:
            raise ValueError(f"order={order} lays out documents for intervention=reorder|truncate, not {kind.name}")
        return kind._with(order=order, keep=keep, ms_poe=ms_poe, calibration=calibration)

    @classmethod
    def _with(cls, **settings: Any) -> Intervention:
        """This kind with those of `settings` it takes (None: its default)."""
        return cls(**{f.name: settings[f.name] for f in fields(cls) if settings.get(f.name) is not None})

    @classmethod
    def _text_settings(cls, args: list[str]) -> dict[str, Any]:
        """The settings a `parse` text gives after the name (`name:a:b`)."""
        if args:
            raise ValueError(f"{cls.name} takes no setting")
        return {}

    @classmethod
    def check(cls, probes: Iterable[str]) -> None:
        """Fail at start-up, naming the setting, when asked of probes it would leave as they are."""
        if cls.applies_to is not None and (untouched := [str(p) for p in probes if str(p) not in cls.applies_to]):
            raise ValueError(f"intervention={cls.name} applies to {sorted(map(str, cls.applies_to))} only; "
                             f"probes={untouched} would be asked as they are: leave them out")

    def changes(self, probes: Iterable[str]) -> list[str]:
        """The probes it changes among `probes` (ms_poe: every one)."""
        return [str(p) for p in probes if self.applies_to is None or str(p) in self.applies_to]

    @property
    def tag(self) -> str:
        """A folder-safe name of the intervention and its setting: reorder-outside_in, truncate-5, ms_poe, ..."""
        return str(self.name)

    def configure(self, cfg: EvalConfig) -> EvalConfig:
        """`cfg` with the probe settings a prompt-level intervention makes (the others: unchanged)."""
        return cfg

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise ValueError naming why it cannot change `model` (before anything is answered)."""

    @contextmanager
    def installed(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
                  ) -> Iterator[Optional[AttnCalibration]]:
        """The context in which the model answers: Ms-PoE installed, attention calibration installed (yielded:
        answer with it), or the model as it is (None). Each checks the model as it installs; call `check_model`
        first to fail before any other work."""
        yield None

    def settings(self, model: PreTrainedModel, calibration: Optional[AttnCalibration] = None) -> dict[str, Any]:
        """What a result's settings record of it: its tag and, for the ones that change the model, their
        settings (layers resolved) and, for attn_calibration, the query rows recalibrated (summed over layers:
        0 would mean it never acted)."""
        return {"intervention": self.tag}


@dataclass(frozen=True)
class NoIntervention(Intervention):
    """The plain evaluation."""

    name = InterventionName.none


@dataclass(frozen=True)
class Reorder(Intervention):
    """The mdqa documents laid out by `order` (outside_in: the best at both ends)."""

    name = InterventionName.reorder
    applies_to = frozenset({Probe.mdqa})
    order: Order = Order.outside_in

    @classmethod
    def _text_settings(cls, args: list[str]) -> dict[str, Any]:
        return {"order": Order(args[0])} if args else {}

    @property
    def tag(self) -> str:
        return f"reorder-{self.order}"

    def configure(self, cfg: EvalConfig) -> EvalConfig:
        return replace(cfg, mdqa=replace(cfg.mdqa, order=self.order))


@dataclass(frozen=True)
class Truncate(Intervention):
    """The top `keep` ranked mdqa documents only, laid out by `order` when set."""

    name = InterventionName.truncate
    applies_to = frozenset({Probe.mdqa})
    keep: int
    order: Optional[Order] = None

    @classmethod
    def _text_settings(cls, args: list[str]) -> dict[str, Any]:
        if not args or int(args[0]) < 1:
            raise ValueError("truncate needs the documents kept, K >= 1: truncate:K")
        return {"keep": int(args[0]), "order": Order(args[1]) if len(args) > 1 else None}

    @property
    def tag(self) -> str:
        return f"truncate-{self.keep}" + (f"-{self.order}" if self.order is not None else "")

    def configure(self, cfg: EvalConfig) -> EvalConfig:
        return replace(cfg, mdqa=replace(cfg.mdqa, order=self.order, keep=self.keep))


@dataclass(frozen=True)
class QueryAware(Intervention):
    """The question (or key) before the documents (or pairs) too."""

    name = InterventionName.query_aware
    applies_to = frozenset({Probe.kv, Probe.mdqa})

    def configure(self, cfg: EvalConfig) -> EvalConfig:
        return replace(cfg, kv=replace(cfg.kv, query_aware=True), mdqa=replace(cfg.mdqa, query_aware=True))


@dataclass(frozen=True)
class MsPoE(Intervention):
    """Per-head RoPE position compression installed on the model: every probe changes."""

    name = InterventionName.ms_poe
    ms_poe: MsPoEConfig = field(default_factory=MsPoEConfig)

    def check_model(self, model: PreTrainedModel) -> None:
        check_ms_poe(model)
        self.ms_poe.layer_indices(model.config.num_hidden_layers)

    @contextmanager
    def installed(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
                  ) -> Iterator[Optional[AttnCalibration]]:
        with ms_poe(model, self.ms_poe):
            yield None

    def settings(self, model: PreTrainedModel, calibration: Optional[AttnCalibration] = None) -> dict[str, Any]:
        layers = self.ms_poe.layer_indices(model.config.num_hidden_layers)
        return {**super().settings(model), "ms_poe": {**asdict(self.ms_poe), "layers": layers}}


@dataclass(frozen=True)
class AttentionCalibration(Intervention):
    """Attention after the documents (or pairs) redistributed by their calibrated relevance: needs a prompt's
    documents or pairs."""

    name = InterventionName.attn_calibration
    applies_to = frozenset({Probe.kv, Probe.mdqa})
    calibration: AttnCalibrationConfig = field(default_factory=AttnCalibrationConfig)

    def check_model(self, model: PreTrainedModel) -> None:
        check_attn_calibration(model, self.calibration)

    @contextmanager
    def installed(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
                  ) -> Iterator[Optional[AttnCalibration]]:
        cache = None
        if self.calibration.reuse_reference:
            cache = ReferenceCache(default_cache_dir() / REFERENCE_SUBDIR, computation_key(model))
        with attn_calibration(model, tokenizer, self.calibration, cache) as calibration:
            yield calibration
            if cache is not None:
                log.info("attn_calibration: %d prompts' references read from %s", calibration.references_reused,
                         cache.root)

    def settings(self, model: PreTrainedModel, calibration: Optional[AttnCalibration] = None) -> dict[str, Any]:
        layers = self.calibration.layer_indices(model.config.num_hidden_layers)
        return {**super().settings(model), "attn_calibration": {
            **asdict(self.calibration), "layers": layers,
            "calibrated_rows": None if calibration is None else calibration.calibrated_rows}}


KINDS: dict[InterventionName, type[Intervention]] = {
    kind.name: kind for kind in (NoIntervention, Reorder, Truncate, QueryAware, MsPoE, AttentionCalibration)}


def by_final_position(result: ProbeResult) -> ProbeResult:
    """A reordered or truncated mdqa result with each item at the gold's final position (truncated-away golds
    and closed-book items left out): the curve a reader of the laid-out prompt sees."""
    outcomes = [{**o, "position": o["extra"]["final_position"], "label": str(o["extra"]["final_position"])}
                for o in result.outcomes if o["position"] >= 0 and o["extra"].get("final_position", -1) >= 0]
    return ProbeResult(result.probe, outcomes, {**result.settings, "positions": "final"})
