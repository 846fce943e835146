"""Jacobian profile of a decoder LM: how strongly each input position moves the last position.

``rho(j) = || d target / d e_j ||_F`` with ``e_j`` the input embedding at position j and the target
the final hidden state at the last position (see DESIGN.md, "The Jacobian profile"). Three
estimators share one forward pass and differ only in the vector-Jacobian products (VJPs) they take:

- ``exact``: the d standard-basis VJPs of the d-dim target, ``exact_chunk`` per batched backward;
- ``hutchinson``: k Gaussian probes u_i, ``rho^2(j) ≈ mean_i ||J_j^T u_i||^2`` (unbiased for rho^2);
- ``top_prob``: one VJP of the last position's top-token probability.

The measurement is side-effect free for training: dropout off while measuring, every module's
train/eval flag restored afterwards, gradients taken w.r.t. the embeddings only (parameter ``.grad``
untouched), probes drawn from a dedicated generator (global RNG untouched).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data_builders.files import atomic_file
from models.build import unwrap

log = logging.getLogger(__name__)


class Estimator(StrEnum):
    exact = "exact"  # d standard-basis VJPs: exact, d times the cost of one
    hutchinson = "hutchinson"  # k Gaussian probes: unbiased for rho^2, with a standard error
    top_prob = "top_prob"  # one VJP of the last position's top-token probability


class ChunkedSource(StrEnum):
    heldout = "heldout"  # excerpts of held-out documents, never trained on
    train = "train"  # excerpts of training text (the paper's Appendix G): data_builders.build.train_documents


class JacobianTarget(StrEnum):
    last_hidden = "last_hidden"  # the final hidden state at the last position, after the final norm
    pre_norm = "pre_norm"  # the input of the final norm


STDERR_PREFIX = "stderr/"  # jacobian.npz key prefix of a set's standard errors
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


@dataclass
class JacobianConfig:
    """Hydra group ``jacobian``: what to measure, on which sequences, how often."""

    every: int = 1  # measure every N optimizer steps; 0 turns the profile off
    estimator: Estimator = Estimator.hutchinson
    num_probes: int = 8  # Gaussian probes per hutchinson profile (>= 2, for the standard error)
    target: JacobianTarget = JacobianTarget.last_hidden
    seq_len: int = 256  # L, tokens per evaluation sequence
    # A set of 0 sequences is absent everywhere (jacobian.npz, metrics, plots, charts); not both 0.
    n_vanilla: int = 2  # sequences that are one held-out document truncated to L
    n_chunked: int = 2  # sequences of chunk_len-token excerpts of distinct documents
    chunk_len: int = 300  # c; when L <= c a chunked sequence is a single excerpt
    chunked_source: ChunkedSource = ChunkedSource.heldout  # where the chunked excerpts come from
    exact_chunk: int = 64  # VJPs per batched backward (exact and hutchinson); bounds memory
    plot_every: int = 50  # with wandb on: redraw plots/jacobian_heatmap_<set>.png and log it every N measured steps
    chart_every: int = 1  # wandb line chart of the profile every N measured steps (~0.1 s each on CPU)
    seed: int = 0  # probe generator seed; the same probes at every step (common random numbers) when window = 1
    # hutchinson: the profile logged at a step is the mean over the probes of the last `window` measured steps
    # (`ProbeWindow`), each step drawing num_probes fresh ones (the first, with no history, num_probes x window):
    # about the variance of num_probes x window probes at the cost of num_probes. 1 = the step's own probes alone.
    window: int = 1
    # Also the attention rollouts of the measured sequences (analysis.measure.rollout): rollout/<set>/<variant>/*
    # against the measured profile, every measured step, and rollout.npz beside jacobian.npz.
    rollout: bool = True


def validate_jacobian(jac: JacobianConfig) -> None:
    """Start-up checks of the `jacobian` section, naming the key."""
    for key in ("plot_every", "chart_every"):  # cadences of measured steps
        if getattr(jac, key) < 1:
            raise ValueError(f"jacobian.{key}={getattr(jac, key)} must be >= 1")
    for key in ("n_vanilla", "n_chunked"):
        if getattr(jac, key) < 0:
            raise ValueError(f"jacobian.{key}={getattr(jac, key)} must be >= 0 (0 leaves the set out)")
    if jac.window < 1:
        raise ValueError(f"jacobian.window={jac.window} must be >= 1 (1: each step's own probes alone)")
    if jac.every > 0 and jac.estimator == Estimator.hutchinson and (
            jac.num_probes < 1 or (jac.window == 1 and jac.num_probes < 2)):
        raise ValueError(f"jacobian.num_probes={jac.num_probes} with jacobian.window={jac.window}: hutchinson needs 2 "
                         "probes a step for its standard error, or 1 a step pooled over a window (jacobian.window > 1)")
    if jac.every > 0 and jac.window > 1 and jac.estimator != Estimator.hutchinson:
        raise ValueError(f"jacobian.window={jac.window} pools hutchinson probes over steps; jacobian.estimator="
                         f"{jac.estimator} draws none: set jacobian.window=1")
    if jac.every > 0 and jac.n_vanilla == jac.n_chunked == 0:
        # A profile of nothing is a mistake, not a way to turn it off: say how to.
        raise ValueError(f"jacobian.n_vanilla=0 and jacobian.n_chunked=0 with jacobian.every={jac.every}: nothing to "
                         "measure; set one of them >= 1, or jacobian.every=0 (jacobian=off) to turn the profile off")


@dataclass
class ProfileResult:
    """A profile, shape (B, L) or (L,) like the input ids, and its standard error (hutchinson only)."""

    profile: np.ndarray
    stderr: np.ndarray | None


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Switch every module to eval; restore each module's own flag (not one global flag) on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder layer (Llama/Qwen2/Mistral ``model.norm`` and kin)."""
    base = unwrap(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    for name in _FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"pre_norm target: {type(decoder).__name__} has none of {_FINAL_NORM_NAMES}")


