"""How `python train.py` is launched: run directories named alike on every rank and node, the resolvers of
conf/train.yaml, and a killed `-m` sweep resumed job by job (`resume_sweep`).

train.py calls these before its recipe starts; nothing here trains.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal, Mapping, Optional, Sequence

from omegaconf import DictConfig

from data_builders.files import atomic_write_text
from models.training.checkpoint import list_checkpoints, newest_checkpoint, newest_intact
from models.training.distributed import DistInfo
from models.training.run_dir import RunDir

log = logging.getLogger("train")


def launch_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """A name that every process of one launch shares on every node, or None.

    SLURM's job (`slurm-<job>`, `slurm-<array job>_<task>` for an array task; a requeued job keeps
    its id, so it finds its own run directory again) or, for ranks on several nodes, torchrun's
    `--rdzv-id` (its default "none" names nothing).
    """
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    several_nodes = int(environ.get("WORLD_SIZE", 1)) > int(environ.get("LOCAL_WORLD_SIZE", 1))
    if run_id != "none" and several_nodes:
        return f"torchrun-{run_id}"
    return None


def run_stamp() -> str:
    """The run directory's name, identical on every rank of one launch, on every node.

    Each rank resolves Hydra's run directory on its own, and `${now:}` can straddle a second
    between them. A launcher id shared by all nodes names the run when there is one (`launch_id`);
    else ranks started by `deepspeed` or `torchrun` on one node share their parent (the launcher),
    whose start time names the run.
    """
    if (name := launch_id()) is not None:
        return name
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    else:
        started = time.time()
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started))


def newest_run_checkpoint(exp_name: str) -> str:
    """`${newest_checkpoint:<exp>}`: the most recent complete checkpoint of any run of outputs/<exp>/ (single
    runs and multirun jobs), e.g. the biased_start model that +exp=debias_study fine-tunes."""
    root = Path("outputs") / exp_name
    runs = sorted(p for pattern in ("*", "multirun_*/*") for p in root.glob(pattern) if p.is_dir())
    ckpt = newest_checkpoint(runs)
    if ckpt is not None:  # that run's last step (copied folders do not keep their order in time)
        ckpt = list_checkpoints(ckpt.parents[1])[-1]
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint of a {exp_name} run under {root}/: run `python train.py "
                                f"+exp={exp_name}` first, or set model.pretrained=<a checkpoint folder>")
    return str(ckpt)


def sweep_dir(resume_sweep: Optional[str], new_dir: str) -> str:
    """`${sweep_dir:${resume_sweep},<new dir>}`, conf/train.yaml's hydra.sweep.dir: the sweep to resume, checked to be
    one (Hydra would create a missing folder and run the whole sweep in it), else a new one."""
    if resume_sweep is None:
        return new_dir
    if not Path(resume_sweep).is_dir():
        raise ValueError(f"resume_sweep={resume_sweep}: no such directory; give the directory of the killed `-m` "
                         "sweep (outputs/<exp_name>/multirun_<time>, printed as it started)")
    if not (Path(resume_sweep) / "multirun.yaml").is_file():
        raise ValueError(f"resume_sweep={resume_sweep}: not the directory of a `-m` sweep (no multirun.yaml in it)")
    return str(resume_sweep)


SweepAction = Literal["skip", "resume", "start"]


def job_overrides(task: Sequence[str]) -> list[str]:
    """A `-m` job's task overrides as job_overrides.json keeps them: without the `resume_sweep=` a rerun adds."""
    return [o for o in task if o.partition("=")[0].lstrip("+~") != "resume_sweep"]


