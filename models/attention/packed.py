"""SDPA for packed rows at the cost of the samples in them, not of the whole row.

A packed row (`data_builders.collate.collate_packed`) holds several samples with `position_ids`
restarting at 0 in each. transformers turns that into a block-diagonal causal mask for sdpa, and
SDPA with an explicit mask computes all L x L scores of the row: on an IN2 mix packed into 2K rows
that made packing slower than padding on the CPU. flash_attention_2 instead runs each sample on its
own (varlen); this is the same for SDPA: the attention implementation `sdpa_packed` runs causal SDPA
on every sample of a row separately (sum of n_i² instead of L²; fused kernels, no mask tensor).

It applies only where it is exact: calls without an attention mask (packed batches carry none),
on layers without a sliding window. Everything else (padded batches, sliding-window layers)
gets transformers' own SDPA and mask. The training loop switches a model to it when `data.packing`
is on with `model.attn_implementation=sdpa`; the name is never saved in a checkpoint's config.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_PACKED = "sdpa_packed"

_segments_of: tuple[torch.Tensor | None, list[list[tuple[int, int]]]] = (None, [])  # the forward's position_ids


def segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of every sample in each row: a new one wherever the position does not go up by 1
    (transformers' rule for packed sequences). Computed once per forward: every layer gets the same tensor."""
    global _segments_of
    if _segments_of[0] is not position_ids:
        starts = torch.diff(position_ids, dim=-1) != 1  # (B, L-1): True before a restart
        bounds = [[0, *(i + 1 for i in row.nonzero().flatten().tolist()), position_ids.shape[-1]]
                  for row in starts.cpu()]
        _segments_of = (position_ids, [list(zip(b, b[1:])) for b in bounds])
    return _segments_of[1]


def packed_sdpa_mask(*args, attention_mask: torch.Tensor | None = None, local_size: int | None = None, **kwargs):
    """No mask for a packed batch (the attention below separates its samples); transformers' otherwise."""
    if attention_mask is None and local_size is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, local_size=local_size, **kwargs)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None, **kwargs):
    """Causal SDPA per sample of each packed row; transformers' SDPA when there is a mask or one sample per row.

    query (B, H, L, d), key/value (B, Hkv, L, d) -> (B, L, H, d), like `sdpa_attention_forward`.
    """
    if attention_mask is not None or position_ids is None or kwargs.get("sliding_window"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = segments(position_ids)  # the forward's own tensor: the cache above keys on it
    rows = rows * query.shape[0] if len(rows) == 1 else rows  # (1, L) position_ids serve every row
    if all(len(row) == 1 for row in rows):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    out = torch.cat([
        torch.cat([sdpa_attention_forward(module, query[i:i + 1, :, a:b], key[i:i + 1, :, a:b],
                                          value[i:i + 1, :, a:b], None, **kwargs)[0] for a, b in row], dim=1)
        for i, row in enumerate(rows)
    ])  # (B, L, H, d)
    return out, None


AttentionInterface.register(SDPA_PACKED, packed_sdpa_attention)
AttentionMaskInterface.register(SDPA_PACKED, packed_sdpa_mask)
