"""The key of an evaluation: what its answers depend on, and nothing else. `analysis.evaluation.answer_record`
files each evaluation's answers under it, so a killed evaluation continues, and the jobs of a study, which all
start from the same checkpoint, answer step 0 once (SmolLM2: ~4 min for 50 questions at 1K tokens).

The answers depend only on the function the weights compute and on the encoded prompts and generation settings,
so the key hashes exactly those: every parameter and buffer (name, dtype, shape, bytes), the model config, each
item's token ids, answers and position, the probe settings, the batching (left padding changes float rounding),
the torch version, the device type, the autocast dtype and the attention implementation.
A LoRA adapter whose B is all zero adds exactly 0 (x A^T B^T with B = 0), so its A is left out: runs whose
only difference is the adapters' random init share the key. Anything else that differs (a seed-drawn
parameter, one changed weight) makes another key, so a hit is always the same answers, never stale ones.

A result file records the same two things apart (`analysis.evaluation.result`): `function_digest` of the weights it
evaluated, and `item_digest` of each item it asked, hashed as the key hashes items.
"""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch

from data_builders.probes import ProbeItem


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def _inert_lora_a(model: torch.nn.Module) -> set[str]:
    """Names of LoRA A weights whose B partner is all zero: they cannot change any output."""
    params = dict(model.named_parameters())
    inert = set()
    for name in params:
        if ".lora_A." in name:
            partner = params.get(name.replace(".lora_A.", ".lora_B."))
            if partner is not None and not torch.count_nonzero(partner):
                inert.add(name)
    return inert


def is_adapter_tensor(name: str) -> bool:
    """A peft tensor: a LoRA weight, or a modules_to_save copy (peft's `disable_adapter()` skips both)."""
    return ".lora_" in name or ".modules_to_save." in name


def function_digest(model: torch.nn.Module, adapters: bool = True) -> str:
    """sha256 of what the model computes: its config and every tensor but inert LoRA A weights; with
    `adapters=False`, what it computes with its adapters off (peft's `disable_adapter()`): no adapter tensor."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    skip = _inert_lora_a(model)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in skip or (not adapters and is_adapter_tensor(name)):
            continue
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def computation_key(model: torch.nn.Module, adapters: bool = True) -> str:
    """sha256 of the function and of how it is computed: the weights (`function_digest`, with or without the
    adapters) and the kernels and precision, which the weights do not say (torch version, device type, autocast
    dtype, attention kernel)."""
    device = next(model.parameters()).device.type
    autocast = str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    how = json.dumps({"torch": torch.__version__, "device": device, "autocast": autocast, "attention": attention},
                     sort_keys=True)
    return hashlib.sha256(f"{function_digest(model, adapters)}|{how}".encode()).hexdigest()


def _item_text(item: ProbeItem) -> str:
    """What an item asks, as text: its id, prompt (text or token ids), answers, position, label and question."""
    return json.dumps([item.id, item.prompt, item.answers, item.position, item.label, item.query], default=str)


def item_digest(item: ProbeItem) -> str:
    """sha256 (16 hex digits) of what the item asks (`_item_text`): two results whose outcomes of one id carry the
    same digest were asked the same prompt for the same answers (`analysis.evaluation.result`)."""
    return hashlib.sha256(_item_text(item).encode()).hexdigest()[:16]


def evaluation_key(model: torch.nn.Module, items: Sequence[ProbeItem], settings: dict) -> str:
    """The cache key of asking `model` `items` under `settings` (generation, batching and scoring)."""
    digest = hashlib.sha256(computation_key(model).encode())
    digest.update(json.dumps({"settings": settings}, sort_keys=True, default=str).encode())
    for it in items:
        digest.update(_item_text(it).encode())
    return digest.hexdigest()[:32]
