"""One probe run's outcome: per-query answers and scores, their mean and interval by gold position (through
`analysis.stats`), the paired difference of two runs on the same items (`paired_delta`), its metric keys, and
its JSON (`<run>/eval/<probe>_step<N>.json`, `models.training.run_dir`)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

import numpy as np

from analysis import stats
from analysis.evaluation.answer_kinds import summarize
from data_builders.files import atomic_write_text, json_safe
from models.training.run_dir import RunDir

# the gold answer's teacher-forced log p(answer | prompt), in nats (analysis.evaluation.loglik)
LOGLIK = stats.Score("loglik", higher_is_better=True, rate=False, label="log p(gold answer), nats")

# How `save_json`'s `ci95` intervals are made; at one position each question is asked once, so resampling the
# position's items resamples questions.
CI_METHOD = (f"{1 - stats.ALPHA:.0%} percentile bootstrap over the questions asked at each position "
             f"({stats.N_BOOT} resamples, seed {stats.RNG_SEED})")


@dataclass
class ProbeResult:
    """Per-query outcomes of one probe run, with accuracy by gold position."""

    probe: str
    # One dict per item: id, query, position, label, prediction, answers, correct (0.0/1.0), extra.
    outcomes: list[dict[str, Any]]
    # How the numbers were made: metric (its name and definition), generation budget, data source,
    # positions... (`probe_settings`): what a reader needs to know which numbers are comparable.
    settings: dict[str, Any] = field(default_factory=dict)

    def _scores(self, position: int, score: stats.Score = stats.ACCURACY) -> np.ndarray:
        """(n,) the `score` of every item at `position`."""
        return np.array([o[score.field] for o in self.outcomes if o["position"] == position], dtype=float)

    def labels(self) -> dict[int, str]:
        """Metric-key label of each position present, in position order."""
        return dict(sorted({o["position"]: o["label"] for o in self.outcomes}.items()))

    def accuracy_by_position(self, score: stats.Score = stats.ACCURACY) -> dict[int, float]:
        """Mean score (by default correctness) at each position present (-1 = closed-book baseline, if any)."""
        return {p: float(self._scores(p, score).mean()) for p in self.labels()}

    def ci_by_position(
        self, n_boot: int = stats.N_BOOT, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED,
        score: stats.Score = stats.ACCURACY,
    ) -> dict[int, tuple[float, float]]:
        """(low, high) of `stats.mean_interval` of the mean score at each position (each question once there)."""
        intervals = {p: stats.mean_interval(self._scores(p, score), None, n_boot, alpha, seed) for p in self.labels()}
        return {p: (iv.low, iv.high) for p, iv in intervals.items()}

    def paired_difference(
        self, a: int, b: int, n_boot: int = stats.N_BOOT, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED,
        score: stats.Score = stats.ACCURACY,
    ) -> stats.Interval:
        """Mean score at position `a` minus at `b` over the questions asked at both (paired by question,
        `stats.cluster_of` of the item id, never by query text), with its `stats.paired_interval`.

        ValueError if no question was asked at both, or if a question occurs twice at one of them."""
        at_a, at_b = self.scores_by_question(a, score), self.scores_by_question(b, score)
        shared = sorted(at_a.keys() & at_b.keys())
        if not shared:
            raise ValueError(f"no question of probe {self.probe!r} was asked at both positions {a} and {b}")
        return stats.paired_interval([at_a[q] for q in shared], [at_b[q] for q in shared], None, n_boot, alpha, seed)

    def scores_by_question(self, position: int, score: stats.Score = stats.ACCURACY) -> dict[str, float]:
        """question (`stats.cluster_of` of the item id, never the query text) -> its score at `position`;
        ValueError when a question occurs twice there."""
        found: dict[str, float] = {}
        for o in self.outcomes:
            if o["position"] == position:
                question = stats.cluster_of(o["id"])
                if question in found:
                    raise ValueError(f"probe {self.probe!r}, questions at position {position}: item id {question!r} "
                                     "occurs more than once; pairing needs each once")
                found[question] = float(o[score.field])
        return found

    def mean_of(self, score: stats.Score = stats.ACCURACY) -> float:
        """Mean score over all items with a gold position (the closed-book baseline is left out)."""
        values = [o[score.field] for o in self.outcomes if o["position"] >= 0]
        return float(np.mean(values)) if values else float("nan")

    def strong_end(self, score: stats.Score = stats.ACCURACY) -> int:
        """The first or the last gold position, whichever scores better: the end a debiasing fine-tune should
        keep while it lifts the others."""
        by_position = {p: v for p, v in self.accuracy_by_position(score).items() if p >= 0}
        ends = (min(by_position), max(by_position))
        pick = max if score.higher_is_better else min
        return pick(ends, key=lambda p: (by_position[p], p))

    @property
    def mean(self) -> float:
        """Accuracy over all queries with a gold position (the closed-book baseline is left out)."""
        correct = [o["correct"] for o in self.outcomes if o["position"] >= 0]
        return float(np.mean(correct)) if correct else float("nan")

    @property
    def asks_at_several_positions(self) -> bool:
        """Some question is asked at more than one gold position (kv, mdqa, needle; not in2's depth bins)."""
        asked: dict[str, int] = {}
        for o in self.outcomes:
            if o["position"] >= 0:
                question = stats.cluster_of(o["id"])
                if asked.setdefault(question, o["position"]) != o["position"]:
                    return True
        return False

    @property
    def answered(self) -> bool:
        """Some item was answered (`correct` finite): false when only the log-likelihood was measured."""
        return any(math.isfinite(o["correct"]) for o in self.outcomes)

    @property
    def position_score(self) -> stats.Score:
        """The score a position curve of this result shows: accuracy, or the log-likelihood when nothing was
        answered."""
        return stats.ACCURACY if self.answered or not self.has_loglik else LOGLIK

    @property
    def has_loglik(self) -> bool:
        """Every outcome holds the teacher-forced log-likelihood of its answer (`analysis.evaluation.loglik`)."""
        return bool(self.outcomes) and all(LOGLIK.field in o for o in self.outcomes)

    @property
    def scores(self) -> list[stats.Score]:
        """What the result can be summarized by: its metric when some item was answered, the gold's
        log-likelihood when measured."""
        return [score for score, measured in ((stats.ACCURACY, self.answered), (LOGLIK, self.has_loglik)) if measured]

    def answers_by_position(self) -> dict[int, dict[str, Any]]:
        """`answer_kinds.summarize` of the answers at each position (kinds, first-line length, short-answer
        scores), for results whose outcomes describe their answers."""
        described = [o for o in self.outcomes if "answer" in o.get("extra", {})]
        return {p: summarize([o["extra"]["answer"] for o in described if o["position"] == p])
                for p in self.labels() if any(o["position"] == p for o in described)}

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """{'<prefix>/<probe>/acc@<label>': ..., '<prefix>/<probe>/acc_mean': ...}, and the same for `loglik`
        (mean nats) when the outcomes have it."""
        labels, key = self.labels(), f"{prefix}/{self.probe}/acc"
        metrics = {f"{key}@{labels[p]}": acc for p, acc in self.accuracy_by_position().items()}
        metrics[f"{key}_mean"] = self.mean
        if self.has_loglik:
            key = f"{prefix}/{self.probe}/loglik"
            by_position = self.accuracy_by_position(LOGLIK)
            metrics.update({f"{key}@{labels[p]}": value for p, value in by_position.items()})
            metrics[f"{key}_mean"] = float(np.mean([v for p, v in by_position.items() if p >= 0]))
        return metrics

    def save_json(self, path: str | Path) -> Path:
        """Write the summary (accuracy, 95% interval and count per label, how the intervals were made) and every
        outcome."""
        labels, cis = self.labels(), self.ci_by_position()
        summary = {
            "probe": self.probe,
            "metric": self.settings.get("metric"),
            "settings": self.settings,
            "mean": self.mean,
            "accuracy": {labels[p]: acc for p, acc in self.accuracy_by_position().items()},
            "ci95": {labels[p]: list(ci) for p, ci in cis.items()},
            "ci_method": CI_METHOD,
            "n": {labels[p]: int(self._scores(p).size) for p in labels},
        }
        if self.has_loglik:
            summary["loglik"] = {labels[p]: value for p, value in self.accuracy_by_position(LOGLIK).items()}
            summary["loglik_ci95"] = {labels[p]: list(ci) for p, ci in self.ci_by_position(score=LOGLIK).items()}
        summary["answers"] = {labels[p]: kinds for p, kinds in self.answers_by_position().items()}
        summary["outcomes"] = self.outcomes
        # Atomic: compare and a resumed run read these back, and must never see half a file.
        atomic_write_text(Path(path), json.dumps(json_safe(summary), indent=1))
        return Path(path)

    @classmethod
    def load_json(cls, path: str | Path) -> ProbeResult:
        """Read back a file written by `save_json`; a score saved as null (a nan: not asked or not finite) reads
        back as nan."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        for o in data["outcomes"]:
            for name in ("correct", LOGLIK.field):
                if name in o and o[name] is None:
                    o[name] = math.nan
        return cls(data["probe"], data["outcomes"], data.get("settings", {}))


def paired_delta(
    plain: ProbeResult, other: ProbeResult, positions: Collection[int] | None = None,
    score: stats.Score = stats.ACCURACY, n_boot: int = stats.N_BOOT, alpha: float = stats.ALPHA,
    seed: int = stats.RNG_SEED, where: tuple[str, str] = ("plain", "other"),
) -> tuple[stats.Interval, int]:
    """Mean score of `other` minus `plain` over the items both asked (paired by id) at `positions` (None: every
    gold position, closed-book left out), and the number of those items.

    The interval (`stats.paired_interval`) resamples whole questions: a question's items at several positions
    share its difficulty and move together. An id that occurs twice in one result raises ValueError naming it
    by `where` (plain's name, other's name). No item in common: nan interval, 0 items."""
    def asked(o: Mapping[str, Any]) -> bool:
        return o["position"] >= 0 if positions is None else o["position"] in positions

    ids, before, after = stats.pair_by_id(plain.outcomes, other.outcomes, score, asked, where)
    clusters = [stats.cluster_of(i) for i in ids]
    return stats.paired_interval(after, before, clusters, n_boot, alpha, seed), len(ids)


def contrast_change(
    plain: ProbeResult, other: ProbeResult, position: int, strong: int, score: stats.Score = stats.ACCURACY,
    n_boot: int = stats.N_BOOT, alpha: float = stats.ALPHA, seed: int = stats.RNG_SEED,
) -> stats.Interval:
    """How much `other` moved the contrast (score at `position` minus at `strong`) against `plain`, paired by
    question: mean over the questions both asked at both positions of (o_k − o_strong) − (p_k − p_strong), with its
    interval over questions. The debiasing effect of a fine-tune, free of any change that moves every position
    alike (an answer format)."""
    tables = [r.scores_by_question(at, score) for r in (other, plain) for at in (position, strong)]
    shared = sorted(set.intersection(*(set(t) for t in tables)))
    if not shared:
        return stats.Interval(math.nan, math.nan, math.nan, 0, "no question asked at both positions by both")
    o_k, o_s, p_k, p_s = (np.array([t[q] for q in shared]) for t in tables)
    return stats.mean_interval((o_k - o_s) - (p_k - p_s), None, n_boot, alpha, seed)


def write_eval_json(run_dir: str | Path, step: int, name: str, result: ProbeResult) -> Path:
    """Save `result` as `run_dir/eval/<name>_step<step>.json`."""
    return result.save_json(RunDir(run_dir).eval_json(name, step))
