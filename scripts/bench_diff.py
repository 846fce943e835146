"""Benchmark of differential attention (V1, V2) against standard attention in the same model.

    python scripts/bench_diff.py        # or: python -m scripts.bench diff

One training step (forward + backward of the LM loss) at L=1024 with SDPA, on two shapes:
- `qwen2_tiny`: the project's CPU model (`conf/model/qwen2_tiny.yaml`, hidden 64, head dim 16, the
  1024-token BPE vocabulary of `data=in2_synthetic`), where the attention maps are ~2/3 of a step;
- `qwen2_shape`: Qwen2's proportions at a CPU-sized width (hidden 512, 8 heads of 64, 2 KV heads, MLP
  5.5x hidden, 2 layers, vocab 8192), where projections and MLP take their usual share.
Time is the best of the repeats and `ratio` the time against standard attention. On CPU the step runs
on one thread and is timed by that thread's CPU time, which other processes on a shared machine disturb
far less than wall time; on CUDA it is wall time.

Memory: on CUDA, the peak allocated during the step above what was allocated before it. On CPU, where no
allocator reports a peak, the bytes of the distinct tensors autograd saves for the backward pass
(parameters excluded): the activation memory a training step holds at its peak. It misses transient
kernel workspace, so it is a lower bound of the true peak; `mem_ratio` compares like with like.

What to expect: V1 scratch computes as many softmax maps as the baseline (half the heads, two maps each)
with 2d-wide values, ~1.3x the attention kernel's time. V2 and retrofit compute 2H maps by definition,
twice the baseline's, so their ratio is about 1 + (attention's share of the step): near 1.7x on the
tiny model, under 1.2x at Qwen2's proportions.
"""

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from models.attention.diff_attention import set_diff_step
from models.build import DiffConfig, ModelConfig, build_model

VARIANTS = [("standard", "standard", "scratch"), ("diff_v1", "diff_v1", "scratch"),
            ("diff_v2", "diff_v2", "scratch"), ("diff_v1 retrofit", "diff_v1", "retrofit")]
TINY_VOCAB = 1024  # data=in2_synthetic's BPE vocabulary (DataConfig.vocab_size)
SHAPES = {
    "qwen2_tiny": (dict(OmegaConf.load(Path(__file__).parents[1] / "conf/model/qwen2_tiny.yaml").init), TINY_VOCAB),
    "qwen2_shape": (dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=2816, tie_word_embeddings=True), 8192),
}


def _model(shape: str, attention: str, mode: str, device: torch.device):
    init, vocab = SHAPES[shape]
    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", init={**init, "attn_implementation": "sdpa"}, attention=attention,
                      diff=DiffConfig(mode=mode, lambda_warmup_steps=1 if mode == "retrofit" else 0))
    model = build_model(cfg, vocab_size=vocab)
    set_diff_step(model, 1)  # retrofit's λ fully in, as after its warm-up
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


def bench_diff(seq_len: int = 1024, batch: int = 1, shapes: tuple[str, ...] = tuple(SHAPES),
               repeats: int = 5) -> list[dict]:
    """Rows `{name, ratio, step_ms, mem_mb, mem_ratio, ...}`; ratios are against standard attention.

    The variants take turns within each repeat, so a load change on a shared machine hits them all.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # one thread, so its CPU time is the step's whole cost
    rows = []
    try:
        for shape in shapes:
            vocab = SHAPES[shape][1]
            ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
            models = {name: _model(shape, attention, mode, device) for name, attention, mode in VARIANTS}
            memory = {name: _step_memory(model, ids) for name, model in models.items()}  # also warms kernels up
            best = dict.fromkeys(models, float("inf"))
            for _ in range(repeats):
                for name, model in models.items():
                    best[name] = min(best[name], _step_seconds(model, ids))
            base = VARIANTS[0][0]
            rows += [{
                "name": f"{name} {shape} L={seq_len}",
                "ratio": best[name] / best[base],
                "step_ms": 1000 * best[name],
                "mem_mb": memory[name] / 2**20,
                "mem_ratio": memory[name] / memory[base],
                "mem_kind": "cuda peak" if device.type == "cuda" else "saved for backward",
                "params": sum(p.numel() for p in model.parameters()),
            } for name, model in models.items()]
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":
    for row in bench_diff():
        print(json.dumps(row))
