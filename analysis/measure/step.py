"""A measured training step in one forward pass: the hutchinson Jacobian profile and the attention rollouts of the
same sequences.

Measured separately, a step ran the model three times on its sequences: the Jacobian's prefix and last-token passes
and the rollouts' own forward, whose hooks recomputed every layer's attention maps with the eager implementation.
Here one forward under eager attention (`rollout.eager_attention`) gives all of it: the last position's output,
whose vector-Jacobian products give the profile, and, read off by `rollout.recording`'s hooks from the same pass,
every layer's input, attention output, maps and head strengths. The values are those of `jacobian_profile` /
`measure_window` and `measure_rollouts` (the same function, probes and maps, in another order of float operations:
tests/test_measure_step.py); the backward also passes through the top layer's computation for the first L - 1
positions, which the separate profile skips, a small cost beside two forward passes.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from analysis.measure.jacobian import (
    JacobianConfig,
    JacobianTarget,
    ProbeWindow,
    ProfileResult,
    WindowResult,
    _final_norm,
    _input_embeddings,
    _probe_squares,
    eval_mode,
    own_estimate,
    probe_estimate,
    step_generator,
)
from analysis.measure.rollout import as_capture, eager_attention, recording, rollouts, split_sets


@dataclass
class StepMeasurement:
    """One measured step: each set's logged profile, the step's own estimate when a window pools them (else None),
    and each set's rollouts {set: {variant: (n_seq, L)}} (empty without them)."""

    profiles: dict[str, ProfileResult]
    pooled: dict[str, WindowResult] | None
    rollouts: dict[str, dict[str, np.ndarray]]


def _output(model: nn.Module, embeds: torch.Tensor, target: JacobianTarget) -> torch.Tensor:
    """(B, d): the target at the last position, from one full forward pass."""
    if target == JacobianTarget.last_hidden:
        return model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1,
                     output_hidden_states=True).hidden_states[-1][:, -1]
    captured: list[torch.Tensor] = []
    handle = _final_norm(model).register_forward_hook(lambda mod, args, out: captured.append(args[0][:, -1]))
    try:
        model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]


def measure_step(model: nn.Module, seqs: Mapping[str, torch.Tensor], cfg: JacobianConfig, step: int,
                 window: ProbeWindow | None = None, with_rollouts: bool = True) -> StepMeasurement:
    """The hutchinson profile of every set at `step` (its own `num_probes`, the same at every step, or with `window`
    fresh ones pooled over the window as `measure_window` does) and, with `with_rollouts`, their rollouts. Every set
    must have one length (they share the pass)."""
    names = list(seqs)
    if len({ids.shape[-1] for ids in seqs.values()}) != 1:
        raise ValueError(f"measure_step needs sets of one length, got {({n: s.shape[-1] for n, s in seqs.items()})}")
    ids = torch.cat(list(seqs.values()))  # (B, L)
    counts = {window.probes_for(name, cfg.num_probes, step) if window else cfg.num_probes for name in names}
    if len(counts) != 1:
        raise ValueError(f"the sets' windows hold different histories ({counts} probes to draw)")
    generator = step_generator(cfg.seed, step) if window else torch.Generator().manual_seed(cfg.seed)
    emb_layer = _input_embeddings(model)
    with eval_mode(model), torch.enable_grad(), eager_attention(model), \
            recording(model, maps_from_output=True) as found:
        embeds = emb_layer(ids.to(emb_layer.weight.device)).detach().requires_grad_(True)  # (B, L, D)
        y = _output(model, embeds, JacobianTarget(cfg.target))  # (B, d)
        q = _probe_squares(y, embeds, counts.pop(), cfg.exact_chunk, generator)  # (k, B, L)
    rolls = split_sets(rollouts(as_capture(found)), seqs) if with_rollouts else {}
    bounds = np.cumsum([0] + [len(s) for s in seqs.values()])
    squares = {name: q[:, lo:hi] for name, lo, hi in zip(names, bounds[:-1], bounds[1:])}
    if window is None:
        estimates = {name: probe_estimate(sq) for name, sq in squares.items()}
        return StepMeasurement({name: ProfileResult(rho.cpu().numpy(), se.cpu().numpy())
                                for name, (rho, se) in estimates.items()}, None, rolls)
    pooled = {}
    for name, sq in squares.items():
        sq = sq.cpu().numpy()
        window.add(name, sq, step)
        pooled[name] = WindowResult(own_estimate(sq), window.estimate(name), window.probes(name))
    return StepMeasurement({name: res.window for name, res in pooled.items()}, pooled, rolls)