def check_resume_sweep(resume_sweep: Optional[str], resume_from: Optional[str], sweep: Optional[str]) -> None:
    """resume_sweep's start-up checks (`sweep`: this `-m` job's hydra.sweep.dir, None for a single run); errors
    name the keys. That the directory is a sweep's `sweep_dir` checks, as Hydra resolves it."""
    if resume_sweep is None:
        return
    if sweep is None:
        raise ValueError(f"resume_sweep={resume_sweep} continues a `-m` sweep: rerun the sweep's command, with -m; a "
                         "single run continues with trainer.resume_from=latest hydra.run.dir=<its directory>")
    if resume_from:
        raise ValueError(f"resume_sweep={resume_sweep} with trainer.resume_from={resume_from}: resume_sweep continues "
                         "each job from its own newest checkpoint; drop one of them")
    if Path(sweep).resolve() != Path(resume_sweep).resolve():
        raise ValueError(f"resume_sweep={resume_sweep} with hydra.sweep.dir={sweep}: resume_sweep sets the sweep "
                         "directory; drop the hydra.sweep.dir override")


def sweep_job_action(run_dir: Path, overrides: list[str]) -> SweepAction:
    """What a job of a sweep rerun with resume_sweep does: `skip` when it finished (finished.json), `resume` from its
    newest intact checkpoint when it has one, else `start`. ValueError naming the directory and both lists when the
    job's overrides are not those it first started with (job_overrides.json): the command changed."""
    paths = RunDir(run_dir)
    if paths.job_overrides.is_file():
        recorded = json.loads(paths.job_overrides.read_text(encoding="utf-8"))
        if recorded != overrides:
            raise ValueError(f"resume_sweep: {run_dir} is the job of overrides {recorded} ({paths.job_overrides}), "
                             f"this job's are {overrides}: the command changed; rerun the sweep's own command (same "
                             "values in the same order) with resume_sweep=<its directory>")
    if paths.finished.is_file():
        return "skip"
    return "resume" if newest_intact(list_checkpoints(run_dir)) is not None else "start"


def log_to_console_only(run_dir: Path) -> None:
    """Detach Hydra's handler of `run_dir`'s train.log: a finished job that a resumed sweep skips or refuses keeps
    its log as it ended (analysis.study times a job from its log's first line to its last)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve().parent == run_dir.resolve():
            root.removeHandler(handler)
            handler.close()


def begin_job(cfg: DictConfig, task: Sequence[str], run_dir: Path, sweep: Optional[str], info: DistInfo) -> bool:
    """Ready a job of `python train.py` (`sweep`: hydra.sweep.dir of a `-m` job, else None); False: skip it.

    A `-m` job records its task overrides (job_overrides.json: Hydra rewrites .hydra/ at every start). With
    resume_sweep (`sweep_job_action`) a finished job is skipped without writing anything, an interrupted one
    continues from its newest intact checkpoint (trainer.resume_from=latest), any other starts afresh.
    """
    check_resume_sweep(cfg.resume_sweep, cfg.trainer.resume_from, sweep)
    if sweep is None:
        return True
    overrides, paths = job_overrides(task), RunDir(run_dir)
    action: SweepAction = "start"
    if cfg.resume_sweep is not None:
        if paths.finished.is_file():
            log_to_console_only(run_dir)
        action = sweep_job_action(run_dir, overrides)
        if info.is_main_process:
            log.info("resume_sweep: job %s %s", run_dir, {
                "skip": f"finished ({paths.finished}): skipped",
                "resume": "was interrupted: continuing from its newest intact checkpoint",
                "start": "has no checkpoint: starting it"}[action])
    if action == "skip":
        return False
    if action == "resume":
        cfg.trainer.resume_from = "latest"
    if info.is_main_process and (cfg.resume_sweep is None or not paths.job_overrides.is_file()):
        atomic_write_text(paths.job_overrides, json.dumps(overrides) + "\n")
    return True


def strip_launcher_args() -> None:
    """`deepspeed` appends --local_rank=N, which Hydra would reject; LOCAL_RANK carries it too."""
    for arg in list(sys.argv[1:]):
        if arg.startswith("--local_rank"):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1] if "=" in arg else "0")
            sys.argv.remove(arg)
