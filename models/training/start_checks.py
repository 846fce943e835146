"""`python train.py`'s checks of the composed config that must come before Hydra writes anything in the run directory.

A `hydra.callbacks` entry of conf/train.yaml, first in the list: a required value nothing set
(`models.training.required_values`) or a resume that would not continue the same run
(`models.training.resume_guard`) is refused in one `error:` line and exit status 1, before the run directory is locked
and Hydra writes `.hydra/` into it. A `-m` sweep's jobs are checked by train.py as each starts.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from models.training.required_values import MissingValueError, check_required, choices_of
from models.training.resume_guard import ResumeRefused, check_hydra_resume

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class HydraStartChecks(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_required(CONF_DIR, choices_of(config.hydra), list(config.hydra.overrides.task))
            schema = OmegaConf.get_type(config)  # the typed schema (train.TrainConfig): each setting's default
            check_hydra_resume(config, dataclasses.asdict(schema()) if dataclasses.is_dataclass(schema) else None)
        except (MissingValueError, ResumeRefused) as err:
            print(f"error: {err}", file=sys.stderr)  # Hydra turns a callback's exceptions into warnings
            raise SystemExit(1) from err
