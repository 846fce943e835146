"""NoPE: a model without position encoding (`model.rope=false`), for the RoPE-invariance check.

The paper compares Jacobian profiles with and without rotary embeddings (Spearman 0.99): the valley
comes from causal masking and residual mixing, not from RoPE. Every decoder here (Qwen2, Llama,
Mistral, and their diff-attention layers, whose `_rope` uses the same cos/sin) applies RoPE as
`q cos + rotate_half(q) sin` with the (cos, sin) its `rotary_emb` module computes once per forward.
`disable_rope` replaces that module by `NoRotaryEmbedding`, whose cos = 1 and sin = 0 make the
rotation the identity: attention scores are plain q·k, and nothing in the model reads positions.

The switch travels with the weights: `disable_rope` sets `config.nope = True`, which `save_pretrained`
writes to config.json, and this project's loaders (`models.build.build_model` with
`model.pretrained`, `models.training.checkpoint.load_checkpoint_model`, hence training resume,
scripts.eval_checkpoint, analysis.compare and scripts.merge_lora) disable RoPE again when they see it.
A plain `AutoModelForCausalLM.from_pretrained` outside this project ignores the key and would run the
weights with RoPE.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

NOPE_KEY = "nope"  # the config attribute (config.json key) of a model trained without position encoding
_ROTARY_NAME = "rotary_emb"  # the rotary module of every HF Llama-family decoder


class NoRotaryEmbedding(nn.Module):
    """A rotary embedding that rotates nothing: cos = 1, sin = 0, of the replaced module's shape."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim  # the width of the cos/sin the replaced module returned (head_dim, or its rotary part)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, self.dim)  # (B, L, dim), as HF's rotary modules return
        return x.new_ones(shape), x.new_zeros(shape)


def is_nope(config: Any) -> bool:
    """Whether a model config (or config.json dict) marks a model trained without position encoding."""
    value = config.get(NOPE_KEY) if isinstance(config, dict) else getattr(config, NOPE_KEY, None)
    return bool(value)


def disable_rope(model: nn.Module) -> nn.Module:
    """Replace every rotary embedding module of `model` by `NoRotaryEmbedding`; mark its config. In place.

    Raises ValueError when the model has no `rotary_emb` module (an architecture whose positions are
    encoded otherwise: there is nothing this switch could turn off).
    """
    parents = [(parent, child) for parent in model.modules()
               if isinstance(child := getattr(parent, _ROTARY_NAME, None), nn.Module)]
    if not parents:
        raise ValueError(f"model.rope=false: {type(model).__name__} has no `{_ROTARY_NAME}` module to turn off "
                         "(NoPE supports the RoPE decoders: qwen2, llama, mistral)")
    for parent, rotary in parents:
        if not isinstance(rotary, NoRotaryEmbedding):
            # cos/sin repeat the frequencies twice (`cat((freqs, freqs))`): twice as wide as inv_freq.
            setattr(parent, _ROTARY_NAME, NoRotaryEmbedding(2 * rotary.inv_freq.numel()))
    setattr(model.config, NOPE_KEY, True)
    return model
