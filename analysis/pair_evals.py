"""Pair eval JSONs answered on the same items: accuracy by position and Δ against a baseline, as one table.

    python -m analysis.pair_evals out/plain/eval/mdqa_step0.json \\
        reorder=out/reorder/interventions/reorder/eval/mdqa_step0.json ms_poe=... --figure mdqa.png

`scripts.eval_checkpoint` answers one intervention (or checkpoint) a run; this puts several such runs side by
side, as `analysis.compare`'s interventions section does for the runs it answers itself. The first JSON is the
baseline (NAME=PATH, or a bare PATH named `plain`); each further one is NAME=PATH. Per row: accuracy at each gold
position with its 95% interval (closed-book too, when asked), the mean over gold positions, and the mean
difference against the baseline on the items both answered (paired by item id, closed-book left out) with its
paired 95% interval, which resamples whole questions, a question's positions together (`*`: excludes 0;
`analysis.stats`); a second table gives that Δ at each position (closed-book too). `--figure` also draws every
row's accuracy by position.
`--shared-items` first restricts every result to the items all of them answered (runs that asked different
numbers of questions of the same seeded sample: the rows then describe one item set). Results of different
probes or metrics fail, naming the file; an item id twice in one result fails, naming the result. So does a pair
that was not asked alike (`result.pairing_mismatch`): a setting both record that differs (another kv pair count,
budget, chat template...), named with its two values, or an item id that holds another prompt or other answers
in one file (each outcome's item digest; files written before outcomes kept one are compared by their settings).
The arms may differ in what they compare: an intervention and the settings it makes, the checkpoint.

A PATH may be a folder (a run's `eval/`, an `out=`'s `eval/`): the latest step of each probe in it, each of the
baseline's probes paired in its own section. VaLProbing results (hundreds of positions) are reported as FILM
reports them instead, all tasks together: Avg and Gap of each row, each row's paired Δ Avg and Δ Gap against the
baseline (`analysis.report.valprobing`), and `--figure` a panel per task.

    python -m analysis.pair_evals base/eval tuned=run/eval --score loglik --figure valprobing.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from analysis import stats
from analysis.command_line import CommandParser
from analysis.evaluation.config import POSITION_AXIS
from analysis.evaluation.result import LOGLIK, SAMPLE_SIZE, ProbeResult, paired_delta, pairing_mismatch
from analysis.report.figures import plot_position_accuracy
from analysis.report.position_tables import answers_table, contrast_table
from analysis.report.tables import markdown_table, num, paired_cell, with_ci
from analysis.report.valprobing import report_lines as valprobing_lines
from models.training.run_dir import latest_eval_files

BASELINE = "plain"  # a bare baseline PATH's name (the interventions study's baseline: no intervention)


def _named(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def _baseline(text: str) -> tuple[str, Path]:
    """The baseline's NAME=PATH, or a bare PATH (an existing path is a path, `=` or not) named `plain`."""
    return (BASELINE, Path(text)) if Path(text).exists() or "=" not in text else _named(text)


def eval_files(path: Path) -> list[Path]:
    """A file is itself; a folder (a run's `eval/`, an `out=`'s) is the latest step of each probe's
    `<probe>_step<N>.json` in it (`run_dir.latest_eval_files`); FileNotFoundError naming a folder with none."""
    if not path.is_dir():
        return [path]
    latest = latest_eval_files(path)
    if not latest:
        raise FileNotFoundError(f"{path}: no <probe>_step<N>.json in this folder")
    return list(latest.values())


def _load(path: Path) -> dict[str, tuple[Path, ProbeResult]]:
    """probe -> (file, result) of a file or a folder (`eval_files`)."""
    loaded = ((file, ProbeResult.load_json(file)) for file in eval_files(path))
    return {result.probe: (file, result) for file, result in loaded}


