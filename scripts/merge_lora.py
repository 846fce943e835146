"""Merge a LoRA adapter into its base model: one standalone safetensors folder, no peft needed to use it.

    python -m scripts.merge_lora outputs/in2/<time>/checkpoints/step-300 --out merged/in2-step300
    python -m scripts.merge_lora ADAPTER_DIR --out DIR --base mistralai/Mistral-7B-v0.1

ADAPTER_DIR is a peft `save_pretrained` folder (adapter_config.json + adapter_model.safetensors),
such as a `peft=lora` run's `checkpoints/step-N/`. The base model is, in this order:

1. `--base` (hub id or folder), when given;
2. `<run_dir>/base_model/` when ADAPTER_DIR is `<run_dir>/checkpoints/step-N` and that folder exists
   (train.py keeps the base of a LoRA run there when `model.pretrained` alone does not give it: a
   random init, or diff layers swapped in; without it the adapter is useless);
3. `base_model_name_or_path` of adapter_config.json (the `model.pretrained` the run started from).

Steps 2 and 3 and the loading are `models.training.checkpoint.load_checkpoint_model`, the project's one
checkpoint loader (a base saved with differential attention loads as one). The tokenizer comes from
ADAPTER_DIR, else `<run_dir>/tokenizer/`, else the base; when none has one the export holds the
weights only (and says so). The export appears complete or not at all (written beside --out, then
renamed). Remote code is never run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from analysis.command_line import CommandParser
from data_builders.files import atomic_dir
from models.build import DType
from models.training.checkpoint import ADAPTER_CONFIG, BaseWeights, base_weights, load_checkpoint_model
from models.training.run_dir import RunDir, run_dir_of

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = tuple(DType)


class MergeError(RuntimeError):
    """Something the merge needs is missing or unusable; the message names the path."""


def check_adapter_dir(adapter_dir: Path) -> None:
    """Check that the folder holds peft adapters: adapter_config.json and the adapter weights."""
    if not adapter_dir.is_dir():
        raise MergeError(f"adapter folder {adapter_dir} does not exist")
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file():
        hint = " (it holds a full model: nothing to merge)" if (adapter_dir / "config.json").is_file() else ""
        raise MergeError(f"{adapter_dir} is not a peft adapter folder: no {ADAPTER_CONFIG}{hint}")
    if not any((adapter_dir / name).is_file() for name in ADAPTER_WEIGHTS):
        raise MergeError(f"{adapter_dir} has {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")


def resolve_base(adapter_dir: Path, base: Optional[str] = None) -> BaseWeights:
    """The adapters' base by the order in the module docstring; MergeError naming what is missing."""
    try:
        found = base_weights(adapter_dir, base=base)
    except FileNotFoundError as err:
        raise MergeError(f"{err}" if base else f"{err}; pass --base") from err
    return found._replace(source="--base") if base else found


def find_tokenizer_dir(adapter_dir: Path, base: str) -> Optional[Path]:
    """First of adapter folder, `<run_dir>/tokenizer/`, base folder that holds tokenizer files."""
    run_dir = run_dir_of(adapter_dir)
    candidates = [adapter_dir, RunDir(run_dir).tokenizer if run_dir is not None else None, Path(base)]
    for folder in candidates:
        if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    return None


def merge_lora(adapter_dir: str | Path, out: str | Path, base: Optional[str] = None, dtype: str = "auto",
               force: bool = False) -> dict:
    """Merge the adapter in `adapter_dir` into its base and write `out`; returns a summary dict."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    if dtype not in DTYPES:
        raise MergeError(f"dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    check_adapter_dir(adapter_dir)
    if out.resolve() == adapter_dir.resolve():
        raise MergeError(f"--out {out} is the adapter folder itself; choose another folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise MergeError(f"output {out} exists and is not empty (pass --force to replace it)")
    base_path, _, source = resolve_base(adapter_dir, base)
    try:
        # safe_merge checks every merged weight for NaN/inf before it replaces the base weight.
        merged = load_checkpoint_model(adapter_dir, dtype=dtype, merge_lora=True, base=base_path)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise MergeError(f"cannot apply the adapter {adapter_dir} to base {base_path!r} (from {source}): {err}") from err

    tok_dir = find_tokenizer_dir(adapter_dir, base_path)
    with atomic_dir(out, replace=True) as tmp:
        # transformers 5 always writes safetensors; the flag keeps 4.x from writing pytorch_model.bin.
        merged.save_pretrained(tmp, safe_serialization=True)
        if tok_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False).save_pretrained(tmp)
    if tok_dir is None:
        print(f"merge_lora: no tokenizer in {adapter_dir}, its run's tokenizer/ or {base_path}; "
              f"{out} holds the merged weights only", file=sys.stderr)
    return {
        "out": str(out),
        "adapter": str(adapter_dir),
        "base": base_path,
        "base_from": source,
        "tokenizer": str(tok_dir) if tok_dir is not None else None,
        "dtype": str(next(merged.parameters()).dtype).removeprefix("torch."),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = CommandParser(
        prog="python -m scripts.merge_lora", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="peft adapter folder, e.g. run_dir/checkpoints/step-N")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the merged model (safetensors + tokenizer)")
    parser.add_argument("--base", metavar="BASE", help="base model hub id or folder (default: see above)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="dtype to load the base in and save the merged model in (default: the base's own)")
    parser.add_argument("--force", action="store_true", help="replace --out even when it is not empty")
    args = parser.parse_args(argv)
    try:
        summary = merge_lora(args.adapter_dir, args.out, args.base, args.dtype, args.force)
    except MergeError as err:
        parser.exit(1, f"merge_lora: error: {err}\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