def _input_embeddings(model: nn.Module) -> nn.Module:
    return unwrap(model).get_input_embeddings()  # PeftModel lacks the method


def _last_position_forward(model: nn.Module, embeds: torch.Tensor, **kwargs):
    """The model's output at the last position only, computed as prefix (cached) + last token.

    Same values as one forward over all L positions, but the top layer's attention and MLP for the
    first L-1 positions become separate graph nodes that do not lead to the target, so each VJP skips
    them: one layer's backward saved per probe (~20% of a hutchinson profile on a 4-layer model). The
    gradient reaches those positions through the cached keys and values of every layer.
    """
    if embeds.shape[1] == 1:
        return model(inputs_embeds=embeds, use_cache=False, **kwargs)
    prefix = model(inputs_embeds=embeds[:, :-1], use_cache=True, logits_to_keep=1)
    return model(inputs_embeds=embeds[:, -1:], cache=prefix.cache, use_cache=True, **kwargs)


def _full_forward(model: nn.Module, embeds: torch.Tensor, **kwargs):
    """The model's output from one pass over all L positions (what hooks on every position's computation need)."""
    return model(inputs_embeds=embeds, use_cache=False, **kwargs)


def _target(model: nn.Module, embeds: torch.Tensor, target: JacobianTarget, estimator: Estimator,
            full_pass: bool = False) -> torch.Tensor:
    """Forward pass from ``embeds`` (B, L, D) to the measured output: (B, d) vectors or (B,) scalars; by
    `_last_position_forward`, or with `full_pass` by one pass over every position (`analysis.measure.step`)."""
    forward = _full_forward if full_pass else _last_position_forward
    if estimator == Estimator.top_prob:
        logits = forward(model, embeds, logits_to_keep=1).logits[:, -1]  # (B, V)
        probs = logits.float().softmax(-1)  # (B, V)
        top = probs.detach().argmax(-1, keepdim=True)  # (B, 1)
        return probs.gather(-1, top).squeeze(-1)  # (B,)
    if target == JacobianTarget.last_hidden:
        # transformers ties hidden_states[-1] to last_hidden_state (after the final norm) unless told not to.
        if getattr(getattr(model, "config", None), "tie_last_hidden_states", None) is False:
            raise ValueError("config.tie_last_hidden_states=False: hidden_states[-1] would be pre-norm")
        out = forward(model, embeds, logits_to_keep=1, output_hidden_states=True)
        return out.hidden_states[-1][:, -1]  # (B, d)
    captured: list[torch.Tensor] = []
    handle = _final_norm(model).register_forward_hook(lambda mod, args, out: captured.append(args[0][:, -1]))
    try:
        forward(model, embeds, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]  # (B, d)


