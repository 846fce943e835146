"""Attention calibration ("found-in-the-middle") as a plug-in inference intervention on Qwen2/Llama/Mistral.

Source: Hsieh et al. 2024, "Found in the Middle: Calibrating Positional Attention Bias Improves Long Context
Utilization" (Findings of ACL 2024, arXiv:2406.16008): Sec. 2.1 (a document's attention), Sec. 3.2, Eq. 3-4
(calibrated attention), Sec. 4.1, Eq. 5-6 (the redistribution), App. B (the last 16 of 32 layers, all heads,
t = 5e-5). The paper released no code; this is written from its equations.

Definitions, for a prompt holding K segments (mdqa documents, kv pairs) at token spans S_1..S_K, in one
calibrated layer and head:

1. A segment's attention (Sec. 2.1): Attn(x_k, k) = (1/N_k) sum_{i in S_k} a_i, the mean weight the query
   gives the N_k tokens of segment k.
2. Reference (Eq. 3): the same prompt with segment k's tokens replaced by a dummy document of the same token
   length (`dummy_text`'s tokens, repeated), so every token keeps its position; one forward pass per
   segment (the paper's O(K) extra passes): ref_k = Attn(dummy, k) of the last prompt token (the query that
   predicts the answer's first token). The tokens before segment k are the prompt's own in pass k, so their
   keys and values are computed once and each pass runs only from its segment on (10 evenly long documents:
   about 60% of the tokens of K full passes). `reference=dummy_shared` swaps every segment for the
   dummy in one pass (1 extra pass instead of K, so it fits a real model on a CPU): ref_k is then the dummy's
   attention at position k beside other dummies rather than beside the real documents, an approximation.
3. Calibrated relevance (Eq. 4): rel_k = Attn(x_k, k) - ref_k.
4. Redistribution (Eq. 5): a'_i = C * alpha_k / Attn(x_k, k) * a_i for i in S_k, with alpha = softmax(rel / t)
   over the segments (`weighting=softmax`, the paper's) and C such that sum_k sum_{i in S_k} a'_i equals
   sum_k sum_{i in S_k} a_i: the query's total segment attention is unchanged, the attention outside segments
   (instructions, question, generated tokens) is untouched, and within a segment the tokens keep their
   proportions; each segment's mean attention becomes proportional to alpha_k (Eq. 6).
   `weighting=proportional` takes alpha_k proportional to max(rel_k, 0) (the segment's mean attention
   proportional to its calibrated relevance itself, no temperature): with a zero reference
   (`reference=zero`) it is the identity, which the exactness tests check; a row whose relevances are all
   <= 0 is left as it is.

What the paper leaves open, and what is done here:

- Granularity: relevance, alpha and the rescaling are per layer, head and query row (Eq. 5 rescales the
  weights of the head that computed them); the paper's analysis averages over layers and heads.
- Which rows: the queries after the last segment, i.e. the question after the documents (or the key after
  the pairs), the answer prompt and every generated token; a query inside the documents cannot see the later
  ones. The reference (the last prompt token's) is held while decoding; each query's own attention gives its
  Attn(x_k, k).
- The dummy document: the paper does not print one; `dummy_text` (a content-free sentence) is a setting.
- Segments with no attention at all (beyond a sliding window) are left out of the redistribution.

Only the calibrated rows are recomputed (in float32, or float64 for float64 models, with the model's
mask); every other output of the layer is the attention kernel's own, so rows before the documents' end
are bit-identical to the plain model's.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from data_builders.files import atomic_file
from models.attention.patching import (
    LayerSet,
    attention_window,
    check_patchable_attention,
    chosen_indices,
    patched_forwards,
    resolve_layers,
)

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")  # kernels whose 4D (or absent, causal) masks the recomputed rows read
LAYER_SETS = (LayerSet.last_half, LayerSet.all)  # the named `layers` settings


class Weighting(StrEnum):
    softmax = "softmax"  # alpha = softmax(rel / t): the paper's Eq. 5
    proportional = "proportional"  # alpha proportional to max(rel, 0): the identity under a zero reference


class Reference(StrEnum):
    dummy = "dummy"  # the dummy document at each segment's position (the paper's Eq. 3): K passes
    dummy_shared = "dummy_shared"  # every segment a dummy at once: 1 pass, an approximation of Eq. 3
    zero = "zero"  # no positional reference: redistribute by the raw attention (an ablation; identity check)


@dataclass
class AttnCalibrationConfig:
    """attn_calibration settings; each default is the paper's where it states one."""

    # "last_half": the last half of the layers (App. B: the last 16 of 32); "all"; or 0-based layer indices
    layers: Any = "last_half"  # (Any: OmegaConf takes no str | list union)
    heads: Any = "all"  # "all" (App. B) or 0-based query-head indices, in every calibrated layer
    temperature: float = 5e-5  # t of Eq. 5 (App. B: 5e-5 in every experiment)
    weighting: Weighting = Weighting.softmax
    reference: Reference = Reference.dummy
    dummy_text: str = "This passage is intentionally left blank."
    # keep each prompt's reference on disk (<POSDEBIAS_CACHE>/calibration_references) and read it back in later
    # runs of the same model and prompts: a temperature sweep measures the references once (read by the caller,
    # which hashes the weights into the `ReferenceCache` it passes)
    reuse_reference: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"attn_calibration.temperature={self.temperature}: must be > 0")
        if not self.dummy_text.strip():
            raise ValueError("attn_calibration.dummy_text is empty: the reference needs dummy tokens")
        self.weighting, self.reference = Weighting(self.weighting), Reference(self.reference)

    def layer_indices(self, num_layers: int) -> list[int]:
        """0-based indices of the calibrated layers ("last_half": L//2 .. L-1, "all", or the list)."""
        return resolve_layers(self.layers, num_layers, LAYER_SETS, "attn_calibration.layers")


