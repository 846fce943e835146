"""Merge a LoRA adapter into its base model: one standalone safetensors folder, no peft needed to use it.

    python -m scripts.merge_lora outputs/in2/<time>/checkpoints/step-300 --out merged/in2-step300
    python -m scripts.merge_lora ADAPTER_DIR --out DIR --base mistralai/Mistral-7B-v0.1

ADAPTER_DIR is a peft `save_pretrained` folder (adapter_config.json + adapter_model.safetensors),
such as a `peft=lora` run's `checkpoints/step-N/`. The base model is, in this order:

1. `--base` (hub id or folder), when given;
2. `<run_dir>/base_model/` when ADAPTER_DIR is `<run_dir>/checkpoints/step-N` and that folder exists
   (train.py keeps the random-init base of a LoRA run there: without it the adapter is useless);
3. `base_model_name_or_path` of adapter_config.json (the `model.pretrained` the run started from).

A base saved with differential attention (its config.json has `diff_attention`) loads through
`models.diff_attention`, which registers the diff model types with the Auto classes. The tokenizer
comes from ADAPTER_DIR, else `<run_dir>/tokenizer/`, else the base; when none has one the export
holds the weights only (and says so). Remote code is never run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from models.checkpoint import STEP_DIR

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MergeError(RuntimeError):
    """Something the merge needs is missing or unusable; the message names the path."""


def check_adapter_dir(adapter_dir: Path) -> dict:
    """The folder's adapter_config.json contents, after checking that the adapter weights are there."""
    if not adapter_dir.is_dir():
        raise MergeError(f"adapter folder {adapter_dir} does not exist")
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file():
        hint = " (it holds a full model: nothing to merge)" if (adapter_dir / "config.json").is_file() else ""
        raise MergeError(f"{adapter_dir} is not a peft adapter folder: no {ADAPTER_CONFIG}{hint}")
    if not any((adapter_dir / name).is_file() for name in ADAPTER_WEIGHTS):
        raise MergeError(f"{adapter_dir} has {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    return json.loads(config_file.read_text())


def run_dir_of(adapter_dir: Path) -> Optional[Path]:
    """`<run_dir>` when `adapter_dir` is `<run_dir>/checkpoints/step-N`, else None."""
    adapter_dir = adapter_dir.resolve()
    if STEP_DIR.match(adapter_dir.name) and adapter_dir.parent.name == "checkpoints":
        return adapter_dir.parent.parent
    return None


def resolve_base(adapter_dir: Path, adapter_config: dict, base: Optional[str] = None) -> tuple[str, str]:
    """(base model hub id or folder, where that choice came from) by the order in the module docstring."""
    if base:
        return base, "--base"
    run_dir = run_dir_of(adapter_dir)
    if run_dir is not None and (run_dir / "base_model").is_dir():
        return str(run_dir / "base_model"), "the run's base_model/ folder"
    recorded = adapter_config.get("base_model_name_or_path")
    if recorded:
        return recorded, f"base_model_name_or_path in {adapter_dir / ADAPTER_CONFIG}"
    looked = f"{run_dir / 'base_model'}, " if run_dir is not None else ""
    raise MergeError(
        f"no base model for {adapter_dir}: looked at {looked}base_model_name_or_path in "
        f"{adapter_dir / ADAPTER_CONFIG} (empty); pass --base"
    )


def check_base(base: str, source: str) -> tuple[str, dict]:
    """(base, its config.json as a dict); a local folder must exist and hold config.json.

    The config is read as a plain dict, so a diff-attention model type needs no registration yet.
    """
    from transformers import PretrainedConfig

    path = Path(base).expanduser()
    # A hub id is `name` or `org/name`; anything else is a folder and must be there.
    looks_like_path = path.is_absolute() or base.startswith((".", "~")) or base.count("/") > 1
    if looks_like_path and not path.is_dir():
        raise MergeError(f"base model folder {path} (from {source}) does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MergeError(f"base model folder {path} (from {source}) has no config.json")
        base = str(path)
    try:
        config, _ = PretrainedConfig.get_config_dict(base)
    except (OSError, ValueError) as err:
        raise MergeError(f"cannot read the base model config of {base!r} (from {source}): {err}") from err
    return base, config


def load_base(base: str, source: str, dtype: str):
    """The base causal LM, with the diff-attention model types registered when its config needs them."""
    base, config = check_base(base, source)
    if config.get("diff_attention") is not None:
        import models.diff_attention  # noqa: F401  (registers qwen2_diff / llama_diff / mistral_diff)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            base, dtype="auto" if dtype == "auto" else DTYPES[dtype], trust_remote_code=False
        )
    except (OSError, ValueError) as err:
        raise MergeError(f"cannot load the base model {base!r} (from {source}): {err}") from err


def find_tokenizer_dir(adapter_dir: Path, base: str) -> Optional[Path]:
    """First of adapter folder, `<run_dir>/tokenizer/`, base folder that holds tokenizer files."""
    run_dir = run_dir_of(adapter_dir)
    candidates = [adapter_dir, run_dir / "tokenizer" if run_dir is not None else None, Path(base)]
    for folder in candidates:
        if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    return None


def merge_lora(adapter_dir: str | Path, out: str | Path, base: Optional[str] = None, dtype: str = "auto",
               force: bool = False) -> dict:
    """Merge the adapter in `adapter_dir` into its base and write `out`; returns a summary dict."""
    from peft import PeftModel

    adapter_dir, out = Path(adapter_dir), Path(out)
    if dtype != "auto" and dtype not in DTYPES:
        raise MergeError(f"dtype {dtype!r} must be auto or one of {sorted(DTYPES)}")
    adapter_config = check_adapter_dir(adapter_dir)
    if out.resolve() == adapter_dir.resolve():
        raise MergeError(f"--out {out} is the adapter folder itself; choose another folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise MergeError(f"output {out} exists and is not empty (pass --force to write into it)")
    base_path, source = resolve_base(adapter_dir, adapter_config, base)
    model = load_base(base_path, source, dtype)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise MergeError(f"cannot apply the adapter {adapter_dir} to base {base_path!r} (from {source}): {err}") from err
    # safe_merge checks every merged weight for NaN/inf before it replaces the base weight.
    merged = peft_model.merge_and_unload(safe_merge=True)

    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors; the flag keeps 4.x from writing pytorch_model.bin.
    merged.save_pretrained(out, safe_serialization=True)
    tok_dir = find_tokenizer_dir(adapter_dir, base_path)
    if tok_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False).save_pretrained(out)
    else:
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
    parser = argparse.ArgumentParser(
        prog="python -m scripts.merge_lora", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="peft adapter folder, e.g. run_dir/checkpoints/step-N")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the merged model (safetensors + tokenizer)")
    parser.add_argument("--base", metavar="BASE", help="base model hub id or folder (default: see above)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="dtype to load the base in and save the merged model in (default: the base's own)")
    parser.add_argument("--force", action="store_true", help="write into --out even when it is not empty")
    args = parser.parse_args(argv)
    try:
        summary = merge_lora(args.adapter_dir, args.out, args.base, args.dtype, args.force)
    except MergeError as err:
        parser.exit(1, f"merge_lora: error: {err}\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
