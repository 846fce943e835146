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

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from transformers import AutoTokenizer

from analysis.command_line import CommandParser
from analysis.during_training import check_watch, watch_nq_file
from analysis.evaluation.watch import WatchSet, build_panel, panel_header
from data_builders.build import built_with
from data_builders.config import DataSource
from data_builders.files import atomic_write_text
from models.training.checkpoint import base_weights, list_checkpoints, load_checkpoint_model
from models.training.engines import Precision
from models.training.resume_guard import trained_with
from models.training.state import TrainerState
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
        raise WatchCheckpointError("the watch is off in this run config: turn it on (watch.enabled=true)")
    if WatchSet.in2 in cfg.watch.sets:
        raise WatchCheckpointError("watch.sets has in2, whose prompts are the run's held-out IN2 records: rebuilding "
                                   "its training data is not done here; give watch.sets=[mdqa] or [kv]")
    return cfg


def checkpoint_step(ckpt: Path) -> int:
    state = ckpt / "trainer_state.json"
    return int(TrainerState.read(ckpt).step) if state.is_file() else 0


def load_run_model(cfg: Any, ckpt: Path, start: bool, device: str) -> torch.nn.Module:
    """The checkpoint's model as the run computed it: the adapters on their base, not merged, in the run's dtype and
    attention (`start`: the base alone, the function of a LoRA run at step 0)."""
    weights = base_weights(ckpt)
    if start and not weights.adapters:
        if not cfg.model.pretrained:
            raise WatchCheckpointError(f"--start: {ckpt} holds whole weights of a randomly initialised run, whose "
                                       "starting weights were not kept; measure one of its checkpoints instead")
        source = local_pretrained(cfg.model.pretrained)
    else:
        source = weights.path if start else ckpt
    model = load_checkpoint_model(source, dtype=cfg.model.dtype, merge_lora=False,
                                  attn_implementation=str(cfg.model.attn_implementation))
    return model.to(device)


def watch_checkpoint(ckpt: str | Path, overrides: Sequence[str] = (), start: bool = False,
                     out: Optional[str | Path] = None, device: str = "cpu") -> Path:
    """Measure the watch's last-step panel on `ckpt` (module docstring); the rows go to `out` (default
    `<run>/watch_checkpoints/step-<N>.jsonl`, `start-<N>` with `start`). Returns that path."""
    ckpt = Path(ckpt)
    if ckpt.is_dir() and not (ckpt / "checkpoint_config.json").is_file() and list_checkpoints(ckpt):
        ckpt = list_checkpoints(ckpt)[-1]  # a run directory: its newest checkpoint
    if not ckpt.is_dir():
        raise WatchCheckpointError(f"{ckpt}: no such checkpoint folder")
    cfg = run_config(ckpt, overrides)
    step = 0 if start else checkpoint_step(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_run_model(cfg, ckpt, start, device)
    built = built_with(cfg.data)
    split = built.nq_split if built.source == DataSource.nq else cfg.eval.mdqa.split
    layers = int(model.config.num_hidden_layers)
    panel = build_panel(cfg.watch, layers, tokenizer, cfg.eval.chat_template, split, watch_nq_file(cfg.watch, cfg.data))
    started = time.perf_counter()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == Precision.bf16):
        rows = panel.measure_due(model, step, last=True)
    print(f"{ckpt} (step {step}{', the starting model' if start else ''}): {len(rows)} prompts measured in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    metrics = panel.loglik_metrics() | panel.jacobian_metrics()
    for key in sorted(k for k in metrics if k.endswith(("_contrast", "doc_share"))):
        print(f"  {key} {metrics[key]:+.3f}", file=sys.stderr)
    run_dir = ckpt.parent.parent
    out = Path(out) if out else run_dir / "watch_checkpoints" / f"{'start' if start else 'step'}-{step}.jsonl"
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
