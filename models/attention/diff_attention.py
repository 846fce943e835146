"""Differential attention (DIFF Transformer, Ye et al. 2024; DIFF V2, 2026) swapped into HF decoders.

Every diff layer computes two softmax maps from two query/key groups and subtracts them:

    A_m = softmax(Q_m K_mᵀ / √d + causal mask),  m = 1 (positive map), 2 (negative map)
    out_h = (A1 - λ A2) V                        per head h, V shared by both maps

Module layout (these are the names to give `peft.LoraConfig(target_modules=...)`):
`q_proj`/`k_proj` make the positive map, `q2_proj`/`k2_proj` the negative map, `v_proj` and `o_proj`
are shared; V1 adds `diff_lambda` (the λ vectors) and, in scratch mode, `head_norm`; V2 adds `lambda_proj`.

- V1 (paper): λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init, one λ per layer, λ vectors of width d drawn from
  N(0, 0.1), λ_init = 0.8 - 0.6·exp(-0.3·(l-1)) for layer l counted from 1 (= HF `layer_idx` + 1).
  Scratch mode halves the heads and doubles the value width (H/2 heads, each with two d-wide query/key maps
  and a 2d-wide value: the parameter count of the attention it replaces), then normalizes each head's
  output with a learnable RMSNorm (`head_norm`, weight shared by heads) and scales it by (1 - λ_init).
- V2: twice the query heads (`q_proj` and `q2_proj`, H heads each) sharing the layer's K/V heads, a
  per-token, per-head λ = sigmoid(W_λ x) (`lambda_proj`, no bias), no per-head norm.

Modes of `convert_to_diff_attention`:

- `scratch`: fresh parameters with the paper's initialization, for random-init models. Projections are
  drawn from N(0, config.initializer_range) like the rest of the HF model.
- `retrofit`: the pretrained `q_proj`/`k_proj`/`v_proj`/`o_proj` stay the positive map, so all original
  heads keep their original function; `q2_proj` starts at zero, which makes A2 exactly the uniform causal
  average (the Cesàro matrix M of the prior), and `k2_proj` (V1) starts as a copy of `k_proj` so that
  `q2_proj` receives gradients. Relaxed from the paper, because each of these would change the pretrained
  function at step 0: no head halving and no value doubling (the pretrained heads are kept as they are),
  no per-head RMS norm and no (1 - λ_init) output scale (the pretrained `o_proj` expects raw head outputs).
  λ keeps its paper form (V1, λ_init included; V2, sigmoid) but enters only through the warm-up below,
  which is what makes step 0 exact; retrofit therefore needs `lambda_warmup_steps >= 1` (default 200).

λ warm-up: every layer uses λ_eff = r·λ with r = min(1, step / lambda_warmup_steps), or r = 1 when
lambda_warmup_steps = 0. The training loop calls `set_diff_step(model, step)` with the number of optimizer
steps taken so far (0 before the first update). r lives in the persistent buffer `lambda_ramp`, so a saved
checkpoint computes what the model computed when it was saved. At r = 0 the negative map, λ and
`q2_proj`/`k2_proj` receive zero gradients; they start learning from the first step with r > 0.

The closed-form prior at initialization (DESIGN: "The closed-form prior"). With random weights both maps
are near uniform, A1 ≈ A2 ≈ M, so a diff layer attends with (1 - λ)·M. Where nothing rescales the head
output, that shrinks the attention branch and so the prior's per-layer a: V2 (λ ≈ sigmoid(0) = 1/2), and
retrofit at step 0 (λ_eff = 0: exactly the original model's prior). V1 scratch differs: its per-head
RMSNorm undoes both the (1 - λ) factor and the shrinking of causally averaged values, so its attention
branch is larger than standard attention's and the layer mixes more. Measured in
tests/test_diff_attention.py::test_init_jacobian_profile (tiny random Qwen2, 3 layers, L=48, exact
Jacobian of the last hidden state w.r.t. the input embeddings at step 0): share of the profile on the last
token 0.21 standard, 0.42 V2, 0.03 V1; fitted a 0.44 standard, 0.25 V2 (V1 fits the prior's shape
poorly); mean of the first 4 positions over the middle band 3.4 standard, 2.0 V2, 2.0 V1; share in the
middle half 0.31 standard, 0.44 V1. Both variants start less primacy-heavy; V2 toward recency, V1 flatter.

Checkpoints: conversion sets `config.diff_attention = {"version", "mode", "layers", "lambda_warmup_steps"}`
and gives the config (and a *ForCausalLM model) a diff subclass whose `model_type` is `<base>_diff`
(`qwen2_diff`, `llama_diff`, `mistral_diff`), registered with the Auto classes when this module is
imported. `load_pretrained_with_diff` (or `AutoModelForCausalLM.from_pretrained` after importing this
module) rebuilds the diff layers and loads every weight. The classes are also registered for the Auto
classes' remote code: `save_pretrained` copies this file (which imports only torch and transformers) beside
the weights and names its classes in config.json's `auto_map`, so a checkpoint folder copied anywhere
loads with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` in a process without this
project (the Hub, lm-evaluation-harness); without `trust_remote_code` transformers refuses to run that
code, an error instead of a model silently missing its negative maps.
Naming the base class (`Qwen2ForCausalLM.from_pretrained`) raises for V1 scratch (its projections have
other shapes) and otherwise logs transformers' model-type warning and load report of UNEXPECTED keys.

`diff_lambda_stats` reports λ_eff per layer. V1's λ is one number per layer (mean = min = max); V2's λ is
per token and head, so its statistics cover every token (padding included) and head of the layer's last
forward pass; a V2 layer that has not run a forward yet is left out.
"""

