"""Running an experiment's commands on one machine, and keeping what of it outlives the machine.

`Scheduler` runs `Job`s (training runs, evaluations: commands of their own, each logging to its file) up to
`parallel` at once, each once the jobs it waits for succeeded; a failed job fails its dependants without running
them; SIGTERM or Ctrl-C stops the jobs under way cleanly. `Keep` mirrors the small and costly part of an experiment
folder (its plan, evaluations, answer records, finished runs' logs and LoRA adapters) into a folder that a repository
can hold, and fills a fresh experiment folder from it. `scripts.reads_middle` and `scripts.watch_tracking` run on them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from data_builders.files import atomic_file
from data_builders.tokenizer import default_cache_dir
from models.training.checkpoint import ADAPTER_CONFIG, checkpoint_damage, list_checkpoints
from models.training.run_dir import BASE_MODEL, TRAINER_STATE, RunDir

ROOT = Path(__file__).resolve().parents[1]
CACHE = "cache"  # <out>/cache: the jobs' POSDEBIAS_CACHE
STOP_GRACE_S = 600  # how long a stopped job may take to save its checkpoint or flush its answers
CHECKPOINT_EVERY_S = 300  # --keep copies at least this often while a job runs (a machine can die any time)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Job:
    """A command of the experiment: its log, what it waits for, and whether it is done already."""

    name: str
    command: list[str]
    log: Path
    after: tuple[str, ...] = ()
    done: bool = False
    # start once this file exists or the job named second has ended (pos2distill runs wait for the first one's
    # teacher answers, which they then read from the cache instead of computing them again)
    wait_for: tuple[Path, str] | None = None


@dataclass
class Scheduler:
    """Runs jobs, up to `parallel` at once, each when the jobs it waits for succeeded; a failed job fails its
    dependants without running them."""

    parallel: int
    deadline: float | None = None
    name: str = "jobs"  # what the progress lines start with
    env: dict[str, str] = field(default_factory=dict)  # added to the jobs' environment
    # called whenever a job ends, every CHECKPOINT_EVERY_S while one runs, and when the scheduler is stopped
    checkpoint: Callable[[], None] | None = None
    started_at: float = field(default_factory=time.monotonic)
    failed: dict[str, str] = field(default_factory=dict)

    def run(self, jobs: Sequence[Job]) -> None:
        running: dict[str, tuple[subprocess.Popen, Job]] = {}
        try:
            self._run(jobs, running)
        finally:  # stopped (SIGTERM, Ctrl-C): each job under way stops cleanly too
            if running and self.checkpoint is not None:
                self.checkpoint()
            for proc, _ in running.values():
                proc.terminate()
            for proc, job in running.values():
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                self.failed[job.name] = f"stopped (log {job.log})"

    def _run(self, jobs: Sequence[Job], running: dict[str, tuple[subprocess.Popen, Job]]) -> None:
        waiting = [j for j in jobs if not j.done]
        finished = {j.name for j in jobs if j.done}
        if jobs:  # an experiment that runs over many sessions: where this one starts
            print(f"[{self.name}] {len(finished)} of {len(jobs)} jobs done already, {len(waiting)} to run", flush=True)
        checkpointed = time.monotonic()
        while waiting or running:
            ended_now = False
            for name, (proc, job) in list(running.items()):
                if proc.poll() is not None:
                    del running[name]
                    ended_now = True
                    if proc.returncode == 0:
                        finished.add(name)
                        print(f"[{self.name}] done: {name} ({len(finished)} of {len(jobs)} done)", flush=True)
                    else:
                        self.failed[name] = f"exit {proc.returncode}, log {job.log}"
                        print(f"[{self.name}] FAILED: {name} (exit {proc.returncode}; {job.log})", flush=True)
            for job in list(waiting):
                if any(a in self.failed for a in job.after):
                    waiting.remove(job)
                    self.failed[job.name] = f"not run: {', '.join(a for a in job.after if a in self.failed)} failed"
            late = self.deadline is not None and time.monotonic() - self.started_at > self.deadline
            if late and waiting:
                for job in waiting:
                    self.failed[job.name] = "not started: past --deadline"
                waiting = []
            ended = finished | set(self.failed)

            def ready(job: Job) -> bool:
                return all(a in finished for a in job.after) and (
                    job.wait_for is None or job.wait_for[0].exists() or job.wait_for[1] in ended)

            for job in [j for j in waiting if ready(j)]:
                if len(running) >= self.parallel:
                    break
                waiting.remove(job)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                print(f"[{self.name}] start: {job.name}: {' '.join(job.command)}", flush=True)
                with open(job.log, "ab") as log:
                    proc = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"})
                running[job.name] = (proc, job)
            if waiting and not running:  # nothing can start any more: what they wait for will never come
                for job in waiting:
                    self.failed[job.name] = "not run: what it waits for did not finish"
                waiting = []
            if self.checkpoint is not None and (ended_now or time.monotonic() - checkpointed > CHECKPOINT_EVERY_S):
                self.checkpoint()
                checkpointed = time.monotonic()
            time.sleep(0.5)


def experiment_cache(out: Path) -> Path:
    """`<out>/cache`, the experiment's jobs' POSDEBIAS_CACHE, its `models` linked to the user's cache's (a model
    is fetched and converted once for every experiment)."""
    cache = out / CACHE
    models = cache / "models"
    if not models.exists() and not models.is_symlink():
        shared = default_cache_dir() / "models"
        shared.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        models.symlink_to(shared.resolve(), target_is_directory=True)
    return cache


@dataclass
class Keep:
    """The part of an experiment folder that outlives its machine (`patterns`, globs under it), mirrored in
    `folder`; `plan`: the file that says which experiment a folder holds.

    With `weights`, also the weights of the LoRA runs (`runs/<n>/`; whole weights, hundreds of MB, and a run with a
    saved base, `base_model/`, are not kept): a finished run's final checkpoint without the optimizer's, scheduler's
    and random states (*.pt), ~7 MB, so that its evaluations run on a fresh machine without training it again; and a
    run still training whole: its newest checkpoint (~25 MB with the optimizer's state) and every file of its folder
    a resume reads, so that a fresh machine resumes it where the last one saved. A checkpoint counts as kept once
    every file its trainer_state.json lists is there at its size (trainer_state.json is copied last); a run's other
    checkpoints, and what a finished run no longer needs, then leave the keep."""

    folder: Path
    out: Path
    patterns: Sequence[str]
    plan: str
    weights: bool = False

    def files(self, root: Path) -> list[Path]:
        """What is kept of `root` (the experiment folder or the keep), relative to it: the patterns' files, then each
        run's weights (a checkpoint's trainer_state.json after its other files)."""
        found = sorted({p.relative_to(root) for pattern in self.patterns for p in root.glob(pattern) if p.is_file()})
        weights = [p.relative_to(root) for run_dir in sorted(root.glob("runs/*")) if self.weights
                   for p in run_weight_files(run_dir)]
        listed = set(weights)
        return [rel for rel in found if rel not in listed] + weights

    def restore(self) -> list[Path]:
        """Copy into `out` every kept file it lacks; the paths copied. ValueError when the two hold other plans."""
        plans = [root / self.plan for root in (self.folder, self.out)]
        if all(p.is_file() for p in plans) and plans[0].read_bytes() != plans[1].read_bytes():
            raise ValueError(f"{plans[0]} and {plans[1]} are the plans of two experiments: keep each in its own folder")
        missing = [rel for rel in self.files(self.folder) if not (self.out / rel).exists()]
        for rel in missing:
            _copy(self.folder / rel, self.out / rel)
        return missing

    def save(self) -> list[Path]:
        """Copy into `folder` every kept file of `out` that it lacks or holds otherwise, never one that is the start
        of what is kept (an answer record behind the kept one); a run's logs once the run finished (a run trained
        again replaces its earlier record), its weights as said above. The paths copied."""
        finished = {run_dir.name: RunDir(run_dir).finished.is_file() for run_dir in self.out.glob("runs/*")}
        listed = self.files(self.out)
        # each run's checkpoint among them (its trainer_state.json): a run still training is kept with it or not at all
        checkpoint = {rel.parts[1]: rel.parent for rel in listed
                      if rel.name == TRAINER_STATE and rel.parts[0] == "runs" and rel.parts[2:3] == ("checkpoints",)}
        changed, short = [], set()  # short: checkpoints a file of which went missing while they were copied
        for rel in listed:
            if rel.parts[0] == "runs" and not finished.get(rel.parts[1], False) and rel.parts[1] not in checkpoint:
                continue
            if rel.name == TRAINER_STATE and rel.parent in short:
                continue  # not whole here: the kept one before it stays the run's
            try:
                kept, mine = self.folder / rel, (self.out / rel).read_bytes()
            except FileNotFoundError:  # a checkpoint the run pruned since it was listed: the next save keeps its newer
                short.add(rel.parent)
                continue
            if not kept.is_file() or not kept.read_bytes().startswith(mine):
                _copy(self.out / rel, kept)
                changed.append(rel)
        if self.weights:
            self._prune(finished, checkpoint)
        return changed

    def _prune(self, finished: dict[str, bool], checkpoint: dict[str, Path]) -> None:
        """Once a run's checkpoint is kept whole: remove the run's other kept checkpoints, and of a finished run its
        states and whatever else the keep would not restore; a run trained again loses its kept finished mark.
        `finished`, `checkpoint`: each run's, as the save found them (a run that finishes during a save keeps its
        states until the next one)."""
        wanted = set(self.files(self.folder))
        for name, done in finished.items():
            kept_run = self.folder / "runs" / name
            kept_ckpt = self.folder / checkpoint[name] if name in checkpoint else None
            if kept_ckpt is not None and whole(kept_ckpt, states=not done):
                for ckpt in list_checkpoints(kept_run):
                    if ckpt != kept_ckpt:
                        shutil.rmtree(ckpt)
                if not done:  # trained again: the kept run has not finished either
                    RunDir(kept_run).finished.unlink(missing_ok=True)
            if done and RunDir(kept_run).finished.is_file():
                for path in sorted(kept_run.rglob("*"), reverse=True):  # files before their folders
                    if path.is_file() and path.relative_to(self.folder) not in wanted:
                        path.unlink()
                    elif path.is_dir() and not any(path.iterdir()):
                        path.rmdir()


RESUME_STATE_SUFFIX = ".pt"  # a checkpoint's optimizer, scheduler and random states: a resume reads them, a load not
LEFT_OUT_OF_RUNS = ("wandb", ".lock", BASE_MODEL)  # wandb's own files (a resumed run starts them anew), the run's lock


def whole(ckpt: Path, states: bool) -> bool:
    """Every file the checkpoint's trainer_state.json lists is there at its size (`states`: the *.pt ones too)."""
    return checkpoint_damage(ckpt, None if states else RESUME_STATE_SUFFIX) is None


