"""Writes a crash cannot leave half-done: write beside the target, flush to disk, then rename.

The one implementation of write-to-temp-then-rename for the whole project (checkpoints, built
datasets, trained tokenizers, jacobian.npz). It lives in the lowest layer so that every other
package can use it.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_tree(folder: Path) -> None:
    """Flush every file under `folder` to disk (a rename publishes only what is on disk)."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def temp_sibling(final: Path) -> Path:
    """A process-unique hidden folder beside `final`, where its contents are written first (host and
    process id: on a file system that several nodes share, process ids alone repeat)."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp{socket.gethostname()}-{os.getpid()}")


def publish_dir(tmp: Path, final: Path, replace: bool) -> None:
    """Give the finished folder `tmp` the name `final` in one rename, after flushing it to disk.

    When `final` exists: with `replace` the old folder is swapped out (never merged) and removed;
    without, `tmp` is discarded, because another process already published the same content.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if not final.exists():
        try:
            tmp.rename(final)
            return
        except OSError:  # another process published `final` between the check and the rename
            if not final.exists():
                raise
    if not replace:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = final.with_name(f".{final.name}.old{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old)


@contextmanager
def atomic_dir(final: Path, replace: bool = False) -> Iterator[Path]:
    """`with atomic_dir(final) as tmp:` write into `tmp`; on success it becomes `final` (see publish_dir).

    An exception inside the block removes `tmp` and leaves `final` as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final, replace)


@contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator:
    """`with atomic_file(path) as f:` write to an open temporary file; on success it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) so that a reader sees the old or the new file, never half."""
    with atomic_file(path, "w") as f:
        f.write(text)
