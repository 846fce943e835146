"""LoRA through peft: wraps the model when `peft=lora`, leaves it alone for `peft=none`.

On a model with differential-attention layers the new maps learn too: `q2_proj`/`k2_proj` get
adapters like the other projections, and the small new modules (λ: `diff_lambda` or `lambda_proj`,
and V1 scratch's per-head norm `head_norm`) train in full through peft's `modules_to_save`, since
they have no pretrained values to adapt. Without them a retrofit's zero-initialised negative map
would never move.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterator

from torch import nn
from transformers import PreTrainedModel

from models.attention.diff_attention import DiffAttentionMixin


class PeftMethod(StrEnum):
    none = "none"  # full fine-tune
    lora = "lora"


@dataclass
class PeftConfig:
    method: PeftMethod = PeftMethod.none
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    # Module names LoRA wraps; the differential-attention projections are named like the standard ones.
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # Added on models with diff layers (those present): adapters on the negative map's projections ...
    diff_target_modules: list[str] = field(default_factory=lambda: ["q2_proj", "k2_proj"])
    # ... and full training of λ and the per-head norm.
    diff_modules_to_save: list[str] = field(default_factory=lambda: ["diff_lambda", "lambda_proj", "head_norm"])


def diff_lora_modules(model: nn.Module, cfg: PeftConfig) -> tuple[list[str], list[str]]:
    """(extra target_modules, modules_to_save): the configured diff modules that the model's diff layers have."""
    present: set[str] = set()
    for module in model.modules():
        if isinstance(module, DiffAttentionMixin):
            present |= {name for name, child in module.named_children() if child is not None}
    return ([n for n in cfg.diff_target_modules if n in present],
            [n for n in cfg.diff_modules_to_save if n in present])


def apply_peft(model: PreTrainedModel, cfg: PeftConfig):
    """The model, wrapped in a peft LoRA model when asked (adapters and the diff modules above train)."""
    if cfg.method == PeftMethod.none:
        return model
    from peft import LoraConfig, get_peft_model  # peft is imported only by runs that use it

    diff_targets, modules_to_save = diff_lora_modules(model, cfg)
    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(dict.fromkeys([*cfg.target_modules, *diff_targets])),
        modules_to_save=modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if getattr(model.base_model.model, "is_activation_checkpointing", False):
        # Frozen embeddings + non-reentrant checkpointing: inputs must require grad for adapters to learn.
        model.enable_input_require_grads()
    return model


def peft_model_of(model: nn.Module) -> nn.Module:
    """The peft model inside a DeepSpeed engine (or the model itself); ValueError when it is no peft model."""
    inner = getattr(model, "module", model)  # DeepSpeed engine
    if not hasattr(inner, "disable_adapter"):
        raise ValueError(f"{type(inner).__name__} has no adapters to disable: the base function needs peft=lora")
    return inner


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's function inside (peft's `disable_adapter()`, LoRA layers skipped, modules_to_save swapped
    for their originals), on a peft model or a DeepSpeed engine around one; the adapters on again after."""
    with peft_model_of(model).disable_adapter():
        yield