def resolve_heads(heads: str | Sequence[int], num_heads: int) -> list[int]:
    """0-based query heads calibrated in each chosen layer ("all" or the list)."""
    return chosen_indices(heads, num_heads, {"all": list(range(num_heads))}, "attn_calibration.heads")


def check_attn_calibration(model: nn.Module, cfg: AttnCalibrationConfig | None = None) -> None:
    """Raise ValueError naming why attention calibration cannot be applied to `model` (and `cfg`)."""
    config = model.config
    check_patchable_attention(config, "attn_calibration", "rescales the one softmax map of standard heads",
                              ATTN_IMPLEMENTATIONS, "recomputes attention rows with the model's mask")
    if cfg is not None:
        cfg.layer_indices(config.num_hidden_layers)
        resolve_heads(cfg.heads, config.num_attention_heads)


def redistribute(probs: torch.Tensor, segment_of_key: torch.Tensor, reference: torch.Tensor,
                 weighting: Weighting | str, temperature: float) -> torch.Tensor:
    """Eq. 5 on attention rows: probs (B, H, Q, S), segment_of_key (B, S) (segment index, -1 outside every
    segment), reference (B, H, K) the dummy attention of each segment -> the recalibrated probs."""
    num_segments = reference.shape[-1]
    if num_segments == 0:
        return probs
    inside = segment_of_key >= 0
    onehot = _segment_onehot(segment_of_key, num_segments, probs.dtype)  # (B, S, K)
    mass = probs @ onehot[:, None]  # (B, H, Q, K): each segment's total attention
    count = onehot.sum(1)[:, None, None, :]  # (B, 1, 1, K): its tokens
    present = (count > 0) & (mass > 0)
    mean = mass / count.clamp(min=1)  # Attn(x_k, k)
    rel = mean - reference[:, :, None, :].to(probs.dtype)  # Eq. 4 (up to the constant rel(x_dum))
    if Weighting(weighting) == Weighting.softmax:
        alpha = (rel / temperature).masked_fill(~present, float("-inf")).softmax(-1).nan_to_num(0.0)
    else:
        alpha = rel.clamp(min=0) * present
    factor = torch.where(present, alpha / mean.where(present, 1.0), 0.0)  # alpha_k / Attn(x_k, k)
    total, new_total = mass.sum(-1, keepdim=True), (factor * mass).sum(-1, keepdim=True)
    usable = new_total > 0  # rows with some segment to keep (proportional: some positive relevance)
    scale = torch.where(usable, factor * total / new_total.where(usable, 1.0), 1.0)  # C * alpha_k / Attn
    token_scale = scale @ onehot.transpose(1, 2)[:, None]  # (B, H, Q, S)
    return probs * torch.where(inside[:, None, None, :], token_scale, 1.0)