import copy
import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import ContextManager

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralForCausalLM
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM

VERSIONS = ("v1", "v2")
MODES = ("scratch", "retrofit")
LAMBDA_VECTOR_STD = 0.1
HEAD_NORM_EPS = 1e-5


def lambda_init(layer_idx: int) -> float:
    """The paper's λ_init for a 0-based HF layer index (the paper's l - 1)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding on one tensor (same arithmetic as `apply_rotary_pos_emb`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, d)
    return (x * cos) + (rotate_half(x) * sin)


class DiffLambda(nn.Module):
    """V1's re-parameterized λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init (one scalar per layer)."""

    def __init__(self, head_dim: int, init: float):
        super().__init__()
        self.init = init
        self.lambda_q1 = nn.Parameter(torch.empty(head_dim))
        self.lambda_k1 = nn.Parameter(torch.empty(head_dim))
        self.lambda_q2 = nn.Parameter(torch.empty(head_dim))
        self.lambda_k2 = nn.Parameter(torch.empty(head_dim))
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=LAMBDA_VECTOR_STD)

    def forward(self) -> torch.Tensor:
        q1, k1, q2, k2 = (p.float() for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2))
        return torch.exp(q1 @ k1) - torch.exp(q2 @ k2) + self.init  # ()

    def extra_repr(self) -> str:
        return f"head_dim={self.lambda_q1.numel()}, lambda_init={self.init:.4f}"


