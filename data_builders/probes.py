"""Position-controlled probes: the same query with its gold placed at each chosen position.

Every builder returns `ProbeItem`s. A query appears once per position (a paired design: the
positions differ only in where the gold sits), so accuracy differences between positions can be
tested query by query. Prompt wording lives in `templates/*.txt`; the key-value and multi-document
QA wording is that of Liu et al. 2023, *Lost in the Middle* (github.com/nelson-liu/lost-in-the-middle,
MIT; the NaturalQuestions passages are CC BY-SA 3.0, Kwiatkowski et al. 2019).

Scorers: kv and needle use `analysis.evaluation.scoring.substring_match`, mdqa `best_subspan_em`, in2 `exact_match`.
"""
from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from data_builders.files import expand_paths, read_jsonl, read_jsonl_lines
from data_builders.mdqa import Distractors, build_mdqa_records, passage_pool
from data_builders.question_split import (
    DEV_SHARE,
    EvaluationPart,
    QuestionSplit,
    evaluation_part,
    is_evaluation_question,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
KV_FILE = "kv-retrieval-75_keys.jsonl.gz"
NQ_FILE = "nq-open-oracle.jsonl.gz"
# Gold positions the reference evaluated for each pair / document count (its EXPERIMENTS.md).
KV_REFERENCE_POSITIONS = {75: (0, 24, 49, 74), 140: (0, 34, 69, 104, 139), 300: (0, 49, 99, 149, 199, 249, 299)}
MDQA_REFERENCE_POSITIONS = {10: (0, 4, 9), 20: (0, 4, 9, 14, 19), 30: (0, 4, 9, 14, 19, 24, 29)}
# The mdqa probe's `pool` value that retrieves distractors from the evaluation questions' passages only
# (`eval.mdqa.pool=heldout`, with `eval.mdqa.questions=heldout`): none of them reaches training on NQ.
HELDOUT_POOL = "heldout"

# Needle keys never occur in the synthetic filler, so the question has exactly one answer in context.
NEEDLE_WORDS = (
    "lantern", "walrus", "quiver", "saffron", "glacier", "trombone", "marmalade", "obsidian", "pelican",
    "kettle", "zeppelin", "juniper", "cobalt", "harpoon", "meadowlark", "tapestry", "sundial", "velvet",
    "anchor", "bramble", "compass", "dynamo", "ember", "falcon", "gondola", "hemlock", "indigo", "jasper",
)
_FILLER_SUBJECTS = ("farmer", "river", "teacher", "village", "merchant", "forest", "sailor", "council")
_FILLER_VERBS = ("watched", "crossed", "described", "visited", "followed", "painted", "measured")
_FILLER_OBJECTS = (
    "the old bridge", "a quiet harbor", "the northern hills", "an empty market", "the long road",
    "a small orchard", "the stone tower", "a winter storm", "the evening bells",
)
_FILLER_TAILS = (
    "before the rain began", "during the festival", "while the town slept", "after a long silence",
    "as the seasons changed", "without saying a word", "for many years",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Order(StrEnum):
    """How ranked documents are laid out (Liu et al. 2024, Sec. 5: putting the best where models look)."""

    descending = "descending"  # rank 1 first (the retriever's order)
    ascending = "ascending"  # rank 1 last, nearest the question
    outside_in = "outside_in"  # best at both ends: pos(d_2j-1) = j, pos(d_2j) = n - j + 1


def arrangement(n: int, order: Order | str) -> list[int]:
    """The 0-based rank of the document at each position: outside-in on ten reads ranks 1,3,5,7,9,10,8,6,4,2."""
    order = Order(order)
    if order == Order.descending:
        return list(range(n))
    if order == Order.ascending:
        return list(range(n))[::-1]
    return list(range(0, n, 2)) + list(range(1, n, 2))[::-1]


def arrange_documents(ctxs: Sequence[Any], gold: int, order: Order | str | None, keep: int | None
                      ) -> tuple[list[Any], int]:
    """`ctxs` in rank order (index 0 = rank 1; the gold ranks where it sits) truncated to the top `keep` and laid
    out by `order` (None: as ranked); returns them and the gold's final index (-1: truncated away)."""
    ranked = list(ctxs)[:keep] if keep is not None else list(ctxs)
    ranks = arrangement(len(ranked), order) if order is not None else list(range(len(ranked)))
    return [ranked[r] for r in ranks], ranks.index(gold) if gold in ranks else -1


@dataclass
class ProbeItem:
    """One query with its gold at one position."""

    id: str
    prompt: str | list[int]  # text, or token ids for already tokenized records (IN2)
    answers: list[str]
    position: int  # gold index among the positions; -1 = no context (closed-book baseline)
    n_positions: int
    probe: str  # kv, mdqa, needle, in2
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-serializable details kept with the outcome
    label: str | None = None  # name of the position in metric keys; None = str(position)
    query: str | None = None  # shared by one query's items at all positions (pairs them); None = id
    # Character spans [start, end) of the documents (mdqa) or pairs (kv) in a text prompt, in order: what
    # attention calibration (models.attention.attn_calibration) treats as segments. Not saved with the outcomes.
    segments: list[tuple[int, int]] | None = None
    # Token ids of the gold answer(s) as a continuation of the prompt, when the probe knows them (IN2: the answer
    # tokens the record trains on); None = tokenize `answers` (analysis.evaluation.loglik). Not saved either.
    targets: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.label is None:
            self.label = str(self.position)
        if self.query is None:
            self.query = self.id


def load_template(name: str) -> str:
    """Prompt template `templates/<name>.txt`, with `str.format` fields."""
    return (TEMPLATES / f"{name}.txt").read_text(encoding="utf-8").rstrip("\n")


def sample_indices(n_total: int, n: int | None, rng: random.Random) -> list[int]:
    """Indices of a seeded sample of n records (all when n is None), in file order."""
    if n is None or n >= n_total:
        return list(range(n_total))
    return sorted(rng.sample(range(n_total), n))


def _check_positions(positions: Sequence[int], n_slots: int) -> None:
    bad = [p for p in positions if not 0 <= p < n_slots]
    if bad:
        raise ValueError(f"positions {bad} are outside 0..{n_slots - 1}")


KV_SEPARATOR = ",\n "  # between the pairs of the JSON object, one pair a line (the layout of Liu et al.)


def kv_pair_texts(pairs: Sequence[Sequence[str]]) -> list[str]:
    """Each pair as it reads inside the JSON object: `"key": "value"`."""
    return [f'"{k}": "{v}"' for k, v in pairs]


def format_kv_records(pairs: Sequence[Sequence[str]]) -> str:
    """The pairs as a JSON object, one pair a line (the layout of Liu et al.)."""
    return "{" + KV_SEPARATOR.join(kv_pair_texts(pairs)) + "}"


def joined_spans(parts: Sequence[str], sep: str, offset: int) -> list[tuple[int, int]]:
    """Character spans of `parts` in `sep.join(parts)` placed at `offset`."""
    spans, at = [], offset
    for part in parts:
        spans.append((at, at + len(part)))
        at += len(part) + len(sep)
    return spans


def fill_template(template: str, field_name: str, parts: Sequence[str], sep: str, prefix: str = "", suffix: str = "",
                  **fields: str) -> tuple[str, list[tuple[int, int]]]:
    """`template` with `{field_name}` = prefix + sep.join(parts) + suffix and the other fields, and the spans of
    `parts` in the result."""
    before = template[: template.index("{" + field_name + "}")].format(**fields)
    prompt = template.format(**{field_name: prefix + sep.join(parts) + suffix}, **fields)
    return prompt, joined_spans(parts, sep, len(before) + len(prefix))


def _synthetic_kv(n_pairs: int, rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    def uid() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    pairs = [(uid(), uid()) for _ in range(n_pairs)]
    key, value = pairs[rng.randrange(n_pairs)]
    return pairs, key, value


def reference_positions(n_slots: int, probe: str) -> tuple[int, ...]:
    """The gold positions the reference evaluated for `n_slots` kv pairs or mdqa documents; for another
    size: the first, the last and three evenly spaced between."""
    table = KV_REFERENCE_POSITIONS if probe == "kv" else MDQA_REFERENCE_POSITIONS
    if n_slots in table:
        return table[n_slots]
    return tuple(sorted({0, *(max(round(k * n_slots / 4) - 1, 0) for k in range(1, 5))}))


def _kv_examples(
    path: str | Path, n_examples: int | None, rng: random.Random
) -> list[tuple[str, int, list[tuple[str, str]], str, str]]:
    """(where, record index, pairs, key, value) of the chosen records; `where` is `file:line` for messages."""
    lines = read_jsonl_lines(path)
    examples = []
    for i in sample_indices(len(lines), n_examples, rng):
        line_no, rec = lines[i]
        where = f"{path}:{line_no}"
        try:
            pairs, key, value = [tuple(p) for p in rec["ordered_kv_records"]], rec["key"], rec["value"]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a kv record (needs ordered_kv_records, key, value): {err!r}") from err
        if (key, value) not in pairs:
            raise ValueError(f"{where}: its key and value are not a pair of its ordered_kv_records")
        if len({k for k, _ in pairs}) != len(pairs):
            # The reference's prompt builder rejects these too; dropping them would shift the gold silently.
            raise ValueError(f"{where}: ordered_kv_records has duplicate keys")
        examples.append((where, i, pairs, key, value))
    return examples


def kv_probe(
    path: str | Path | None = None,
    n_pairs: int | None = None,
    positions: Sequence[int] | None = None,
    n_examples: int | None = None,
    seed: int = 0,
    query_aware: bool = False,
) -> list[ProbeItem]:
    """Key-value retrieval: find the value of one UUID key among UUID pairs (Liu et al.'s probe).

    Reads records with `ordered_kv_records`, `key`, `value` from `path` (any pair count: the reference's
    75-, 140- and 300-key files), or synthesizes UUID pairs when `path` is None (n_pairs default 75).
    n_pairs=None takes every pair of a file's records, which must then all have the same count; a set
    n_pairs takes the gold and the first n_pairs-1 other pairs of each record (fewer pairs fail).
    positions=None: the reference's for that count (`reference_positions`). As the reference does, the
    gold pair is moved to each position and the other pairs keep their order. n_examples=None takes
    every record (500 when synthesizing, the published size); otherwise a seeded sample. Any record,
    count or position that does not fit fails with a ValueError naming the file, line and reason.
    """
    rng = random.Random(seed)
    if path is None:
        n_pairs = 75 if n_pairs is None else n_pairs
        n = 500 if n_examples is None else n_examples
        examples = [(f"synthetic example {i}", i, *_synthetic_kv(n_pairs, rng)) for i in range(n)]
    else:
        examples = _kv_examples(path, n_examples, rng)
        if not examples:
            raise ValueError(f"{path}: no kv records")
        if n_pairs is None:
            n_pairs = len(examples[0][2])
            for where, _, pairs, _, _ in examples:
                if len(pairs) != n_pairs:
                    raise ValueError(f"{where}: {len(pairs)} pairs, but {examples[0][0]} has {n_pairs}; set "
                                     "n_pairs to ask every record with the same count")
    positions = reference_positions(n_pairs, "kv") if positions is None else tuple(positions)
    bad = [p for p in positions if not 0 <= p < n_pairs]
    if bad:
        raise ValueError(f"{examples[0][0] if examples else path}: gold positions {bad} do not fit "
                         f"{n_pairs} pairs (positions run 0..{n_pairs - 1})")
    # query_aware: the key before the JSON data too (Liu et al.'s query-aware contextualization)
    template = load_template("kv_retrieval_query_aware" if query_aware else "kv_retrieval")
    items = []
    for where, i, pairs, key, value in examples:
        if len(pairs) < n_pairs:
            raise ValueError(f"{where}: {len(pairs)} pairs, fewer than n_pairs={n_pairs}")
        others = [p for p in pairs if p != (key, value)][: n_pairs - 1]
        for pos in positions:
            ordered = others[:pos] + [(key, value)] + others[pos:]
            prompt, segments = fill_template(template, "kv_records", kv_pair_texts(ordered), KV_SEPARATOR, "{", "}",
                                             key=key)
            items.append(
                ProbeItem(
                    id=f"kv-{i}@{pos}",
                    prompt=prompt,
                    segments=segments,
                    answers=[value],
                    position=pos,
                    n_positions=n_pairs,
                    probe="kv",
                    extra={"example": i, "key": key},
                    query=f"kv-{i}",
                )
            )
    return items


def document_lines(docs: Sequence[Mapping[str, str]]) -> list[str]:
    """The reference's mdqa document lines: `Document [k](Title: <title>) <text>`."""
    return [f"Document [{k + 1}](Title: {d['title']}) {d['text']}" for k, d in enumerate(docs)]


def mdqa_prompt(question: str, docs: Sequence[Mapping[str, str]], query_aware: bool = False
                ) -> tuple[str, list[tuple[int, int]]]:
    """The mdqa prompt over `docs` (in order) and the character span of each document line in it: the one renderer
    of the probe's items and of IN2 training samples in its format (`data.in2.layout=mdqa`, data_builders.in2_mdqa).
    Liu et al.'s instruction, `Document [k](Title: <title>) <text>` lines, the question, `Answer:`."""
    template = "mdqa_query_aware" if query_aware else "mdqa"
    return fill_template(load_template(template), "documents", document_lines(docs), "\n", question=question)


@dataclass(frozen=True)
class Layout:
    """Prompt-level interventions of the kv and mdqa probes (analysis.evaluation.interventions): query-aware prompts
    (the question or key before the data too, Liu et al.'s templates), and for mdqa ranked documents
    truncated to the top `keep` and laid out by `order`. The default asks the reference's prompts."""

    query_aware: bool = False
    order: Order | None = None
    keep: int | None = None

    @property
    def moves_documents(self) -> bool:
        return self.order is not None or self.keep is not None


def _qa_item(
    i: int, rec: Mapping[str, Any], ctxs: Sequence[Mapping[str, str]], position: int, label: str | None,
    extra: Mapping[str, Any], layout: Layout = Layout(),
) -> ProbeItem:
    """One mdqa item: the question over `ctxs` (the closed-book prompt when there are none).

    With a layout that moves documents, `position` stays the gold's rank (its index in `ctxs`, the
    retriever's order), so curves pair with the un-intervened ones; extra["final_position"] is where it ends.
    """
    extra = dict(extra)
    if ctxs and layout.moves_documents:
        ctxs, extra["final_position"] = arrange_documents(ctxs, position, layout.order, layout.keep)
    if ctxs:
        prompt, segments = mdqa_prompt(rec["question"], ctxs, layout.query_aware)
    else:
        prompt, segments = load_template("closedbook_qa").format(question=rec["question"]), []
    return ProbeItem(
        id=f"mdqa-{i}@{label or position}",
        prompt=prompt,
        segments=segments,
        answers=list(rec["answers"]),
        position=position,
        n_positions=len(ctxs),
        probe="mdqa",
        extra=extra,
        label=label,
        query=f"mdqa-{i}",
    )


def _check_qa_record(where: str, rec: Mapping[str, Any]) -> None:
    if not isinstance(rec.get("question"), str) or not rec["question"]:
        raise ValueError(f"{where}: not a QA record: needs a non-empty `question`")
    if not isinstance(rec.get("answers"), list) or not all(isinstance(a, str) for a in rec["answers"]):
        raise ValueError(f"{where}: `answers` must be a list of strings")
    for k, c in enumerate(rec.get("ctxs") or []):
        if not isinstance(c, dict) or not isinstance(c.get("title"), str) or not isinstance(c.get("text"), str):
            raise ValueError(f"{where}: ctxs[{k}] needs a `title` and a `text`")


def heldout_passages(records: Iterable[Mapping[str, Any]], split: QuestionSplit) -> list[dict[str, str]]:
    """The distinct passages (`passage_pool`) of the records whose question is an evaluation question of `split`:
    an IN2 build from NQ with `data.nq_split` equal to `split` trains on none of them, as gold or distractor."""
    return passage_pool(r for r in records if is_evaluation_question(r["question"], split))


def check_mdqa_pool(pool: str | Path | None, distractors: Distractors | str, heldout: QuestionSplit | None,
                    prefix: str = "eval.mdqa.") -> None:
    """Fail naming the key (`<prefix>pool`) on a distractor pool the mdqa probe cannot use: a value that is neither
    a passage file nor HELDOUT_POOL, or HELDOUT_POOL without retrieved distractors or without held-out questions
    (`<prefix>questions=heldout`, whose split says which passages are held out)."""
    if pool is None:
        return
    if str(pool) == HELDOUT_POOL:
        if Distractors(distractors) != Distractors.retrieved:
            raise ValueError(f"{prefix}pool={HELDOUT_POOL} is a pool to retrieve from, but {prefix}distractors="
                             f"{distractors} draws other questions' passages: set {prefix}distractors=retrieved")
        if heldout is None:
            raise ValueError(f"{prefix}pool={HELDOUT_POOL} retrieves from the passages of the evaluation questions of "
                             f"{prefix}split: set {prefix}questions=heldout")
        return
    if not Path(pool).expanduser().is_file():
        raise ValueError(f"{prefix}pool={str(pool)!r} is neither a passage file (JSON lines of title/text, or of "
                         f"records with ctxs) nor {HELDOUT_POOL!r} (the evaluation questions' passages only)")


def _built_qa_items(
    file: Path, lines: Sequence[tuple[int, dict[str, Any]]], chosen: Sequence[int], n_docs: int | None,
    positions: Sequence[int] | None, distractors: str, pool: str | Path | None, seed: int, layout: Layout,
    heldout: QuestionSplit | None = None,
) -> list[ProbeItem]:
    """Items of an oracle file (one gold passage per question): distractors added, gold at each position.
    `pool=HELDOUT_POOL`: retrieved from the file's passages of `heldout`'s evaluation questions only."""
    n_docs = 20 if n_docs is None else n_docs
    positions = reference_positions(n_docs, "mdqa") if positions is None else tuple(positions)
    bad = [p for p in positions if not 0 <= p < n_docs]
    if bad:
        raise ValueError(f"{file}: gold positions {bad} do not fit n_docs={n_docs} (positions run 0..{n_docs - 1})")
    records = [rec for _, rec in lines]
    if pool is not None and str(pool) == HELDOUT_POOL:
        pool_passages = heldout_passages(records, heldout)
    else:
        pool_passages = passage_pool(read_jsonl(pool)) if pool is not None else None
    try:
        built = build_mdqa_records(records, n_docs, positions, distractors, pool_passages, chosen, seed)
    except ValueError as err:
        raise ValueError(f"{file}: cannot add {n_docs - 1} {distractors} distractors: {err}") from err
    items = []
    for k, i in enumerate(chosen):
        extra = {"example": i, "question": records[i]["question"], "file": file.name, "distractors": str(distractors)}
        items += [_qa_item(i, built[pos][k], built[pos][k]["ctxs"], pos, None, extra, layout) for pos in positions]
    return items


def _given_qa_items(
    file: Path, lines: Sequence[tuple[int, dict[str, Any]]], chosen: Sequence[int], n_docs: int | None,
    positions: Sequence[int] | None, layout: Layout,
) -> list[ProbeItem]:
    """Items of a file in the reference format, asked as they are: the gold is where `isgold` says."""
    items = []
    counts: dict[int, str] = {}  # document count -> the first record with it
    for i in chosen:
        line_no, rec = lines[i]
        where, ctxs = f"{file}:{line_no}", rec.get("ctxs") or []
        if ctxs and counts.setdefault(len(ctxs), where) == where and len(counts) > 1:
            first = next(w for n, w in counts.items() if n != len(ctxs))
            raise ValueError(f"{where}: {len(ctxs)} documents, but {first} has another count; positions of "
                             "different counts do not compare: ask such records separately")
        golds = [k for k, c in enumerate(ctxs) if c.get("isgold") is True]
        if len(golds) > 1:
            raise ValueError(f"{where}: {len(golds)} documents are flagged isgold (at {golds}); expected one")
        if n_docs is not None and ctxs and len(ctxs) != n_docs:
            raise ValueError(f"{where}: {len(ctxs)} documents, but n_docs={n_docs}")
        if golds and positions is not None and golds[0] not in positions:
            raise ValueError(f"{where}: its gold is at index {golds[0]}, not among positions {list(positions)}")
        position, label = (golds[0], None) if golds else (-1, "nogold" if ctxs else "closedbook")
        extra = {"example": i, "question": rec["question"], "file": file.name}
        items.append(_qa_item(i, rec, ctxs, position, label, extra, layout))
    return items


def mdqa_probe(
    path: str | Path,
    n_docs: int | None = None,
    positions: Sequence[int] | None = None,
    distractors: Distractors | str = Distractors.retrieved,
    pool: str | Path | None = None,
    n_examples: int | None = None,
    seed: int = 0,
    closed_book: bool = True,
    layout: Layout = Layout(),
    heldout: QuestionSplit | None = None,
    part: EvaluationPart | None = None,
    dev_share: float = DEV_SHARE,
) -> list[ProbeItem]:
    """Multi-document QA (Liu et al.): a question over documents, one of which holds the answer.

    `path`: a JSON-lines file, or a glob of several (`qa_data/20_total_documents/*.jsonl.gz`). Each is
    - an oracle file (every record has one passage, e.g. nq-open-oracle): n_docs-1 distractors are added
      (`data_builders.mdqa`; `distractors=retrieved`: the best BM25 passages of `pool`, else of the file's
      own passages, that contain no answer, by score, as the reference built its data) and the gold goes
      to each of `positions` (None: the reference's for n_docs, default 20 documents);
    - or a file in the reference format (`ctxs` with `isgold`, e.g. `*_gold_at_9.jsonl.gz`), asked as it
      is: position = the index of the gold; a record with no gold is asked at position -1, labelled
      "nogold" (documents) or "closedbook" (none). n_docs and positions, when set, must agree with it.
    Records pair across files by their index (the reference's files hold one question set in one order);
    n_examples=None takes every record, otherwise the same seeded sample of each file. `closed_book` adds a
    question-only item per question (position -1, label "closedbook"), the no-context baseline.
    `layout`: query-aware prompts, and the documents (in rank order: the gold's index is its rank) truncated
    and reordered; positions stay the gold's rank (`_qa_item`).
    `heldout`: ask only the evaluation questions of this split (data_builders.question_split: those an IN2
    build from NQ with the same `data.nq_split` never trains on); None asks from every record. `part`: only
    the dev or the test part of those (`evaluation_part` with `dev_share`).
    `pool`: a passage file to retrieve distractors from; None = the oracle file's own passages; HELDOUT_POOL
    ("heldout", with `heldout` set) = the file's passages of `heldout`'s evaluation questions only, which an IN2
    build from NQ never trains on, so that no distractor was seen in training (`check_mdqa_pool`).
    """
    if layout.keep is not None and layout.keep < 1:
        raise ValueError(f"{path}: keep={layout.keep} documents: keep at least one")
    check_mdqa_pool(pool, distractors, heldout, "mdqa.")
    if part is not None and heldout is None:
        raise ValueError(f"{path}: the {part} part is a part of the evaluation questions: set their split (heldout)")
    if not 0 < dev_share < 1:
        raise ValueError(f"mdqa.dev_share={dev_share} must be in (0, 1)")
    items: list[ProbeItem] = []
    asked: dict[str, str] = {}  # item id -> file:line of the record that asked it
    questions: dict[str, tuple[str, str]] = {}  # query -> (file:line, question) of its first record
    for file in expand_paths(path):
        lines = read_jsonl_lines(file)
        for line_no, rec in lines:
            _check_qa_record(f"{file}:{line_no}", rec)
        eligible = [i for i, (_, rec) in enumerate(lines)
                    if heldout is None or (is_evaluation_question(rec["question"], heldout) and (
                        part is None or evaluation_part(rec["question"], heldout, dev_share) == part))]
        if heldout is not None and not eligible:
            raise ValueError(f"{file}: none of its {len(lines)} questions is an evaluation question of {heldout}")
        chosen = [eligible[k] for k in sample_indices(len(eligible), n_examples, random.Random(seed))]
        if lines and all(len(rec.get("ctxs") or []) == 1 for _, rec in lines):
            file_items = _built_qa_items(file, lines, chosen, n_docs, positions, distractors, pool, seed, layout,
                                         heldout)
        else:
            file_items = _given_qa_items(file, lines, chosen, n_docs, positions, layout)
        for item in file_items:
            where = f"{file}:{lines[item.extra['example']][0]}"
            first_where, question = questions.setdefault(item.query, (where, item.extra["question"]))
            if question != item.extra["question"]:
                raise ValueError(f"{where} and {first_where}: record {item.extra['example']} holds different "
                                 "questions; files asked together must hold one question set in one order")
            if asked.setdefault(item.id, where) != where:
                raise ValueError(f"{where} and {asked[item.id]}: both ask record {item.extra['example']} at "
                                 f"{item.label}")
        items += file_items
    if closed_book:
        has_baseline = {it.query for it in items if it.label == "closedbook"}
        first_items: dict[str, ProbeItem] = {}
        for it in items:
            first_items.setdefault(it.query, it)
        # the question's details without where its gold went: a closed-book item has no document to place
        items += [_qa_item(it.extra["example"], {"question": it.extra["question"], "answers": it.answers}, [], -1,
                           "closedbook", {k: v for k, v in it.extra.items() if k != "final_position"})
                  for q, it in first_items.items() if q not in has_baseline]
    no_gold_labels = sorted({it.label for it in items if it.position < 0})
    if len(no_gold_labels) > 1:
        raise ValueError(f"{path}: records without a gold document and closed-book items would share position -1 "
                         f"(labels {no_gold_labels}): set closed_book=false, or ask such files alone")
    return items


def synthetic_filler(n_sentences: int = 2000, seed: int = 0) -> list[str]:
    """Bland generated sentences, a filler that needs no data file (holds no digits, no needle word)."""
    rng = random.Random(seed)
    return [
        f"The {rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_VERBS)} {rng.choice(_FILLER_OBJECTS)} "
        f"{rng.choice(_FILLER_TAILS)}."
        for _ in range(n_sentences)
    ]


def nq_filler(path: str | Path) -> list[str]:
    """Real English filler: the annotated long-answer paragraphs of the NQ-Open oracle file."""
    texts = []
    for line_no, rec in read_jsonl_lines(path):
        gold = rec.get("nq_annotated_gold")
        text = gold.get("long_answer") if isinstance(gold, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{line_no}: no nq_annotated_gold.long_answer text (the needle probe's filler is "
                             f"the NQ-Open oracle file of Liu et al. 2023, {NQ_FILE}, as it is released)")
        texts.append(text)
    return texts


def needle_probe(
    filler_texts: Sequence[str],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    context_lens: Sequence[int] = (256, 512, 1024),
    tokenizer: PreTrainedTokenizerBase | None = None,
    n_examples: int = 5,
    seed: int = 0,
) -> list[ProbeItem]:
    """Needle in a haystack: "The secret code of <word> is <5-digit number>." inside filler text.

    Lengths are in tokens of `tokenizer` when one is given, else in characters. For each example and
    length, whole filler sentences (cycling through `filler_texts` from a seeded start) are taken
    while the filler plus needle fits the length, and the needle goes to the sentence boundary
    nearest each depth (0 = first, 1 = last). Token lengths add per-sentence counts, so they can be
    off by a few tokens where a tokenizer merges across sentence boundaries. position = depth index;
    extra holds context_len (the requested length, the heatmap axis), depth, and the realised
    relative depth and length.
    """
    sentences = [s for t in filler_texts for s in _SENTENCE_END.split(t.strip()) if s]
    if not sentences:
        raise ValueError("needle_probe needs non-empty filler_texts")
    sizes: dict[int, int] = {}

    def size(text: str) -> int:
        # The space is the joiner in front of every sentence of the context; a sentence takes at
        # least one unit, so the filling loop below ends.
        n = len(tokenizer.encode(" " + text, add_special_tokens=False)) if tokenizer else len(text) + 1
        return max(n, 1)

    def sentence_size(k: int) -> int:
        if k not in sizes:  # tokenize lazily: a long filler is mostly never used
            sizes[k] = size(sentences[k])
        return sizes[k]

    rng = random.Random(seed)
    template = load_template("needle")
    haystack = "\n".join(sentences)
    items = []
    for e in range(n_examples):
        word, start = rng.choice(NEEDLE_WORDS), rng.randrange(len(sentences))
        code = str(rng.randrange(10_000, 100_000))
        while code in haystack:  # the code must be the only answer in the context
            code = str(rng.randrange(10_000, 100_000))
        needle = f"The secret code of {word} is {code}."
        for length in context_lens:
            budget, chosen, bounds = length - size(needle), [], [0]
            k = start
            while bounds[-1] + sentence_size(k) <= budget:
                chosen.append(sentences[k])
                bounds.append(bounds[-1] + sentence_size(k))
                k = (k + 1) % len(sentences)
            if not chosen:
                raise ValueError(f"context_len={length} leaves no room for a filler sentence")
            total = bounds[-1]
            for d_idx, depth in enumerate(depths):
                cut = min(range(len(bounds)), key=lambda b: abs(bounds[b] - depth * total))
                context = " ".join(chosen[:cut] + [needle] + chosen[cut:])
                items.append(
                    ProbeItem(
                        id=f"needle-{e}-{length}@{d_idx}",
                        prompt=template.format(context=context, word=word),
                        answers=[code],
                        position=d_idx,
                        n_positions=len(depths),
                        probe="needle",
                        extra={
                            "example": e,
                            "context_len": length,
                            "depth": float(depth),
                            "realised_depth": bounds[cut] / total,
                            "realised_len": total + size(needle),
                        },
                        label=str(float(depth)),
                        query=f"needle-{e}-{length}",
                    )
                )
    return items


def depth_bin(depth: float, bins: int) -> int:
    """Index of the equal-width depth bin holding `depth` in [0, 1]; depth 1 falls in the last bin."""
    return min(max(int(depth * bins), 0), bins - 1)


def bin_label(index: int, bins: int) -> str:
    """Lower edge of a depth bin as a metric-key label: 0.0, 0.1, ..., 0.9 for 10 bins."""
    return str(round(index / bins, 4))


def _trained_answer(rec: Mapping[str, Any]) -> list[int]:
    """The answer tokens an IN2 record trains on: its labelled tokens after the prompt (all of them without
    labels: the schema is prompt + answer + eos), without the final eos."""
    after = [int(t) for t in rec["input_ids"][rec["prompt_len"]:]]
    if "labels" in rec:
        after = [t for t, label in zip(after, rec["labels"][rec["prompt_len"]:]) if label != -100]
    return after[:-1]


def in2_probe(records: Iterable[Mapping[str, Any]], bins: int = 10) -> list[ProbeItem]:
    """Held-out IN2 records as items binned by gold depth (position = bin of record["depth"]).

    The prompt is the record's own token ids before the answer, `input_ids[:prompt_len]`, so
    generation sees exactly the tokens that training saw; `targets` holds the answer tokens it trains on.
    """
    items = []
    for rec in records:
        b = depth_bin(rec["depth"], bins)
        items.append(
            ProbeItem(
                id=str(rec["id"]),
                prompt=list(rec["input_ids"][: rec["prompt_len"]]),
                answers=list(rec["answers"]),
                position=b,
                n_positions=bins,
                probe="in2",
                extra={k: rec[k] for k in ("depth", "context_tokens", "task", "source") if k in rec},
                label=bin_label(b, bins),
                targets=[_trained_answer(rec)],
            )
        )
    return items
