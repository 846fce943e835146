"""One probe run's outcome: per-query answers and correctness, accuracy and bootstrap intervals by gold
position, its metric keys, and its JSON (`<run>/eval/<probe>_step<N>.json`, `models.training.run_dir`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.evaluation.scoring import bootstrap_ci, paired_bootstrap_ci
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import RunDir


@dataclass
class ProbeResult:
    """Per-query outcomes of one probe run, with accuracy by gold position."""

    probe: str
    # One dict per item: id, query, position, label, prediction, answers, correct (0.0/1.0), extra.
    outcomes: list[dict[str, Any]]
    # How the numbers were made: metric (its name and definition), generation budget, data source,
    # positions... (`probe_settings`): what a reader needs to know which numbers are comparable.
    settings: dict[str, Any] = field(default_factory=dict)

    def _correct(self, position: int) -> np.ndarray:
        return np.array([o["correct"] for o in self.outcomes if o["position"] == position], dtype=float)

    def labels(self) -> dict[int, str]:
        """Metric-key label of each position present, in position order."""
        return dict(sorted({o["position"]: o["label"] for o in self.outcomes}.items()))

    def accuracy_by_position(self) -> dict[int, float]:
        """Mean correctness at each position present (-1 = closed-book baseline, if any)."""
        return {p: float(self._correct(p).mean()) for p in self.labels()}

    def ci_by_position(
        self, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> dict[int, tuple[float, float]]:
        """Percentile bootstrap interval of the accuracy at each position."""
        return {p: bootstrap_ci(self._correct(p), n_boot, alpha, seed) for p in self.labels()}

    def paired_difference(
        self, a: int, b: int, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
    ) -> tuple[float, tuple[float, float]]:
        """acc(a) - acc(b) over the queries asked at both positions, with its paired bootstrap interval."""
        at_a = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == a}
        at_b = {o["query"]: o["correct"] for o in self.outcomes if o["position"] == b}
        shared = sorted(at_a.keys() & at_b.keys())
        if not shared:
            raise ValueError(f"no query of probe {self.probe!r} was asked at both positions {a} and {b}")
        x, y = np.array([at_a[q] for q in shared]), np.array([at_b[q] for q in shared])
        return float((x - y).mean()), paired_bootstrap_ci(x, y, n_boot, alpha, seed)

    @property
    def mean(self) -> float:
        """Accuracy over all queries with a gold position (the closed-book baseline is left out)."""
        correct = [o["correct"] for o in self.outcomes if o["position"] >= 0]
        return float(np.mean(correct)) if correct else float("nan")

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """{'<prefix>/<probe>/acc@<label>': ..., '<prefix>/<probe>/acc_mean': ...}."""
        labels, key = self.labels(), f"{prefix}/{self.probe}/acc"
        metrics = {f"{key}@{labels[p]}": acc for p, acc in self.accuracy_by_position().items()}
        metrics[f"{key}_mean"] = self.mean
        return metrics

    def save_json(self, path: str | Path) -> Path:
        """Write the summary (accuracy, 95% interval and count per label) and every outcome."""
        labels, cis = self.labels(), self.ci_by_position()
        summary = {
            "probe": self.probe,
            "metric": self.settings.get("metric"),
            "settings": self.settings,
            "mean": self.mean,
            "accuracy": {labels[p]: acc for p, acc in self.accuracy_by_position().items()},
            "ci95": {labels[p]: list(ci) for p, ci in cis.items()},
            "n": {labels[p]: int(self._correct(p).size) for p in labels},
            "outcomes": self.outcomes,
        }
        # Atomic: compare and a resumed run read these back, and must never see half a file.
        atomic_write_text(Path(path), json.dumps(json_safe(summary), indent=1))
        return Path(path)

    @classmethod
    def load_json(cls, path: str | Path) -> ProbeResult:
        """Read back a file written by `save_json`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["probe"], data["outcomes"], data.get("settings", {}))


def write_eval_json(run_dir: str | Path, step: int, name: str, result: ProbeResult) -> Path:
    """Save `result` as `run_dir/eval/<name>_step<step>.json`."""
    return result.save_json(RunDir(run_dir).eval_json(name, step))