class DiffAttentionMixin:
    """Differential attention on top of an HF attention module (see the module docstring).

    What differs from the base attention: a second query (and, for V1, key) projection for the negative
    map, λ (`diff_lambda` or `lambda_proj`), the per-head norm of V1 scratch, V1 scratch's halved head
    count with double-width values, and the KV cache entry: V1 caches both key maps, (B, 2Hkv, S, d),
    next to (B, Hkv, S, dv) values, which needs a cache that sizes keys and values apart (DynamicCache,
    the default; StaticCache raises a shape error).
    """

    def __init__(self, config, layer_idx: int, version: str = "v1", mode: str = "scratch",
                 lambda_warmup_steps: int = 0):
        super().__init__(config, layer_idx)
        _check_settings(version, mode, lambda_warmup_steps)
        self.version, self.mode, self.lambda_warmup_steps = version, mode, lambda_warmup_steps
        self.lambda_init = lambda_init(layer_idx)
        d, heads, kv_heads = self.head_dim, config.num_attention_heads, config.num_key_value_heads
        halve = version == "v1" and mode == "scratch"
        if halve and (heads % 2 or kv_heads % 2):
            raise ValueError(f"V1 scratch halves the heads: needs even head counts, got {heads}/{kv_heads}")
        self.num_heads = heads // 2 if halve else heads
        self.num_kv_heads = kv_heads // 2 if halve else kv_heads
        self.v_head_dim = 2 * d if halve else d
        # query heads per KV head in the one backend call that computes both maps (V2 shares K/V)
        self.num_key_value_groups = (2 if version == "v2" else 1) * self.num_heads // self.num_kv_heads
        # Qwen2 decides the window per layer, Mistral per model, Llama has none
        self.window = getattr(self, "sliding_window", getattr(config, "sliding_window", None))

        q_bias, k_bias = self.q_proj.bias is not None, self.k_proj.bias is not None

        def linear(n_out: int, bias: bool) -> nn.Linear:
            return nn.Linear(config.hidden_size, n_out, bias=bias)

        if halve:  # the baseline's query/key widths are split between the two maps
            self.q_proj = linear(self.num_heads * d, q_bias)
            self.k_proj = linear(self.num_kv_heads * d, k_bias)
        self.q2_proj = linear(self.num_heads * d, q_bias)
        self.k2_proj = linear(self.num_kv_heads * d, k_bias) if version == "v1" else None
        self.diff_lambda = DiffLambda(d, self.lambda_init) if version == "v1" else None
        self.lambda_proj = linear(self.num_heads, False) if version == "v2" else None
        self.head_norm = nn.RMSNorm(self.v_head_dim, eps=HEAD_NORM_EPS) if halve else None
        self.register_buffer("lambda_ramp", torch.tensor(1.0 if lambda_warmup_steps == 0 else 0.0))
        self.last_lambda = None
        self._init_diff_weights(config.initializer_range)

    def _init_diff_weights(self, std: float) -> None:
        """Scratch initialization; retrofit's q2_proj starts at zero so that A2 = M exactly."""
        for module in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.q2_proj, self.k2_proj,
                       self.lambda_proj):
            if module is None:
                continue
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        if self.mode == "retrofit":
            nn.init.zeros_(self.q2_proj.weight)

    @torch.no_grad()
    def retrofit_from(self, original: nn.Module) -> None:
        """Take the pretrained projections of `original` as the positive map; k2_proj starts as k_proj."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).load_state_dict(getattr(original, name).state_dict())
        if self.k2_proj is not None:
            self.k2_proj.load_state_dict(original.k_proj.state_dict())

    def set_diff_step(self, step: int) -> None:
        """Set the warm-up ramp r = min(1, step / lambda_warmup_steps) for `step` optimizer steps taken."""
        warmup = self.lambda_warmup_steps
        self.lambda_ramp.fill_(1.0 if warmup == 0 else min(1.0, step / warmup))

    def _lambda(self, x: torch.Tensor) -> torch.Tensor:
        """λ_eff broadcastable to (B, L, H)."""
        if self.version == "v1":
            lam = self.diff_lambda().view(1, 1, 1)  # (1, 1, 1)
        else:
            lam = torch.sigmoid(self.lambda_proj(x).float())  # (B, L, H)
        return self.lambda_ramp.float() * lam

    def _attend(self, q, k, v, mask, **kwargs):
        """Both maps in one call: q (B, 2H, L, d), k (B, ·, S, d), v (B, ·, S, dv) -> (B, L, 2H, dv)."""
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          eager_attention_forward)
        if v.shape[-1] == q.shape[-1] or self.config._attn_implementation == "eager":
            return interface(self, q, k, v, mask, **kwargs)
        # Fused kernels need equal query and value widths (SDPA silently falls back to its math kernel,
        # which materializes the L x L map and ran ~3x slower at L=1024 on CPU), so V1 scratch's d-wide
        # queries and keys are zero-padded to the value's 2d: q·k is unchanged and `scaling` stays
        # 1/sqrt(d). One 2d-wide call costs ~1.3x a d-wide one on CPU; splitting v in halves cost 2x.
        pad = (0, v.shape[-1] - q.shape[-1])
        return interface(self, nn.functional.pad(q, pad), nn.functional.pad(k, pad), v, mask, **kwargs)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        d = self.head_dim

        def heads(proj: nn.Linear, width: int = d) -> torch.Tensor:
            return proj(hidden_states).view(*input_shape, -1, width)  # (B, L, heads, width)

        # Both maps go through one backend call; the head order keeps each query head on its GQA group.
        if self.version == "v1":
            # map-major, A1's heads then A2's: query head m·H + h reads KV head m·Hkv + h // groups
            q = torch.cat([heads(self.q_proj), heads(self.q2_proj)], dim=2)  # (B, L, 2H, d)
            k = torch.cat([heads(self.k_proj), heads(self.k2_proj)], dim=2)  # (B, L, 2Hkv, d)
        else:
            # V2 pairs the maps of head h as query heads 2h, 2h+1, which share head h's K/V
            q = torch.stack([heads(self.q_proj), heads(self.q2_proj)], dim=3).flatten(2, 3)  # (B, L, 2H, d)
            k = heads(self.k_proj)  # (B, L, Hkv, d)
        v = heads(self.v_proj, self.v_head_dim).transpose(1, 2)  # (B, Hkv, L, dv)
        cos, sin = position_embeddings
        q = _rope(q.transpose(1, 2), cos, sin)  # (B, 2H, L, d)
        k = _rope(k.transpose(1, 2), cos, sin)  # (B, 2Hkv | Hkv, L, d)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, ·, S, ·)
        if self.version == "v1":
            v = torch.cat([v, v], dim=1)  # (B, 2Hkv, S, dv): both maps read the same values
        dropout = self.attention_dropout if self.training else 0.0
        o, w = self._attend(q, k, v, attention_mask, dropout=dropout, scaling=self.scaling,
                            sliding_window=self.window, **kwargs)  # (B, L, 2H, dv)

        def maps(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:  # 2H heads on dim -> (A1, A2) parts
            return x.chunk(2, dim=dim) if self.version == "v1" else x.unflatten(dim, (-1, 2)).unbind(dim + 1)

        lam = self._lambda(hidden_states)  # (B|1, L|1, H|1)
        if self.version == "v2":
            self.last_lambda = lam.detach()
        o1, o2 = maps(o, 2)  # (B, L, H, dv)
        out = o1 - lam.unsqueeze(-1).to(o1.dtype) * o2  # (B, L, H, dv)
        if self.head_norm is not None:
            out = self.head_norm(out) * (1.0 - self.lambda_init)
        out = self.o_proj(out.reshape(*input_shape, -1))  # (B, L, hidden)
        if w is not None:
            w1, w2 = maps(w, 1)  # (B, H, L, S)
            w = w1 - lam.transpose(1, 2).unsqueeze(-1).to(w.dtype) * w2
        return out, w


class Qwen2DiffAttention(DiffAttentionMixin, Qwen2Attention):
    """Qwen2Attention with differential attention; differences in `DiffAttentionMixin`."""


class LlamaDiffAttention(DiffAttentionMixin, LlamaAttention):
    """LlamaAttention with differential attention; differences in `DiffAttentionMixin`."""


class MistralDiffAttention(DiffAttentionMixin, MistralAttention):
    """MistralAttention with differential attention; differences in `DiffAttentionMixin`."""


class Qwen2DiffConfig(Qwen2Config):
    """Qwen2Config of a model with diff layers (`diff_attention` holds the settings)."""

    model_type = "qwen2_diff"


class LlamaDiffConfig(LlamaConfig):
    """LlamaConfig of a model with diff layers (`diff_attention` holds the settings)."""

    model_type = "llama_diff"


class MistralDiffConfig(MistralConfig):
    """MistralConfig of a model with diff layers (`diff_attention` holds the settings)."""

    model_type = "mistral_diff"


class DiffForCausalLMMixin:
    """Builds the base *ForCausalLM, then swaps in the diff layers named by `config.diff_attention`."""

    def __init__(self, config):
        super().__init__(config)
        _swap_attention(self, **config.diff_attention)


class Qwen2DiffForCausalLM(DiffForCausalLMMixin, Qwen2ForCausalLM):
    """Qwen2ForCausalLM with diff layers, loadable by `from_pretrained`."""

    config_class = Qwen2DiffConfig


class LlamaDiffForCausalLM(DiffForCausalLMMixin, LlamaForCausalLM):
    """LlamaForCausalLM with diff layers, loadable by `from_pretrained`."""

    config_class = LlamaDiffConfig


class MistralDiffForCausalLM(DiffForCausalLMMixin, MistralForCausalLM):
    """MistralForCausalLM with diff layers, loadable by `from_pretrained`."""

    config_class = MistralDiffConfig


# base config -> (base attention, diff attention, diff config); base LM -> diff LM
_FAMILIES = {
    Qwen2Config: (Qwen2Attention, Qwen2DiffAttention, Qwen2DiffConfig),
    LlamaConfig: (LlamaAttention, LlamaDiffAttention, LlamaDiffConfig),
    MistralConfig: (MistralAttention, MistralDiffAttention, MistralDiffConfig),
}
_LM_CLASSES = {
    Qwen2ForCausalLM: Qwen2DiffForCausalLM,
    LlamaForCausalLM: LlamaDiffForCausalLM,
    MistralForCausalLM: MistralDiffForCausalLM,
}
for _config_cls, _lm_cls in zip((Qwen2DiffConfig, LlamaDiffConfig, MistralDiffConfig), _LM_CLASSES.values()):
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModelForCausalLM.register(_config_cls, _lm_cls, exist_ok=True)
    # save_pretrained copies this file beside the weights and names its classes in config.json's
    # auto_map: the checkpoint then loads with trust_remote_code=True where this project is absent.
    _config_cls.register_for_auto_class()
    _lm_cls.register_for_auto_class("AutoModelForCausalLM")


# λ ramps in over this many optimizer steps by default in retrofit mode: long enough that the negative
# map enters gradually after the pretrained function, short against a fine-tune of a few thousand steps.
RETROFIT_WARMUP_STEPS = 200


def _check_settings(version: str, mode: str, lambda_warmup_steps: int) -> None:
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(lambda_warmup_steps, int) or lambda_warmup_steps < 0:
        raise ValueError(f"lambda_warmup_steps must be an int >= 0, got {lambda_warmup_steps!r}")
    if mode == "retrofit" and lambda_warmup_steps < 1:
        raise ValueError("retrofit needs lambda_warmup_steps >= 1: the warm-up ramp is what makes step 0 "
                         "compute the original function")


def _family(config) -> tuple[type, type, type]:
    for base_cls, family in _FAMILIES.items():
        if type(config) is base_cls or type(config) is family[2]:
            return family
    raise ValueError(f"diff attention supports Qwen2, Llama and Mistral models, got {type(config).__name__}")


def _swap_attention(model: nn.Module, version: str, mode: str, layers: Sequence[int],
                    lambda_warmup_steps: int) -> list[tuple[nn.Module, nn.Module]]:
    """Replace the attention of `layers` by fresh diff modules; returns (original, new) pairs."""
    base_cls, diff_cls, _ = _family(model.config)
    wanted, swapped = set(layers), []
    parents = [m for m in model.modules() if type(getattr(m, "self_attn", None)) is base_cls]
    for parent in parents:
        original = parent.self_attn
        if original.layer_idx in wanted:
            weight = original.q_proj.weight
            new = diff_cls(model.config, original.layer_idx, version, mode, lambda_warmup_steps)
            parent.self_attn = new.to(device=weight.device, dtype=weight.dtype)
            swapped.append((original, parent.self_attn))
    if {new.layer_idx for _, new in swapped} != wanted:
        raise ValueError(f"layers {sorted(wanted)} not all found among the model's standard attention layers")
    return swapped


def convert_to_diff_attention(model: PreTrainedModel, version: str = "v1", mode: str = "scratch",
                              layers: str | Sequence[int] = "all", lambda_warmup_steps: int | None = None,
                              gather: Callable[[nn.Module], ContextManager] | None = None) -> PreTrainedModel:
    """Swap diff attention into `layers` (0-based HF indices or "all") of a Qwen2/Llama/Mistral model.

    In place; returns `model`. `lambda_warmup_steps=None` means no warm-up for scratch and
    RETROFIT_WARMUP_STEPS for retrofit (whose step-0 exactness is the warm-up's ramp). The settings are
    recorded in `model.config.diff_attention`, which travels in `config.json` (see the module docstring
    for the modes and the checkpoint format). `gather(module)`: a context in which a module's weights
    are whole, for a model partitioned while it loaded (ZeRO-3); retrofit reads the original
    projections inside it. The new modules are whole until the engine partitions them.
    """
    if getattr(model.config, "diff_attention", None):
        raise ValueError(f"model already has diff attention: {model.config.diff_attention}")
    if lambda_warmup_steps is None:
        lambda_warmup_steps = RETROFIT_WARMUP_STEPS if mode == "retrofit" else 0
    _check_settings(version, mode, lambda_warmup_steps)
    n_layers = model.config.num_hidden_layers
    layer_list = list(range(n_layers)) if layers == "all" else sorted({int(i) for i in layers})
    if not layer_list or not all(0 <= i < n_layers for i in layer_list):
        raise ValueError(f"layers must be 'all' or indices in [0, {n_layers}), got {layers!r}")
    original_config = model.config
    settings = dict(version=version, mode=mode, layers=layer_list, lambda_warmup_steps=lambda_warmup_steps)
    for original, new in _swap_attention(model, **settings):
        if mode == "retrofit":
            with gather(original) if gather is not None else nullcontext():  # weights partitioned at load
                new.retrofit_from(original)
    # a converted copy of the config, so that other holders of the original object are left alone
    config = copy.deepcopy(model.config)
    config.__class__ = _family(config)[2]
    config.diff_attention = settings
    for module in model.modules():
        if getattr(module, "config", None) is original_config:
            module.config = config
    if type(model) in _LM_CLASSES:
        model.__class__ = _LM_CLASSES[type(model)]
    return model


def load_pretrained_with_diff(path: str, **from_pretrained_kwargs) -> PreTrainedModel:
    """Load a checkpoint saved from a diff model (its config.json carries `diff_attention`)."""
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "diff_attention", None):
        raise ValueError(f"{path} has no diff_attention settings; load it with AutoModelForCausalLM")
    return AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)


def _diff_modules(model: nn.Module) -> list[DiffAttentionMixin]:
    return [m for m in model.modules() if isinstance(m, DiffAttentionMixin)]


def set_diff_step(model: nn.Module, step: int) -> None:
    """Advance the λ warm-up of every diff layer to `step` optimizer steps taken."""
    for module in _diff_modules(model):
        module.set_diff_step(step)


@torch.no_grad()
def diff_lambda_stats(model: nn.Module) -> dict[str, float]:
    """λ_eff statistics per diff layer: `diff/layer{l}/lambda_{mean,min,max}`, l the 0-based layer index."""
    stats = {}
    for module in _diff_modules(model):
        if module.version == "v1":
            lam = module._lambda(None)
        elif module.last_lambda is not None:
            lam = module.last_lambda
        else:
            continue
        prefix = f"diff/layer{module.layer_idx}/lambda_"
        stats.update({prefix + "mean": lam.mean().item(), prefix + "min": lam.min().item(),
                      prefix + "max": lam.max().item()})
    return stats