def _segment_onehot(segment_of_key: torch.Tensor, num_segments: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) segment labels (-1: none) -> (B, S, K) membership, zero rows outside every segment."""
    onehot = nn.functional.one_hot(segment_of_key.clamp(min=0), max(num_segments, 1))[..., :num_segments]
    return (onehot * (segment_of_key >= 0)[..., None]).to(dtype)


def segment_attention(probs: torch.Tensor, segment_of_key: torch.Tensor, num_segments: int) -> torch.Tensor:
    """(B, H, Q, K) mean attention of each segment's tokens, Attn(x_k, k) (0 for an empty segment)."""
    onehot = _segment_onehot(segment_of_key, num_segments, probs.dtype)
    return (probs @ onehot[:, None]) / onehot.sum(1)[:, None, None, :].clamp(min=1)


@dataclass
class _State:
    """What the installed forwards read: the mode, and per mode its inputs and outputs."""

    mode: str = "off"  # off | measure (record the reference) | calibrate
    probe_segments: torch.Tensor | None = None  # measure: (B, S) segment of each dummy token, -1 elsewhere
    num_segments: int = 0  # measure: K
    measured: dict[int, torch.Tensor] = field(default_factory=dict)  # measure: layer -> (B, Hc, K) mean attention
    segment_of_key: torch.Tensor | None = None  # calibrate: (B, W) segment per prompt column, -1 outside
    start: torch.Tensor | None = None  # calibrate: (B,) first column calibrated (after the last segment)
    first_start: int = 0  # calibrate: start.min(), kept on the host (no device sync in every forward)
    reference: dict[int, torch.Tensor] = field(default_factory=dict)  # calibrate: layer -> (B, Hc, K)
    calibrated_rows: torch.Tensor | int = 0  # query rows recalibrated so far, summed over layers (for checks)


def _allowed(mask: Any, rows: slice, q_cols: torch.Tensor, num_keys: int, window: int | None,
             batch: int) -> torch.Tensor:
    """(B, 1, Q, S) bool: the keys each query row attends to, read from the layer's mask."""
    device = q_cols.device
    if mask is None:  # sdpa's causal shortcut: causal (and the window, which the kernel would apply)
        k_cols = torch.arange(num_keys, device=device)
        keys = k_cols[None, :] <= q_cols[:, None]
        if window is not None:
            keys = keys & (k_cols[None, :] > q_cols[:, None] - window)
        return keys[None, None].expand(batch, 1, -1, -1)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"attn_calibration reads 4D attention masks; got {type(mask).__name__} "
                         f"{getattr(mask, 'shape', '')}")
    part = mask[:, :, rows, :num_keys]
    keys = part if part.dtype == torch.bool else part > torch.finfo(part.dtype).min / 2
    return keys.expand(batch, 1, -1, -1)


