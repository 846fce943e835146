"""Processes and ranks: where a rank runs, how it joins the process group, and the collectives the loop needs.

Every collective runs on the engine's device (NCCL reduces CUDA tensors only): `all_mean`, `all_sum`,
`all_finite`, `any_rank` and `broadcast_object` take that device; `barrier` needs none (the rank's
device is bound before the process group is joined). Slurm launches are read by `slurm_env`.
"""
from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"  # the local CUDA device when there is one, else the CPU


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[003-005,010],cpu1` -> `gpu003` (what `scontrol show
    hostnames` prints first), `rack[1-2]-n[07-08]` -> `rack1-n07`."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas inside brackets separate ranges
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)


def slurm_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torch.distributed's variables mapped from SLURM's, for `srun python train.py` (one task per GPU).

    Only inside an `srun` step (SLURM_STEP_NUM_TASKS: the batch script itself carries SLURM_PROCID
    and SLURM_NTASKS too) and only when no launcher (torchrun, deepspeed) set RANK. MASTER_ADDR is the
    step's first node; MASTER_PORT, unless exported, is derived from the job id (15000-24999), so two
    jobs sharing a node do not collide. Returns {} when not started that way.
    """
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")
    if "RANK" in environ or not all(environ.get(k) for k in needed):
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(15000 + int(environ.get("SLURM_JOB_ID", 0)) % 10000),
    }


def dist_info() -> DistInfo:
    """Rank and world size from the launcher's environment (deepspeed / torchrun / srun), else one process."""
    env = {**os.environ, **slurm_env()}
    return DistInfo(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
    )


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` picks the local CUDA device when there is one, else the CPU."""
    name = Device(name)
    if name == Device.auto:
        name = Device.cuda if torch.cuda.is_available() else Device.cpu
    if name == Device.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible (use trainer=cpu)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(timeout_s: float) -> None:
    """Join the launcher's process group; a rank that cannot reach the others fails, naming itself.

    The timeout also bounds every later collective (gloo and nccl honour it), so a hung rank ends
    the run with an error instead of a silent hang.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    for key, value in slurm_env().items():  # srun without a launcher: deepspeed reads these
        os.environ.setdefault(key, value)
    info = dist_info()
    # Bind this rank's device before any collective (barrier() has no tensor to say which GPU).
    get_accelerator().set_device(info.local_rank)
    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RuntimeError(
            f"rank {info.rank} of {info.world_size}: could not join the process group within "
            f"{timeout_s:.0f} s (trainer.collective_timeout_s): {exc}"
        ) from exc


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_mean(value: float, device: torch.device) -> float:
    """Mean of a scalar over ranks (the value itself in a single process), reduced on `device`."""
    if not _distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum of a tensor over ranks (a copy of it in a single process), on its own device."""
    values = values.detach().clone()
    if _distributed():
        torch.distributed.all_reduce(values)
    return values


def all_finite(value: torch.Tensor, device: torch.device) -> bool:
    """Whether `value` is finite on every rank, reduced on `device`."""
    finite = torch.isfinite(value).all().to(device=device, dtype=torch.float32).reshape(1)
    if _distributed():
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return finite.item() == 1.0


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is set on any rank, reduced on `device`: one answer for all ranks."""
    if not _distributed():
        return flag
    t = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item() > 0


def broadcast_object(obj: Any, device: torch.device) -> Any:
    """The main process's `obj` (picklable) on every rank, so that all ranks act on one decision."""
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, device=device)
    return box[0]


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far: allocated on a CUDA device, else the resident set (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _distributed():
        torch.distributed.barrier()


@contextmanager
def main_first(info: DistInfo) -> Iterator[None]:
    """Run the block on the main process, then on the first process of every other node, then on the rest.

    For work that fills a cache (data build, tokenizer training, downloads): the main process fills
    it, the others load it; on nodes whose cache is local, that node's first process fills it for its
    node. Every rank passes two barriers. A failure inside the block does not release the waiting
    ranks: the launcher ends them (or the collective timeout does).
    """
    stage = 0 if info.is_main_process else 1 if info.local_rank == 0 else 2
    for _ in range(stage):
        barrier()
    yield
    for _ in range(2 - stage):
        barrier()
