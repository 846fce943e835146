"""Residual-aware attention rollout read from the model itself, compared with the measured Jacobian.

Herasimchyk et al. 2026 approximate the influence of input position j on the last position by the
last row of ``N_H ... N_1``, ``N_t = (1-λ_t) I + λ_t A_t``, with ``A_t`` layer t's attention and
``λ_t`` its measured residual share, ``E_positions ||a_t|| / (||x_t|| + ||a_t||)`` (a_t: the attention
block's output added to the residual stream x_t). `capture` takes both from one forward pass of any
decoder this project trains (diff attention included: its map is ``A1 - λ A2``, so entries can be
negative); `rollouts` gives the variants below, and `rollout_metrics` compares each with a measured
profile as the ``rollout/<set>/<variant>/*`` metrics.

The maps are recomputed from each attention module's own inputs with its eager implementation and an
explicit causal mask, so they are the maps the model computes under SDPA or flash attention too, with
no `output_attentions` pass. Heads are weighted, in the per-head variant, by the mean norm of what each
head adds to the residual stream (its slice of ``o_proj``), normalized over the layer's heads.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping

import numpy as np
import torch
from torch import nn

from analysis.measure.jacobian import eval_mode, split_by_set
from analysis.measure.prior import log10_profile, rollout, spearman, w1_distance
from models.build import unwrap

FIXED_RESIDUAL = 0.5  # the fixed-residual baseline's λ


class RolloutVariant(StrEnum):
    attention_only = "attention_only"  # λ_t = 1: plain attention rollout, head-averaged maps
    fixed_residual = "fixed_residual"  # λ_t = 0.5 in every layer
    measured = "measured"  # λ_t measured in the forward pass, head-averaged maps
    measured_heads = "measured_heads"  # measured λ_t, heads weighted by what they add to the residual


ROLLOUT_METRICS = ("spearman", "w1", "rmse_log10")


@dataclass
class Capture:
    """What one forward pass of B sequences of length L tells the rollout, per decoder layer t = 1..H."""

    mean_maps: np.ndarray  # (B, H, L, L) float32: head-averaged attention
    weighted_maps: np.ndarray  # (B, H, L, L) float32: heads weighted by `head_weights`
    residual_share: np.ndarray  # (B, H): measured λ_t
    head_weights: np.ndarray  # (B, H, n_heads): each head's share of the layer's output norm (sums to 1)
    heads: list[np.ndarray] | None = None  # with keep_heads: per layer (B, n_heads, L, L), at least float32


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (also inside peft or DeepSpeed wrappers)."""
    base = unwrap(model).base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(unwrap(model)).__name__} has no decoder layers at .base_model.layers")
    return layers


