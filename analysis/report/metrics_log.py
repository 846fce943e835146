"""Run logging: the same scalars to wandb (offline by default) and to `run_dir/metrics.jsonl`.

The JSONL file is the source of truth for `analysis.compare`; wandb is a viewer. Only the main
process creates a logger; the other ranks get `NullLogger`. `profile_charts` builds the wandb line
charts of the Jacobian profiles against the prior, `accuracy_chart` those of accuracy by position.

wandb as its users expect: the environment's `WANDB_MODE` applies unless `logger.mode` is set
(`resolve_mode`); a resumed run continues the wandb run of the checkpoint (its id is kept in
`run_dir/wandb_run.json` and in every checkpoint's trainer_state.json); runs are named from the
experiment and the overrides and grouped per sweep (`run_names`); the run table shows the best
accuracy, the lowest loss and the last valley depth (`SUMMARIES`).
"""
from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import numpy as np

from analysis.measure.prior import log10_profile, scaled_prior
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import RunDir

CHART_POINTS = 128  # positions per curve in the wandb profile chart (jacobian.npz keeps all L)
NAME_MAX = 128  # characters of a wandb run name
# Run-table summaries (`wandb.define_metric`) of the logged keys matching each pattern (fnmatch: `*` spans
# `/`). wandb 0.31 globs only a trailing `*` ("eval/*"), so each key is defined when it is first logged.
SUMMARIES = {
    "eval/*/acc_mean": "max,last",  # best and final mean accuracy of every probe, in2 included
    "train/loss": "min,last",
    "eval/loss": "min,last",
    "valley/*/*_to_trough_log10": "last,min",  # valley depths of each Jacobian set: final and shallowest
}
# Overrides left out of a run's name: the experiment (its name leads), where it resumes from, how it logs.
NAME_SKIPPED = ("exp", "exp_name", "trainer.resume_from", "resume_sweep", "logger", "hydra")


class LoggerMode(StrEnum):
    offline = "offline"  # no account needed; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"  # metrics.jsonl only


WANDB_MODE_ALIASES = {"dryrun": LoggerMode.offline, "run": LoggerMode.online}  # wandb's older spellings


@dataclass
class LoggerConfig:
    mode: Optional[LoggerMode] = None  # None = the environment's WANDB_MODE when set, else offline
    project: str = "posdebias"
    entity: Optional[str] = None
    # wandb run name; None = `train.py` names it from the experiment and the overrides (`run_names`),
    # a programmatic `train.run` after the run directory
    name: Optional[str] = None
    group: Optional[str] = None  # wandb group; None = `train.py`: the experiment, or the sweep of a -m run
    tags: list[str] = field(default_factory=list)


def resolve_mode(mode: Optional[str], environ: Mapping[str, str] = os.environ) -> LoggerMode:
    """`logger.mode` when set, else the environment's `WANDB_MODE` when set, else offline.

    wandb itself lets an explicit `mode=` beat WANDB_MODE, so the environment is read here.
    """
    if mode is not None:
        return LoggerMode(mode)
    env = environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return LoggerMode.offline
    try:
        return WANDB_MODE_ALIASES.get(env) or LoggerMode(env)
    except ValueError:
        raise ValueError(f"WANDB_MODE={environ['WANDB_MODE']!r} is not one of "
                         f"{', '.join(LoggerMode)} (or {', '.join(WANDB_MODE_ALIASES)}); unset it or set "
                         f"logger.mode") from None


def stored_run_id(run_dir: str | Path) -> Optional[str]:
    """The id of the wandb run `run_dir` logged to (its wandb_run.json), or None."""
    path = RunDir(run_dir).wandb_run
    return json.loads(path.read_text()).get("id") if path.is_file() else None


def _split_overrides(text: str) -> list[str]:
    """Hydra's `override_dirname` ("a=1,b=[x,y]") back into overrides: commas inside brackets or quotes stay."""
    items, depth, quote, current = [], 0, None, ""
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        current += char
    return [item for item in [*items, current] if item]


def shorten(name: str, max_len: int = NAME_MAX) -> str:
    """`name` cut to `max_len` characters, an ellipsis marking the cut."""
    return name if len(name) <= max_len else name[:max_len - 1] + "…"


