"""Markdown tables and their cells, for every report (compare, study, rollout study, run summary).

Numbers are written with 3 decimals everywhere; what stands for a missing number is each report's own
(`missing`), so a report reads as it always has.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from analysis.stats import Interval


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines: the header, the separator, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def num(value: float | str | None, signed: bool = False, missing: str | None = "n/a") -> str:
    """A number to 3 decimals (`signed`: with its sign); `missing` for None, nan and ±inf.

    With `missing=None` (for values that are never None) nan and inf are written as numbers ("nan", "+inf").
    A string is the cell as it is (metrics.jsonl files written before NaN became null hold "nan" and "inf").
    """
    if isinstance(value, str):
        return value
    if missing is not None and (value is None or not math.isfinite(value)):
        return missing
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def with_ci(value: float, low: float, high: float, signed: bool = False, missing: str | None = "n/a") -> str:
    """`value [low, high]`, each written by `num`."""
    return f"{num(value, signed, missing)} [{num(low, signed, missing)}, {num(high, signed, missing)}]"


def paired_cell(delta: Interval) -> str:
    """A paired difference with its interval, signed, and ` *` when the interval excludes 0."""
    return with_ci(delta.value, delta.low, delta.high, signed=True, missing=None) + (" *" if delta.resolved else "")


def with_delta(value: float | None, base: float | None = None) -> str:
    """The value, and its difference to `base` when both are finite ("0.700 (Δ +0.267)"); "–" without a value."""
    if value is None:
        return "–"
    text = num(value, missing=None)
    if base is None or not (math.isfinite(value) and math.isfinite(base)):
        return text
    return f"{text} (Δ {num(value - base, signed=True, missing=None)})"


def deltas_to_first(values: Sequence[float | None]) -> list[str]:
    """A row's cells: each value after the first with its difference to the first (`with_delta`)."""
    return [with_delta(v, None if i == 0 or values[0] is None else values[0]) for i, v in enumerate(values)]