def _causal_mask(attn: nn.Module, L: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive (1, 1, L, L) mask: causal, and the layer's sliding window when it has one."""
    i = torch.arange(L, device=device)
    allowed = i[None, :] <= i[:, None]  # (L, L): key j <= query i
    # Diff layers keep theirs in .window; Qwen2 decides per layer (.sliding_window), Mistral per model.
    window = next((getattr(attn, n) for n in ("window", "sliding_window") if hasattr(attn, n)),
                  getattr(attn.config, "sliding_window", None))
    if window:
        allowed &= i[:, None] - i[None, :] < window
    mask = torch.zeros(L, L, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _eager_maps(attn: nn.Module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The module's attention maps (B, n_heads, L, L), from its eager implementation on these inputs."""
    with eager_attention(attn.config):
        L = hidden_states.shape[1]
        mask = _causal_mask(attn, L, hidden_states.dtype, hidden_states.device)
        # .forward, not __call__: the capture hooks must not see this second pass.
        _, maps = attn.forward(hidden_states=hidden_states, position_embeddings=position_embeddings,
                               attention_mask=mask)
    if maps is None:
        raise ValueError(f"{type(attn).__name__} returned no attention maps from its eager implementation")
    return maps


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 up; a float64 model, as in the tests, stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _arg(args: tuple, kwargs: dict, name: str, index: int):
    return kwargs[name] if name in kwargs else args[index]


def _head_strengths(o_proj: nn.Module, heads_in: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, n_heads): the mean norm over positions of what each head adds to the residual stream.

    Head h's part is o_proj of its slice alone, less o_proj of nothing (a bias). Calling the module, not
    reading its weight, keeps this right for LoRA-wrapped and ZeRO-3-partitioned projections alike; the heads go
    through it as one batch of n_heads inputs, each holding one head's slice.
    """
    split = heads_in.unflatten(-1, (n_heads, -1))  # (B, L, nh, dv)
    base = _wide(o_proj(torch.zeros_like(heads_in)))  # (B, L, d)
    alone = torch.zeros((n_heads, *split.shape), dtype=split.dtype, device=split.device)  # (nh, B, L, nh, dv)
    for h in range(n_heads):
        alone[h, :, :, h] = split[:, :, h]
    added = _wide(o_proj(alone.flatten(-2))) - base  # (nh, B, L, d)
    return added.norm(dim=-1).mean(dim=-1).T  # (B, nh)


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, keep_heads: bool = False) -> Capture:
    """Attention maps, residual shares and head weights of every decoder layer for `input_ids` (B, L).

    One forward pass (dropout off, modes restored); the maps come from the eager recomputation above.
    `keep_heads` also keeps every head's map (tests, small models). Computed in the model's dtype, at
    least float32 (float64 for a float64 model).
    """
    with recording(model) as found, eval_mode(model):
        unwrap(model).base_model(input_ids=input_ids)  # the decoder alone: no logits are needed
    return as_capture(found, keep_heads)


@contextmanager
def eager_attention(config) -> Iterator[None]:
    """Every attention layer that reads this model config computes with transformers' eager implementation (which
    returns its maps); the implementation it had is restored on exit."""
    previous = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextmanager
def recording(model: nn.Module, maps_from_output: bool = False) -> Iterator[dict[str, list]]:
    """Hooks that record, for every decoder layer t of the forward passes run inside: its input x, attention
    output a, maps, o_proj input and head strengths (`as_capture` turns them into a `Capture`).

    The maps are recomputed from each attention module's own inputs with its eager implementation (any attention
    kernel), or with `maps_from_output` read from the module's own output: a forward under `eager_attention`
    returns them, which saves the recomputation when that forward is run anyway (a measured step's Jacobian).
    Everything recorded is detached: a forward that keeps its graph for a backward is not changed.
    """
    layers = decoder_layers(model)
    n_layers = len(layers)
    found: dict[str, list] = {k: [None] * n_layers for k in ("maps", "x", "a", "o_in", "strength")}

    def on_layer_input(t):
        def hook(module, args, kwargs):
            found["x"][t] = _arg(args, kwargs, "hidden_states", 0).detach()
        return hook

    inner = [False]  # set while the hooks call the modules themselves: only the real forward is recorded

    def on_attention_input(t):
        def hook(module, args, kwargs):
            inner[0] = True
            try:
                with torch.no_grad():
                    found["maps"][t] = _wide(_eager_maps(module, _arg(args, kwargs, "hidden_states", 0),
                                                         _arg(args, kwargs, "position_embeddings", 1)))
            finally:
                inner[0] = False
        return hook

    def on_attention_output(t):
        def hook(module, args, output):
            found["a"][t] = output[0].detach()
            if maps_from_output:
                if output[1] is None:
                    raise ValueError(f"{type(module).__name__} returned no attention maps: run the forward under "
                                     "eager_attention(model)")
                found["maps"][t] = _wide(output[1].detach())
            inner[0] = True
            try:
                with torch.no_grad():
                    found["strength"][t] = _head_strengths(module.o_proj, found["o_in"][t],
                                                           found["maps"][t].shape[1])
            finally:
                inner[0] = False
        return hook

    def on_o_proj_input(t):
        def hook(module, args):
            if not inner[0]:
                found["o_in"][t] = args[0].detach()
        return hook

    with ExitStack() as stack:
        for t, layer in enumerate(layers):
            attn = layer.self_attn
            hooks = [layer.register_forward_pre_hook(on_layer_input(t), with_kwargs=True),
                     attn.register_forward_hook(on_attention_output(t)),
                     attn.o_proj.register_forward_pre_hook(on_o_proj_input(t))]
            if not maps_from_output:
                hooks.append(attn.register_forward_pre_hook(on_attention_input(t), with_kwargs=True))
            for handle in hooks:
                stack.callback(handle.remove)
        yield found


def as_capture(found: dict[str, list], keep_heads: bool = False) -> Capture:
    """`capture`'s arrays from what `recording` found: head-mean and head-weighted maps, residual shares."""
    mean_maps, weighted_maps, shares, weights = [], [], [], []
    for t in range(len(found["maps"])):
        maps = found["maps"][t]  # (B, nh, L, L) float64
        x, a = _wide(found["x"][t]), _wide(found["a"][t])  # (B, L, d)
        x_norm, a_norm = x.norm(dim=-1), a.norm(dim=-1)  # (B, L)
        shares.append((a_norm / (x_norm + a_norm).clamp_min(1e-30)).mean(dim=1))  # (B,)
        strength = found["strength"][t]  # (B, nh): mean norm of what each head adds to the residual
        w = strength / strength.sum(dim=1, keepdim=True).clamp_min(1e-30)  # (B, nh)
        weights.append(w)
        mean_maps.append(maps.mean(dim=1))  # (B, L, L)
        weighted_maps.append(torch.einsum("bh,bhij->bij", w, maps))  # (B, L, L)
    return Capture(
        mean_maps=torch.stack(mean_maps, dim=1).float().cpu().numpy(),
        weighted_maps=torch.stack(weighted_maps, dim=1).float().cpu().numpy(),
        residual_share=torch.stack(shares, dim=1).cpu().numpy(),
        head_weights=torch.stack(weights, dim=1).cpu().numpy(),
        heads=[m.cpu().numpy() for m in found["maps"]] if keep_heads else None,
    )


def rollouts(cap: Capture) -> dict[str, np.ndarray]:
    """{variant: (B, L) float64}: the last row of each variant's rollout, for every sequence."""
    B, H = cap.residual_share.shape
    L = cap.mean_maps.shape[-1]
    out = {v: np.empty((B, L)) for v in RolloutVariant}
    for b in range(B):
        mean_maps = cap.mean_maps[b].astype(np.float64)  # (H, L, L)
        out[RolloutVariant.attention_only][b] = rollout(L, np.ones(H), mean_maps)
        out[RolloutVariant.fixed_residual][b] = rollout(L, np.full(H, FIXED_RESIDUAL), mean_maps)
        out[RolloutVariant.measured][b] = rollout(L, cap.residual_share[b], mean_maps)
        out[RolloutVariant.measured_heads][b] = rollout(L, cap.residual_share[b],
                                                        cap.weighted_maps[b].astype(np.float64))
    return out


def rollout_metrics(profile: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """How well a rollout (L,) predicts a measured profile (L,): Spearman, W1 and RMSE of log10 with a
    free scale. Diff-attention rollouts can go negative: their magnitude is compared."""
    predicted = np.abs(predicted)
    resid = log10_profile(profile) - log10_profile(predicted)
    return {"spearman": spearman(profile, predicted), "w1": w1_distance(profile, predicted),
            "rmse_log10": float(resid.std())}


def record_name(set_name: str, variant: str) -> str:
    """The `rollout.npz` set holding one evaluation set's rollouts of one variant."""
    return f"{set_name}.{variant}"


def measure_rollouts(model: nn.Module, seqs: Mapping[str, torch.Tensor]) -> dict[str, dict[str, np.ndarray]]:
    """{set: {variant: (n_seq, L)}}: every rollout of every sequence of every (non-empty) set.

    Sets of one length share a forward pass (per-call overhead dominates at the lengths measured per step).
    """
    seqs = {name: ids for name, ids in seqs.items() if len(ids)}
    if not seqs:
        return {}
    if len({ids.shape[1] for ids in seqs.values()}) > 1:
        return {name: measure_rollouts(model, {name: ids})[name] for name, ids in seqs.items()}
    return split_sets(rollouts(capture(model, torch.cat(list(seqs.values())))), seqs)


def split_sets(rows: Mapping[str, np.ndarray], seqs: Mapping[str, torch.Tensor]) -> dict[str, dict[str, np.ndarray]]:
    """{variant: (B, L)} rollouts of the sets' sequences stacked in order -> {set: {variant: (n_seq, L)}}."""
    by_variant = {str(v): split_by_set(r, seqs) for v, r in rows.items()}
    return {name: {v: parts[name] for v, parts in by_variant.items()} for name in seqs}


def mean_rollout(rows: np.ndarray) -> np.ndarray:
    """A set's rollout (L,): the mean magnitude over its sequences, as the measured profile is their mean."""
    return np.abs(rows).mean(axis=0)


def rollout_set_metrics(profiles: Mapping[str, np.ndarray], rolls: Mapping[str, Mapping[str, np.ndarray]]
                        ) -> dict[str, float]:
    """``rollout/<set>/<variant>/<metric>``: each set's mean rollout against its mean measured profile (L,)."""
    return {f"rollout/{name}/{variant}/{metric}": value
            for name, by_variant in rolls.items() for variant, rows in by_variant.items()
            for metric, value in rollout_metrics(profiles[name], mean_rollout(rows)).items()}
