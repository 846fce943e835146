"""One writer per run directory: a process that writes a run directory holds its lock (`<run>/.lock`) until it ends.

The lock is an exclusive `flock` on the file, which the kernel releases however the holder ends, a SIGKILL too.
While held, the file names the holder (pid, host, command, start time); a holder that ends normally empties it.
A second writer is refused at start-up with a message naming the directory and the holder. A lock found free
but not empty was left by a holder that died without releasing it: it is taken over, and the log says whose. A
directory this process cannot write (read-only, no permission) is refused the same way, as the first write there.

`python train.py` takes the lock of its run directory (of a `-m` sweep's directory too) through `HydraRunLock`
before Hydra writes anything there, and `run()` holds its run directory's; `scripts.eval_checkpoint` holds its
output folder's. With several ranks, only the main process (RANK 0) locks: one lock per run, not per rank.
Taking a lock this process already holds is a no-op, so nested holders (Hydra, then `run()`) share it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from data_builders.files import refused_write
from models.training.run_dir import LOCK

log = logging.getLogger(__name__)

_held: dict[Path, int] = {}  # resolved run directory -> the open lock file's descriptor, in this process


class RunDirInUse(RuntimeError):
    """Another process writes this run directory."""


class RunDirNotWritable(RunDirInUse):
    """This process cannot write the run directory (read-only, no permission): refused wherever one in use is."""


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _describe(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')} "
            f"({holder.get('command', '?')})")


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"command": text[:200]}


def acquire(run_dir: str | Path, advice: str = "write elsewhere") -> bool:
    """Hold `run_dir`'s lock from now on (creating the folder); False if this process held it already.
    RunDirInUse naming the holder, and `advice` on what to do, if another process holds it; RunDirNotWritable naming
    the directory and `advice` if this process cannot write there."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return False
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        refused = refused_write(err, run_dir, advice)
        if refused is None:
            raise
        raise RunDirNotWritable(str(refused)) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read_holder(fd)
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RunDirInUse(f"{run_dir} is in use by {_describe(holder or {})}: one process writes a run "
                          f"directory; wait for it to end, or {advice}") from None
    stale = _read_holder(fd)
    if stale is not None:
        log.warning("%s: took over the lock left by %s, which ended without releasing it (killed?)", run_dir,
                    _describe(stale))
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(_holder()) + "\n").encode())
    os.fsync(fd)
    _held[run_dir] = fd
    return True


def release(run_dir: str | Path) -> None:
    """Give `run_dir`'s lock up (emptied: nobody holds it); nothing if this process does not hold it."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is None:
        return
    os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextmanager
def holding(run_dir: str | Path, advice: str = "write elsewhere") -> Iterator[None]:
    """`run_dir`'s lock held inside the block (main rank only; kept if this process held it already)."""
    taken = is_main_rank() and acquire(run_dir, advice)
    try:
        yield
    finally:
        if taken:
            release(run_dir)


def _acquire_or_exit(run_dir: str, advice: str) -> None:
    """`acquire`, or the refusal on stderr and exit status 1: Hydra turns a callback's exceptions into warnings."""
    try:
        acquire(run_dir, advice)
    except RunDirInUse as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


class HydraRunLock(Callback):
    """`hydra.callbacks` entry of conf/train.yaml: the run's (or the sweep's) directory locked before Hydra writes
    its `.hydra/` files there. The run directory is resolved once and pinned, so the job writes the one locked."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _pin_and_lock(config.hydra.run, "give another hydra.run.dir")

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _pin_and_lock(config.hydra.sweep, "give another hydra.sweep.dir")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        release(config.hydra.sweep.dir)


def _pin_and_lock(node: DictConfig, advice: str) -> None:
    """`node.dir` (hydra.run or hydra.sweep) resolved once and pinned, then locked by the main rank."""
    with read_write(node):
        node.dir = str(node.dir)
    if is_main_rank():
        _acquire_or_exit(node.dir, advice)
