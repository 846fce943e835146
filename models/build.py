"""Model builder: a random-init model from a config, or a pretrained one from a hub id or folder.

Both paths return a Hugging Face `PreTrainedModel`; differential attention and LoRA are applied on
top of it by their own modules, so the loop never needs to know how the model was made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from models.diff_attention import convert_to_diff_attention

ATTENTIONS = ("standard", "diff_v1", "diff_v2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DiffConfig:
    mode: str = "scratch"  # scratch (paper init, random-init models) | retrofit (pretrained: exact at step 0)
    layers: Any = "all"  # "all" or a list of 0-based layer indices
    lambda_warmup_steps: int = 0  # steps over which λ ramps in; retrofit needs >= 1


@dataclass
class ModelConfig:
    name: str = "qwen2_tiny"
    pretrained: Optional[str] = None  # hub id or local folder; None = random init from `arch` + `init`
    arch: str = "qwen2"  # model_type for random init (qwen2, llama, mistral)
    init: dict[str, Any] = field(default_factory=dict)  # config kwargs for random init (hidden_size, ...)
    tokenizer: Optional[str] = None  # tokenizer id/folder; None = the pretrained model's, or a BPE trained on the data
    attention: str = "standard"  # standard | diff_v1 | diff_v2
    diff: DiffConfig = field(default_factory=DiffConfig)
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


def build_model(cfg: ModelConfig, vocab_size: int, pad_token_id: int | None = None) -> PreTrainedModel:
    """The configured causal LM: `from_pretrained` when `pretrained` is set, else random init."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype={cfg.dtype!r} must be one of {sorted(DTYPES)}")
    dtype = DTYPES[cfg.dtype]
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"model.attention={cfg.attention!r} must be one of {ATTENTIONS}")
    if cfg.pretrained:
        # Importing models.diff_attention registers the diff model types with the Auto classes, so a
        # checkpoint saved with differential attention restores its diff layers (and weights) here.
        model = AutoModelForCausalLM.from_pretrained(
            cfg.pretrained, dtype=dtype, trust_remote_code=cfg.trust_remote_code
        )
    else:
        # Plain containers: HF configs type-check nested fields (rope_parameters) and reject a DictConfig.
        init = OmegaConf.to_container(cfg.init, resolve=True) if OmegaConf.is_config(cfg.init) else dict(cfg.init)
        config = AutoConfig.for_model(cfg.arch, vocab_size=vocab_size, pad_token_id=pad_token_id, **init)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    already_diff = getattr(model.config, "diff_attention", None) is not None
    if cfg.attention != "standard" and not already_diff:
        convert_to_diff_attention(
            model,
            version=cfg.attention.removeprefix("diff_"),
            mode=cfg.diff.mode,
            layers=cfg.diff.layers if isinstance(cfg.diff.layers, str) else list(cfg.diff.layers),
            lambda_warmup_steps=cfg.diff.lambda_warmup_steps,
        )
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model
