"""Benchmark of differential attention (V1, V2) against the standard attention of the same tiny model.

    python scripts/bench_diff.py        # or: python -m scripts.bench diff

One training step (forward + backward of the LM loss) at L=1024 on a tiny random Qwen2 (hidden 64,
4 heads, 2 KV heads, 2 layers, SDPA); time is the best of the repeats, `ratio` the time against standard
attention. On CPU the step runs on one thread and is timed by that thread's CPU time, which other
processes on a shared machine disturb far less than wall time; on CUDA it is wall time.

Memory: on CUDA, the peak allocated during the step above what was allocated before it. On CPU, where no
allocator reports a peak, the bytes of the distinct tensors autograd saves for the backward pass
(parameters excluded): the activation memory a training step holds at its peak. It misses transient
kernel workspace, so it is a lower bound of the true peak; `mem_ratio` compares like with like.

At this size SDPA is most of a standard step, and every diff variant runs twice the softmax-map work
(V2 and retrofit: 2H query heads; V1: half the heads but 2d-wide values, fed to the fused kernel as two
d-wide halves), so expect ratios near 2x here and far less where projections and MLPs dominate.
"""

import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from models.diff_attention import convert_to_diff_attention, set_diff_step

VARIANTS = [("standard", None, None), ("diff_v1", "v1", "scratch"), ("diff_v2", "v2", "scratch"),
            ("diff_v1 retrofit", "v1", "retrofit")]


def _model(version, mode, layers: int, device: torch.device):
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if version is not None:
        convert_to_diff_attention(model, version=version, mode=mode,
                                  lambda_warmup_steps=1 if mode == "retrofit" else 0)
        set_diff_step(model, 1)
    return model.to(device).train()


def _step_memory(model, ids) -> int:
    """Bytes of the step's peak (CUDA) or of the tensors saved for backward (CPU)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return sum(saved.values())


def _step_seconds(model, ids) -> float:
    """Wall time of one step on CUDA; on CPU the CPU time of the (single) calling thread."""
    if ids.is_cuda:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    else:
        start = time.thread_time()
        model(ids, labels=ids).loss.backward()
        elapsed = time.thread_time() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def bench_diff(seq_len: int = 1024, batch: int = 1, layers: int = 2, repeats: int = 7) -> list[dict]:
    """Rows `{name, ratio, step_ms, mem_mb, mem_ratio, ...}`; ratios are against standard attention.

    The variants take turns within each repeat, so a load change on a shared machine hits them all.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.randint(0, 100, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    models = {name: _model(version, mode, layers, device) for name, version, mode in VARIANTS}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # one thread, so its CPU time is the step's whole cost
    try:
        memory = {name: _step_memory(model, ids) for name, model in models.items()}  # also warms kernels up
        best = dict.fromkeys(models, float("inf"))
        for _ in range(repeats):
            for name, model in models.items():
                best[name] = min(best[name], _step_seconds(model, ids))
    finally:
        torch.set_num_threads(threads)
    base = VARIANTS[0][0]
    return [{
        "name": f"{name} L={seq_len}",
        "ratio": best[name] / best[base],
        "step_ms": 1000 * best[name],
        "mem_mb": memory[name] / 2**20,
        "mem_ratio": memory[name] / memory[base],
        "mem_kind": "cuda peak" if device.type == "cuda" else "saved for backward",
        "params": sum(p.numel() for p in model.parameters()),
    } for name, model in models.items()]


if __name__ == "__main__":
    for row in bench_diff():
        print(json.dumps(row))
