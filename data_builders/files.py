"""Files: writes a crash cannot leave half-done, JSON without NaN, and text, JSON-lines and glob reads.

Crash-safe writes go beside the target, are flushed to disk, then renamed: the one implementation of
write-to-temp-then-rename for the whole project (checkpoints, built datasets, trained tokenizers,
jacobian.npz); a write the file system refuses (read-only, no permission, a file over its size limit) fails as a
`FileSystemError` naming the path and what to do (`refused_write`). `json_safe` is the one rule for numbers JSON cannot
hold (NaN, inf: null). `text_lines` is the one reader of a user's text files: a file that is not UTF-8, or whose
compression is damaged (cut short by a download or a full disk), fails naming the file and the line. It all lives in
the lowest layer so that every other package can use it.
"""
from __future__ import annotations

import bz2
import errno
import glob
import gzip
import json
import lzma
import math
import os
import shutil
import socket
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # compressed files, read line by line
# what a damaged or cut-short compressed file raises (gzip.BadGzipFile and bz2's bad stream are OSErrors)
DAMAGED = (EOFError, OSError, zlib.error, lzma.LZMAError)
NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a write that failed for lack of room
REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)  # a write the file system refused (`refused_write`)
ELSEWHERE = "write elsewhere"


class FileSystemError(OSError):
    """The file system refused a write, or a path is of the wrong kind (a file where a folder is needed): one line that
    names the path and says what to do. `errno` is the operating system's."""

    def __str__(self) -> str:
        return str(self.strerror)


def _related(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def refused_write(err: BaseException, path: Path, advice: str = ELSEWHERE) -> FileSystemError | None:
    """`err` said as a FileSystemError when it is the file system refusing to write `path` (a file or a folder):
    read-only, no permission, or a file larger than the file system or `ulimit -f` allows; `advice` is what to do
    instead (give another folder). None for any other error, and for one about a path outside `path`'s folder (a
    file read while writing: its permission is not the folder's)."""
    if not isinstance(err, OSError) or isinstance(err, FileSystemError) or err.errno not in REFUSED:
        return None
    path = Path(path).absolute()
    failed = Path(os.fsdecode(err.filename)).absolute() if err.filename else None
    if failed is not None and not _related(failed, path.parent):
        return None
    folder = failed.parent if failed is not None else path.parent  # where the refused entry was to be made
    if err.errno == errno.EFBIG:
        why, do = ("a file grew larger than its file system or `ulimit -f` allows",
                   f"write to another file system (FAT32 holds 4 GiB a file) or raise the limit, or {advice}")
    elif err.errno == errno.EROFS:
        why, do = "it is on a read-only file system", f"{advice}, or remount it writable"
    else:
        why, do = f"this user may not write in {folder}", f"make it writable (chmod, chown), or {advice}"
    return FileSystemError(err.errno, f"cannot write {path}: {why}: {do}")


@contextmanager
def writing(path: Path, advice: str = ELSEWHERE) -> Iterator[None]:
    """`with writing(path):` the block writes `path`; a write the file system refuses fails as `refused_write` says."""
    try:
        yield
    except OSError as err:
        named = refused_write(err, path, advice)
        if named is None:
            raise
        raise named from err


def out_of_space(err: BaseException) -> bool:
    """A write failed for lack of room: an OSError with ENOSPC, EFBIG or EDQUOT, or a library's error around
    one (safetensors reports the io error in its message)."""
    if isinstance(err, OSError):
        return err.errno in NO_SPACE
    said = str(err)
    return any(os.strerror(code) in said for code in NO_SPACE) or any(
        kind in said for kind in ("StorageFull", "FileTooLarge", "QuotaExceeded"))  # Rust's io::ErrorKind


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
def atomic_dir(final: Path, replace: bool = False, advice: str = ELSEWHERE) -> Iterator[Path]:
    """`with atomic_dir(final) as tmp:` write into `tmp`; on success it becomes `final` (see publish_dir).

    An exception inside the block removes `tmp` and leaves `final` as it was. A write the file system refuses
    fails naming `final` and `advice` (`refused_write`).
    """
    final = Path(final)
    with writing(final, advice):
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
    """`with atomic_file(path) as f:` write to an open temporary file; on success it replaces `path`. A write the
    file system refuses fails naming `path` (`refused_write`)."""
    path = Path(path)
    with writing(path):
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


def json_safe(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers and every NaN or infinity as None (JSON null: JSON has no
    NaN, and a reader such as pandas reads null back as missing), in nested dicts, lists and tuples too."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy and torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (`read_jsonl_lines`); a bad line fails naming file and line."""
    return [rec for _, rec in read_jsonl_lines(path)]


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a UTF-8 text file, decompressed by its suffix (.gz, .bz2, .xz); a
    line's \\r\\n end is read as \\n, as text mode reads it.

    ValueError naming the file and line for text that is not UTF-8, and naming the file and how far it read for
    a compressed file that is damaged or cut short (a half-finished download, a copy onto a full disk).
    """
    path = Path(path)
    line_no = 0
    with OPENERS.get(path.suffix, open)(path, "rb") as f:
        try:
            for line_no, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not UTF-8 text ({err.reason} at byte {err.start}): "
                                     "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
                yield line_no, (text[:-2] + "\n" if text.endswith("\r\n") else text)
        except DAMAGED as err:
            raise ValueError(f"{path}: damaged or cut short after {line_no} lines ({err}): fetch or copy the "
                             "file again") from None


def read_jsonl_lines(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-blank line of a JSON-lines file (.gz, .bz2, .xz: compressed); a bad
    line, text that is not UTF-8, a damaged file or one without any record fails naming the file (and line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    out = []
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not a JSON object: {err}") from err
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(rec).__name__}")
        out.append((line_no, rec))
    if not out:
        raise ValueError(f"{path}: empty: no records in it (a file written or copied only in part?)")
    return out


def expand_paths(pattern: str | Path) -> list[Path]:
    """The files a path or glob pattern (`qa_data/20_total_documents/*.jsonl.gz`) names, sorted."""
    text = str(pattern)
    if not glob.has_magic(text):
        return [Path(text)]
    found = sorted(Path(p) for p in glob.glob(os.path.expanduser(text)))
    if not found:
        raise FileNotFoundError(f"{text}: no file matches this pattern")
    return found
