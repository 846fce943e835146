"""Run logging: the same scalars to wandb (offline by default) and to `run_dir/metrics.jsonl`.

The JSONL file is the source of truth for `analysis.compare`; wandb is a viewer. Only the main
process creates a logger; the other ranks get `NullLogger`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    mode: str = "offline"  # offline (no account needed) | online | disabled
    project: str = "posdebias"
    entity: Optional[str] = None
    name: Optional[str] = None  # wandb run name; None = the run directory's name
    tags: list[str] = ()  # type: ignore[assignment]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


class MetricsLogger:
    """Appends one JSON object per `log` call to metrics.jsonl and mirrors scalars to wandb."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]):
        if cfg.mode not in MODES:
            raise ValueError(f"logger.mode={cfg.mode!r} must be one of {MODES}")
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        if cfg.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or Path(run_dir).name,
                tags=list(cfg.tags),
                mode=cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def log_media(self, media: dict[str, Any], step: int) -> None:
        """wandb-only objects (images, plots); the run directory keeps their PNGs instead."""
        if self._wandb is not None:
            self._wandb.log(media, step=step)

    @property
    def wandb_run(self):
        return self._wandb

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullLogger:
    """What non-main ranks log to."""

    wandb_run = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_media(self, media: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl (the reader `analysis.compare` uses)."""
    path = Path(run_dir) / "metrics.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
