"""An evaluation's answers recorded as they are made, so that the same evaluation run again after a kill answers
only what is missing.

Items are answered in fixed chunks (`chunks_of`): consecutive items, `RECORD_CHUNK` at a time, or one shared
context's items together (VaLProbing's sets, whose prefill they share). Each chunk's outcomes become one line of
`<cache>/evaluations/answered/<key>.jsonl`, flushed and fsynced before the next chunk starts; `key` is
`analysis.evaluation.reuse.evaluation_key` of the weights, the items and every setting (the chunking too), so a
changed model or setting never reads another evaluation's answers. A run killed mid-line leaves a torn last line,
which is cut off before the next append. Every run, resumed or not, answers in the same chunks, so a resumed run's
answers are those of an uninterrupted one, byte for byte.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

from data_builders.probes import ProbeItem

log = logging.getLogger(__name__)

RECORD_SUBDIR = Path("evaluations") / "answered"
RECORD_CHUNK = 16  # items between two durable records: a kill loses at most this many answers
FORMAT = "posdebias answer record v1"

Outcome = dict[str, Any]


def chunks_of(items: Sequence[ProbeItem], size: int = RECORD_CHUNK,
              group: Callable[[ProbeItem], Hashable] | None = None) -> list[range]:
    """Index ranges that partition `items` in order: `size` items at a time, or, with `group`, each run of
    consecutive items of one group whole (a shared context is prefilled once a chunk)."""
    if size < 1:
        raise ValueError(f"chunk size {size} must be >= 1")
    if group is None:
        return [range(start, min(start + size, len(items))) for start in range(0, len(items), size)]
    bounds = [0] + [i for i in range(1, len(items)) if group(items[i]) != group(items[i - 1])] + [len(items)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class AnswerRecord:
    """The chunks of one evaluation answered so far, in a JSON-lines file: a header naming the key and the item
    count, then one `{"chunk", "ids", "outcomes"}` line a chunk."""

    def __init__(self, path: Path, key: str, chunks: Sequence[Sequence[str]]) -> None:
        self.path, self.key, self.chunk_ids = Path(path), key, [list(c) for c in chunks]
        self.header = {"format": FORMAT, "key": key, "items": sum(map(len, self.chunk_ids))}

    def read_back(self) -> dict[int, list[Outcome]]:
        """{chunk index: its outcomes} recorded by earlier runs; cuts a torn last line off the file. A line that
        is not this evaluation's (another key, other ids) is a bug or a damaged file: it is named and ignored."""
        if not self.path.is_file():
            return {}
        data = self.path.read_bytes()
        done: dict[int, list[Outcome]] = {}
        good = 0  # bytes up to the last whole, valid line
        for number, line in enumerate(data.splitlines(keepends=True), 1):
            if not line.endswith(b"\n"):
                break  # torn by a kill mid-write
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: not a JSON line (damaged record): the answers from here on are answered "
                            "again", self.path, number)
                break
            if number == 1:
                if row != self.header:
                    log.warning("%s: its header %s is not this evaluation's %s: answering every item again",
                                self.path, row, self.header)
                    break
            elif (not isinstance(row, dict) or not 0 <= row.get("chunk", -1) < len(self.chunk_ids)
                  or row.get("ids") != self.chunk_ids[row["chunk"]]):
                log.warning("%s:%d: a chunk of other items than this evaluation's: answering it again",
                            self.path, number)
                break
            else:
                done[row["chunk"]] = row["outcomes"]
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return done

    def append(self, chunk: int, outcomes: list[Outcome]) -> None:
        """Record `chunk`'s outcomes durably (flushed and fsynced) before anything else is answered."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        if not self.path.is_file() or self.path.stat().st_size == 0:
            lines.append(json.dumps(self.header))
        lines.append(json.dumps({"chunk": chunk, "ids": self.chunk_ids[chunk], "outcomes": outcomes}))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())


def record_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / RECORD_SUBDIR / f"{key}.jsonl"
