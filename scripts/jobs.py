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
from models.training.checkpoint import ADAPTER_CONFIG, list_checkpoints
from models.training.run_dir import TRAINER_STATE, RunDir

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

    With `weights`, also the runs' (`runs/<n>/`) weights: a finished run's final checkpoint when it holds LoRA
    adapters (~7 MB), all of it that loads the model and not the optimizer's, scheduler's and random states (*.pt),
    so that its evaluations run on a fresh machine without training it again (whole weights, hundreds of MB, are not
    kept); and a run still training, its newest checkpoint whole (~25 MB with the optimizer's state) with every file
    of its folder a resume reads, so that a fresh machine resumes it where the last one saved. The keep holds one
    checkpoint a run: the older ones are removed from it as a newer one is kept."""

    folder: Path
    out: Path
    patterns: Sequence[str]
    plan: str
    weights: bool = False

    def files(self, root: Path) -> list[Path]:
        found = {p for pattern in self.patterns for p in root.glob(pattern) if p.is_file()}
        for run_dir in sorted(root.glob("runs/*")) if self.weights else ():
            found |= set(run_weight_files(run_dir))
        return sorted(p.relative_to(root) for p in found)

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
        changed = []
        listed = self.files(self.out)
        # a run still training: its files go with its newest checkpoint, or not at all (nothing to resume from)
        in_flight = {p.relative_to(self.out) for run_dir in self.out.glob("runs/*") if self.weights
                     and not RunDir(run_dir).finished.is_file() for p in run_weight_files(run_dir)}
        for rel in listed:
            if rel.parts[0] == "runs" and rel not in in_flight and not RunDir(
                    self.out / "runs" / rel.parts[1]).finished.is_file():
                continue
            try:
                kept, mine = self.folder / rel, (self.out / rel).read_bytes()
            except FileNotFoundError:  # a checkpoint the run pruned since it was listed: the next save keeps its newer
                continue
            if not kept.is_file() or not kept.read_bytes().startswith(mine):
                _copy(self.out / rel, kept)
                changed.append(rel)
        if self.weights:
            self._prune(listed)
        return changed

    def _prune(self, listed: Sequence[Path]) -> None:
        """Remove from the keep what a run's newer state replaced, once that state is kept whole (its
        trainer_state.json, written last): the run's other checkpoints, and a finished run's optimizer, scheduler and
        random states; a finished run's kept states when it has no weights to keep; the finished mark of a run
        trained again. A final adapter is never removed but by a newer one."""
        checkpoint_of = {rel.parts[1]: self.folder / Path(*rel.parts[:4]) for rel in listed
                         if rel.parts[0] == "runs" and len(rel.parts) > 4 and rel.parts[2] == "checkpoints"}
        for run_dir in self.out.glob("runs/*"):
            kept_run, finished = self.folder / run_dir.relative_to(self.out), RunDir(run_dir).finished.is_file()
            newest = checkpoint_of.get(run_dir.name)
            if newest is None or not (newest / TRAINER_STATE).is_file():
                if finished:  # whole weights, not kept: a resume state of it is of no use any more
                    for ckpt in list_checkpoints(kept_run):
                        if any(ckpt.glob(f"*{RESUME_STATE_SUFFIX}")):
                            shutil.rmtree(ckpt)
                continue
            for ckpt in list_checkpoints(kept_run):
                if ckpt != newest:
                    shutil.rmtree(ckpt)
            if finished:
                for state in newest.glob(f"*{RESUME_STATE_SUFFIX}"):
                    state.unlink()
            else:  # trained again: the kept run has not finished either
                RunDir(kept_run).finished.unlink(missing_ok=True)


RESUME_STATE_SUFFIX = ".pt"  # a checkpoint's optimizer, scheduler and random states: a resume reads them, a load not
LEFT_OUT_OF_RUNS = ("wandb", ".lock")  # never kept: wandb's own files (a resumed run starts them anew), the run's lock


def run_weight_files(run_dir: Path) -> list[Path]:
    """What `Keep(weights=True)` keeps of a run beyond its logs, its checkpoint's files first: a finished run's final
    LoRA adapters, or a run still training its newest checkpoint with its folder's files; [] for a run with
    whole weights or no checkpoint."""
    newest = next(reversed(list_checkpoints(run_dir)), None)
    if newest is None:
        return []
    if RunDir(run_dir).finished.is_file():
        if not (newest / ADAPTER_CONFIG).is_file():
            return []
        return sorted(p for p in newest.iterdir() if p.is_file() and p.suffix != RESUME_STATE_SUFFIX)
    checkpoints = RunDir(run_dir).checkpoints
    rest = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_relative_to(checkpoints)
            and p.relative_to(run_dir).parts[0] not in LEFT_OUT_OF_RUNS]
    return sorted(p for p in newest.rglob("*") if p.is_file()) + sorted(rest)


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
