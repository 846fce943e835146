"""The kit of the inference interventions that replace attention forwards (`models.attention.ms_poe`,
`models.attention.attn_calibration`): which models they can patch, the layers and heads a setting selects,
the sliding window a layer's original forward passes, and installing forwards one intervention at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from torch import nn

ARCHS = ("qwen2", "llama", "mistral")
PATCHED_BY = "_patched_by"  # attribute of an installed forward function: the intervention that installed it


class LayerSet(StrEnum):
    """The named sets a `layers` setting may take besides a list of 0-based indices (each intervention allows
    some of them)."""

    reference = "reference"  # every layer but the first two: the Ms-PoE reference's runs (src/ms_poe.sh)
    last_half = "last_half"  # L//2 .. L-1: attention calibration's paper (App. B: the last 16 of 32)
    all = "all"


def check_patchable_attention(config: Any, who: str, what: str, implementations: Sequence[str], why: str) -> None:
    """Raise ValueError when `who` (an intervention that replaces attention forwards) cannot patch a model of
    `config`: differential attention (`who` `what`), an architecture outside ARCHS, or an attention
    implementation outside `implementations` (`who` `why`)."""
    if getattr(config, "diff_attention", None) is not None:
        raise ValueError(f"{who}: differential-attention layers ({config.diff_attention}) compute two maps per head; "
                         f"{who} {what}")
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise ValueError(f"{who} patches the attention of {ARCHS}; got architecture {model_type!r}")
    attn_impl = getattr(config, "_attn_implementation", None)
    if attn_impl not in implementations:
        raise ValueError(f"{who} {why}: attn_implementation must be one of {tuple(implementations)}, got "
                         f"{attn_impl!r}")


def chosen_indices(value: str | Sequence[int], count: int, named: dict[str, list[int]], setting: str) -> list[int]:
    """0-based indices a layers/heads setting selects among `count`: a name of `named`, or a list of indices;
    ValueError naming `setting` when it selects none or one out of range."""
    if isinstance(value, str):
        if value not in named:
            raise ValueError(f"{setting}={value!r}: use {', '.join(named)}, or a list of indices")
        chosen = named[value]
    else:
        chosen = sorted({int(i) for i in value})
    if not chosen or not all(0 <= i < count for i in chosen):
        raise ValueError(f"{setting}={value!r} selects none of the {count} (indices must be in [0, {count}))")
    return chosen


def resolve_layers(layers: str | Sequence[int], num_layers: int, named: Sequence[LayerSet], setting: str) -> list[int]:
    """0-based indices of the patched layers among `num_layers`: one of the sets `named` allows ("reference":
    2..L-1, "last_half": L//2..L-1, "all": 0..L-1) or a list; ValueError naming `setting` otherwise."""
    sets = {LayerSet.reference: list(range(2, num_layers)),
            LayerSet.last_half: list(range(num_layers // 2, num_layers)), LayerSet.all: list(range(num_layers))}
    return chosen_indices(layers, num_layers, {str(name): sets[name] for name in named}, setting)


def attention_window(module: nn.Module, model_type: str) -> tuple[int | None, dict[str, Any]]:
    """The layer's sliding window, and the `sliding_window` kwarg the original forward passes (Llama: none)."""
    if model_type == "llama":
        return None, {}
    if hasattr(module, "sliding_window"):  # Qwen2 decides it per layer (layer_types)
        window = module.sliding_window
    else:  # Mistral passes the config's to every layer
        window = getattr(module.config, "sliding_window", None)
    return window, {"sliding_window": window}


def installed_interventions(modules: Iterable[nn.Module]) -> set[str]:
    """The interventions whose forwards are installed on any of `modules`."""
    return {getattr(m.__dict__.get("forward"), PATCHED_BY, None) for m in modules} - {None}


@contextmanager
def patched_forwards(modules: dict[int, nn.Module], make: Callable[[int, nn.Module], Callable], who: str
                     ) -> Iterator[None]:
    """Give each attention module (by layer index) the forward `make(index, module)` returns, and restore the
    model's own on exit (errors too). One intervention at a time: modules another one (or this one) patched
    are refused, as a second patch would silently replace the first."""
    owners = installed_interventions(modules.values())
    if owners:
        raise RuntimeError(f"{who}: {', '.join(sorted(owners))} is already installed on these layers (one "
                           "intervention at a time)")
    saved: list[tuple[nn.Module, bool, Any]] = []
    try:
        for idx, module in modules.items():
            # an instance attribute shadows the class's forward; remember one that was already there
            saved.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
            forward = make(idx, module)
            setattr(forward, PATCHED_BY, who)
            module.forward = forward
        yield
    finally:
        for module, had_own, previous in reversed(saved):
            if had_own:
                module.forward = previous
            else:
                del module.forward
