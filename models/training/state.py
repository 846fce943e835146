"""Where a run stands at a checkpoint, besides its weights and optimizer: `trainer_state.json` and the RNG files.

The JSON is written by the main process after the checkpoint's other files (it is what marks the folder as a
checkpoint), one `rng-rank<R>.pt` by every rank; `models.training.checkpoint` then adds the size of every
file (`files`) before the folder is published. Besides the step, the data position, where metrics.jsonl ended and
the wandb run, it keeps the state of each stateful part of the run by its name (`components`: the objective's as
`debias`, the Jacobian's probe window as `jacobian_window`, `health`, `watch`), each a top-level key of the JSON;
a part's state an older checkpoint lacks reads as None.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from models.training.run_dir import TRAINER_STATE, rng_name

CORE = ("step", "stream_position", "metrics_bytes", "wandb_run_id", "files")


@dataclass
class TrainerState:
    """The resume state of a checkpoint (`trainer_state.json`)."""

    step: int  # optimizer steps done
    stream_position: int  # micro-batches the data stream has drawn (BatchStream.position)
    metrics_bytes: Optional[int] = None  # where metrics.jsonl ended: resuming in place cuts it back to here
    wandb_run_id: Optional[str] = None  # the wandb run the run logged to: a run resumed from here continues it
    components: dict[str, Any] = field(default_factory=dict)  # each stateful part's state, by its name
    files: Optional[dict[str, int]] = None  # the size of every other file of the checkpoint, to find a damaged one

    def state_dict(self) -> dict[str, Any]:
        """The JSON object of trainer_state.json; a key whose value is None (or an empty state) is left out."""
        state: dict[str, Any] = {"step": self.step, "stream_position": self.stream_position}
        optional = {"metrics_bytes": self.metrics_bytes, "wandb_run_id": self.wandb_run_id,
                    **{name: part for name, part in self.components.items() if part}, "files": self.files}
        return state | {key: value for key, value in optional.items() if value is not None}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TrainerState:
        """Read `state_dict`'s object back (KeyError without step or stream_position)."""
        components = {key: value for key, value in state.items() if key not in CORE}
        return cls(state["step"], state["stream_position"], state.get("metrics_bytes"), state.get("wandb_run_id"),
                   components, state.get("files"))

    @classmethod
    def read(cls, folder: str | Path) -> TrainerState:
        """The checkpoint's trainer_state.json (no RNG state is touched)."""
        return cls.from_state_dict(json.loads((Path(folder) / TRAINER_STATE).read_text()))

    def write(self, folder: str | Path) -> None:
        (Path(folder) / TRAINER_STATE).write_text(json.dumps(self.state_dict(), indent=2))

    def save(self, folder: Path, rank: int) -> None:
        """This rank's RNG state, and (main process) trainer_state.json, last."""
        torch.save({"torch": torch.get_rng_state()}, folder / rng_name(rank))
        if rank == 0:
            self.write(folder)

    @classmethod
    def load(cls, folder: Path, rank: int) -> TrainerState:
        """Restore this rank's RNG state; returns the checkpoint's state."""
        rng = folder / rng_name(rank)
        if not rng.exists():
            raise FileNotFoundError(f"{rng}: the checkpoint was written by fewer ranks than this run has")
        torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
        return cls.read(folder)
