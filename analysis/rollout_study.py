"""How well each rollout explains the measured Jacobian: Herasimchyk et al.'s comparison at CPU scale.

    python -m analysis.rollout_study                       # trains the default in2 run (jacobian off), ~2 min
    python -m analysis.rollout_study --checkpoint outputs/in2/<time> --data-dir $POSDEBIAS_DATA

For a trained checkpoint (the latest of a run directory, a checkpoint folder, or, by default, a fresh
`+exp=in2` run without Jacobian measurements) and a random-init model of the same architecture, it
measures the exact Jacobian profile (`analysis.measure.jacobian`, estimator exact) of held-out sequences (the
run's vanilla and chunked kinds) and compares it with every rollout variant of `analysis.measure.rollout` and
with the fitted Cesàro prior: Spearman, W1 and RMSE of log10 (free scale) of the mean profiles. It also
reports how much smaller the measured-λ rollout's discrepancy is than that of the attention-only (λ=1)
and fixed-residual (λ=0.5) baselines: 1 - W1(measured) / W1(baseline), the paper's ~85%. Writes
`<out>/rollout_study.md` (the table) and `<out>/rollout_study.png` (the profiles). The report also
holds the RoPE-invariance check at init: the Spearman between the exact profiles of three random inits
with and without RoPE (`model.rope=false`), which the paper finds near 0.99.
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

from analysis.evaluation.checkpoints import CompareError, load_checkpoint_tokenizer, load_model, resolve_target
from analysis.measure.heldout import HeldoutError, heldout_documents
from analysis.measure.jacobian import Estimator, JacobianConfig, build_eval_sequences, measure_sets
from analysis.measure.prior import fit_alpha, prior_profile, spearman
from analysis.measure.rollout import ROLLOUT_METRICS, RolloutVariant, capture, rollout_metrics, rollouts
from analysis.report.figures import plot_predicted_profiles
from analysis.report.tables import markdown_table, num
from data_builders.files import atomic_write_text
from models.attention.nope import disable_rope, is_nope
from models.training.checkpoint import checkpoint_config

JACOBIAN = "Jacobian (exact)"  # the measured profile, in the plot
PRIOR_ROW = "cesaro_prior"  # the closed-form prior at its log-space fit α (prior/alpha)


@dataclass
class StudyRow:
    model: str
    set_name: str
    predictor: str  # a RolloutVariant or PRIOR_ROW
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


def run_study(checkpoint: str | None, out: Path, steps: int, seq_len: int, n_seq: int,
              data_dir: str | None, seed: int = 0) -> Path:
    """Train (or take) the checkpoint, study it and its random init; the report's path."""
    source = checkpoint or str(train_default_run(out, steps))
    target = resolve_target(source)
    tokenizer = load_checkpoint_tokenizer(target)
    trained = load_model(target, "cpu", "float32")
    torch.manual_seed(seed)
    config = checkpoint_config(target.checkpoint, target.run_dir)
    random_init = AutoModelForCausalLM.from_config(config).eval()
    if is_nope(config):  # the same architecture: a NoPE run's random init has no RoPE either
        disable_rope(random_init)
    cfg = JacobianConfig(estimator=Estimator.exact, seq_len=seq_len, n_vanilla=n_seq, n_chunked=n_seq,
                         chunk_len=max(seq_len // 4, 1))
    n_docs = cfg.n_vanilla + cfg.n_chunked * math.ceil(cfg.seq_len / cfg.chunk_len)
    try:
        docs, doc_source = heldout_documents(tokenizer, data_dir, seq_len, n_docs)
    except HeldoutError as err:
        raise CompareError(str(err)) from err
    seqs = build_eval_sequences(docs, seq_len, cfg.n_vanilla, cfg.n_chunked, cfg.chunk_len)
    rows, curves = [], {}
    for name, model in ((f"trained (step {target.step})", trained), ("random init", random_init)):
        model_rows, curves[name] = study_model(name, model, seqs, cfg)
        rows += model_rows
    png = plot_predicted_profiles(curves, out / "rollout_study.png", JACOBIAN, PRIOR_ROW)
    rope_lines = []
    if not is_nope(config):
        rope_rows = rope_invariance(config, seqs, cfg, seeds=(seed, seed + 1, seed + 2))
        rope_lines = ["## RoPE invariance at init", "",
                      "Spearman between the exact profiles of a random init with RoPE and the same weights without "
                      "it (`model.rope=false`), on the sequences above.", "",
                      *markdown_table(["seed", "set", "Spearman"],
                                      [[str(s), name, num(rho, missing=None)] for s, name, rho in rope_rows]), ""]
    report = out / "rollout_study.md"
    atomic_write_text(report, "\n".join([
        "# Rollout vs measured Jacobian", "",
        f"Checkpoint `{target.checkpoint}` and a random init of its architecture (seed {seed}); exact Jacobian "
        f"profiles of {n_seq} vanilla and {n_seq} chunked sequences of L={seq_len} tokens ({doc_source}), mean "
        "over sequences. Spearman: rank correlation (1 = same order); W1: earth mover's distance of the "
        "normalized profiles on [0, 1]; RMSE log10: of the log residual, scale free. The Cesàro prior is "
        "taken at its log-space fit α (`prior/alpha`), so its W1 is `prior/w1_logfit`.", "",
        *table(rows), "", "## Discrepancy removed by the measured λ", "", *reduction_table(rows), "",
        f"![profiles]({png.name})", "", *rope_lines]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.rollout_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="run directory or checkpoint folder (default: train the in2 run)")
    parser.add_argument("--out", default="rollout_study", help="output folder (default ./rollout_study)")
    parser.add_argument("--steps", type=int, default=2000, help="steps of the default run it trains (default 2000)")
    parser.add_argument("--seq-len", type=int, default=256, help="L of the measured sequences (default 256)")
    parser.add_argument("--n-seq", type=int, default=2, help="sequences per set (default 2)")
    parser.add_argument("--data-dir", default=None, help="folder with nq-open-oracle.jsonl.gz for NQ text "
                                                         "(default: synthetic documents)")
    args = parser.parse_args(argv)
    try:
        report = run_study(args.checkpoint, Path(args.out), args.steps, args.seq_len, args.n_seq, args.data_dir)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