def _make_forward(module: nn.Module, model_type: str, heads: list[int], cfg: AttnCalibrationConfig,
                  state: _State) -> Callable:
    """The calibrated forward of one attention module (HF's attention forward, plus the recomputed rows)."""
    modeling = sys.modules[type(module).__module__]  # the architecture's own helpers, as its forward uses
    apply_rotary, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward
    window, window_kwargs = attention_window(module, model_type)
    groups = module.num_key_value_groups
    head_index = torch.tensor(heads, device=module.q_proj.weight.device)  # the chosen query heads
    layer = module.layer_idx

    def rows_probs(query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax attention of the chosen heads' query rows (B, Hc, Q, d) over the keys, in float32+."""
        dtype = torch.promote_types(query.dtype, torch.float32)
        keys = key[:, head_index // groups]  # each chosen query head's key head
        logits = (query.to(dtype) @ keys.to(dtype).transpose(2, 3)) * module.scaling
        return logits.masked_fill(~allowed, float("-inf")).softmax(-1)

    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:  # the pre-5 keyword name
            cache = kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, L, d)
        key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, L, d)
        value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin)
        offset = cache.get_seq_length(layer) if cache is not None else 0  # columns before this forward's queries
        if cache is not None:
            key, value = cache.update(key, value, layer, kwargs=kwargs)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
        attn_output, attn_weights = interface(
            module, query, key, value, attention_mask,
            dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling,
            **window_kwargs, **kwargs,
        )  # (B, L, H, d)
        batch, num_queries, num_keys = query.shape[0], query.shape[2], key.shape[2]
        q_cols = torch.arange(offset, offset + num_queries, device=query.device)
        chosen = query[:, head_index]
        if state.mode == "measure":  # the last token's attention to each dummy segment of each row
            last = slice(num_queries - 1, num_queries)
            allowed = _allowed(attention_mask, last, q_cols[last], num_keys, window, batch)
            probs = rows_probs(chosen[:, :, last], key, allowed)  # (B, Hc, 1, S)
            state.measured[layer] = segment_attention(probs, state.probe_segments, state.num_segments)[:, :, 0]
        elif state.mode == "calibrate":
            first = max(state.first_start - offset, 0)  # the first local row any batch row calibrates
            if first < num_queries:
                rows = slice(first, num_queries)
                allowed = _allowed(attention_mask, rows, q_cols[rows], num_keys, window, batch)
                probs = rows_probs(chosen[:, :, rows], key, allowed)
                segment_of_key = state.segment_of_key.to(query.device)
                if num_keys > segment_of_key.shape[1]:  # generated tokens belong to no segment
                    segment_of_key = nn.functional.pad(segment_of_key, (0, num_keys - segment_of_key.shape[1]),
                                                       value=-1)
                probs = redistribute(probs, segment_of_key[:, :num_keys], state.reference[layer],
                                     cfg.weighting, cfg.temperature)
                values = value[:, head_index // groups]
                new = (probs.to(value.dtype) @ values).transpose(1, 2)  # (B, Q', Hc, d)
                keep = (q_cols[rows][None, :] >= state.start.to(query.device)[:, None])  # (B, Q')
                part = attn_output[:, rows]  # a view: (B, Q', H, d)
                part[:, :, head_index] = torch.where(
                    keep[:, :, None, None], new.to(part.dtype), part[:, :, head_index])
                state.calibrated_rows = state.calibrated_rows + keep.sum()  # a device tensor: no sync here
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return module.o_proj(attn_output), attn_weights

    return forward


def token_spans(offsets: Sequence[tuple[int, int]], char_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges [first, last + 1) of ordered, disjoint character spans, from a tokenizer's offset mapping: a
    token belongs to the first span it overlaps (special tokens, offset (0, 0), to none)."""
    if any(b0 > a1 for (_, b0), (a1, _) in zip(char_spans, char_spans[1:])):
        raise ValueError(f"segment spans {list(char_spans)} overlap or are out of order")
    ends = [b for _, b in char_spans]
    first: list[int | None] = [None] * len(char_spans)
    last = [0] * len(char_spans)
    for t, (s, e) in enumerate(offsets):
        k = bisect.bisect_right(ends, s)  # the first span ending after the token starts
        if e > s and k < len(char_spans) and char_spans[k][0] < e:
            first[k] = t if first[k] is None else first[k]
            last[k] = t
    empty = [char_spans[k] for k, f in enumerate(first) if f is None]
    if empty:
        raise ValueError(f"characters {empty[0][0]}..{empty[0][1]} of the prompt hold no token of their own")
    return [(f, l + 1) for f, l in zip(first, last)]


def encode_with_segments(tokenizer: PreTrainedTokenizerBase, prompt: str, segments: Sequence[tuple[int, int]],
                         chat_template: bool = False, who: str = "segments") -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of a text prompt (as `analysis.evaluation.generate.encode_prompt` makes them) and the token ranges
    of its character `segments` (documents, kv pairs); ValueError naming `who` when they cannot be located."""
    if not tokenizer.is_fast:
        raise ValueError(f"{who} maps documents to tokens with the tokenizer's offsets: it needs a fast tokenizer, "
                         f"got {type(tokenizer).__name__}")
    text, shift, special = prompt, 0, True
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        shift, special = text.index(prompt), False
        expected = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if chat_template and ids != expected:
        raise ValueError(f"{who}: the chat template's text does not re-tokenize to its ids, so the documents' tokens "
                         "cannot be located; use chat_template=false")
    return ids, token_spans(encoded["offset_mapping"], [(a + shift, b + shift) for a, b in segments])


@dataclass(frozen=True)
class ReferenceCache:
    """References kept on disk across runs (a temperature sweep, a rerun): the reference of a prompt depends on
    the function the model computes, the calibrated layers and heads, the reference kind and dummy, and the
    prompt's tokens and segments, never on the temperature or the weighting. `model_key` names the function
    (the caller hashes the weights, kernels and precision); the rest is hashed here, so a hit is always the
    same measurement."""

    root: Path
    model_key: str

    def path(self, cfg: AttnCalibrationConfig, layers: Sequence[int], heads: Sequence[int],
             dummy_ids: Sequence[int], ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> Path:
        what = {"model": self.model_key, "layers": list(layers), "heads": list(heads),
                "reference": str(cfg.reference), "dummy": list(dummy_ids), "ids": list(ids),
                "spans": [list(span) for span in spans]}
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
        return Path(self.root) / f"{digest}.pt"


class AttnCalibration:
    """Yielded by `attn_calibration`: encodes prompts with their segments' token spans, and wraps each generate
    batch in `batch(...)`, which measures the reference and switches the installed layers to calibrating."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: AttnCalibrationConfig,
                 layers: list[int], heads: list[int], state: _State, cache: ReferenceCache | None) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.layers, self.heads, self.state, self.cache = layers, heads, state, cache
        self.dummy_ids = tokenizer(cfg.dummy_text, add_special_tokens=False)["input_ids"]
        if not self.dummy_ids:
            raise ValueError(f"attn_calibration.dummy_text={cfg.dummy_text!r} encodes to no token")
        self.references_reused = 0  # prompts whose reference was read from `cache`

    @property
    def calibrated_rows(self) -> int:
        return int(self.state.calibrated_rows)

    def encode(self, prompt: str, segments: Sequence[tuple[int, int]], chat_template: bool = False
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a text prompt (as `encode_prompt` makes them) and its segments' token ranges."""
        return encode_with_segments(self.tokenizer, prompt, segments, chat_template, "attn_calibration")

    def _forward(self, ids: torch.Tensor, cache: DynamicCache | None = None) -> None:
        """One pass of a (1, L) id row after `cache`'s tokens (none: from the start), the last logit only."""
        past = cache.get_seq_length() if cache is not None else 0
        ids = ids.to(self.model.device)
        with torch.no_grad():
            self.model(input_ids=ids, attention_mask=torch.ones(1, past + ids.shape[1], dtype=torch.long,
                                                                device=ids.device),
                       cache=cache, use_cache=cache is not None, logits_to_keep=1)

    def _measure(self, ids: torch.Tensor, labels: torch.Tensor, cache: DynamicCache | None = None
                 ) -> dict[int, torch.Tensor]:
        """layer -> (Hc, K): the last token's mean attention over each labelled segment, for `ids` after `cache`."""
        self.state.mode, self.state.probe_segments = "measure", labels[None].to(self.model.device)
        try:
            self._forward(ids[None], cache)
        finally:
            self.state.mode, self.state.probe_segments = "off", None
        return {layer: self.state.measured[layer][0].float().cpu() for layer in self.layers}

    def prompt_attention(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """layer -> (Hc, K): Attn(x_k, k) of the last prompt token over the prompt's own segments (no swap): with
        the reference it gives that token's calibrated relevance, rel = Attn(x_k, k) - ref_k."""
        labels = torch.full((len(ids),), -1, dtype=torch.long)
        for k, (a, b) in enumerate(spans):
            labels[a:b] = k
        self.state.num_segments = len(spans)
        return self._measure(torch.tensor(list(ids)), labels)

    def references(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """layer -> (Hc, K): each segment's dummy attention at its position, from the last prompt token (read
        from the reference cache when a run before measured the same prompt)."""
        if self.cfg.reference == Reference.zero or not spans:
            return {layer: torch.zeros(len(self.heads), len(spans)) for layer in self.layers}
        path = self.cache.path(self.cfg, self.layers, self.heads, self.dummy_ids, ids, spans) if self.cache else None
        if path is not None and path.exists():
            self.references_reused += 1
            return torch.load(path)
        self.state.num_segments = len(spans)
        if self.cfg.reference == Reference.dummy_shared:
            measured = self._measure(*self._swapped(ids, list(enumerate(spans))))
        else:
            measured = self._per_segment(ids, spans)
        if path is not None:
            with atomic_file(path) as f:  # a run killed while writing leaves no half file for the next to read
                torch.save(measured, f)
        return measured

    def _per_segment(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Eq. 3, one pass per segment, the last-starting first: the cache holds the prompt's own keys and values
        up to the segment's start (cropped back after each pass), so pass k runs only the tokens from S_k on."""
        measured = {layer: torch.zeros(len(self.heads), len(spans)) for layer in self.layers}
        cache = DynamicCache()  # full layers even where the model slides a window: each pass's labels span every key
        last_first = sorted(range(len(spans)), key=lambda k: spans[k][0], reverse=True)
        shared = spans[last_first[0]][0]  # the tokens before the last segment are every pass's own
        if shared:
            self._forward(torch.tensor([list(ids[:shared])]), cache)
        for k in last_first:
            start = spans[k][0]
            if cache.get_seq_length() > start:  # back to the prompt's own tokens (a negative crop: tokens removed)
                cache.crop(start - cache.get_seq_length())
            copy, labels = self._swapped(ids, [(k, spans[k])])
            for layer, ref in self._measure(copy[start:], labels, cache).items():
                measured[layer][:, k] = ref[:, k]
        return measured

    def _swapped(self, ids: Sequence[int], segments: Sequence[tuple[int, tuple[int, int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` with each of `segments` ((k, span) pairs) replaced by the dummy's tokens (repeated to the span's
        length), and every token's segment label: k on the swapped tokens, -1 elsewhere."""
        copy, labels = torch.tensor(list(ids)), torch.full((len(ids),), -1, dtype=torch.long)
        for k, (a, b) in segments:
            copy[a:b] = torch.tensor([self.dummy_ids[i % len(self.dummy_ids)] for i in range(b - a)])
            labels[a:b] = k
        return copy, labels

    @contextmanager
    def batch(self, prompts: Sequence[Sequence[int]], spans: Sequence[Sequence[tuple[int, int]]], width: int
              ) -> Iterator[None]:
        """Calibrate a left-padded batch of `prompts` (padded to `width`) with segments at `spans`."""
        if not any(spans):
            yield
            return
        num_segments = max(len(s) for s in spans)
        segment_of_key = torch.full((len(prompts), width), -1, dtype=torch.long)
        start = torch.full((len(prompts),), width, dtype=torch.long)
        reference = {layer: torch.zeros(len(prompts), len(self.heads), num_segments) for layer in self.layers}
        for row, (ids, row_spans) in enumerate(zip(prompts, spans)):
            pad = width - len(ids)
            for k, (a, b) in enumerate(row_spans):
                segment_of_key[row, pad + a:pad + b] = k
            if row_spans:
                start[row] = pad + max(b for _, b in row_spans)
            for layer, ref in self.references(ids, row_spans).items():
                reference[layer][row, :, :ref.shape[1]] = ref
        device = self.model.device
        self.state.segment_of_key, self.state.start = segment_of_key.to(device), start.to(device)
        self.state.first_start = int(start.min())
        self.state.reference = {layer: ref.to(device) for layer, ref in reference.items()}
        self.state.mode = "calibrate"
        try:
            yield
        finally:
            self.state.mode, self.state.reference = "off", {}
            self.state.segment_of_key = self.state.start = None


@contextmanager
def attn_calibration(model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: AttnCalibrationConfig | None = None,
                     cache: ReferenceCache | None = None) -> Iterator[AttnCalibration]:
    """Install the calibrated forward on `cfg.layers`; restore the model's forwards on exit (errors too).

    Outside a `batch(...)` the layers compute what the plain model computes. `cache` keeps each prompt's
    reference on disk for later runs of the same model (None: measured every time).
    """
    cfg = cfg if cfg is not None else AttnCalibrationConfig()
    check_attn_calibration(model, cfg)
    layers = cfg.layer_indices(model.config.num_hidden_layers)
    heads = resolve_heads(cfg.heads, model.config.num_attention_heads)
    state = _State()
    modules = {i: model.model.layers[i].self_attn for i in layers}

    def install(idx: int, module: nn.Module) -> Callable:
        return _make_forward(module, model.config.model_type, heads, cfg, state)

    with patched_forwards(modules, install, "attn_calibration"):
        yield AttnCalibration(model, tokenizer, cfg, layers, heads, state, cache)
