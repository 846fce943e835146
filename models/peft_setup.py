"""LoRA through peft: wraps the model when `peft=lora`, leaves it alone for `peft=none`."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from transformers import PreTrainedModel


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


def apply_peft(model: PreTrainedModel, cfg: PeftConfig):
    """The model, wrapped in a peft LoRA model when asked (only adapter weights train)."""
    if cfg.method == PeftMethod.none:
        return model
    from peft import LoraConfig, get_peft_model  # peft is imported only by runs that use it

    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if getattr(model.base_model.model, "is_activation_checkpointing", False):
        # Frozen embeddings + non-reentrant checkpointing: inputs must require grad for adapters to learn.
        model.enable_input_require_grads()
    return model