def _vjp_sq_norms(
    y: torch.Tensor, embeds: torch.Tensor, cotangents: Sequence[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """``||J_j^T v||^2`` (n, B, L) float64 per cotangent chunk v (n, B, d), one batched backward each.

    Only one chunk's embedding gradients (n, B, L, D) are alive at a time: that bounds the memory.
    """
    for i, v in enumerate(cotangents):
        retain = i < len(cotangents) - 1
        if v.shape[0] == 1:  # one probe: a plain backward, no vmap over probes
            (g,) = torch.autograd.grad(y, embeds, v[0].to(y), retain_graph=retain)
            g = g[None]  # (1, B, L, D)
        else:
            (g,) = torch.autograd.grad(y, embeds, v.to(y), retain_graph=retain, is_grads_batched=True)  # (n, B, L, D)
        # Square in at least float32: summing D squares in bf16 would keep ~3 significant digits.
        yield g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum(-1).double()  # (n, B, L)


def _probe_squares(y: torch.Tensor, embeds: torch.Tensor, num_probes: int, chunk: int,
                   generator: torch.Generator | None) -> torch.Tensor:
    """(k, B, L) float64: ``||J_j^T u_i||^2`` of k Gaussian probes u_i (B, d) drawn on the CPU from `generator`
    (None: a fresh one seeded 0); each is unbiased for rho^2(j)."""
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    u = torch.randn(num_probes, y.shape[0], y.shape[-1], generator=gen, dtype=torch.float64)  # (k, B, d)
    return torch.cat(list(_vjp_sq_norms(y, embeds, u.to(y.device).split(chunk))))  # (k, B, L)


def probe_estimate(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rho (B, L) from k probes' squared norms q (k >= 2, B, L), and its standard error: that of rho^2 (the probes'
    spread over sqrt(k)) through the delta method, d rho = d(rho^2) / (2 rho); rho = 0 only where every probe gave
    0, so its error is 0 there."""
    rho = q.mean(0).sqrt()
    return rho, q.std(0) / math.sqrt(q.shape[0]) / (2 * rho).clamp_min(torch.finfo(torch.float64).tiny)


def own_estimate(q: np.ndarray) -> ProfileResult:
    """`probe_estimate` of one step's probes (k, B, L); a single probe has no standard error (None)."""
    q = np.asarray(q, dtype=np.float64)
    if q.shape[0] < 2:
        return ProfileResult(np.sqrt(q[0]), None)
    rho, stderr = probe_estimate(torch.from_numpy(q))
    return ProfileResult(rho.numpy(), stderr.numpy())


def hutchinson_squares(
    model: nn.Module,
    input_ids: torch.Tensor,
    num_probes: int,
    target: JacobianTarget | str = JacobianTarget.last_hidden,
    chunk: int = 64,
    generator: torch.Generator | None = None,
) -> np.ndarray:
    """Each probe's ``||J_j^T u_i||^2``, (k, B, L) float64 for `input_ids` (B, L): the terms whose mean
    `jacobian_profile`'s hutchinson estimate squares, for estimates that pool probes over steps (`ProbeWindow`)."""
    if num_probes < 1 or chunk < 1:
        raise ValueError(f"need num_probes >= 1 and chunk >= 1, got {num_probes} and {chunk}")
    emb_layer = _input_embeddings(model)
    with eval_mode(model), torch.enable_grad():
        embeds = emb_layer(input_ids.to(emb_layer.weight.device)).detach().requires_grad_(True)  # (B, L, D)
        y = _target(model, embeds, JacobianTarget(target), Estimator.hutchinson)  # (B, d)
        return _probe_squares(y, embeds, num_probes, chunk, generator).detach().cpu().numpy()


def hutchinson_with_output(
    model: nn.Module, input_ids: torch.Tensor, num_probes: int, chunk: int = 64,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, torch.Tensor, object]:
    """`hutchinson_squares` of the last hidden state (k, B, L), and what the same forward gives a continuation of
    the sequence: the last position's logits (B, V) and the KV cache of every position. Call it inside `eval_mode`
    when the continuation is scored too. The forward is one pass over all positions, as a plain forward of the
    sequence is, so that a continuation scored from it equals the plain forward's bit for bit under bf16 autocast
    too (prefix + last token, `_last_position_forward`, rounds differently: ~0.08 nats an answer on SmolLM2)."""
    if num_probes < 1 or chunk < 1:
        raise ValueError(f"need num_probes >= 1 and chunk >= 1, got {num_probes} and {chunk}")
    if getattr(getattr(model, "config", None), "tie_last_hidden_states", None) is False:
        raise ValueError("config.tie_last_hidden_states=False: hidden_states[-1] would be pre-norm")
    emb_layer = _input_embeddings(model)
    with eval_mode(model), torch.enable_grad():
        embeds = emb_layer(input_ids.to(emb_layer.weight.device)).detach().requires_grad_(True)  # (B, L, D)
        out = model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, output_hidden_states=True)
        y = out.hidden_states[-1][:, -1]  # (B, d)
        squares = _probe_squares(y, embeds, num_probes, chunk, generator).detach().cpu().numpy()
    return squares, out.logits[:, -1].detach(), out.cache


def jacobian_profile(
    model: nn.Module,
    input_ids: torch.Tensor,
    estimator: Estimator | str = Estimator.hutchinson,
    num_probes: int = 8,
    target: JacobianTarget | str = JacobianTarget.last_hidden,
    chunk: int = 64,
    generator: torch.Generator | None = None,
) -> ProfileResult:
    """Per-position Jacobian norm of ``target`` at the last position w.r.t. the input embeddings.

    ``input_ids`` is (B, L) or (L,); the result has the same leading shape. ``chunk`` VJPs share a
    batched backward. ``generator`` (CPU) draws the hutchinson probes; None means a fresh one seeded 0.
    The hutchinson standard error is the delta-method one for rho: ``se(rho^2) / (2 rho)`` with
    ``se(rho^2)`` = the sample std of the k per-probe squared norms over sqrt(k). Probes are shared
    by all positions of a sequence, so errors along one sequence are correlated. ``top_prob`` has
    its own scalar target and ignores ``target``.
    """
    estimator, target = Estimator(estimator), JacobianTarget(target)  # ValueError naming the enum
    if estimator == Estimator.hutchinson and num_probes < 2:
        raise ValueError(f"hutchinson needs num_probes >= 2 for its standard error, got {num_probes}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    squeeze = input_ids.dim() == 1
    ids = input_ids.unsqueeze(0) if squeeze else input_ids  # (B, L)
    stderr = None
    emb_layer = _input_embeddings(model)
    with eval_mode(model), torch.enable_grad():
        embeds = emb_layer(ids.to(emb_layer.weight.device)).detach().requires_grad_(True)  # (B, L, D)
        y = _target(model, embeds, target, estimator)  # (B, d) or (B,)
        B = y.shape[0]
        if estimator == Estimator.top_prob:
            (g,) = torch.autograd.grad(y.sum(), embeds)  # (B, L, D); batch rows are independent
            rho = g.to(torch.promote_types(g.dtype, torch.float32)).norm(dim=-1).double()  # (B, L)
        elif estimator == Estimator.exact:
            d = y.shape[-1]
            eye = torch.eye(d, dtype=y.dtype, device=y.device)  # (d, d)
            basis = [eye[s:s + chunk, None, :].expand(-1, B, -1) for s in range(0, d, chunk)]  # [(n, B, d)]
            rho = sum(sq.sum(0) for sq in _vjp_sq_norms(y, embeds, basis)).sqrt()  # (B, L)
        else:
            rho, se = probe_estimate(_probe_squares(y, embeds, num_probes, chunk, generator))  # (B, L) each
            stderr = se.cpu().numpy()
    profile = rho.detach().cpu().numpy()
    if squeeze:
        profile = profile[0]
        stderr = None if stderr is None else stderr[0]
    return ProfileResult(profile=profile, stderr=stderr)


def measure_sets(
    model: nn.Module, seqs: Mapping[str, torch.Tensor], cfg: JacobianConfig
) -> dict[str, ProfileResult]:
    """One profile per evaluation set, with the same probes at every call.

    Sets of one length share a single batched forward and backward (one call costs less than one per
    set on small models); the rows are split back by set.
    """
    def measure(ids: torch.Tensor) -> ProfileResult:
        return jacobian_profile(model, ids, cfg.estimator, cfg.num_probes, cfg.target, cfg.exact_chunk,
                                generator=torch.Generator().manual_seed(cfg.seed))

    if len({ids.shape[-1] for ids in seqs.values()}) != 1:
        return {name: measure(ids) for name, ids in seqs.items()}
    both = measure(torch.cat(list(seqs.values())))
    profiles = split_by_set(both.profile, seqs)
    stderr = split_by_set(both.stderr, seqs) if both.stderr is not None else dict.fromkeys(seqs)
    return {name: ProfileResult(profiles[name], stderr[name]) for name in seqs}


def split_by_set(rows, seqs: Mapping[str, torch.Tensor], axis: int = 0) -> dict:
    """{set: its slice of `rows`}: rows of the sets' sequences stacked in order along `axis` (an array or tensor)."""
    bounds = np.cumsum([0] + [len(ids) for ids in seqs.values()])
    index = [slice(None)] * axis
    return {name: rows[(*index, slice(lo, hi))] for name, lo, hi in zip(seqs, bounds[:-1], bounds[1:])}


class ProbeWindow:
    """Hutchinson probes pooled over the last `steps` measured steps, per set: the streamed estimator.

    The profile changes little from one step to the next, so the probes of recent steps estimate it together:
    ``rho^2(j)`` = the mean of every pooled probe's ``||J_j^T u_i||^2``. On a profile that does not move it is
    unbiased, and its standard error (the pooled probes' spread over sqrt(count), delta method for rho) is that
    of one step with all those probes: ``rho ± t(0.975, count - 1) x stderr`` covers the exact rho ~95% of the time
    (tests/test_jacobian_window.py). On a moving profile it is the window's average, ~steps/2 behind, and the
    spread includes the movement. Each step keeps (its step, count, sum, sum of squares) of its probes per position,
    so the state is small and is saved with a checkpoint (`state_dict`): a resumed run logs what an uninterrupted
    one does. A step at or before one the window holds replaces it and what came after (a resumed run measures its
    first step again).
    """

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"jacobian.window={steps} must be >= 1")
        self.steps = steps
        self._sums: dict[str, list[tuple[int, int, np.ndarray, np.ndarray]]] = {}  # (step, n, sum, sum of squares)

    def _kept(self, name: str, before: int | None = None) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        kept = self._sums.get(name, [])
        return kept if before is None else [entry for entry in kept if entry[0] < before]

    def probes_for(self, name: str, num_probes: int, step: int | None = None) -> int:
        """Probes `step` draws: num_probes, or num_probes x steps while the window holds no earlier step."""
        return num_probes if self._kept(name, step) else num_probes * self.steps

    def add(self, name: str, squares: np.ndarray, step: int) -> None:
        """One step's per-probe squared norms (k, B, L); the oldest step leaves a full window."""
        q = np.asarray(squares, dtype=np.float64)
        kept = self._kept(name, step) + [(step, q.shape[0], q.sum(0), (q * q).sum(0))]
        self._sums[name] = kept[-self.steps:]

    def probes(self, name: str) -> int:
        """Probes the set's estimate pools."""
        return sum(n for _, n, _, _ in self._kept(name))

    def estimate(self, name: str) -> ProfileResult:
        """The pooled profile of `name` and its standard error (B, L); the error is 0 with a single probe."""
        kept = self._kept(name)
        n = sum(k for _, k, _, _ in kept)
        total, squares = sum(t for _, _, t, _ in kept), sum(q for _, _, _, q in kept)
        mean = total / n
        var = np.maximum(squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else np.zeros_like(mean)
        rho = np.sqrt(mean)
        stderr = np.sqrt(var / n) / np.maximum(2 * rho, np.finfo(np.float64).tiny)
        return ProfileResult(rho, stderr)

    def state_dict(self) -> dict[str, list]:
        return {name: [[step, n, t.tolist(), q.tolist()] for step, n, t, q in kept]
                for name, kept in self._sums.items()}

    def load_state_dict(self, state: Mapping[str, list]) -> None:
        self._sums = {name: [(int(step), int(n), np.asarray(t, dtype=np.float64), np.asarray(q, dtype=np.float64))
                             for step, n, t, q in kept][-self.steps:] for name, kept in state.items()}


@dataclass
class WindowResult:
    """One set at one step: the step's own probes' estimate and the window's (`ProbeWindow.estimate`)."""

    step: ProfileResult  # its standard error is None when the step drew a single probe
    window: ProfileResult
    probes: int  # probes the window's estimate pools


def step_generator(seed: int, step: int) -> torch.Generator:
    """The probe generator of one step: every step draws its own probes (a window pools independent ones), the
    same step always the same (a resumed run measures what an uninterrupted one does)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))


def measure_window(
    model: nn.Module, seqs: Mapping[str, torch.Tensor], cfg: JacobianConfig, step: int, window: ProbeWindow
) -> dict[str, WindowResult]:
    """Fresh hutchinson probes of every set at `step` (`ProbeWindow.probes_for`), added to `window`; each set's
    own estimate and the window's. Sets of one length share one batched forward and backward, as in
    `measure_sets`."""
    names = list(seqs)
    counts = {name: window.probes_for(name, cfg.num_probes, step) for name in names}
    if len({ids.shape[-1] for ids in seqs.values()}) == 1 and len(set(counts.values())) == 1:
        q = hutchinson_squares(model, torch.cat(list(seqs.values())), counts[names[0]], cfg.target, cfg.exact_chunk,
                               step_generator(cfg.seed, step))
        squares = split_by_set(q, seqs, axis=1)
    else:
        squares = {name: hutchinson_squares(model, seqs[name], counts[name], cfg.target, cfg.exact_chunk,
                                            step_generator(cfg.seed, step)) for name in names}
    return pool(window, squares, step)


def pool(window: ProbeWindow, squares: Mapping[str, np.ndarray], step: int) -> dict[str, WindowResult]:
    """Each set's probes of `step` (k, B, L) added to `window`: the step's own estimate and the window's."""
    out = {}
    for name, q in squares.items():
        window.add(name, q, step)
        out[name] = WindowResult(own_estimate(q), window.estimate(name), window.probes(name))
    return out


def excerpts_per_sequence(seq_len: int, chunk_len: int) -> int:
    """Excerpts in one chunked sequence: ceil(L / c), each from another document."""
    return math.ceil(seq_len / chunk_len)


def build_eval_sequences(
    documents: Sequence[Sequence[int] | np.ndarray],
    seq_len: int,
    n_vanilla: int,
    n_chunked: int,
    chunk_len: int,
    chunk_documents: Sequence[Sequence[int] | np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Evaluation sequences ``{"vanilla": (n_vanilla, L), "chunked": (n_chunked, L)}`` of token ids.

    A set with 0 sequences is left out of the result, so that no consumer sees an empty set.
    Policy, deterministic in document order:

    - vanilla i = the i-th document with at least L tokens, truncated to L;
    - chunked: ceil(L / c) excerpts per sequence, excerpt m at positions [m c, (m+1) c), the last one
      cut to fit L (so L <= c gives one excerpt); an excerpt is the first tokens of a document with
      at least min(c, L) tokens. Excerpts come from documents not used by vanilla first, each
      document once; only when those run out do documents repeat (the vanilla ones join the
      rotation), with a warning. A sequence never holds two excerpts of one document.
    - with ``chunk_documents`` the excerpts come from those documents only (e.g. training text),
      ``documents`` then serve vanilla alone.

    Raises ValueError when fewer than n_vanilla documents have L tokens, or fewer distinct documents
    than excerpts per chunked sequence are long enough.
    """
    if seq_len < 1 or chunk_len < 1 or n_vanilla < 0 or n_chunked < 0:
        raise ValueError(f"need seq_len, chunk_len >= 1 and counts >= 0, got {seq_len}, {chunk_len}, "
                         f"{n_vanilla}, {n_chunked}")
    docs = [np.asarray(doc, dtype=np.int64) for doc in documents]
    long_docs = [i for i, doc in enumerate(docs) if len(doc) >= seq_len]
    if len(long_docs) < n_vanilla:
        raise ValueError(f"vanilla needs {n_vanilla} documents of >= {seq_len} tokens, "
                         f"found {len(long_docs)}")
    vanilla_ids = long_docs[:n_vanilla]
    vanilla = [docs[i][:seq_len] for i in vanilla_ids]

    widths = [min(chunk_len, seq_len - s) for s in range(0, seq_len, chunk_len)]  # excerpt lengths
    if chunk_documents is None:
        used = set(vanilla_ids)
        fresh = [i for i, doc in enumerate(docs) if len(doc) >= widths[0] and i not in used]
        pool = fresh + vanilla_ids  # vanilla documents have L >= widths[0] tokens
    else:  # another source shares nothing with vanilla
        docs = [np.asarray(doc, dtype=np.int64) for doc in chunk_documents]
        fresh = pool = [i for i, doc in enumerate(docs) if len(doc) >= widths[0]]
    if n_chunked and len(pool) < len(widths):
        raise ValueError(f"chunked needs {len(widths)} distinct documents of >= {widths[0]} tokens, "
                         f"found {len(pool)}")
    n_excerpts = n_chunked * len(widths)
    if n_excerpts > len(fresh):
        log.warning("chunked: %d excerpts from %d documents not used by vanilla; documents repeat",
                    n_excerpts, len(fresh))
    # Consecutive excerpts walk the pool cyclically, so a sequence (len(widths) <= len(pool)) never
    # repeats a document.
    chunked = [
        np.concatenate([docs[pool[(n * len(widths) + m) % len(pool)]][:w] for m, w in enumerate(widths)])
        for n in range(n_chunked)
    ]

    sets = {"vanilla": vanilla, "chunked": chunked}
    return {name: torch.from_numpy(np.stack(rows)) for name, rows in sets.items() if rows}  # (n, L) each


def journal_path(npz_path: str | os.PathLike) -> Path:
    """The append-only journal beside a ``jacobian.npz``: steps measured since its last rewrite."""
    return Path(npz_path).with_suffix(".journal")


def _record_dtype(sets: Mapping[str, int], seq_len: int, stderr: bool) -> np.dtype:
    """One journal record: the step, each set's (n_seq, L) float32 profiles, then its standard errors.

    Sets in name order; the standard errors (only with ``stderr``) are keyed like the npz, ``stderr/<set>``.
    """
    fields = [("step", "<i8")] + [(name, "<f4", (sets[name], seq_len)) for name in sorted(sets)]
    if stderr:
        fields += [(STDERR_PREFIX + name, "<f4", (sets[name], seq_len)) for name in sorted(sets)]
    return np.dtype(fields)


def _split_stderr(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """npz arrays -> ({set: profiles}, {set: standard errors})."""
    profiles = {k: v for k, v in arrays.items() if not k.startswith(STDERR_PREFIX)}
    stderr = {k.removeprefix(STDERR_PREFIX): v for k, v in arrays.items() if k.startswith(STDERR_PREFIX)}
    return profiles, stderr


def read_jacobian(path: str | os.PathLike, with_stderr: bool = False) -> tuple:
    """Steps (S,) and ``{set: (n_seq, S, L)}`` float32 of a run: ``jacobian.npz`` plus its journal.

    With ``with_stderr`` also ``{set: (n_seq, S, L)}`` of the profiles' standard errors, empty when
    the run's estimator gives none (exact, top_prob). Mid-run, or after a crash, the last steps are
    in the journal only; this is how every reader (plots, compare, a resumed recorder) sees all of
    them. A torn last record is ignored.
    """
    with np.load(path) as z:
        steps = z["steps"]
        arrays = {k: z[k] for k in z.files if k != "steps"}
    journal = journal_path(path)
    profiles, stderr = _split_stderr(arrays)
    if profiles and journal.is_file():
        seq_len = next(iter(profiles.values())).shape[2]
        dtype = _record_dtype({k: v.shape[0] for k, v in profiles.items()}, seq_len, bool(stderr))
        raw = journal.read_bytes()
        records = np.frombuffer(raw, dtype, count=len(raw) // dtype.itemsize)
        # Records at or before the npz's last step were folded into it just before a crash.
        records = records[records["step"] > (steps[-1] if len(steps) else -1)]
        if len(records):
            steps = np.concatenate([steps, records["step"]])
            arrays = {k: np.concatenate([v, records[k].transpose(1, 0, 2)], axis=1) for k, v in arrays.items()}
            profiles, stderr = _split_stderr(arrays)
    return (steps, profiles, stderr) if with_stderr else (steps, profiles)


class JacobianRecorder:
    """Profiles of every measured step in ``jacobian.npz``: ``<set>`` (n_seq, n_steps, L), ``steps``.

    When the estimator gives standard errors (hutchinson), ``stderr/<set>`` holds them, of the
    profiles' shape; the first recorded step decides whether a file has them, and every later step
    must agree (``read_jacobian(path, with_stderr=True)`` reads them back).

    Each step is appended to ``jacobian.journal`` (one fixed-size record), and the journal is folded
    into the npz (rewritten atomically, fsynced) every `fold_every` steps and by `close()`, which also
    removes the journal. So a step costs O(1) however long the run, and a crash keeps every finished
    step: `read_jacobian` reads the npz and the journal together (only a power loss can take the
    journal's unfolded steps). Constructed on an existing file it continues that file (training
    resume); a step at or before the last recorded one drops the recorded steps from it on, because
    a resumed run measures them again. Stored as float32 (7 significant digits over many decades is
    enough for plots and metrics).
    """

    def __init__(self, path: str | os.PathLike, sets: Mapping[str, int], seq_len: int, fold_every: int = 100) -> None:
        if "steps" in sets or any("/" in name for name in sets):
            raise ValueError(f"set names {sorted(sets)}: 'steps' is reserved and '/' marks standard errors")
        if fold_every < 1:
            raise ValueError(f"fold_every={fold_every} must be >= 1")
        self.path = Path(path)
        self.journal = journal_path(self.path)
        self.sets = dict(sets)
        self.seq_len = seq_len
        self.fold_every = fold_every
        self._steps: list[int] = []
        self._rows: dict[str, list[np.ndarray]] = {name: [] for name in self.sets}  # per step (n_seq, L)
        self._stderr_rows: dict[str, list[np.ndarray]] = {name: [] for name in self.sets}
        self._has_stderr: bool | None = None  # unknown until a step is recorded (or read from the file)
        if self.path.exists():
            self._resume()
        self._fold()  # the npz now defines the journal's record layout, and the journal is empty

    def _resume(self) -> None:
        steps, arrays, stderr = read_jacobian(self.path, with_stderr=True)
        expected = {name: (n, len(steps), self.seq_len) for name, n in self.sets.items()}
        found = {k: v.shape for k, v in arrays.items()}
        if found != expected or (stderr and {k: v.shape for k, v in stderr.items()} != expected):
            raise ValueError(f"{self.path} holds {found}, this run expects {expected}")
        self._steps = [int(s) for s in steps]
        self._rows = {name: list(arrays[name].transpose(1, 0, 2)) for name in self.sets}
        if stderr:
            self._has_stderr = True
            self._stderr_rows = {name: list(stderr[name].transpose(1, 0, 2)) for name in self.sets}
        elif len(steps):
            self._has_stderr = False

    @property
    def steps(self) -> np.ndarray:
        return np.asarray(self._steps, dtype=np.int64)

    def _stack(self, rows: list[np.ndarray], name: str) -> np.ndarray:
        if not rows:
            return np.empty((self.sets[name], 0, self.seq_len), dtype=np.float32)
        return np.stack(rows, axis=1)

    def array(self, name: str) -> np.ndarray:
        """Recorded profiles of one set, (n_seq, n_steps, L)."""
        return self._stack(self._rows[name], name)

    def stderr(self, name: str) -> np.ndarray | None:
        """Recorded standard errors of one set, (n_seq, n_steps, L); None when the estimator gives none."""
        return self._stack(self._stderr_rows[name], name) if self._has_stderr else None

    def add(self, step: int, results: Mapping[str, ProfileResult]) -> None:
        """Record one step's results ``{set: ProfileResult}`` (profiles and standard errors (n_seq, L)).

        A journal record, or a fold every `fold_every` steps.
        """
        if set(results) != set(self.sets):
            raise ValueError(f"expected profiles for sets {sorted(self.sets)}, got {sorted(results)}")
        given = {name for name, res in results.items() if res.stderr is not None}
        if given and given != set(self.sets):
            raise ValueError(f"step {step}: standard errors for {sorted(given)} only, of sets {sorted(self.sets)}")
        for name, res in results.items():
            for what, arr in (("profiles", res.profile), ("stderr", res.stderr)):
                if arr is not None and np.shape(arr) != (self.sets[name], self.seq_len):
                    raise ValueError(f"set {name!r}: expected shape {(self.sets[name], self.seq_len)} of {what}, "
                                     f"got {np.shape(arr)}")
        if self._has_stderr is not None and bool(given) != self._has_stderr:
            recorded = "with" if self._has_stderr else "without"
            raise ValueError(f"step {step}: {self.path} was recorded {recorded} standard errors, this step "
                             f"comes {'with' if given else 'without'} (another estimator?)")
        # The npz announces the record layout: the first step with standard errors must rewrite it.
        new_layout = self._has_stderr is None and bool(given)
        self._has_stderr = bool(given)
        keep = bisect.bisect_left(self._steps, step)  # recorded steps increase
        rewind = keep < len(self._steps)
        if rewind:
            log.info("jacobian: step %d already recorded; dropping %d recorded steps from it on",
                     step, len(self._steps) - keep)
            del self._steps[keep:]
            for rows in (*self._rows.values(), *self._stderr_rows.values()):
                del rows[keep:]
        self._steps.append(int(step))
        for name, res in results.items():
            self._rows[name].append(np.asarray(res.profile, dtype=np.float32))
            if self._has_stderr:
                self._stderr_rows[name].append(np.asarray(res.stderr, dtype=np.float32))
        # A rewind drops steps the npz or journal may hold: rewrite from memory.
        if rewind or new_layout or len(self._steps) - self._folded >= self.fold_every:
            self._fold()
            return
        record = np.zeros((), _record_dtype(self.sets, self.seq_len, self._has_stderr))
        record["step"] = step
        for name, res in results.items():
            record[name] = res.profile
            if self._has_stderr:
                record[STDERR_PREFIX + name] = res.stderr
        with open(self.journal, "ab") as f:
            f.write(record.tobytes())

    def close(self) -> None:
        """Fold the journal into the npz and remove it (end of run)."""
        self._fold()
        self.journal.unlink(missing_ok=True)

    def _fold(self) -> None:
        self._write()
        self.journal.write_bytes(b"")  # after the npz replace: a crash in between leaves records read_jacobian skips
        self._folded = len(self._steps)

    def _write(self) -> None:
        arrays = {name: self.array(name) for name in self.sets}
        if self._has_stderr:
            arrays.update({STDERR_PREFIX + name: self.stderr(name) for name in self.sets})
        with atomic_file(self.path, "wb") as f:
            np.savez(f, steps=self.steps, **arrays)