def run_names(exp_name: str, overrides: str | Sequence[str], sweep_dir: Optional[str | Path] = None,
              max_len: int = NAME_MAX) -> tuple[str, str]:
    """(name, group) of a wandb run, from the experiment, the job's overrides and the sweep.

    name: `<exp_name>` and the overrides that change what is trained, as Hydra's override_dirname writes
    them (`in2 trainer.lr=0.001,model=qwen2_0.5b`): `+exp=`, `exp_name=`, `trainer.resume_from=`, `resume_sweep=`,
    `logger.*` and `hydra.*` left out, a path value shortened to its last component, at most `max_len` characters.
    group: `<exp_name>/<sweep folder name>` for a job of a `-m` sweep (`sweep_dir`), else `<exp_name>`.
    `overrides`: a list (`HydraConfig.get().overrides.task`) or an override_dirname string.
    """
    if isinstance(overrides, str):
        overrides = _split_overrides(overrides)
    kept = []
    for override in overrides:
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")  # +key=v adds, ++key=v forces, ~key deletes
        if bare in NAME_SKIPPED or bare.split(".")[0] in NAME_SKIPPED:
            continue
        if "/" in value and not value.startswith(("[", "{", "'", '"')):
            value = Path(value.rstrip("/")).name or value  # a path: its last component
        kept.append(f"{key.lstrip('+')}{sep}{value}")
    name = shorten(f"{exp_name} {','.join(kept)}" if kept else exp_name, max_len)
    group = f"{exp_name}/{Path(sweep_dir).name}" if sweep_dir else exp_name
    return name, group


def init_wandb(cfg: LoggerConfig, mode: LoggerMode, folder: Path, config: dict[str, Any],
               run_id: Optional[str] = None, name: Optional[str] = None, job_type: Optional[str] = None):
    """`wandb.init` into `folder`/wandb: continues the run `run_id` when given (any mode), else a new one."""
    import wandb  # optional heavy dependency: imported only when a run logs to it

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=name or cfg.name,
        group=cfg.group,
        tags=list(cfg.tags),
        mode=mode.value,
        dir=str(folder),
        config=config,
        id=run_id,
        resume="allow",
        job_type=job_type,
    )