def load_results(baseline: tuple[str, Path], others: Sequence[tuple[str, Path]]) -> dict[str, dict[str, ProbeResult]]:
    """probe -> {name -> result} for every probe of the baseline (NAME, PATH), the baseline first; ValueError
    naming a file or folder that does not pair (another probe or metric, a setting or an item asked otherwise)."""
    base_name, base_path = baseline
    firsts = _load(base_path)
    by_probe = {probe: {base_name: result} for probe, (_, result) in firsts.items()}
    names = {base_name}
    for name, path in others:
        if name in names:
            raise ValueError(f"{name}={path}: the name {name!r} is given twice")
        names.add(name)
        found = _load(path)
        for probe, (first_file, first) in firsts.items():
            file, result = found.get(probe, (path, None))
            if result is None or result.settings.get("metric") != first.settings.get("metric"):
                held = ", ".join(f"{p!r} with metric {r.settings.get('metric')!r}" for p, (_, r) in found.items())
                raise ValueError(f"{file}: holds {held}, but {first_file} is {probe!r} with "
                                 f"{first.settings.get('metric')!r}")
            # results of fewer questions of one sample pair on the ids both asked (the items column says how many)
            why = pairing_mismatch(first, result, (str(first_file), str(file)), free=SAMPLE_SIZE)
            if why is not None:
                raise ValueError(f"{why}: not asked alike, so nothing pairs them; pair evaluations made with the "
                                 "same probe settings")
            by_probe[probe][name] = result
    return by_probe


def shared_items(results: dict[str, ProbeResult]) -> dict[str, ProbeResult]:
    """Each result with only the outcomes whose item id every result has; ValueError if none is shared."""
    ids = set.intersection(*({o["id"] for o in r.outcomes} for r in results.values()))
    if not ids:
        raise ValueError("--shared-items: no item id is in every result")
    return {name: ProbeResult(r.probe, [o for o in r.outcomes if o["id"] in ids], r.settings)
            for name, r in results.items()}


SCORES = {"correct": stats.ACCURACY, "loglik": LOGLIK}
WHY_MISSING = {"correct": "nothing answered: the log-likelihood alone was measured",
               "loglik": "answered before log-likelihoods were kept, or with eval.loglik=false"}


def _position_header(labels: dict[int, str]) -> list[str]:
    return ["closed-book" if p < 0 else f"gold {label}" for p, label in labels.items()]


def paired_table(results: dict[str, ProbeResult], n_boot: int = stats.N_BOOT,
                 score: stats.Score = stats.ACCURACY) -> list[str]:
    """The markdown table: a row per result, a column per position of the baseline (the first)."""
    base_name, base = next(iter(results.items()))
    labels = base.labels()
    header = ["arm", *_position_header(labels), "mean over gold positions",
              f"Δ vs {base_name} [95% CI, questions resampled]", "items"]
    rows = []
    for name, result in results.items():
        value, ci = result.accuracy_by_position(score), result.ci_by_position(n_boot, score=score)
        cells = [with_ci(value[p], *ci[p]) if p in value else "n/a" for p in labels]
        delta, items = "", str(sum(o["position"] >= 0 for o in result.outcomes))
        if name != base_name:
            interval, n = paired_delta(base, result, score=score, n_boot=n_boot, where=(base_name, name))
            delta, items = paired_cell(interval), str(n)
        rows.append([name, *cells, num(result.mean_of(score)), delta, items])
    return markdown_table(header, rows)


def delta_by_position_table(results: dict[str, ProbeResult], n_boot: int = stats.N_BOOT,
                            score: stats.Score = stats.ACCURACY) -> list[str]:
    """The markdown table of each result's paired Δ against the baseline at every position of the baseline (the
    same items, by id), with its paired 95% interval over questions (`*`: excludes 0)."""
    base_name, base = next(iter(results.items()))
    labels = base.labels()
    rows = []
    for name, result in list(results.items())[1:]:
        cells = [paired_cell(paired_delta(base, result, {position}, score, n_boot, where=(base_name, name))[0])
                 for position in labels]
        rows.append([name, *cells])
    return markdown_table(["arm", *_position_header(labels)], rows)


