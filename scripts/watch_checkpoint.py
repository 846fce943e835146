"""The watch on a saved checkpoint: what its run logs at its last step (analysis.evaluation.watch), measured again
on the weights of any checkpoint, with the run's own panel or a larger one.

    python -m scripts.watch_checkpoint RUN/checkpoints/step-150
    python -m scripts.watch_checkpoint RUN/checkpoints/step-25 watch.every=0 watch.loglik_questions=81 --out p.jsonl
    python -m scripts.watch_checkpoint RUN/checkpoints/step-25 --start      # the run's starting model, as step 0

The model computes as the run's did: LoRA adapters on their base, not merged, in the run's `model.dtype` and
attention (`checkpoint_config.json`, the run's config); the panel is the run's `watch.*` with the
`watch.key=value` overrides given; the measurement runs under the run's bf16 autocast when it trained in bf16. The
rows are what the run's `watch.jsonl` holds at its last step (the panel's header first), so
`analysis.evaluation.watch.position_signals` reads a `--start` file and a checkpoint's file together as one run's
start and end. The starting model is the run's base weights without adapters: LoRA's B starts at zero, so it is
the function the run measured at step 0. A run that watches its own IN2 records (`watch.sets` with in2) needs its
training data rebuilt: give `watch.sets=[mdqa]` or `[kv]` instead.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from analysis.command_line import CommandParser
from analysis.during_training import check_watch, watch_nq_file
from analysis.evaluation.checkpoints import CompareError, load_checkpoint_tokenizer, resolve_target
from analysis.evaluation.watch import WatchSet, build_panel, panel_header
from data_builders.build import built_with
from data_builders.config import DataSource
from data_builders.files import atomic_write_text
from models.build import DType, differs_from_pretrained
from models.training.checkpoint import base_weights, load_checkpoint_model
from models.training.engines import Precision
from models.training.run_dir import run_dir_of, trained_with
from models.wheel_models import local_pretrained

EXAMPLE = "python -m scripts.watch_checkpoint outputs/reads_middle/run/checkpoints/step-150 watch.loglik_questions=81"


class WatchCheckpointError(RuntimeError):
    """The checkpoint or an override cannot be used; the message names which."""


def run_config(ckpt: Path, overrides: Sequence[str]) -> Any:
    """The checkpoint's run config (train.TrainConfig) with `watch.*` overrides applied and checked."""
    from train import TrainConfig  # train.py's schema: the run's own config, typed

    saved = trained_with(ckpt)
    if saved is None:
        raise WatchCheckpointError(f"{ckpt}: no checkpoint_config.json, and no run config beside it: not a "
                                   "checkpoint of a train.py run")
    for item in overrides:
        if not item.startswith("watch.") or "=" not in item:
            raise WatchCheckpointError(f"{item!r}: only watch.key=value overrides change what is measured")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), saved, OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise WatchCheckpointError(f"{ckpt}: {err}") from err
    try:
        check_watch(cfg.watch, cfg.data)
    except (ValueError, FileNotFoundError) as err:
        raise WatchCheckpointError(str(err)) from err
    if not cfg.watch.on:
        raise WatchCheckpointError("nothing to measure: the watch is off (watch.enabled=false), or measures neither "
                                   "Jacobians nor log p (watch.every=0 watch.loglik=false)")
    if WatchSet.in2 in cfg.watch.sets:
        raise WatchCheckpointError("watch.sets has in2, whose prompts are the run's held-out IN2 records: rebuilding "
                                   "its training data is not done here; give watch.sets=[mdqa] or [kv]")
    return cfg