class MetricsLogger:
    """Appends one JSON object per `log` call to metrics.jsonl and mirrors scalars to wandb.

    The wandb run continues `run_id` (the id a resumed checkpoint carries), else the run this
    directory logged to before (wandb_run.json), else is a new one; its id is then kept in
    wandb_run.json and as `run_id` (for checkpoints). A disabled logger writes no wandb file but
    still hands on a `run_id` it was given.
    """

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: Optional[str] = None):
        mode = resolve_mode(cfg.mode)
        run_dir = Path(run_dir)
        self.path = RunDir(run_dir).metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        self._defined: set[str] = set()  # keys whose summaries are set (`SUMMARIES`)
        self.run_id = run_id or stored_run_id(run_dir)
        if mode != LoggerMode.disabled:
            self._wandb = init_wandb(cfg, mode, run_dir, config, self.run_id, cfg.name or run_dir.name)
            self.run_id = self._wandb.id
            atomic_write_text(RunDir(run_dir).wandb_run, json.dumps(
                {"id": self.run_id, "project": cfg.project, "entity": cfg.entity, "name": self._wandb.name,
                 "group": cfg.group, "mode": mode.value}, indent=2))

    def _define_summaries(self, keys) -> None:
        for key in keys:
            if key in self._defined:
                continue
            self._defined.add(key)
            summary = next((s for pattern, s in SUMMARIES.items() if fnmatch.fnmatchcase(key, pattern)), None)
            if summary is not None:
                self._wandb.define_metric(key, summary=summary)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = json_safe({"step": step, **metrics})
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._define_summaries(metrics)
            self._wandb.log(metrics, step=step)

    def bytes_written(self) -> int:
        """Where metrics.jsonl ends now: a checkpoint records it, and resuming in place cuts the file back to
        it (`truncate_metrics`), so that each step is in the file once however the run was stopped."""
        self._file.flush()
        return self._file.tell()

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
    run_id = None

    def bytes_written(self) -> int:
        return 0

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_media(self, media: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def truncate_metrics(run_dir: str | Path, size: int) -> None:
    """Cut `run_dir/metrics.jsonl` back to its first `size` bytes: the rows logged before a checkpoint was
    saved (a killed run's later rows, a torn last line included, are logged again when training resumes)."""
    path = RunDir(run_dir).metrics
    if path.is_file() and path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl (the reader `analysis.compare` uses)."""
    path = RunDir(run_dir).metrics
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def profile_charts(
    profiles: Mapping[str, np.ndarray], alphas: Mapping[str, float], n_layers: int, step: int,
    rollouts: Optional[Mapping[str, Mapping[str, np.ndarray]]] = None,
) -> dict[str, Any]:
    """wandb line charts ``jacobian/<set>/profile``: each set's mean profile (L,), its scaled prior and its
    rollouts (``rollouts[set][variant]``, (L,), `analysis.measure.rollout.mean_rollout`), log10.

    ``alphas[set]`` is the prior's residual weight (the fit `topology_metrics` logged), scaled onto the
    profile by `analysis.measure.prior.scaled_prior`; each rollout is scaled by its own mean log10 offset. At most
    CHART_POINTS positions are drawn, both ends kept.
    """
    import wandb  # optional heavy dependency: imported only when a run logs to it

    charts = {}
    for name, rho in profiles.items():
        log_rho = log10_profile(rho)
        prior, alpha = scaled_prior(rho, n_layers, alphas[name])  # (L,)
        curves = {"measured": log_rho, f"prior fit (a={alpha:.3f})": log10_profile(prior)}
        for variant, curve in (rollouts or {}).get(name, {}).items():
            log_curve = log10_profile(curve)
            curves[f"rollout, {variant}"] = log_curve + np.mean(log_rho - log_curve)
        # wandb type-checks every table row (~0.2 ms each): draw at most CHART_POINTS positions, ends kept.
        shown = np.unique(np.linspace(0, len(rho) - 1, min(len(rho), CHART_POINTS)).round().astype(int))
        charts[f"jacobian/{name}/profile"] = wandb.plot.line_series(
            xs=(shown / max(len(rho) - 1, 1)).tolist(), ys=[c[shown].tolist() for c in curves.values()],
            keys=list(curves), title=f"log10 Jacobian profile, {name}, step {step}",
            xname="relative position (j-1)/(L-1)",
        )
    return charts


def watch_charts(rows: Sequence[Mapping[str, Any]], step: int) -> dict[str, Any]:
    """wandb line charts ``watch/<set>/profile``: each unit's (document's, pair's, depth tenth's) share of rho^2 on
    the watch prompts (analysis.evaluation.watch), mean over the prompts, at the first measurement against the latest
    of each prompt, and the prior's share over the same spans."""
    import wandb  # optional heavy dependency: imported only when a run logs to it

    charts = {}
    for name in dict.fromkeys(r["set"] for r in rows if r.get("kind") == "jacobian"):
        mine = [r for r in rows if r.get("kind") == "jacobian" and r["set"] == name]
        first_step = min(r["step"] for r in mine)
        latest = {(r["question"], r["slot"]): r for r in sorted(mine, key=lambda r: r["step"])}
        curves = {f"step {first_step}": np.mean([r["units"] for r in mine if r["step"] == first_step], axis=0),
                  f"step {step} (each prompt's latest)": np.mean([r["units"] for r in latest.values()], axis=0),
                  "prior": np.mean([r["prior_units"] for r in latest.values()], axis=0)}
        units = len(next(iter(curves.values())))
        charts[f"watch/{name}/profile"] = wandb.plot.line_series(
            xs=list(range(units)), ys=[c.tolist() for c in curves.values()], keys=list(curves),
            title=f"{name}: each slot's share of rho^2 on the watch prompts, step {step}", xname="slot")
    return charts


def accuracy_chart(accuracy: Mapping[int, float], labels: Mapping[int, str], title: str):
    """A wandb line chart of accuracy by gold position, over its table (position, label, accuracy).

    Logged under one key per probe, its table can be drawn for several runs in one wandb panel.
    Positions below 0 (mdqa's closed-book baseline) are left out: their accuracy is a scalar of its own.
    """
    import wandb  # optional heavy dependency: imported only when a run logs to it

    rows = [[int(p), str(labels.get(p, p)), float(a)] for p, a in sorted(accuracy.items()) if p >= 0]
    table = wandb.Table(columns=["position", "label", "accuracy"], data=rows)
    return wandb.plot.line(table, "position", "accuracy", title=title)


def log_report(cfg: LoggerConfig, folder: str | Path, images: Mapping[str, str | Path],
               tables: Mapping[str, tuple[Sequence[str], Sequence[Sequence[Any]]]],
               config: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Log a report's PNGs (`key -> path`) and tables (`key -> (columns, rows)`) as one wandb run of
    job type `report`, written under `folder`/wandb; returns its id (None when the mode is disabled)."""
    mode = resolve_mode(cfg.mode)
    if mode == LoggerMode.disabled:
        return None
    import wandb  # optional heavy dependency: imported only when a run logs to it

    run = init_wandb(cfg, mode, Path(folder), config or {}, name=cfg.name or Path(folder).resolve().name,
                     job_type="report")
    try:
        run.log({**{key: wandb.Image(str(png)) for key, png in images.items()},
                 **{key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])
                    for key, (columns, rows) in tables.items()}})
        return run.id
    finally:
        run.finish()
