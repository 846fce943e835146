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
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from analysis.measure.jacobian import (
    Estimator,
    JacobianConfig,
    JacobianTarget,
    ProbeWindow,
    ProfileResult,
    WindowResult,
    _input_embeddings,
    _probe_squares,
    _target,
    eval_mode,
    pool,
    probe_estimate,
    split_by_set,
    step_generator,
)
from analysis.measure.rollout import as_capture, eager_attention, recording, rollouts, split_sets
from models.build import unwrap


@dataclass
class StepMeasurement:
    """One measured step: each set's logged profile, the step's own estimate when a window pools them (else None),
    and each set's rollouts {set: {variant: (n_seq, L)}} (empty without them)."""

    profiles: dict[str, ProfileResult]
    pooled: dict[str, WindowResult] | None
    rollouts: dict[str, dict[str, np.ndarray]]


def measure_step(model: nn.Module, seqs: Mapping[str, torch.Tensor], cfg: JacobianConfig, step: int,
                 window: ProbeWindow | None = None, with_rollouts: bool = True) -> StepMeasurement:
    """The hutchinson profile of every set at `step` (its own `num_probes`, the same at every step, or with `window`
    fresh ones pooled over the window as `measure_window` does) and, with `with_rollouts`, their rollouts. Every set
    must have one length (they share the pass)."""
    names = list(seqs)
    if len({ids.shape[-1] for ids in seqs.values()}) != 1:
        raise ValueError(f"measure_step needs sets of one length, got {({n: s.shape[-1] for n, s in seqs.items()})}")
    if window is None and cfg.num_probes < 2:
        raise ValueError(f"num_probes={cfg.num_probes} without a window: a step's own estimate needs 2 probes for its "
                         "standard error")
    ids = torch.cat(list(seqs.values()))  # (B, L)
    counts = {window.probes_for(name, cfg.num_probes, step) if window else cfg.num_probes for name in names}
    if len(counts) != 1:
        raise ValueError(f"the sets' windows hold different histories ({counts} probes to draw)")
    generator = step_generator(cfg.seed, step) if window else torch.Generator().manual_seed(cfg.seed)
    emb_layer = _input_embeddings(model)
    # Without rollouts the model keeps its own attention kernel: eager attention and the hooks cost ~60% more here.
    with eval_mode(model), torch.enable_grad(), ExitStack() as stack:
        if with_rollouts:
            stack.enter_context(eager_attention(unwrap(model).config))
            found = stack.enter_context(recording(model, maps_from_output=True))
        embeds = emb_layer(ids.to(emb_layer.weight.device)).detach().requires_grad_(True)  # (B, L, D)
        y = _target(model, embeds, JacobianTarget(cfg.target), Estimator.hutchinson, full_pass=True)  # (B, d)
        q = _probe_squares(y, embeds, counts.pop(), cfg.exact_chunk, generator)  # (k, B, L)
    rolls = split_sets(rollouts(as_capture(found)), seqs) if with_rollouts else {}
    squares = split_by_set(q, seqs, axis=1)
    if window is None:
        estimates = {name: probe_estimate(sq) for name, sq in squares.items()}
        return StepMeasurement({name: ProfileResult(rho.cpu().numpy(), se.cpu().numpy())
                                for name, (rho, se) in estimates.items()}, None, rolls)
    pooled = pool(window, {name: sq.cpu().numpy() for name, sq in squares.items()}, step)
    return StepMeasurement({name: res.window for name, res in pooled.items()}, pooled, rolls)
