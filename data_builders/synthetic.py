"""Synthetic IN2 source: short documents about invented entities, with questions answered by one fact.

Every document describes one invented person (name, city, job, colour, pet, instrument). Names are
drawn from invented syllables, so no fact can be known from pre-training or memorised across samples:
the model can only answer by finding the entity's segment in the context. Same seed, same documents.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

_SYLLABLES = (
    "ka lo mir ven tor sa bel dra fin gor hul ix jun kes lun mor nax oru pel quin ras sil tam "
    "ulv vor wex yan zel"
).split()
_VALUES = {
    "city": "Arvel Brisk Corran Dunmore Elsk Farrow Glimm Harth Istra Jorvik Kessel Lorn Marrow Nesk "
    "Orrin Pallis Quell Rusk Sarn Tolvar".split(),
    "job": "baker pilot farmer tailor sailor potter miner weaver mason cooper glazier "
    "ranger scribe brewer carver smith".split(),
    "colour": "red blue green yellow purple orange silver golden white black brown pink".split(),
    "pet": "cat dog owl goat horse parrot rabbit ferret turtle lizard hamster pony".split(),
    "instrument": "harp flute drum lute violin trumpet cello organ banjo oboe".split(),
}
# (sentence in the document, question) per attribute; {n} is the entity name, {v} the value.
_TEMPLATES = {
    "city": ("{n} lives in {v}.", "Where does {n} live?"),
    "job": ("{n} works as a {v}.", "What is the job of {n}?"),
    "colour": ("The favourite colour of {n} is {v}.", "What is the favourite colour of {n}?"),
    "pet": ("{n} keeps a {v} at home.", "Which pet does {n} keep?"),
    "instrument": ("{n} plays the {v}.", "Which instrument does {n} play?"),
}
ATTRIBUTES = tuple(_TEMPLATES)


@dataclass(frozen=True)
class QAItem:
    """A question answered by one fact of one document."""

    question: str
    answers: tuple[str, ...]
    attribute: str
    lead: str = ""  # the fact's own words before the answer ("Kamir works as a"), for cloze-style prompts


@dataclass(frozen=True)
class Document:
    """One answer-bearing (or distractor) document and the questions it answers."""

    doc_id: str
    entity: str
    text: str
    qa: tuple[QAItem, ...] = field(default_factory=tuple)


def _name(rng: random.Random) -> str:
    n_syll = rng.choice((2, 3))
    return "".join(rng.choice(_SYLLABLES) for _ in range(n_syll)).capitalize()


def max_documents() -> int:
    """Distinct entity names, hence documents, that `generate_documents` can produce."""
    return len({"".join(p) for k in (2, 3) for p in itertools.product(_SYLLABLES, repeat=k)})


def generate_documents(n: int, seed: int, prefix: str = "syn", facts: int | None = None) -> list[Document]:
    """`n` documents with distinct entity names; deterministic in `seed`. `facts`: keep each document's first
    `facts` sentences (and their questions) only, the same persons and values as the full documents."""
    rng = random.Random(seed)
    docs, seen = [], set()
    while len(docs) < n:
        name = _name(rng)
        if name in seen:
            continue
        seen.add(name)
        attrs = list(ATTRIBUTES)
        rng.shuffle(attrs)
        sentences, qa = [], []
        for attr in attrs:
            value = rng.choice(_VALUES[attr])
            statement, question = _TEMPLATES[attr]
            sentences.append(statement.format(n=name, v=value))
            lead = statement.split(" {v}")[0].format(n=name)
            qa.append(QAItem(question.format(n=name), (value,), attr, lead))
        docs.append(Document(f"{prefix}-{seed}-{len(docs)}", name, " ".join(sentences[:facts]), tuple(qa[:facts])))
    return docs


# Integration questions need two or three documents. A second person is named through a value it
# shares with the first ("the person who plays the same instrument as A"); the assembler keeps that
# person unique in the context by rejecting distractors that state the shared fact (`forbid`).
_BRIDGES = {
    "city": "lives in the same city as {a}",
    "job": "has the same job as {a}",
    "colour": "has the same favourite colour as {a}",
    "pet": "keeps the same pet as {a}",
    "instrument": "plays the same instrument as {a}",
}
_COMPARISONS = {
    "city": "Do {a} and {b} live in the same city?",
    "job": "Do {a} and {b} have the same job?",
    "colour": "Do {a} and {b} have the same favourite colour?",
    "pet": "Do {a} and {b} keep the same pet?",
    "instrument": "Do {a} and {b} play the same instrument?",
}
_COUNTS = {
    "city": "How many of {a}, {b} and {c} live in {v}?",
    "job": "How many of {a}, {b} and {c} work as a {v}?",
    "colour": "How many of {a}, {b} and {c} have {v} as their favourite colour?",
    "pet": "How many of {a}, {b} and {c} keep a {v} at home?",
    "instrument": "How many of {a}, {b} and {c} play the {v}?",
}
INTEGRATION_KINDS = ("two_hop", "comparison", "count")


@dataclass(frozen=True)
class IntegrationQA:
    """A question answered from two or three documents; `docs` index the document list, in question order."""

    question: str
    answers: tuple[str, ...]
    docs: tuple[int, ...]
    kind: str  # two_hop | comparison | count
    extractive: bool  # the answer is written in a document (two_hop), not derived (yes/no, a count)
    forbid: tuple[str, ...] = ()  # facts no other document of the context may state


def _fact(attribute: str, value: str) -> str:
    """The statement of a fact without its subject ("plays the harp"), to find it in other documents."""
    return _TEMPLATES[attribute][0].split("{n}")[1].format(v=value).strip(" .")


def _partner(candidates: Sequence[int], ok: Callable[[int], bool], rng: random.Random) -> int | None:
    """A uniform draw among the `candidates` that pass `ok` (rejection sampling; None if 20 draws fail)."""
    for _ in range(20):
        b = rng.choice(candidates)
        if ok(b):
            return b
    return None


def _two_hop(docs, facts, by_value, rng) -> IntegrationQA | None:
    a = rng.randrange(len(docs))
    bridge, target = rng.sample(ATTRIBUTES, 2)
    value = facts[a][bridge]
    b = _partner(by_value[bridge][value], lambda b: b != a and facts[b][target] != facts[a][target], rng)
    if b is None:
        return None
    who = "the person who " + _BRIDGES[bridge].format(a=docs[a].entity)
    question = _TEMPLATES[target][1].format(n=who)
    return IntegrationQA(question, (facts[b][target],), (a, b), "two_hop", True, (_fact(bridge, value),))


def _comparison(docs, facts, by_value, rng) -> IntegrationQA | None:
    a = rng.randrange(len(docs))
    attribute = rng.choice(ATTRIBUTES)
    if rng.random() < 0.5:
        b = _partner(by_value[attribute][facts[a][attribute]], lambda b: b != a, rng)
    else:
        b = _partner(range(len(docs)), lambda b: facts[b][attribute] != facts[a][attribute], rng)
    if b is None:
        return None
    answer = "yes" if facts[a][attribute] == facts[b][attribute] else "no"
    question = _COMPARISONS[attribute].format(a=docs[a].entity, b=docs[b].entity)
    return IntegrationQA(question, (answer,), (a, b), "comparison", False)


def _count(docs, facts, by_value, rng) -> IntegrationQA | None:
    attribute = rng.choice(ATTRIBUTES)
    value = rng.choice(_VALUES[attribute])
    k = rng.randrange(4)  # answers 0..3 equally often
    holders = by_value[attribute].get(value, [])
    if len(holders) < k:
        return None
    chosen = rng.sample(holders, k)
    while len(chosen) < 3:
        c = rng.randrange(len(docs))
        if facts[c][attribute] != value and c not in chosen:
            chosen.append(c)
    rng.shuffle(chosen)
    question = _COUNTS[attribute].format(v=value, **dict(zip("abc", (docs[c].entity for c in chosen))))
    return IntegrationQA(question, (str(k),), tuple(chosen), "count", False)


def integration_questions(docs: list[Document], n: int, seed: int) -> list[IntegrationQA]:
    """`n` integration questions over `docs`, the three kinds in turn; deterministic in `seed`."""
    rng = random.Random(seed)
    facts = [{qa.attribute: qa.answers[0] for qa in d.qa} for d in docs]
    by_value: dict[str, dict[str, list[int]]] = {attr: {} for attr in ATTRIBUTES}
    for k, f in enumerate(facts):
        for attr, value in f.items():
            by_value[attr].setdefault(value, []).append(k)
    makers = {"two_hop": _two_hop, "comparison": _comparison, "count": _count}
    questions: list[IntegrationQA] = []
    for _ in range(50 * n + 100):
        if len(questions) == n:
            break
        q = makers[INTEGRATION_KINDS[len(questions) % 3]](docs, facts, by_value, rng)
        if q is not None:
            questions.append(q)
    else:
        raise ValueError(f"{len(docs)} documents are too few for {n} integration questions")
    return questions
