"""A resume is the same run, or it is refused: the settings a checkpoint was trained with travel inside it.

Every checkpoint holds the resolved config of the run that wrote it (`checkpoint_config.json`; older checkpoints:
their run directory's `.hydra/config.yaml`). `trainer.resume_from` (latest, auto or a folder) is refused, naming the
keys, when the config now differs in anything but the settings a run may change as it goes on (`MAY_CHANGE`: its
length, checkpoint and logging cadence, the machine), or when the checkpoint is past `trainer.max_steps`.

The check runs twice: before Hydra rewrites `.hydra/` in the run directory (`check_hydra_resume`, from
`models.training.start_checks`), so a refused resume writes nothing there, and once the config is typed (train.py's
`check_resumed_run`) for every other way in. Hydra rewrites `.hydra/` at every start; a resume first keeps the run's first
`.hydra/*.yaml` in `.hydra/first/`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.training.checkpoint import resolve_checkpoint
from models.training.run_dir import HYDRA_DIR, trained_with
from models.training.state import TrainerState

# Dotted keys (or a section, with a trailing dot) a resumed run may set anew: how long it runs, how often it saves,
# logs and evaluates, and where; never what it trains on, what it trains, or how.
MAY_CHANGE = (
    "trainer.max_steps", "trainer.save_every", "trainer.keep_last_n", "trainer.resume_from", "trainer.max_bad_steps",
    "trainer.loss_spike_factor", "trainer.loss_spike_steps", "trainer.collective_timeout_s", "trainer.device",
    "logger.", "eval.every", "eval.probe_every", "eval.resume", "eval.batch_size", "eval.batch_tokens",
    "jacobian.plot_every", "jacobian.chart_every", "exp_name", "resume_sweep",
)
SHOWN = 6  # differing keys named in full; the rest are counted


class ResumeRefused(ValueError):
    """A resume that would not continue the same run."""


def _plain(config: Any) -> Any:
    """A config as JSON would hold it (enums as their values, tuples as lists), for comparing."""
    return json.loads(json.dumps(config, default=str))


def _flat(values: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(values, dict):
        return {k: v for key, value in values.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): values}


def may_change(key: str) -> bool:
    return any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in MAY_CHANGE)


def differences(saved: Mapping[str, Any], now: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
                ) -> list[tuple[str, Any, Any]]:
    """(key, value in the checkpoint's run, value now) of every setting that differs and may not. A key the
    checkpoint's config lacks (a setting added since) is compared with its default in `defaults` (a new setting's
    default keeps the old behaviour); a key the config no longer has is not compared."""
    before, after = _flat(_plain(dict(saved))), _flat(_plain(dict(now)))
    default = _flat(_plain(dict(defaults or {})))
    return [(key, before.get(key, default.get(key)), after[key]) for key in sorted(after)
            if before.get(key, default.get(key)) != after[key] and not may_change(key)]


def check_hydra_resume(config: DictConfig, defaults: Mapping[str, Any] | None = None) -> None:
    """`check_resume` of a single run's composed config (with its `hydra` node), before Hydra writes `.hydra/`; a
    resume that may go on keeps the run's first config (`keep_first_config`). A checkpoint it cannot find, or a value
    resolved from Hydra's own node, is left to train.py's check, which names it."""
    resume_from = OmegaConf.select(config, "trainer.resume_from")
    if not resume_from:
        return
    run_dir = Path(str(config.hydra.run.dir))
    try:
        ckpt = resolve_checkpoint(str(resume_from), run_dir)
        now = OmegaConf.to_container(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]), resolve=True)
    except (OSError, ValueError, OmegaConfBaseException):
        return
    if ckpt is not None:
        check_resume(ckpt, now, str(resume_from), defaults)
        keep_first_config(run_dir)


def check_resume(ckpt: Path, now: Mapping[str, Any], resume_from: str, defaults: Mapping[str, Any] | None = None
                 ) -> None:
    """ResumeRefused when resuming `ckpt` under the config `now` would not continue the run that wrote it;
    `defaults`: every setting's default (`differences`)."""
    state, max_steps = TrainerState.read(ckpt), now["trainer"]["max_steps"]
    named = f"trainer.resume_from={resume_from}" + ("" if Path(resume_from) == ckpt else f" ({ckpt})")
    if state.step > max_steps:
        raise ResumeRefused(f"{named} is step {state.step}, past trainer.max_steps={max_steps}: give "
                            f"trainer.max_steps >= {state.step}, or resume from an earlier checkpoint")
    saved = trained_with(ckpt)
    if saved is None:
        return
    differ = differences(saved, now, defaults)
    if not differ:
        return
    listed = ", ".join(f"{key} ({before!r} there, {after!r} now)" for key, before, after in differ[:SHOWN])
    more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
    architecture = ("model.arch", "model.init.", "model.pretrained", "model.attention", "model.rope", "model.diff.")
    model = " (another architecture)" if any(key.startswith(architecture) for key, _, _ in differ) else ""
    raise ResumeRefused(f"{named} was trained with other settings{model}: {listed}{more}; a resume continues the "
                        "same run: drop those overrides, or start a new run without trainer.resume_from")


def keep_first_config(run_dir: Path) -> None:
    """Copy the run directory's `.hydra/*.yaml` to `.hydra/first/` unless a copy is there: the first config survives
    Hydra's rewrite at every start."""
    hydra_dir, first = run_dir / HYDRA_DIR, run_dir / HYDRA_DIR / "first"
    if first.is_dir() or not (hydra_dir / "config.yaml").is_file():
        return
    first.mkdir()
    for path in hydra_dir.glob("*.yaml"):
        shutil.copy2(path, first / path.name)
