"""Multi-scale Positional Encoding (Ms-PoE) as a plug-in inference intervention on Qwen2/Llama/Mistral.

Source: Zhang et al. 2024, "Found in the Middle: How Language Models Use Long Contexts Better via
Plug-and-Play Positional Encoding" (arXiv:2403.04797); reference code github.com/VITA-Group/Ms-PoE
(commit a46c3d1): `utils/modify_arch/llama.py` (`MsPoELlamaRotaryEmbedding._set_cos_sin_cache`,
`MsPoELlamaAttention._head_wise_statistics`, `._calculate_outlier`, `.forward`,
`MsPoELlamaForCausalLM.__init__` / `._reset`), `utils/setup.py`, the flags of `inference.py` and the
paper's runs in `src/ms_poe.sh`. Written from reading those files; no code is copied.

Definition, for one patched layer with H query heads sharing Hkv key/value heads (G = H / Hkv):

1. Ratio table (`_set_cos_sin_cache`): r_k = ratio_min + (ratio_max - ratio_min) * k / H, k = 0..H-1,
   in float32. The largest ratio is ratio_max - (ratio_max - ratio_min) / H: the reference never reaches
   ratio_max (1.2..1.8 over 32 heads gives 1.2..1.78125). `endpoint=True` (default: the paper's "from 1.2 to
   1.8") gives linspace(min, max, H).
2. Head order, per batch row, computed once per prompt on the prefill forward (the forward that finds
   this layer's cache empty) and held through decoding (`enable_head_metrics` is switched off after
   the first forward and only `_reset` turns it back on). From the layer's UNROTATED projections (the
   reference calls `_head_wise_statistics` before applying the rotary embedding), with the key heads
   repeated to the query heads:
       w_h   = softmax(q_h,last · K_hᵀ · scaling + mask)          the last prompt token's attention
       a_h   = #{j : w_h,j > 3 · mean(w_h)} / n                  share of keys 3x above the mean
       order = argsort(-a)                                        `outlier = -(...)`, `outlier.argsort()`
   so order[0] is the head with the largest share of above-average keys (the most position-aware one
   in the paper's terms). Over a padded row the keys are the row's real (non-pad) keys (and, in a
   sliding-window layer, the keys in the last token's window): n counts those and the mean runs over
   them, so a left-padded prompt gets the order it would get alone. argsort is stable (ties keep head
   order), where the reference's is not.
   `head_type="normal"` is the reference's `--head_type normal` (used in src/ms_poe.sh for answer
   positions 5, 7, 10): no statistic, order = (H-1, ..., 1, 0).
3. Ratio per head. `assignment="reference"` is what the code does: the cos/sin table is
   indexed by ratio number k and `cos = cos[self.head_order]` gives head h the ratio r_{order[h]}
   (the order is used as an index, not as a rank). `assignment="rank"` (default) is the rule the method states
   (position-aware heads keep ratios near 1, the others are compressed more): head order[i] gets r_i,
   so the head with the i-th largest share a gets the i-th smallest ratio. The two agree only where the
   order is its own inverse (e.g. head_type="normal").
4. Rotary embedding of head h at position p: angles (p / ratio_h) · inv_freq, computed from the model's
   `rotary_emb.inv_freq` in float32 like HF's rotary module (the reference divides the float32 position
   grid by the ratio), times `rotary_emb.attention_scaling`, cast to the activations' dtype. The query
   and the keys of head h use the same ratio; values are not touched.
5. KV cache: keys are stored rotated (the reference: "key/value are already rotated"), so a decoding
   step only rotates its new query/key, with the ratios held from the prefill.

Deviations from the reference, and why:

- GQA. The reference rotates key head j with the ratio of query head j·G (`sample_rotary_emb`:
  `cos[::num_key_value_groups]`), so in a GQA model the other G-1 query heads of the group meet keys
  rotated at another scale (it only ran on MHA Llama-2/Vicuna, where G = 1). Here each query head
  attends to keys rotated with its own ratio: when the ratios differ inside a group, the layer keeps
  one rotated key head per query head (the cache then holds (B, H, S, d) keys beside (B, Hkv, S, d)
  values; `DynamicCache`, `generate`'s default, accepts that; a static cache does not and is refused).
  When every group shares one ratio (ratio_min == ratio_max, or G = 1) keys stay (B, Hkv, S, d) and
  the attention call is HF's own, which makes unit ratios bit-identical to the plain model.
- Masks and batches. The reference rebuilds a causal mask without padding and squeezes a batch of one;
  here the layer uses the model's own mask (padding, sliding window) and every row has its own order.
- The statistic's softmax runs in float32 (float64 for float64 models) and is compared there; the
  reference casts the float32 softmax back to the activations' dtype (fp16) before comparing.
- `layers`: the reference takes an explicit `--apply_layers` list; `layers="reference"` is the list
  its runs use, every layer but the first two (src/ms_poe.sh: "2,3,...,31" for 32-layer Vicuna-7B).
- The reference fails on scaled RoPE (`assert False` for linear/dynamic); here any rope type of the
  HF rotary module works, as its `inv_freq` / `attention_scaling` already carry the scaling.

The forward of each patched attention module mirrors transformers 5.x's Qwen2/Llama/Mistral attention:
q/k/v projections, the rotary embedding, `cache.update(...)`, the configured attention interface with
the sliding window the original passes (Qwen2: the layer's, Mistral: the config's, Llama: none), o_proj.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from models.attention.nope import is_nope
from models.attention.patching import (
    LayerSet,
    attention_window,
    check_patchable_attention,
    patched_forwards,
    resolve_layers,
)

HEAD_TYPES = ("outlier", "normal")
ASSIGNMENTS = ("reference", "rank")
# attention kernels whose masks the head statistic can read: 4D bool/additive masks, or flash's 2D padding mask
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
LAYER_SETS = (LayerSet.reference, LayerSet.all)  # the named `layers` settings


@dataclass
class MsPoEConfig:
    """Ms-PoE settings. ratio_min, ratio_max, layers, head_type and outlier_threshold default to the reference
    code's (inference.py flags, src/ms_poe.sh runs). assignment and endpoint default to the paper's text, which
    the code departs from: `assignment="reference", endpoint=False` is what the code computes."""

    ratio_min: float = 1.2  # --compress_ratio_min (inference.py default, src/ms_poe.sh)
    ratio_max: float = 1.8  # --compress_ratio_max
    # "reference": every layer but the first two (src/ms_poe.sh --apply_layers "2,...,31" on 32 layers);
    # "all"; or a list of 0-based layer indices (the reference's --apply_layers)
    layers: Any = "reference"  # (Any: OmegaConf takes no str | list union)
    # "outlier": order from the last prompt token's attention (reference default, --head_type unset);
    # "normal": fixed order H-1..0 (reference --head_type normal)
    head_type: str = "outlier"
    outlier_threshold: float = 3.0  # `attn_weights > 3 * average` in `_calculate_outlier` (hard-coded there)
    # "rank" (the method as the paper states it): head order[i] gets r[i], the less position-aware a head, the
    # larger its compression; "reference": head h gets r[order[h]], what the code does (`cos[self.head_order]`)
    assignment: str = "rank"
    # True: linspace(ratio_min, ratio_max, H), the paper's range; False: r_k = min + (max - min) k / H as the
    # code's `_set_cos_sin_cache` (ratio_max never reached)
    endpoint: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.ratio_min <= self.ratio_max:
            raise ValueError(f"Ms-PoE needs 0 < ratio_min <= ratio_max, got {self.ratio_min}, {self.ratio_max}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        if self.assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {self.assignment!r}")
        if isinstance(self.layers, str) and self.layers not in LAYER_SETS:
            raise ValueError(f"layers must be 'reference', 'all' or a list of layer indices, got {self.layers!r}")

    def layer_indices(self, num_layers: int) -> list[int]:
        """0-based indices of the patched layers ("reference": 2..L-1, the reference's runs; "all": 0..L-1; a list)."""
        return resolve_layers(self.layers, num_layers, LAYER_SETS, "ms_poe.layers")


@dataclass
class LayerState:
    """What one patched layer holds between its prefill and its decoding steps (per batch row)."""

    head_order: torch.Tensor | None = None  # (B, H) long: order[b, 0] is row b's most outlier-rich head
    ratios: torch.Tensor | None = None  # (B, H) float32: the position divisor of each head
    scores: torch.Tensor | None = None  # (B, H) the share a_h of above-threshold keys (None for "normal")
    per_head_keys: bool = False  # keys kept per query head (ratios differ inside a GQA group)
    num_prefills: int = 0  # forwards that computed the order (one per prompt), for checks


@dataclass
class MsPoEState:
    """Yielded by `ms_poe`: the settings, the ratio table and each patched layer's state."""

    cfg: MsPoEConfig
    table: torch.Tensor  # (H,) float32: r_k, k = 0..H-1
    layers: dict[int, LayerState] = field(default_factory=dict)


def ratio_table(cfg: MsPoEConfig, num_heads: int) -> torch.Tensor:
    """The ratios r_k, k = 0..H-1 (float32, as the reference builds them from its float32 inv_freq)."""
    if cfg.endpoint:
        return torch.linspace(cfg.ratio_min, cfg.ratio_max, num_heads, dtype=torch.float32)
    k = torch.arange(num_heads, dtype=torch.float32)
    return cfg.ratio_min + (cfg.ratio_max - cfg.ratio_min) * (k / num_heads)


def assign_ratios(order: torch.Tensor, table: torch.Tensor, assignment: str) -> torch.Tensor:
    """(B, H) head order -> (B, H) ratio of each head (see the module docstring, step 3)."""
    table = table.to(order.device)
    if assignment == "reference":
        return table[order]  # head h reads row order[h] of the ratio-indexed table
    return torch.empty_like(table[order]).scatter_(1, order, table.expand(order.shape))  # head order[i] <- r_i


def check_ms_poe(model: nn.Module) -> None:
    """Raise ValueError naming why Ms-PoE cannot be applied to `model`; return None when it can."""
    config = model.config
    check_patchable_attention(config, "Ms-PoE", "rescales the RoPE of standard attention heads only",
                              ATTN_IMPLEMENTATIONS, "reads the attention mask for its head statistic")
    if is_nope(config):
        raise ValueError("Ms-PoE rescales RoPE positions, but this model has no position encoding "
                         "(NoPE: config.nope=true, models/nope.py)")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if getattr(rotary, "inv_freq", None) is None:
        raise ValueError(f"Ms-PoE needs the model's RoPE frequencies (model.model.rotary_emb.inv_freq); "
                         f"{type(model).__name__} has none")


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, d) -> (B, Hkv·groups, S, d), head j·groups + i reading head j (HF's `repeat_kv`)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_half: Callable) -> torch.Tensor:
    """HF's `apply_rotary_pos_emb` on one tensor, cos/sin already per head: (B, heads, L, d)."""
    return (x * cos) + (rotate_half(x) * sin)


def _scaled_cos_sin(rotary: nn.Module, position_ids: torch.Tensor, ratios: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, H, L, d) of the positions position_ids / ratio_h, as HF's rotary module computes them.

    Same float32 arithmetic as `Qwen2RotaryEmbedding.forward` (positions times inv_freq, cat, cos/sin,
    times attention_scaling, cast): with ratio 1 the division is exact and the result is bit-identical.
    """
    inv_freq = rotary.inv_freq.to(device=position_ids.device, dtype=torch.float32)
    positions = position_ids.float()[:, None, :] / ratios.to(position_ids.device)[:, :, None]  # (B, H, L)
    freqs = positions[..., None] * inv_freq  # (B, H, L, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * rotary.attention_scaling
    sin = emb.sin() * rotary.attention_scaling
    return cos.to(dtype), sin.to(dtype)


def _last_query_keys(mask: Any, batch: int, num_keys: int, window: int | None,
                     device: torch.device) -> torch.Tensor:
    """(B, S) bool: the keys the last query of a prefill attends to, read from the layer's mask."""
    if mask is None:  # sdpa/flash without padding: the last query sees every key (up to a window below)
        keys = torch.ones(batch, num_keys, dtype=torch.bool, device=device)
    elif not isinstance(mask, torch.Tensor):
        raise ValueError(f"Ms-PoE cannot read a {type(mask).__name__} attention mask; use eager or sdpa")
    elif mask.dim() == 2:  # flash attention's (B, S) padding mask, 1 = real token
        keys = mask[:, :num_keys].bool()
    else:  # (B|1, 1, L, S) bool (True = attend) or additive float (0 = attend, dtype min = masked)
        row = mask[:, 0, -1, :num_keys]
        keys = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
        keys = keys.expand(batch, num_keys)
    if window is not None and (mask is None or mask.dim() == 2):
        # kernels that apply the window themselves: HF keeps kv_idx > q_idx - window
        keys = keys & (torch.arange(num_keys, device=device) > num_keys - 1 - window)
    return keys


@torch.no_grad()
def outlier_scores(query: torch.Tensor, key: torch.Tensor, keys: torch.Tensor, scaling: float,
                   threshold: float) -> torch.Tensor:
    """(B, H) share a_h of the attended keys with weight > threshold x mean, for the last query.

    query (B, H, L, d) and key (B, Hkv, L, d) are the unrotated projections (as in the reference's
    `_head_wise_statistics`); keys (B, L) marks the keys the last query attends to.
    """
    groups = query.shape[1] // key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    logits = (query[:, :, -1:, :] @ _repeat_heads(key, groups).transpose(2, 3)).squeeze(2) * scaling  # (B, H, L)
    allowed = keys[:, None, :]  # (B, 1, L)
    weights = logits.to(dtype).masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, L)
    count = allowed.sum(-1, keepdim=True).to(dtype)  # (B, 1, 1) real keys per row
    mean = weights.sum(-1, keepdim=True) / count  # the reference's `attn_weights.mean(-1)` over real keys
    return ((weights > threshold * mean) & allowed).sum(-1).to(dtype) / count.squeeze(-1)


