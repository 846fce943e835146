"""The debias study (the command); the package's docstring says what a study is."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis import stats
from analysis.command_line import CommandParser, positive_int
from analysis.study.load import MDE_SIMULATIONS, REFERENCE_ARM, StudyError, load_study
from analysis.study.report import fairness_table, reanalyse_per_seed, write_report
from models.training.run_dir import FINISHED


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m analysis.study",
        description="Compare the arms of a debias sweep (Hydra -m: one job per debias arm and seed) on position "
                    "fairness (crossed-design intervals and paired permutation tests against the reference arm), on "
                    "the Jacobian valley and on whether it tracks the curve. Writes OUT/report.md, OUT/study.json, "
                    "OUT/accuracy_by_depth.png, OUT/valley_accuracy_scatter.png and OUT/answers/.",
    )
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR",
                        help="the sweep directory (its job subdirectories); with --per-seed, a study.json")
    parser.add_argument("--per-seed", action="store_true",
                        help="re-analyse an older study.json that kept no answers, from its per-seed values and "
                             "tracking points (prints markdown)")
    parser.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR/study)")
    parser.add_argument("--reference", default=REFERENCE_ARM,
                        help=f"the arm differences are taken against (default: {REFERENCE_ARM})")
    parser.add_argument("--score", default=stats.ACCURACY.field,
                        help="the outcome field compared (default: correct)")
    parser.add_argument("--lower-is-better", action="store_true", help="lower scores are better (e.g. a loss)")
    parser.add_argument("--seeds", choices=[s.value for s in stats.Seeds], default=stats.Seeds.shared.value,
                        help="shared: seed k is the same init and data order in every arm (train.py's seed); "
                             "independent: each arm's seeds are its own draws (default: shared)")
    parser.add_argument("--n-perm", type=positive_int, default=stats.N_PERM,
                        help=f"permutations of the extremes' tests (default {stats.N_PERM})")
    parser.add_argument("--mde-simulations", type=positive_int, default=MDE_SIMULATIONS,
                        help=f"simulated studies behind the worst-bin MDE (default {MDE_SIMULATIONS})")
    parser.add_argument("--seed", type=int, default=stats.RNG_SEED, help="random seed (default 0)")
    parser.add_argument("--skip-incomplete", action="store_true",
                        help=f"leave out the jobs that did not finish (no {FINISHED}) and their seeds in every arm, "
                             "naming them in the report (default: stop, naming them)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: the sweep cannot be read as a study)."""
    args = build_parser().parse_args(argv)
    if args.per_seed:
        try:
            print("\n".join(reanalyse_per_seed(args.sweep_dir)))
        except StudyError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "study"
    score = stats.Score(args.score, not args.lower_is_better, rate=args.score == stats.ACCURACY.field,
                        label=args.score)
    try:
        study = load_study(args.sweep_dir, score, args.skip_incomplete)
        report = write_report(study, out, args.reference, stats.Seeds(args.seeds), args.n_perm, seed=args.seed,
                              n_sim=args.mde_simulations)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    numbers = json.loads((out / "study.json").read_text(encoding="utf-8"))
    print("\n".join(fairness_table(numbers)))
    print(f"wrote {report}")
    return 0
