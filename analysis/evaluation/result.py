"""One probe run's outcome: per-query answers and scores, their mean and interval by gold position (through
`analysis.stats`), the paired difference of two runs on the same items (`paired_delta`), its metric keys, and
its JSON (`<run>/eval/<probe>_step<N>.json`, `models.training.run_dir`).

Where a result comes from is in its JSON: the checkpoint it evaluated (`Checkpoint`: its path and the digest of its
weights), its settings, and the digest of every item it asked (each outcome's `item_digest`, and `items_fingerprint`
over all of them). `pairing_mismatch` says why two results cannot be paired item by item: a setting that differs,
or an item asked otherwise; files written before results kept digests are compared by their settings alone.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

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

ITEM_DIGEST = "item_digest"  # an outcome's key: `reuse.item_digest` of the item it answers
# Settings two results paired item by item may differ in: the arms compared (an inference-time intervention and the
# settings it makes), and texts that describe how a number is computed rather than what was asked or how it is scored
FREE_SETTINGS = frozenset({"intervention", "order", "keep", "query_aware", "ms_poe", "attn_calibration",
                           "comparable_with_reference", "metric_definition", "loglik", "reference", "prefill"})
# What asking fewer questions of one seeded sample changes: results that differ only there pair on the ids both asked
SAMPLE_SIZE = frozenset({"queries", "skipped"})
EVAL_FILE_ADVICE = "give an eval/<probe>_step<N>.json (scripts.eval_checkpoint, train.py), or the folder holding it"


@dataclass
class Checkpoint:
    """What a result evaluated: where its weights came from (a checkpoint folder, a hub id, or the run directory of
    an evaluation during training) and `reuse.function_digest` of them (None where it was not taken: weights
    sharded over processes)."""

    path: str
    digest: str | None = None


def fingerprint(digests: Iterable[str]) -> str:
    """sha256 of a set of item digests (`reuse.item_digest`), in any order: what a result file asked."""
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


@dataclass
class ProbeResult:
    """Per-query outcomes of one probe run, with accuracy by gold position."""

    probe: str
    # One dict per item: id, query, position, label, prediction, answers, correct (0.0/1.0), extra.
    outcomes: list[dict[str, Any]]
    # How the numbers were made: metric (its name and definition), generation budget, data source,
    # positions... (`probe_settings`): what a reader needs to know which numbers are comparable.
    settings: dict[str, Any] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None  # what was evaluated; None when not recorded (older files)

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
    def fingerprint(self) -> str | None:
        """`fingerprint` of the items asked (each outcome's `item_digest`); None for a result written before
        outcomes kept their item's digest."""
        digests = [o.get(ITEM_DIGEST) for o in self.outcomes]
        return fingerprint(digests) if digests and all(digests) else None

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
            "checkpoint": None if self.checkpoint is None else asdict(self.checkpoint),
            "items_fingerprint": self.fingerprint,
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
        back as nan. ValueError naming the file when it is no such file (not JSON, or no outcomes: a metrics file)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not an evaluation result, not even JSON ({err}): {EVAL_FILE_ADVICE}") from err
        if not isinstance(data, dict) or not isinstance(data.get("outcomes"), list) or "probe" not in data:
            raise ValueError(f"{path}: not an evaluation result: no per-item outcomes in it (an "
                             f"eval/metrics_step<N>.json holds metric values only): {EVAL_FILE_ADVICE}")
        for o in data["outcomes"]:
            for name in ("correct", LOGLIK.field):
                if name in o and o[name] is None:
                    o[name] = math.nan
        checkpoint = data.get("checkpoint")
        return cls(data["probe"], data["outcomes"], data.get("settings", {}),
                   Checkpoint(**checkpoint) if checkpoint else None)


def _layout(settings: Mapping[str, Any]) -> tuple[Any, Any, bool]:
    """How the prompts were laid out: documents reordered or cut, the query before them too. Another layout is
    another text by design: neither the slot count nor the items' digests of two layouts are compared."""
    return settings.get("order"), settings.get("keep"), bool(settings.get("query_aware"))


def _compared(key: str, value: Any) -> Any:
    # where a data file lies differs between machines; its name says which file it is
    return Path(value).name if key == "source" and isinstance(value, str) else value


def settings_mismatch(probe: str, a: Mapping[str, Any], b: Mapping[str, Any], where: tuple[str, str],
                      free: Collection[str] = ()) -> str | None:
    """`<probe> <key>: <a's value> in <where[0]>, <b's> in <where[1]>` for each setting both record that differs
    (joined by '; '), or None: what two results paired item by item must share. `FREE_SETTINGS`, `free` and, between
    prompt layouts, the slot count may differ; a setting only one records (an older file) is not compared."""
    skip = FREE_SETTINGS | set(free) | ({"slots"} if _layout(a) != _layout(b) else set())
    differ = [key for key in a if key in b and key not in skip and _compared(key, a[key]) != _compared(key, b[key])]
    if not differ:
        return None
    return f"{probe} " + "; ".join(f"{key}: {a[key]} in {where[0]}, {b[key]} in {where[1]}" for key in differ)


def items_mismatch(a: ProbeResult, b: ProbeResult, where: tuple[str, str]) -> str | None:
    """How many of the item ids both results asked carry different item digests (another prompt or other answers
    under one id), naming the first, or None. Not compared where either outcome has no digest (an older file) or
    the prompt layouts differ (`_layout`)."""
    if _layout(a.settings) != _layout(b.settings):
        return None
    theirs = {o["id"]: o.get(ITEM_DIGEST) for o in b.outcomes}
    both = [(o["id"], o.get(ITEM_DIGEST), theirs[o["id"]]) for o in a.outcomes if o["id"] in theirs]
    differ = [item for item, mine, other in both if mine and other and mine != other]
    if not differ:
        return None
    return (f"{a.probe}: {len(differ)} of the {len(both)} item ids both asked (first {differ[0]}) hold another prompt "
            f"or other answers in {where[1]} than in {where[0]}")


def pairing_mismatch(a: ProbeResult, b: ProbeResult, where: tuple[str, str], free: Collection[str] = (),
                     items: bool = True) -> str | None:
    """Why `a` and `b` (named by `where`) cannot be paired item by item, as one line: their settings
    (`settings_mismatch`), then, with `items`, their items (`items_mismatch`); None when nothing tells them apart."""
    return settings_mismatch(a.probe, a.settings, b.settings, where, free) or (
        items_mismatch(a, b, where) if items else None)


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
    changes = contrast_changes(plain, other, position, strong, score)
    if not changes:
        return stats.Interval(math.nan, math.nan, math.nan, 0, "no question asked at both positions by both")
    return stats.mean_interval(np.array(list(changes.values())), None, n_boot, alpha, seed)


def contrast_changes(plain: ProbeResult, other: ProbeResult, position: int, strong: int,
                     score: stats.Score = stats.ACCURACY) -> dict[str, float]:
    """`contrast_change` question by question: (o_k − o_strong) − (p_k − p_strong) for every question both asked at
    both positions, in question order."""
    tables = [r.scores_by_question(at, score) for r in (other, plain) for at in (position, strong)]
    shared = sorted(set.intersection(*(set(t) for t in tables)))
    return {q: (tables[0][q] - tables[1][q]) - (tables[2][q] - tables[3][q]) for q in shared}


def write_eval_json(run_dir: str | Path, step: int, name: str, result: ProbeResult,
                    checkpoint: Checkpoint | None = None) -> Path:
    """Save `result` as `run_dir/eval/<name>_step<step>.json`, recording `checkpoint` as what it evaluated (None:
    what `result` records already)."""
    if checkpoint is not None:
        result.checkpoint = checkpoint
    return result.save_json(RunDir(run_dir).eval_json(name, step))
