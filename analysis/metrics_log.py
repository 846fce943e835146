"""Run logging: the same scalars to wandb (offline by default) and to `run_dir/metrics.jsonl`.

The JSONL file is the source of truth for `analysis.compare`; wandb is a viewer. Only the main
process creates a logger; the other ranks get `NullLogger`. `profile_charts` builds the wandb line
charts of the Jacobian profiles against the prior.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import numpy as np

from analysis.prior import log10_profile, scaled_prior

CHART_POINTS = 128  # positions per curve in the wandb profile chart (jacobian.npz keeps all L)


class LoggerMode(StrEnum):
    offline = "offline"  # no account needed; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"  # metrics.jsonl only


@dataclass
class LoggerConfig:
    mode: LoggerMode = LoggerMode.offline
    project: str = "posdebias"
    entity: Optional[str] = None
    name: Optional[str] = None  # wandb run name; None = the run directory's name
    tags: list[str] = field(default_factory=list)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


class MetricsLogger:
    """Appends one JSON object per `log` call to metrics.jsonl and mirrors scalars to wandb."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]):
        mode = LoggerMode(cfg.mode)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        if mode != LoggerMode.disabled:
            import wandb  # optional heavy dependency: imported only when a run logs to it

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or Path(run_dir).name,
                tags=list(cfg.tags),
                mode=mode.value,
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

    def image(self, png: str | Path):
        """A wandb image of a PNG, for `log_media` (call only when `wandb_run` is not None)."""
        import wandb  # optional heavy dependency: imported only when a run logs to it

        return wandb.Image(str(png))

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


def profile_charts(
    profiles: Mapping[str, np.ndarray], alphas: Mapping[str, float], n_layers: int, step: int
) -> dict[str, Any]:
    """wandb line charts ``jacobian/<set>/profile``: each set's mean profile (L,) and its scaled prior, log10.

    ``alphas[set]`` is the prior's residual weight (the fit `topology_metrics` logged), scaled onto the
    profile by `analysis.prior.scaled_prior`. At most CHART_POINTS positions are drawn, both ends kept.
    """
    import wandb  # optional heavy dependency: imported only when a run logs to it

    charts = {}
    for name, rho in profiles.items():
        prior, alpha = scaled_prior(rho, n_layers, alphas[name])  # (L,)
        # wandb type-checks every table row (~0.2 ms each): draw at most CHART_POINTS positions, ends kept.
        shown = np.unique(np.linspace(0, len(rho) - 1, min(len(rho), CHART_POINTS)).round().astype(int))
        charts[f"jacobian/{name}/profile"] = wandb.plot.line_series(
            xs=(shown / max(len(rho) - 1, 1)).tolist(),
            ys=[log10_profile(rho)[shown].tolist(), log10_profile(prior)[shown].tolist()],
            keys=["measured", f"prior fit (a={alpha:.3f})"],
            title=f"log10 Jacobian profile, {name}, step {step}", xname="relative position (j-1)/(L-1)",
        )
    return charts
