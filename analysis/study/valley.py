"""The debias study (the Jacobian valley at the first and last logged step); the package's docstring says what a study is."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from analysis.study.load import SET_ORDER, VALLEY_KEY, VALLEY_METRICS, Study


def valley_ends(metrics: Mapping[int, Mapping[str, Any]]) -> dict[tuple[str, str], tuple[int, float, int, float]]:
    """(set, metric) -> (first step, value, last step, value) of the valley keys (VALLEY_METRICS) logged in
    `metrics` (step -> its merged row, `merged_metrics`)."""
    logged: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for step, row in metrics.items():
        for key, value in row.items():
            match = VALLEY_KEY.match(key)
            # non-finite values are null in metrics.jsonl (strings in files older than that rule): not a measurement
            if match and isinstance(value, (int, float)) and math.isfinite(value):
                logged.setdefault((match.group(1), match.group(2)), []).append((step, float(value)))
    return {key: (*values[0], *values[-1]) for key, values in logged.items()}


def in_set_order(names: Iterable[str]) -> list[str]:
    """Jacobian set names once each, `vanilla` and `chunked` first, any other after them by name."""
    return sorted(set(names), key=lambda name: (SET_ORDER.index(name) if name in SET_ORDER else len(SET_ORDER), name))


def valley_sets(study: Study) -> list[str]:
    """The Jacobian sets any job logged valley metrics for, `vanilla` and `chunked` first."""
    return in_set_order(name for job in study.jobs for name, _ in valley_ends(job.metrics))


def valley_changes(study: Study) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{arm: {set: {metric: {start, end, change, start_steps, end_steps, seeds}}}}: means over the arm's seeds
    that logged the metric (nan and no seeds when none did) at their first and last logged steps."""
    sets, out = valley_sets(study), {}
    for arm in study.arms:
        ends = [valley_ends(job.metrics) for job in study.arm_jobs(arm)]
        out[arm] = {}
        for name in sets:
            out[arm][name] = {}
            for metric in VALLEY_METRICS:
                found = [e[(name, metric)] for e in ends if (name, metric) in e]
                start = float(np.mean([f[1] for f in found])) if found else float("nan")
                end = float(np.mean([f[3] for f in found])) if found else float("nan")
                out[arm][name][metric] = {
                    "start": start, "end": end, "change": end - start,
                    "start_steps": sorted({f[0] for f in found}), "end_steps": sorted({f[2] for f in found}),
                    "seeds": len(found),
                }
    return out