def load_run_model(cfg: Any, ckpt: Path, start: bool, device: str) -> torch.nn.Module:
    """The checkpoint's model as the run computed it: the adapters on their base, not merged, in the run's dtype and
    attention (`start`: the base alone, the function of a LoRA run at step 0)."""
    weights = base_weights(ckpt)
    if start and not weights.adapters:
        if differs_from_pretrained(cfg.model):
            raise WatchCheckpointError(f"--start: {ckpt} holds whole weights of a run that did not start from "
                                       "model.pretrained as it is (a random init, diff layers swapped in, or RoPE "
                                       "turned off), whose starting weights were not kept: measure a checkpoint")
        source = local_pretrained(cfg.model.pretrained)
    else:
        source = weights.path if start else ckpt
    # LoRA: the base in the run's model.dtype, the adapters in fp32 as peft makes them; whole weights as saved (the
    # torch engine trains and saves them in fp32)
    dtype = cfg.model.dtype if weights.adapters else DType.auto
    model = load_checkpoint_model(source, dtype=dtype, merge_lora=False,
                                  attn_implementation=str(cfg.model.attn_implementation))
    return model.to(device)


def default_out(ckpt: Path, step: int, start: bool, overrides: Sequence[str]) -> Path:
    """`<run>/watch_checkpoints/step-<N>.jsonl` (`start.jsonl`), with a digest of the overrides when there are some:
    two panels of one checkpoint never overwrite each other."""
    run_dir = run_dir_of(ckpt.resolve()) or ckpt.resolve().parent
    name = "start" if start else f"step-{step}"
    if overrides:
        name += "-" + hashlib.sha256(json.dumps(sorted(overrides)).encode()).hexdigest()[:8]
    return run_dir / "watch_checkpoints" / f"{name}.jsonl"


def watch_checkpoint(ckpt: str | Path, overrides: Sequence[str] = (), start: bool = False,
                     out: Optional[str | Path] = None, device: str = "cpu") -> Path:
    """Measure the watch's last-step panel on `ckpt` (module docstring); the rows go to `out` (default
    `default_out`). Returns that path."""
    try:
        target = resolve_target(ckpt)  # a run directory: its newest checkpoint
    except CompareError as err:
        raise WatchCheckpointError(str(err)) from err
    if target.hub_id is not None:
        raise WatchCheckpointError(f"{ckpt}: no such checkpoint folder")
    ckpt = Path(target.checkpoint)
    cfg = run_config(ckpt, overrides)
    if not start and target.step is None:
        raise WatchCheckpointError(f"{ckpt}: no trainer_state.json and not a step-N folder: which training step it "
                                   "holds is unknown")
    step = 0 if start else target.step
    try:
        tokenizer = load_checkpoint_tokenizer(target)
        model = load_run_model(cfg, ckpt, start, device)
        built = built_with(cfg.data)
        split = built.nq_split if built.source == DataSource.nq else cfg.eval.mdqa.split
        panel = build_panel(cfg.watch, int(model.config.num_hidden_layers), tokenizer, cfg.eval.chat_template, split,
                            watch_nq_file(cfg.watch, cfg.data))
    except (CompareError, OSError, ValueError, KeyError, RuntimeError) as err:
        raise WatchCheckpointError(f"{ckpt}: {err}") from err
    started = time.perf_counter()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == Precision.bf16):
        rows = panel.measure_due(model, step, last=True)
    print(f"{ckpt} (step {step}{', the starting model' if start else ''}): {len(rows)} prompts measured in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    metrics = panel.loglik_metrics() | panel.jacobian_metrics()
    for key in sorted(k for k in metrics if k.endswith(("_contrast", "doc_share"))):
        print(f"  {key} {metrics[key]:+.3f}", file=sys.stderr)
    out = Path(out) if out else default_out(ckpt, step, start, overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {**panel_header(panel, step), "checkpoint": str(ckpt.resolve()), "start": start,
              "overrides": list(overrides)}
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in [header, *rows]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m scripts.watch_checkpoint", description=__doc__.split("\n\n")[0],
                           example=EXAMPLE)
    parser.add_argument("checkpoint", help="a checkpoint folder (checkpoints/step-N) or a run directory (its newest)")
    parser.add_argument("overrides", nargs="*", help="watch.key=value: another panel than the run's")
    parser.add_argument("--start", action="store_true", help="the run's starting model (its adapters as initialised)")
    parser.add_argument("--out", help="the rows' file (default <run>/watch_checkpoints/step-N.jsonl)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    try:
        path = watch_checkpoint(args.checkpoint, args.overrides, args.start, args.out, args.device)
    except WatchCheckpointError as err:
        print(f"watch_checkpoint: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
