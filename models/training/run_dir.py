"""A run directory's files, by name: the one place their names are spelled.

    <run>/
      .hydra/config.yaml, overrides.yaml   the resolved config and the command-line overrides (Hydra)
      train.log                            the run's log lines (start-up, evals, saves, a failure)
      metrics.jsonl                        one JSON row per logged step (the wandb history, offline)
      jacobian.npz, rollout.npz            Jacobian profiles and attention rollouts of every measured step
      watch.jsonl                          the watch's measurements on the task's own prompts (analysis.evaluation.watch)
      eval/<probe>_step<N>.json            position-wise results (analysis.evaluation.result.ProbeResult)
      eval/metrics_step<N>.json            their metric values (scripts.eval_checkpoint)
      plots/*.png                          figures drawn during and at the end of the run
      checkpoints/step-<N>/                save_pretrained + tokenizer + trainer_state.json + rng-rank<R>.pt
                                           + checkpoint_config.json (the run's config: a resume must match it)
      base_model/                          the saved base of a LoRA run started from a changed architecture
      tokenizer/                           the run's tokenizer
      summary.md                           the end-of-run summary (analysis.report.run_summary)
      finished.json                        {"step": N}: written last, once a run reached trainer.max_steps and its end
      job_overrides.json                   a `-m` job's task overrides as it first started (Hydra rewrites .hydra/)
      distill_responses.json               debias=pos2distill: the answers at the strong slot, kept or not, counted
      teacher_choice.json                  debias=pos2distill_best: each sample's teacher slot and log p per candidate
      wandb_run.json, wandb/               the wandb run the directory logs to, and wandb's own files
      .lock                                held by the one process writing the directory (models.training.run_lock)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

HYDRA_DIR = ".hydra"
RUN_CONFIG = Path(HYDRA_DIR) / "config.yaml"
OVERRIDES = Path(HYDRA_DIR) / "overrides.yaml"
TRAIN_LOG = "train.log"
METRICS = "metrics.jsonl"
JACOBIAN = "jacobian.npz"
ROLLOUT = "rollout.npz"  # in jacobian.npz's format, one set per "<set>.<variant>"
WATCH = "watch.jsonl"
EVAL_DIR = "eval"
PLOTS_DIR = "plots"
CHECKPOINTS_DIR = "checkpoints"
BASE_MODEL = "base_model"
TOKENIZER_DIR = "tokenizer"
SUMMARY = "summary.md"
FINISHED = "finished.json"  # the marker of a finished run: a sweep resumed with resume_sweep skips its job
JOB_OVERRIDES = "job_overrides.json"  # what resume_sweep and analysis.study read as the job's overrides
DISTILL_RESPONSES = "distill_responses.json"
TEACHER_CHOICE = "teacher_choice.json"
WANDB_RUN = "wandb_run.json"
LOCK = ".lock"
TRAINER_STATE = "trainer_state.json"  # inside a checkpoint folder: what marks it as complete
CHECKPOINT_CONFIG = "checkpoint_config.json"  # inside a checkpoint folder: the config of the run that wrote it

EVAL_FILE = re.compile(r"^(?P<probe>\w+?)_step(?P<step>\d+)\.json$")
STEP_DIR = re.compile(r"^step-(\d+)$")


def eval_name(probe: str, step: int) -> str:
    return f"{probe}_step{step}.json"


def rng_name(rank: int) -> str:
    """A checkpoint's RNG state of one rank (models.training.state.TrainerState)."""
    return f"rng-rank{rank}.pt"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created or read here)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / RUN_CONFIG

    @property
    def overrides(self) -> Path:
        return self.root / OVERRIDES

    @property
    def log(self) -> Path:
        return self.root / TRAIN_LOG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def jacobian(self) -> Path:
        return self.root / JACOBIAN

    @property
    def rollout(self) -> Path:
        return self.root / ROLLOUT

    @property
    def watch(self) -> Path:
        return self.root / WATCH

    @property
    def eval(self) -> Path:
        return self.root / EVAL_DIR

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def base_model(self) -> Path:
        return self.root / BASE_MODEL

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_DIR

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def finished(self) -> Path:
        return self.root / FINISHED

    @property
    def job_overrides(self) -> Path:
        return self.root / JOB_OVERRIDES

    @property
    def distill_responses(self) -> Path:
        return self.root / DISTILL_RESPONSES

    @property
    def teacher_choice(self) -> Path:
        return self.root / TEACHER_CHOICE

    @property
    def wandb_run(self) -> Path:
        return self.root / WANDB_RUN

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def eval_json(self, probe: str, step: int) -> Path:
        return self.eval / eval_name(probe, step)

    def eval_metrics(self, step: int) -> Path:
        return self.eval / f"metrics_step{step}.json"

    def plot(self, name: str) -> Path:
        return self.plots / f"{name}.png"

    def eval_files(self, probe: str) -> dict[int, Path]:
        """{step: path} of every `eval/<probe>_step<N>.json`, by step."""
        folder = self.eval
        found = {}
        for path in folder.glob(f"{probe}_step*.json") if folder.is_dir() else ():
            match = EVAL_FILE.match(path.name)
            if match and match["probe"] == probe:
                found[int(match["step"])] = path
        return dict(sorted(found.items()))


def latest_eval_files(folder: Path) -> dict[str, Path]:
    """{probe: path} of the latest step of each probe's `<probe>_step<N>.json` in `folder` (a run's `eval/` or a
    copy of one), by probe name; the `metrics_step<N>.json` files are not a probe's."""
    latest: dict[str, tuple[int, Path]] = {}
    for path in folder.glob("*_step*.json"):
        match = EVAL_FILE.match(path.name)
        if match and match["probe"] != "metrics" and int(match["step"]) >= latest.get(match["probe"], (-1,))[0]:
            latest[match["probe"]] = (int(match["step"]), path)
    return {probe: latest[probe][1] for probe in sorted(latest)}


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The run directory of a `<run>/checkpoints/step-<N>` folder; None for a folder outside a run."""
    checkpoint = Path(checkpoint).resolve()
    if STEP_DIR.match(checkpoint.name) and checkpoint.parent.name == CHECKPOINTS_DIR:
        return checkpoint.parents[1]
    return None


def trained_with(ckpt: Path) -> Optional[dict[str, Any]]:
    """The config the checkpoint was trained with: its own copy, else its run directory's (a checkpoint from before
    the copy), else None (a folder outside a run)."""
    own = ckpt / CHECKPOINT_CONFIG
    if own.is_file():
        return json.loads(own.read_text(encoding="utf-8"))
    run_dir = run_dir_of(ckpt)
    if run_dir is not None and (run_dir / RUN_CONFIG).is_file():
        return yaml.safe_load((run_dir / RUN_CONFIG).read_text(encoding="utf-8"))
    return None