class _OneKeyHeadPerQueryHead:
    """The attention module as the kernels see it, with one key/value head per query head (no GQA repeat)."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _make_forward(module: nn.Module, rotary: nn.Module, model_type: str, cfg: MsPoEConfig,
                  table: torch.Tensor, state: LayerState) -> Callable:
    """The Ms-PoE forward of one attention module (HF attention forward, RoPE per head)."""
    modeling = sys.modules[type(module).__module__]  # the architecture's own helpers, as its forward uses
    rotate_half, eager = modeling.rotate_half, modeling.eager_attention_forward
    window, window_kwargs = attention_window(module, model_type)
    groups = module.num_key_value_groups

    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:  # the pre-5 keyword name
            cache = kwargs.pop("past_key_values", None)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("Ms-PoE needs the position_ids the decoder layer passes to its attention")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, L, d)
        key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, L, d)
        value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, L, d)
        batch, num_heads = query.shape[:2]

        prefill = cache is None or cache.get_seq_length(module.layer_idx) == 0
        if prefill:  # a new prompt: (re)compute the head order, like the reference's first forward
            if cfg.head_type == "normal":
                order = torch.arange(num_heads - 1, -1, -1, device=query.device).expand(batch, num_heads)
                state.scores = None
            else:
                keys = _last_query_keys(attention_mask, batch, key.shape[2], window, query.device)
                state.scores = outlier_scores(query, key, keys, module.scaling, cfg.outlier_threshold)
                order = torch.argsort(-state.scores, dim=-1, stable=True)  # `(-share).argsort()`
            state.head_order = order
            state.ratios = assign_ratios(order, table, cfg.assignment)  # (B, H)
            per_group = state.ratios.view(batch, -1, groups)
            state.per_head_keys = groups > 1 and not bool((per_group == per_group[..., :1]).all())
            if state.per_head_keys and cache is not None and not isinstance(cache, DynamicCache):
                raise ValueError(f"Ms-PoE with per-head ratios inside GQA groups caches one key head per query "
                                 f"head, which needs a DynamicCache; got {type(cache).__name__}")
            state.num_prefills += 1
        elif state.ratios is None or state.ratios.shape[0] != batch:
            raise RuntimeError("Ms-PoE: a decoding step without the head order of its prefill (the cache was "
                               "filled outside the ms_poe context, or the batch changed)")

        cos, sin = _scaled_cos_sin(rotary, position_ids, state.ratios, query.dtype)  # (B, H, L, d)
        query = _rotate(query, cos, sin, rotate_half)
        if state.per_head_keys:  # each query head's own copy of its key head, at its own scale
            key = _rotate(_repeat_heads(key, groups), cos, sin, rotate_half)
        else:  # one ratio per group: rotate the key heads with their group's (first head's) ratio
            key = _rotate(key, cos[:, ::groups], sin[:, ::groups], rotate_half)

        if cache is not None:
            key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)

        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
        target: Any = module
        if state.per_head_keys:
            value, target = _repeat_heads(value, groups), _OneKeyHeadPerQueryHead(module)
        attn_output, attn_weights = interface(
            target,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            **window_kwargs,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return module.o_proj(attn_output), attn_weights

    return forward


@contextmanager
def ms_poe(model: nn.Module, cfg: MsPoEConfig | None = None) -> Iterator[MsPoEState]:
    """Install Ms-PoE on the attention of `cfg.layers`; restore the model's forwards on exit (errors too).

    Yields the `MsPoEState` (head order, ratios and prefill count of each patched layer, updated by every
    forward). Works with `model(...)` and `model.generate(...)` (left padding, DynamicCache); the head
    order is recomputed on every forward that starts from an empty cache (a new prompt), from each row's
    LAST token, so prompts must be left-padded (right padding would score a pad token). Per-row state is
    not reordered with the cache: fine for greedy/sampling, and for beam search, whose beams of a prompt
    are expanded before the prefill and so share one order.
    """
    cfg = cfg if cfg is not None else MsPoEConfig()
    check_ms_poe(model)
    decoder = model.model
    chosen = cfg.layer_indices(len(decoder.layers))
    state = MsPoEState(cfg=cfg, table=ratio_table(cfg, model.config.num_attention_heads))

    def install(idx: int, module: nn.Module) -> Callable:
        state.layers[idx] = LayerState()
        return _make_forward(module, decoder.rotary_emb, model.config.model_type, cfg, state.table, state.layers[idx])

    with patched_forwards({i: decoder.layers[i].self_attn for i in chosen}, install, "Ms-PoE"):
        yield state
