import gzip
import itertools
import json
import re
import string
import unicodedata
from pathlib import Path

import pytest
import regex

from analysis.evaluation.scoring import (
    best_subspan_em,
    exact_match,
    first_line,
    normalize_answer,
    substring_match,
    whole_word_subspan_em,
)
from tests.conftest import shared_data_file

NQ_SLICE = (0, 80)  # fixed slice of records whose answers are decorated model-style


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  Quick, brown FOX!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("theater anthem", "theater anthem"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("  \t\n ", ""),
        ("Wilhelm Conrad Röntgen", "wilhelm conrad röntgen"),
        ("Gandhi's", "gandhis"),  # ASCII apostrophe dropped
        ("Gandhi’s", "gandhi’s"),  # curly apostrophe is not in string.punctuation
        ("“Oak Island”…", "“oak island”…"),
        ("the the", ""),
        ("a\u0300 la carte", "a\u0300 la carte"),  # NFD "à": `regex` keeps the "a" (`re` would not)
        ("the\u0301", "the\u0301"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_substring_match():
    value = "9a5e1208-7d0a-4fed-9819-10e6641fa9c3"
    assert substring_match(f' "{value.upper()}"}}', [value]) == 1.0  # case-insensitive
    assert substring_match("9a5e1208 7d0a", [value]) == 0.0
    assert substring_match("9a5e12087d0a4fed981910e6641fa9c3", [value]) == 0.0  # no normalization
    assert substring_match("the value is B", ["a", "b"]) == 1.0
    assert substring_match("", [value]) == 0.0
    assert substring_match("anything", [""]) == 0.0  # an empty gold never matches


def test_best_subspan_em():
    answers = ["Wilhelm Conrad Röntgen"]
    assert best_subspan_em("It was awarded to Wilhelm Conrad Röntgen, of Germany.", answers) == 1.0
    assert best_subspan_em("wilhelm conrad RÖNTGEN", answers) == 1.0
    assert best_subspan_em("Conrad Wilhelm Röntgen", answers) == 0.0  # contiguous, in order
    assert best_subspan_em("In 19011", ["1901"]) == 1.0  # characters, not tokens (published quirk)
    assert best_subspan_em("In 1901.", ["1901"]) == 1.0
    assert best_subspan_em("concatenate", ["cat"]) == 1.0
    assert best_subspan_em("“Gandhi’s”", ["Gandhi"]) == 1.0
    assert best_subspan_em("the Beatles", ["Beatles", "The Rolling Stones"]) == 1.0  # articles dropped
    assert best_subspan_em("rolling stones", ["Beatles", "The Rolling Stones"]) == 1.0  # any gold answer
    assert best_subspan_em("", answers) == 0.0
    assert best_subspan_em("anything", []) == 0.0
    # A gold that normalizes to nothing is a substring of everything (published quirk).
    assert best_subspan_em("the end", ["The"]) == 1.0
    assert best_subspan_em("", ["..."]) == 1.0
    assert best_subspan_em("Paris", ["Lyon", ""]) == 1.0
    # Decomposed vs precomposed accents are different strings: no Unicode normalization.
    assert best_subspan_em("Réunion", ["Re\u0301union"]) == 0.0


def test_whole_word_subspan_em():
    answers = ["Wilhelm Conrad Röntgen"]
    assert whole_word_subspan_em("It was awarded to Wilhelm Conrad Röntgen, of Germany.", answers) == 1.0
    assert whole_word_subspan_em("wilhelm conrad RÖNTGEN", answers) == 1.0
    assert whole_word_subspan_em("Conrad Wilhelm Röntgen", answers) == 0.0  # contiguous, in order
    assert whole_word_subspan_em("In 19011", ["1901"]) == 0.0  # whole tokens only
    assert whole_word_subspan_em("In 1901.", ["1901"]) == 1.0
    assert whole_word_subspan_em("“Gandhi’s”", ["Gandhi"]) == 0.0
    assert whole_word_subspan_em("the Beatles", ["Beatles", "The Rolling Stones"]) == 1.0
    assert whole_word_subspan_em("rolling stones", ["Beatles", "The Rolling Stones"]) == 1.0
    assert whole_word_subspan_em("", answers) == 0.0
    assert whole_word_subspan_em("the end", ["The"]) == 0.0  # gold normalizes to nothing


def test_first_line():
    assert first_line("Paris") == "Paris"
    assert first_line("  Paris  ") == "Paris"
    assert first_line("\n\n  Paris\nQuestion: what else?\nLyon") == "Paris"  # leading newlines skipped
    assert first_line("Paris is the capital.\n\nDocument [3](Title: Lyon) ...") == "Paris is the capital."
    assert first_line(" \t Paris \r\nLyon") == "Paris"  # the "\r" of "\r\n" goes with the strip
    assert first_line("Paris\u2028Lyon") == "Paris\u2028Lyon"  # only "\n" ends a line
    assert first_line("") == ""
    assert first_line(" \n \n ") == ""
    # The whole pipeline: text after the answer line cannot score.
    assert best_subspan_em(first_line("I don't know.\nDocument [1]: Paris is ..."), ["Paris"]) == 0.0
    assert best_subspan_em(first_line("\nParis\nLyon"), ["Paris"]) == 1.0


def test_exact_match():
    assert exact_match(" Paris\nQuestion: what else", ["Paris"]) == 1.0  # cut at the first newline
    assert exact_match("Paris is the capital", ["Paris"]) == 0.0
    assert exact_match("the PARIS.", ["Paris"]) == 1.0
    assert exact_match("lyon", ["Paris", "Lyon"]) == 1.0
    assert exact_match("", ["Paris"]) == 0.0
    assert exact_match("", ["The"]) == 0.0
    assert exact_match("Paris</s>junk", ["Paris"], stop=("</s>",)) == 1.0


# ---------------------------------------------------------------------------------------------
# Oracle for the multi-document QA metric. Written from the documented behaviour (SQuAD v1.1
# normalization as used by Liu et al. 2023, "Lost in the Middle"; the metric is a substring test
# on normalized strings) and checked once, by hand, against the reference source: the whole
# battery below gave zero disagreements. Not the reference code; kept deliberately different.
# ---------------------------------------------------------------------------------------------
_ORACLE_PUNCT = frozenset(string.punctuation)
_ORACLE_ARTICLE = regex.compile(r"\b(?:a|an|the)\b")  # the `regex` module: its \b is the reference's
_STDLIB_ARTICLE = re.compile(r"\b(?:a|an|the)\b")  # only to show that the battery separates the two


def _oracle_normalize(text, article=_ORACLE_ARTICLE):
    kept = []
    for char in text.lower():
        if char in _ORACLE_PUNCT:
            continue
        kept.append(char)
    no_articles = article.sub(" ", "".join(kept))
    return " ".join(no_articles.split())


def _oracle_em(prediction, golds):
    haystack = _oracle_normalize(prediction).lower()
    for gold in golds:
        if haystack.find(_oracle_normalize(gold).lower()) >= 0:
            return 1.0
    return 0.0


def _oracle_cut(generation):
    return generation.strip().partition("\n")[0].strip()


def _nfd(text):
    return unicodedata.normalize("NFD", text)


# Hand-written part: special predictions and golds, crossed with model-style decorations.
_HAND_PAIRS = [
    ("Paris", ["Paris"]),
    ("", ["Paris"]),
    ("", ["The"]),
    ("", [""]),
    ("", []),
    ("anything", []),
    ("Paris", ["Lyon", "The"]),
    ("Paris", ["Lyon", ""]),
    ("Paris", ["..."]),
    ("Paris", ["“”"]),  # curly quotes do not normalize away
    ("Paris", ["…"]),
    ("“Paris”", ["“Paris”"]),
    ("«Paris»", ["Paris"]),
    ("« Paris »", ["« Paris »"]),
    ("In 19011 the king died", ["1901"]),
    ("In 1901.", ["1901"]),
    ("1,901", ["1901"]),
    ("1.901", ["1,901"]),
    ("$1,000,000", ["1 million", "1000000"]),
    ("19 01", ["1901"]),
    ("concatenate", ["cat"]),
    ("scatter", ["cat", "dog"]),
    ("the the the", ["the the"]),
    ("The Who", ["The The"]),
    ("A Tribe Called Quest", ["tribe called quest"]),
    ("an Apple a day", ["apple day"]),
    ("an Apple a day", ["apple a day"]),
    ("apple a day", ["apple  day"]),
    ("theater", ["the"]),
    ("theater", ["ater"]),
    ("anthem", ["them"]),
    ("a-the-an", ["athean"]),
    ("a_the_an", ["a the an"]),
    ("the_end", ["end"]),
    ("Gandhi's", ["Gandhi"]),
    ("Gandhi’s", ["Gandhi"]),
    ("Gandhi’s", ["Gandhi's"]),
    ("Gandhi's", ["Gandhi’s"]),
    ("Gandhis", ["Gandhi's"]),
    ("rock 'n' roll", ["rock n roll"]),
    ("rock ’n’ roll", ["rock n roll"]),
    ("AT&T", ["at t"]),
    ("AT&T", ["ATT"]),
    ("U.S.A.", ["USA"]),
    ("U. S. A.", ["USA"]),
    ("Jean-Paul Sartre", ["Jean Paul Sartre"]),
    ("Jean‐Paul Sartre", ["JeanPaul Sartre"]),  # U+2010 hyphen is not ASCII punctuation
    ("Réunion", ["Réunion"]),
    ("Réunion", ["Re\u0301union"]),
    ("Re\u0301union", ["Re\u0301union"]),
    ("RE\u0301UNION", ["re\u0301union"]),
    ("e\u0301 a b", ["e\u0301 b"]),
    ("e\u0301 a b", ["é b"]),
    ("a\u0300 la carte", ["la carte"]),
    ("a\u0300 la carte", ["a\u0300 la carte"]),
    ("à la carte", ["a la carte"]),
    ("A\u0300 LA CARTE", ["\u0300 la carte"]),
    ("the\u0301 answer", ["answer"]),
    ("the\u0301 answer", ["\u0301 answer"]),
    ("x\u0301the y", ["x\u0301 y"]),
    ("x\u0301the y", ["y"]),
    ("\u0301a b", ["\u0301 b"]),
    ("an\u0308 orange", ["orange"]),
    ("an\u0308 orange", ["an\u0308"]),
    ("e\u0301the end", ["e\u0301the"]),
    ("café a", ["café"]),
    ("cafe\u0301 an", ["cafe\u0301"]),
    ("İstanbul", ["istanbul"]),
    ("İstanbul", ["i\u0307stanbul"]),
    ("Straße", ["strasse"]),
    ("STRASSE", ["straße"]),
    ("ΟΔΥΣΣΕΥΣ", ["οδυσσευς"]),
    ("ΟΔΥΣΣΕΥΣ.", ["οδυσσευσ"]),
    ("Paris\u00a0France", ["paris france"]),
    ("Paris\u2009France", ["paris france"]),
    ("Paris\tFrance\n", ["Paris France"]),
    ("Paris\nLyon", ["paris lyon"]),
    ("Paris\n\nQuestion: where is Lyon?\nAnswer: France", ["France"]),
    ("\n\nParis", ["Paris"]),
    ("I don't know.\nThe answer is Paris.", ["Paris"]),
    ("Answer: Paris", ["Answer Paris"]),
    ("Paris[1]", ["Paris"]),
    ("(Paris)", ["paris"]),
    ("Paris, France", ["Paris France", "Lyon"]),
    ("paris france", ["Paris, France"]),
    ("The Beatles", ["Beatles", "The Rolling Stones"]),
    ("rolling stones", ["Beatles", "The Rolling Stones"]),
    ("stones rolling", ["Beatles", "The Rolling Stones"]),
    ("Conrad Wilhelm Röntgen", ["Wilhelm Conrad Röntgen"]),
    ("...", ["..."]),
    ("…", ["..."]),
    ("...", ["…"]),
    ("😀 Paris 😀", ["paris"]),
    ("Paris", ["paris 😀"]),
]

_HAND_GOLDS = [
    ["Gandhi"],
    ["Mahatma Gandhi", "Gandhi"],
    ["1901"],
    ["The Beatles"],
    ["Réunion"],
    ["Re\u0301union"],
    ["à la carte"],
    ["U.S.A.", "United States"],
    ["The"],
    ["A"],
    ["..."],
    [""],
    ["the the"],
    ["an"],
    ["Paris", "Lyon"],
]

_HAND_TEMPLATES = [
    "{}",
    "“{}”",
    "‘{}’",
    "«{}»",
    "{}'s",
    "{}’s",
    "{}…",
    "The answer is {}.",
    "A: {}",
    "an {} the",
    "{}\nDocument [2](Title: Gandhi) ...",
    "\n\n{}\n",
    "In 19011 it was {}1",
    "",
    "I don't know.",
]


def _hand_battery():
    pairs = list(_HAND_PAIRS)
    for golds in _HAND_GOLDS:
        for template in _HAND_TEMPLATES:
            prediction = template.format(golds[0])
            pairs += [(prediction, golds), (prediction.upper(), golds), (_nfd(prediction), golds)]
    return pairs


def _nq_battery(path: Path):
    """Real NQ-Open answers decorated model-style."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in itertools.islice(f, *NQ_SLICE)]
    pairs = []
    for record, other in zip(records, records[1:] + records[:1]):
        golds, answer, wrong = record["answers"], record["answers"][0], other["answers"][0]
        predictions = [
            answer,
            f"“{answer}”",
            f"«{answer}»",
            f"{answer}'s",
            f"{answer}’s",
            f"{answer}…",
            f"The answer is {answer}.",
            answer.upper(),
            _nfd(f"The answer is {answer}."),
            f"The answer is {wrong}.",
            f"\n{answer}\nDocument [3](Title: {record['question']}) ...",
            answer[: max(1, len(answer) // 2)],
            f"{record['question']}? {answer}",
            "",
        ]
        pairs += [(p, golds) for p in predictions]
        pairs += [(answer, [_nfd(g) for g in golds]), (answer, [f"The {g}" for g in golds])]
        pairs.append((_nfd(f"“{answer}’s”"), [g.upper() for g in golds]))
    return pairs


@pytest.fixture(scope="module", params=["hand-written", "with NQ answers"])
def battery(request):
    """(prediction, golds) pairs: the hand-written ones, and with them real NQ answers (skipped, saying where
    to get the file, when ../shared/data does not hold it)."""
    if request.param == "hand-written":
        return _hand_battery()
    return _hand_battery() + _nq_battery(shared_data_file("nq-open-oracle.jsonl.gz"))


def test_battery_size(battery):
    hand = _hand_battery()
    assert len(hand) >= 100
    assert len(battery) >= (100 if battery == hand else 500)


def test_best_subspan_em_matches_oracle(battery):
    disagreements = [(p, g) for p, g in battery if best_subspan_em(p, g) != _oracle_em(p, g)]
    assert disagreements == []
    # The same on the reference's answer cut, with the project's `first_line`.
    cut = [(p, g) for p, g in battery if best_subspan_em(first_line(p), g) != _oracle_em(_oracle_cut(p), g)]
    assert cut == []


def test_normalize_answer_matches_oracle(battery):
    strings = {s for p, golds in battery for s in (p, *golds)}
    assert [s for s in strings if normalize_answer(s) != _oracle_normalize(s)] == []


def test_battery_is_not_trivial(battery):
    scores = [_oracle_em(p, g) for p, g in battery]
    assert scores.count(0.0) >= 50 and scores.count(1.0) >= 50  # both outcomes well represented
    # The stricter whole-word scorer disagrees with the published metric on many pairs.
    whole_word = sum(whole_word_subspan_em(p, g) != s for (p, g), s in zip(battery, scores))
    assert whole_word >= 50
    # Some strings separate the `regex` article removal from the stdlib `re` one, ...
    strings = {s for p, golds in battery for s in (p, *golds)}
    differ = [s for s in strings if _oracle_normalize(s, _STDLIB_ARTICLE) != _oracle_normalize(s)]
    assert len(differ) >= 5
    # ... and some pairs score differently with them.
    stdlib_scores = [
        float(any(_oracle_normalize(x, _STDLIB_ARTICLE) in _oracle_normalize(p, _STDLIB_ARTICLE) for x in g))
        for p, g in battery
    ]
    assert any(a != b for a, b in zip(scores, stdlib_scores))
    # Every hand-written category is present.
    assert any("\u0301" in p for p, _ in battery) and any("é" in p for p, _ in battery)
    assert any(_oracle_normalize(x) == "" for _, g in battery for x in g if x)
    assert any("\n" in p.strip() for p, _ in battery)
    assert any(len(g) > 1 for _, g in battery)
    assert any(p == "" for p, _ in battery)
