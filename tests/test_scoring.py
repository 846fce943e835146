import math

import numpy as np
import pytest

from analysis.scoring import (
    best_subspan_em,
    bootstrap_ci,
    exact_match,
    normalize_answer,
    paired_bootstrap_ci,
    substring_match,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  Quick, brown FOX!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("theater anthem", "theater anthem"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("  \t\n ", ""),
        ("Wilhelm Conrad Röntgen", "wilhelm conrad röntgen"),
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
    assert best_subspan_em("In 19011", ["1901"]) == 0.0  # whole tokens only
    assert best_subspan_em("In 1901.", ["1901"]) == 1.0
    assert best_subspan_em("the Beatles", ["Beatles", "The Rolling Stones"]) == 1.0  # articles dropped
    assert best_subspan_em("rolling stones", ["Beatles", "The Rolling Stones"]) == 1.0  # any gold answer
    assert best_subspan_em("", answers) == 0.0
    assert best_subspan_em("the end", ["The"]) == 0.0  # gold normalizes to nothing


def test_exact_match():
    assert exact_match(" Paris\nQuestion: what else", ["Paris"]) == 1.0  # cut at the first newline
    assert exact_match("Paris is the capital", ["Paris"]) == 0.0
    assert exact_match("the PARIS.", ["Paris"]) == 1.0
    assert exact_match("lyon", ["Paris", "Lyon"]) == 1.0
    assert exact_match("", ["Paris"]) == 0.0
    assert exact_match("", ["The"]) == 0.0
    assert exact_match("Paris</s>junk", ["Paris"], stop=("</s>",)) == 1.0


def test_bootstrap_ci_basic():
    assert bootstrap_ci(np.ones(50)) == (1.0, 1.0)
    assert bootstrap_ci(np.zeros(50)) == (0.0, 0.0)
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([])))
    x = np.random.default_rng(1).integers(0, 2, 400).astype(float)
    low, high = bootstrap_ci(x)
    assert low < x.mean() < high
    assert bootstrap_ci(x) == (low, high)  # seeded
    # The percentile interval of a Bernoulli mean is close to the normal approximation.
    half = 1.96 * math.sqrt(x.mean() * (1 - x.mean()) / x.size)
    assert abs((high - low) / 2 - half) < 0.2 * half
    narrow = bootstrap_ci(x, alpha=0.5)
    assert low <= narrow[0] <= narrow[1] <= high


def test_paired_bootstrap_ci():
    rng = np.random.default_rng(0)
    easy = rng.integers(0, 2, 300).astype(float)
    assert paired_bootstrap_ci(easy, easy) == (0.0, 0.0)
    # b is a with a tenth of the correct answers lost: a real, small, consistent drop.
    b = easy * (rng.random(300) > 0.1)
    low, high = paired_bootstrap_ci(easy, b)
    assert 0.0 < low <= (easy - b).mean() <= high
    # Unpaired intervals of the two means overlap although the paired difference is clearly > 0.
    assert bootstrap_ci(b)[1] > bootstrap_ci(easy)[0]
    with pytest.raises(ValueError):
        paired_bootstrap_ci(np.ones(3), np.ones(4))
