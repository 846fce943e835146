"""Checkpoints: `run_dir/checkpoints/step-N/`, written to a temporary folder and renamed.

A folder named `step-N` is complete by construction: it only gets that name after every file in it
was written and flushed, so a kill mid-save leaves the previous checkpoint as the latest one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(resume_from: str, run_dir: str | Path) -> Path:
    """`latest` (newest complete checkpoint of this run) or an explicit checkpoint folder."""
    if resume_from == "latest":
        ckpts = list_checkpoints(run_dir)
        if not ckpts:
            raise FileNotFoundError(f"trainer.resume_from=latest: no checkpoint under {Path(run_dir) / 'checkpoints'}")
        return ckpts[-1]
    path = Path(resume_from)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"trainer.resume_from={resume_from}: not a checkpoint folder (no {TRAINER_STATE})")
    return path


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def atomic_checkpoint(
    run_dir: str | Path,
    step: int,
    write: Callable[[Path], None],
    keep_last_n: int = 0,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Call `write(tmp_folder)` on every rank, then publish it as `checkpoints/step-<step>` in one rename.

    In a multi-process run every rank calls this (each writes its own shards into the same
    temporary folder); only the main process creates, renames and prunes folders.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    write(tmp)
    _fsync_tree(tmp)
    barrier()
    if is_main:
        if final.exists():  # re-saving the same step (e.g. after a resume): replace, never merge
            old = root / f".old-step-{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        if keep_last_n > 0:
            for stale in list_checkpoints(run_dir)[:-keep_last_n]:
                shutil.rmtree(stale)
    barrier()
    return final


def save_trainer_state(folder: Path, step: int, rank: int, extra: dict[str, Any]) -> None:
    """RNG state of this rank, and (main process) the JSON resume state: step, data position, ...

    `trainer_state.json` is what marks a folder as a checkpoint, so the main process writes it
    after its other files.
    """
    torch.save({"torch": torch.get_rng_state()}, folder / f"rng-rank{rank}.pt")
    if rank == 0:
        (folder / TRAINER_STATE).write_text(json.dumps({"step": step, **extra}, indent=2))


def load_trainer_state(folder: Path, rank: int) -> dict[str, Any]:
    """Restore this rank's RNG state; returns the JSON resume state."""
    rng = folder / f"rng-rank{rank}.pt"
    if not rng.exists():
        raise FileNotFoundError(f"{rng}: the checkpoint was written by fewer ranks than this run has")
    torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
    return json.loads((folder / TRAINER_STATE).read_text())


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load a `save_pretrained` folder's safetensors into an already built model (tied weights allowed)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):  # a LoRA model: the folder holds the adapters only
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file as load_adapters

        result = set_peft_model_state_dict(model, load_adapters(folder / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise RuntimeError(f"{folder}: adapter keys not in the model: {result.unexpected_keys[:5]}")
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, p in model.named_parameters()
    }
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