def run_weight_files(run_dir: Path) -> list[Path]:
    """What `Keep(weights=True)` keeps of a LoRA run beyond its logs: a finished run's newest whole checkpoint
    without its states, or a run still training its newest whole checkpoint with its folder's files; the
    checkpoint's trainer_state.json after its other files. [] for a run with whole weights, a saved base or no
    whole checkpoint."""
    paths = RunDir(run_dir)
    done = paths.finished.is_file()
    ckpt = next((c for c in reversed(list_checkpoints(run_dir)) if whole(c, states=not done)), None)
    if ckpt is None or not (ckpt / ADAPTER_CONFIG).is_file() or paths.base_model.exists():
        return []
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != TRAINER_STATE
                   and (not done or p.suffix != RESUME_STATE_SUFFIX)) + [ckpt / TRAINER_STATE]
    if done:
        return files
    return files + sorted(p for p in run_dir.rglob("*") if p.is_file() and not p.is_relative_to(paths.checkpoints)
                          and p.relative_to(run_dir).parts[0] not in LEFT_OUT_OF_RUNS)


def _copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, atomic_file(dst) as out:
        shutil.copyfileobj(f, out)


def stopped(signum: int, frame: object) -> None:
    """SIGTERM or Ctrl-C (installed for STOP_SIGNALS): stop, the jobs under way stopping cleanly and the keep saved;
    a second one is ignored so that the stop finishes."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stoppable(keep: Keep | None, label: str) -> Iterator[None]:
    """An experiment's command while it runs: SIGTERM or Ctrl-C stop it (`stopped`), and whatever way it ends, what
    `keep` keeps is saved (and said, as `[label]`)."""
    handlers = {sig: signal.signal(sig, stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if keep is not None:
            saved = keep.save()
            if saved:
                print(f"[{label}] {len(saved)} files kept in {keep.folder}", flush=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def exit_code(scheduler: Scheduler) -> int:
    """1, naming them, when jobs failed or were not run; else 0."""
    if scheduler.failed:
        print("failed or not run:\n" + "\n".join(f"  {k}: {v}" for k, v in scheduler.failed.items()), file=sys.stderr)
        return 1
    return 0