def probe_lines(results: dict[str, ProbeResult], score: stats.Score, strong: int | None, n_boot: int,
                figure: Path | None) -> list[str]:
    """The tables of one probe's results (and its figure, when asked): built whole, so an id asked twice in one
    file fails before anything is printed."""
    base_name, base = next(iter(results.items()))
    strong = strong if strong is not None else base.strong_end(score)
    lines = [*paired_table(results, n_boot, score), "",
             f"Δ vs {base_name} at each position, paired by item [95% CI, questions resampled]:", "",
             *delta_by_position_table(results, n_boot, score), "",
             f"Each position minus the strong end (gold {base.labels()[strong]}), paired by question; "
             f"`change vs {base_name}`: that contrast's change against the baseline (the debiasing effect):", "",
             *contrast_table(results, strong, n_boot, score)]
    if answers := answers_table(results):
        lines += ["", "What the answers are (shares of the position's answers):", "", *answers]
    if figure is not None:
        png = plot_position_accuracy(results, figure, f"{base.probe}: {score.label} by gold position",
                                     POSITION_AXIS.get(base.probe, "gold position"), score)
        lines += ["", f"figure: {png}"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m analysis.pair_evals", description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=_baseline,
                        help="the baseline's eval JSON (eval/<probe>_step<N>.json), or a folder of them (the latest "
                             f"step of each probe); NAME=PATH names it (default {BASELINE!r})")
    parser.add_argument("others", nargs="+", type=_named,
                        help="NAME=PATH of each eval JSON (or folder) compared with it")
    parser.add_argument("--score", choices=sorted(SCORES), default="correct",
                        help="correct: the probe's metric (default); loglik: the teacher-forced log-likelihood of "
                             "the gold answer, in nats")
    parser.add_argument("--strong", type=int, default=None,
                        help="the strong gold position the contrasts are taken against (default: the first or the "
                             "last, whichever the baseline scores better)")
    parser.add_argument("--figure", type=Path,
                        help="also write the score by position of every row to this PNG (several probes: "
                             "<stem>_<probe>.png; VaLProbing: FILM's figure, <stem>_loglik.png by log-likelihood)")
    parser.add_argument("--film-bins", action="store_true",
                        help="VaLProbing: FILM's bins, each bin's last position left out (plot.py's quirk)")
    parser.add_argument("--n-boot", type=int, default=stats.N_BOOT,
                        help=f"bootstrap resamples of every interval (default {stats.N_BOOT})")
    parser.add_argument("--shared-items", action="store_true",
                        help="compare every result on the items all of them answered (e.g. 10 of a run's 20 questions)")
    args = parser.parse_args(argv)
    score = SCORES[args.score]
    try:
        by_probe = load_results(args.baseline, args.others)
        if args.shared_items:
            by_probe = {probe: shared_items(results) for probe, results in by_probe.items()}
        for probe, results in by_probe.items():
            missing = [name for name, r in results.items() if score not in r.scores]
            if missing:
                raise ValueError(f"--score {args.score}: {', '.join(missing)} has no {score.field!r} in its {probe} "
                                 f"outcomes ({WHY_MISSING[args.score]})")
        valprobing = {probe: results for probe, results in by_probe.items() if probe.startswith("valprobing_")}
        sections = {probe: results for probe, results in by_probe.items() if probe not in valprobing}
        several = len(sections) + bool(valprobing) > 1

        def figure(tag: str) -> Path | None:
            if args.figure is None or not several:
                return args.figure
            return args.figure.with_name(f"{args.figure.stem}_{tag}{args.figure.suffix}")

        out = {probe: probe_lines(results, score, args.strong, args.n_boot, figure(probe))
               for probe, results in sections.items()}
        if valprobing:
            rows = {name: {probe: results[name] for probe, results in valprobing.items()}
                    for name in next(iter(valprobing.values()))}
            out["VaLProbing"] = valprobing_lines(rows, figure("valprobing"), args.film_bins, "VaLProbing", (score,))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for title, lines in out.items():
        print("\n".join([f"## {title}", "", *lines, ""] if several else lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
