"""Pair eval JSONs answered on the same items: accuracy by position and Δ against a baseline, as one table.

    python -m scripts.pair_evals out/plain/eval/mdqa_step0.json \\
        reorder=out/reorder/interventions/reorder/eval/mdqa_step0.json ms_poe=... --figure mdqa.png

`scripts.eval_checkpoint` answers one intervention (or checkpoint) a run; this puts several such runs side by
side, as `analysis.compare`'s interventions section does for the runs it answers itself. The first JSON is the
baseline; each further one is NAME=PATH. Per row: accuracy at each gold position with its 95% interval
(closed-book too, when asked), the mean over gold positions, and the mean difference against the baseline on
the items both answered (paired by item id, closed-book left out) with its paired 95% interval, which resamples
whole questions, a question's positions together (`*`: excludes 0; `analysis.stats`); a second table gives
that Δ at each position (closed-book too). `--figure` also draws every row's accuracy by position.
`--shared-items` first restricts every result to the items all of them answered (runs that asked different
numbers of questions of the same seeded sample: the rows then describe one item set). Results of different
probes or metrics fail, naming the file; an item id twice in one result fails, naming the result.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from analysis import stats
from analysis.evaluation.config import POSITION_AXIS
from analysis.evaluation.result import LOGLIK, ProbeResult, paired_delta
from analysis.report.figures import plot_position_accuracy
from analysis.report.position_tables import answers_table, contrast_table
from analysis.report.tables import markdown_table, num, paired_cell, with_ci


def _named(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def load_results(baseline: Path, others: Sequence[tuple[str, Path]]) -> dict[str, ProbeResult]:
    """name -> result, the baseline first (named `plain`); ValueError naming a file that does not pair."""
    first = ProbeResult.load_json(baseline)
    results = {"plain": first}
    for name, path in others:
        if name in results:
            raise ValueError(f"{name}={path}: the name {name!r} is given twice")
        result = results[name] = ProbeResult.load_json(path)
        if result.probe != first.probe or result.settings.get("metric") != first.settings.get("metric"):
            raise ValueError(f"{path}: probe {result.probe!r} with metric {result.settings.get('metric')!r}, but "
                             f"{baseline} is {first.probe!r} with {first.settings.get('metric')!r}")
    return results


def shared_items(results: dict[str, ProbeResult]) -> dict[str, ProbeResult]:
    """Each result with only the outcomes whose item id every result has; ValueError if none is shared."""
    ids = set.intersection(*({o["id"] for o in r.outcomes} for r in results.values()))
    if not ids:
        raise ValueError("--shared-items: no item id is in every result")
    return {name: ProbeResult(r.probe, [o for o in r.outcomes if o["id"] in ids], r.settings)
            for name, r in results.items()}


SCORES = {"correct": stats.ACCURACY, "loglik": LOGLIK}


def _position_header(labels: dict[int, str]) -> list[str]:
    return ["closed-book" if p < 0 else f"gold {label}" for p, label in labels.items()]


def paired_table(results: dict[str, ProbeResult], n_boot: int = stats.N_BOOT,
                 score: stats.Score = stats.ACCURACY) -> list[str]:
    """The markdown table: a row per result, a column per position of the baseline."""
    plain = results["plain"]
    labels = plain.labels()
    header = ["arm", *_position_header(labels), "mean over gold positions",
              "Δ vs plain [95% CI, questions resampled]", "items"]
    rows = []
    for name, result in results.items():
        value, ci = result.accuracy_by_position(score), result.ci_by_position(n_boot, score=score)
        cells = [with_ci(value[p], *ci[p]) if p in value else "n/a" for p in labels]
        delta, items = "", str(sum(o["position"] >= 0 for o in result.outcomes))
        if name != "plain":
            interval, n = paired_delta(plain, result, score=score, n_boot=n_boot, where=("plain", name))
            delta, items = paired_cell(interval), str(n)
        rows.append([name, *cells, num(result.mean_of(score)), delta, items])
    return markdown_table(header, rows)


def delta_by_position_table(results: dict[str, ProbeResult], n_boot: int = stats.N_BOOT,
                            score: stats.Score = stats.ACCURACY) -> list[str]:
    """The markdown table of each result's paired Δ against the baseline at every position of the baseline (the
    same items, by id), with its paired 95% interval over questions (`*`: excludes 0)."""
    plain = results["plain"]
    labels = plain.labels()
    rows = []
    for name, result in list(results.items())[1:]:
        cells = [paired_cell(paired_delta(plain, result, {position}, score, n_boot, where=("plain", name))[0])
                 for position in labels]
        rows.append([name, *cells])
    return markdown_table(["arm", *_position_header(labels)], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.pair_evals", description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="the baseline's eval JSON (eval/<probe>_step<N>.json)")
    parser.add_argument("others", nargs="+", type=_named, help="NAME=PATH of each eval JSON compared with it")
    parser.add_argument("--score", choices=sorted(SCORES), default="correct",
                        help="correct: the probe's metric (default); loglik: the teacher-forced log-likelihood of "
                             "the gold answer, in nats")
    parser.add_argument("--strong", type=int, default=None,
                        help="the strong gold position the contrasts are taken against (default: the first or the "
                             "last, whichever the baseline scores better)")
    parser.add_argument("--figure", type=Path, help="also write the score by position of every row to this PNG")
    parser.add_argument("--n-boot", type=int, default=stats.N_BOOT,
                        help=f"bootstrap resamples of every interval (default {stats.N_BOOT})")
    parser.add_argument("--shared-items", action="store_true",
                        help="compare every result on the items all of them answered (e.g. 10 of a run's 20 questions)")
    args = parser.parse_args(argv)
    score = SCORES[args.score]
    try:
        results = load_results(args.baseline, args.others)
        if args.shared_items:
            results = shared_items(results)
        missing = [name for name, r in results.items() if not all(score.field in o for o in r.outcomes)]
        if missing:
            raise ValueError(f"--score {args.score}: {', '.join(missing)} has no {score.field!r} in its outcomes "
                             "(answered before log-likelihoods were kept, or with eval.loglik=false)")
        strong = args.strong if args.strong is not None else results["plain"].strong_end(score)
        # Built before printing: an id asked twice in one file fails here, naming it, with nothing printed.
        tables = (paired_table(results, args.n_boot, score), delta_by_position_table(results, args.n_boot, score),
                  contrast_table(results, strong, args.n_boot, score), answers_table(results))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(tables[0]))
    print("\nΔ vs plain at each position, paired by item [95% CI, questions resampled]:\n")
    print("\n".join(tables[1]))
    print(f"\nEach position minus the strong end (gold {results['plain'].labels()[strong]}), paired by question; "
          "`change vs plain`: that contrast's change against the baseline (the debiasing effect):\n")
    print("\n".join(tables[2]))
    if tables[3]:
        print("\nWhat the answers are (first line; shares of the position's answers):\n")
        print("\n".join(tables[3]))
    if args.figure is not None:
        probe = results["plain"].probe
        png = plot_position_accuracy(results, args.figure, f"{probe}: {score.label} by gold position",
                                     POSITION_AXIS.get(probe, "gold position"), score)
        print(f"\nfigure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
