"""`data.in2.depth_law`: where training golds go (the held-out split stays uniform)."""
import random

import numpy as np
import pytest
from scipy import stats

from data_builders.build import build_datasets
from data_builders.config import DataConfig, DepthLaw, In2Config
from data_builders.in2 import offset_law, uniform_offset

SMALL = dict(context_len=512, num_train=1500, num_eval=200, num_train_docs=600, num_eval_docs=200, cache=False)
FREE = 1_000_000  # free tokens: offsets fine enough that a KS test against a continuous law holds


def draws(law: DepthLaw, n: int = 20_000, **in2) -> np.ndarray:
    offset, rng = offset_law(DataConfig(in2=In2Config(depth_law=law, **in2))), random.Random(0)
    return np.array([offset(FREE, rng) for _ in range(n)]) / FREE


def test_uniform_is_in2s_own_draw():
    a, b = random.Random(3), random.Random(3)
    assert [uniform_offset(FREE, a) for _ in range(100)] == [b.randint(0, FREE) for _ in range(100)]
    assert offset_law(DataConfig()) is uniform_offset


def test_ends_law_takes_only_the_ends_evenly():
    depth = draws(DepthLaw.ends, depth_ends=0.2)
    assert np.all((depth <= 0.2) | (depth >= 0.8))
    assert abs(np.mean(depth < 0.5) - 0.5) < 0.02  # both ends alike
    folded = np.minimum(depth, 1 - depth) / 0.2  # distance to the nearer end, as a share of the band
    assert stats.kstest(folded, "uniform").pvalue > 0.01


@pytest.mark.parametrize("a, b", [(0.5, 0.5), (2.0, 2.0), (1.0, 3.0)])
def test_beta_law_passes_a_ks_test(a, b):
    depth = draws(DepthLaw.beta, depth_beta=[a, b])
    assert stats.kstest(depth, stats.beta(a, b).cdf).pvalue > 0.01
    assert stats.kstest(depth, "uniform").pvalue < 1e-6  # and is not the uniform law


def test_training_golds_follow_the_law_held_out_ones_stay_uniform():
    bundle = build_datasets(DataConfig(in2=In2Config(depth_law=DepthLaw.ends, depth_ends=0.15), **SMALL))
    train, held_out = np.asarray(bundle.train["depth"]), np.asarray(bundle.eval["depth"])
    assert np.all((train <= 0.15) | (train >= 0.85))
    assert np.mean((held_out > 0.25) & (held_out < 0.75)) > 0.35  # the middle is asked at evaluation
    assert stats.kstest(held_out, "uniform").pvalue > 0.01
    assert bundle.stats["config"]["in2"]["depth_law"] == "ends"  # the dataset card records it


@pytest.mark.parametrize("in2, key", [
    (In2Config(depth_ends=0.0), "data.in2.depth_ends"),
    (In2Config(depth_ends=0.6), "data.in2.depth_ends"),
    (In2Config(depth_beta=[1.0]), "data.in2.depth_beta"),
    (In2Config(depth_beta=[1.0, -2.0]), "data.in2.depth_beta"),
])
def test_bad_depth_settings_fail_at_start_up(in2, key):
    with pytest.raises(ValueError, match=key):
        build_datasets(DataConfig(in2=in2, **SMALL))
