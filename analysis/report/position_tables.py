"""Markdown tables of position without answer format: each position's contrast to the strong end, its change
against a baseline (the debiasing effect), and what the answers are (`analysis.pair_evals`, `analysis.compare`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from analysis import stats
from analysis.evaluation.result import ProbeResult, contrast_change
from analysis.report.tables import markdown_table, num, paired_cell


def contrast_table(results: Mapping[str, ProbeResult], strong: int, n_boot: int = stats.N_BOOT,
                   score: stats.Score = stats.ACCURACY) -> list[str]:
    """Within each result, every position minus the strong end (paired by question), and each later result's
    change of that contrast against the first (`contrast_change`): the debiasing effect, which a change of answer
    format, moving every position alike, does not move."""
    names = list(results)
    baseline = results[names[0]]
    labels = baseline.labels()
    others = [p for p in labels if p != strong]
    header = ["", *(f"{'closed-book' if p < 0 else f'gold {labels[p]}'} − gold {labels[strong]}" for p in others)]
    rows = [[name, *(paired_cell(result.paired_difference(p, strong, n_boot, score=score)) for p in others)]
            for name, result in results.items()]
    rows += [[f"{name}: change vs {names[0]}",
              *(paired_cell(contrast_change(baseline, results[name], p, strong, score, n_boot)) for p in others)]
             for name in names[1:]]
    return markdown_table(header, rows)


def _words(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def answer_columns(probe: str) -> list[str]:
    """The columns of an answer-kinds table: the kinds' shares (a kv answer's kind is the pair whose value the
    whole answer names, `answer_kinds.value_kind`; any other's, where its first line comes from), the median
    first-line length and the short-answer scores on the first line."""
    kinds = ["the gold pair's value", "another pair's value", "no pair's value"] if probe == "kv" \
        else ["span of the gold", "span of a distractor", "in no document"]
    return [*kinds, "median first-line words", "exact match (first line)", "whole-word match (first line)"]


def answer_cells(summary: Mapping[str, Any]) -> list[str]:
    """One position's cells under `answer_columns`, from `answer_kinds.summarize`."""
    return [*(num(summary.get(f"share_{kind}")) for kind in ("gold", "distractor", "none")),
            _words(summary.get("median_first_line_words")), num(summary.get("short_em")), num(summary.get("whole_word"))]


def answers_table(results: Mapping[str, ProbeResult]) -> list[str]:
    """What the answers are, per result and position: the share of each answer kind (`answer_columns`), the
    median first-line length and the short-answer scores. Empty for results saved before answers were
    described."""
    rows = []
    for name, result in results.items():
        labels = result.labels()
        for p, kinds in result.answers_by_position().items():
            rows.append([name, "closed-book" if p < 0 else labels[p], *answer_cells(kinds)])
    if not rows:
        return []
    return markdown_table(["", "position", *answer_columns(next(iter(results.values())).probe)], rows)
