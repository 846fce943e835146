"""VaLProbing's report: Avg and Gap of several models by FILM's score and by the gold completion's log-likelihood,
each later model's paired Δ against the first, and FILM's figure (the numbers: `analysis.evaluation.valprobing`)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from analysis import stats
from analysis.evaluation.result import LOGLIK, ProbeResult
from analysis.evaluation.valprobing import Summary, compare, summarize
from analysis.report.figures import plot_valprobing
from data_builders.valprobing import Task


def table_lines(summaries: Mapping[str, Sequence[Summary]], percent: bool = True) -> list[str]:
    """Avg and Gap of each model (rows) on each task (columns), FILM's way (x100 for rates)."""
    tasks = [str(t) for t in Task if any(s.task == t for row in summaries.values() for s in row)]
    lines = ["| model | " + " | ".join(f"{t} Avg | {t} Gap" for t in tasks) + " |",
             "| --- |" + " --- | --- |" * len(tasks)]
    for model, row in summaries.items():
        found = {s.task: s for s in row}
        cells = []
        for t in tasks:
            s = found.get(t)
            if s is None:
                cells += ["—", "—"]
                continue
            k = 100.0 if percent and s.score.rate else 1.0
            cells += [f"{k * s.avg.value:.1f} [{k * s.avg.low:.1f}, {k * s.avg.high:.1f}]", f"{k * s.gap:.1f}"]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def report_lines(results: Mapping[str, Mapping[str, ProbeResult]], out_png: str | Path | None,
                 film_bins: bool = False, title: str = "",
                 scores: Sequence[stats.Score] = (stats.ACCURACY, LOGLIK)) -> list[str]:
    """Markdown of the VaLProbing results of several models ({model: {probe: result}}, the first the reference),
    by each of `scores` where measured (FILM's score, the gold completion's log-likelihood): Avg and Gap of each,
    each later model's paired Δ against the first, and FILM's figure (`out_png`; `<stem>_loglik.png` for the
    log-likelihood; none when `out_png` is None)."""
    valprobing = {model: {p: r for p, r in by_probe.items() if p.startswith("valprobing_")}
                  for model, by_probe in results.items()}
    valprobing = {m: r for m, r in valprobing.items() if r}
    if not valprobing:
        return []
    bins = "FILM's bins (each bin's last position left out)" if film_bins else "every position in its bin"
    lines = []
    for score in scores:
        summaries = {model: [summarize(r, film_bins, score) for r in by_probe.values() if score in r.scores]
                     for model, by_probe in valprobing.items()}
        summaries = {m: s for m, s in summaries.items() if s}
        if not summaries:
            continue
        unit = "x100 " if score.rate else "nats "
        lines += [f"### By {'FILM score' if score.rate else score.label}", "",
                  f"Avg: the mean of the bins' means over sets, {unit}(95% interval: `stats.linear_interval`, items "
                  f"drawn within their set and bin); Gap: the best bin minus the worst; {bins}.", "",
                  *table_lines(summaries), ""]
        lines += _delta_lines(valprobing, summaries, film_bins, score)
        if out_png is not None:
            png = Path(out_png) if score.rate else Path(out_png).with_name(f"{Path(out_png).stem}_loglik.png")
            lines += [f"![valprobing]({plot_valprobing(summaries, png, title).name})", ""]
    return lines


def _delta_lines(results: Mapping[str, Mapping[str, ProbeResult]], summaries: Mapping[str, Sequence[Summary]],
                 film_bins: bool, score: stats.Score) -> list[str]:
    """Each later model's paired Δ Avg and Δ Gap against the first, by `score`."""
    models = list(summaries)
    k = 100.0 if score.rate else 1.0
    rows = []
    for model in models[1:]:
        for probe, tuned in results[model].items():
            base = results[models[0]].get(probe)
            if base is None or score not in base.scores or score not in tuned.scores:
                continue
            c = compare(base, tuned, film_bins, score)
            rows.append(f"| {model} | {c.task} | {k * c.delta_avg.value:+.1f} [{k * c.delta_avg.low:+.1f}, "
                        f"{k * c.delta_avg.high:+.1f}] | {k * c.delta_gap:+.1f} | {c.gap_p:.3f} | {c.delta_avg.n} |")
    if not rows:
        return []
    return [f"Paired against `{models[0]}` on the same items (Δ Gap: paired permutation p-value; the Gap has no "
            "interval, being an extreme over bins):", "",
            "| model | task | Δ Avg [95%] | Δ Gap | p (Δ Gap) | items |", "| --- | --- | --- | --- | --- | --- |",
            *rows, ""]
