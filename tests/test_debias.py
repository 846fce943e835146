"""Position-targeted objectives (models/training/debias.py), depth sampling, the retrieval mix, and their wiring."""
from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from analysis.measure.prior import prior_density
from data_builders.collate import BatchStream, collate, collate_packed
from data_builders.config import DataConfig, DepthLaw, validate_data
from data_builders.depth_prior import depth_prior
from data_builders.in2 import offset_law
from data_builders.needle_mix import retrieval_samples
from data_builders.tokenizer import train_bpe_tokenizer
from models.training.debias import DebiasConfig
from models.training.loss import causal_lm_loss
from models.training.objectives import Context, build
from models.training.objectives.base import mean_one_clipped, sample_sums
from models.training.objectives.depth_weight import depth_weights
from models.training.objectives.group_dro import GroupDRO
from models.training.objectives.loss_weight import BinLossWeights
from tests.conftest import TINY
from train import DistInfo, as_train_config, run, validate


def objective_of(cfg: DebiasConfig, layers: int, all_sum) -> object:
    """The registered objective of `cfg` (models.training.objectives) on IN2 data of the default settings."""
    return build(Context(cfg, layers, all_sum, DataConfig()))


def _density(d, H, alpha):
    """The prior's smooth large-L density written out: sum_r C(H,r)(1-a)^(H-r) a^r ln(1/x)^(r-1)/(r-1)!."""
    from math import comb, factorial, log

    x = max(d, 1 / 256)
    return sum(comb(H, r) * (1 - alpha) ** (H - r) * alpha**r * log(1 / x) ** (r - 1) / factorial(r - 1)
               for r in range(1, H + 1))


def test_depth_prior_is_the_closed_form_density():
    for d in (0.0, 0.001, 0.1, 0.37, 0.5, 0.99, 1.0):
        assert depth_prior(d, 4, 0.4) == pytest.approx(_density(d, 4, 0.4), rel=1e-12)
    x = np.linspace(1 / 256, 1, 97)
    for H, alpha in ((1, 0.3), (4, 0.5), (24, 0.2)):  # the prior module's density, for a constant alpha
        np.testing.assert_allclose(depth_prior(x, H, alpha), prior_density(x, H, alpha), rtol=1e-12)


def test_depth_weights_average_one_and_follow_the_formula():
    depths = torch.tensor([0.0, 0.05, 0.2, 0.4, 0.5, 0.6, 0.8, 0.95, 1.0], dtype=torch.float64)
    for beta, cap in ((1.0, 100.0), (2.0, 1.5), (0.5, 3.0)):
        w = depth_weights(depths, 4, 0.5, beta, cap)
        raw = torch.tensor([_density(float(d), 4, 0.5) ** -beta for d in depths], dtype=torch.float64)
        assert w.mean().item() == pytest.approx(1.0, abs=1e-12)
        assert w.max().item() <= cap + 1e-12
        free = w < cap - 1e-12
        ratio = w[free] / raw[free]  # the unclipped weights are proportional to p(d)^(-beta)
        assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-12)
        assert torch.all(raw[~free] * ratio[0] >= cap - 1e-12)  # the clipped ones would have been larger
    uncapped = depth_weights(depths, 4, 0.5, 1.0, 100.0)
    raw = torch.tensor([1 / _density(float(d), 4, 0.5) for d in depths], dtype=torch.float64)
    assert torch.allclose(uncapped, raw / raw.mean(), rtol=1e-12)
    assert torch.equal(depth_weights(depths, 4, 0.5, 0.0, 5.0), torch.ones_like(depths))


def test_mean_one_clipping_water_fills():
    w = mean_one_clipped(torch.tensor([1.0, 1.0, 1.0, 100.0]), 2.0)
    assert torch.allclose(w, torch.tensor([2 / 3, 2 / 3, 2 / 3, 2.0], dtype=torch.float64))


def _tiny_model():
    config = AutoConfig.for_model("qwen2", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def _batch(depths=(0.05, 0.15, 0.55, 0.58, 0.91, 0.12)):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, d in enumerate(depths):
        n = 10 + 2 * i
        ids = torch.randint(1, 50, (n,), generator=g).tolist()
        answer = 2 + i % 3  # answers of different lengths
        rows.append({"input_ids": ids, "labels": [-100] * (n - answer) + ids[n - answer:], "depth": d})
    return rows


def _per_token(model, batch):
    """Every labelled token's NLL from the full logits (the reference for the sparse path)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    return nll.view(targets.shape), targets != -100


def _reference_group_dro(per_sample_nll, bins, q, eta, K=10):
    """Sagawa's `LossComputer.compute_robust_loss` written out (github.com/kohpangwei/group_DRO, loss.py), per
    answer token: group_loss = sum / (count + (count == 0)), adv_probs *= exp(eta group_loss) renormalised,
    robust_loss = group_loss @ adv_probs; over all K bins, an absent one with loss 0."""
    total = [torch.zeros((), dtype=torch.float64) for _ in range(K)]
    count = torch.zeros(K, dtype=torch.float64)
    for tokens, k in zip(per_sample_nll, bins):
        total[k] = total[k] + tokens.sum()
        count[k] += tokens.numel()
    group_loss = torch.stack(total) / (count + (count == 0))
    adv_probs = q * torch.exp(eta * group_loss.detach())
    adv_probs = adv_probs / adv_probs.sum()
    return group_loss @ adv_probs, adv_probs


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_group_dro_steps_equal_the_reference_with_absent_bins():
    model, eta = _tiny_model(), 0.3
    objective = objective_of(DebiasConfig(objective="group_dro", bins=10, eta=eta), 2, lambda t: t.clone())
    q = objective.dro.q.clone()
    # two steps (the second from a non-uniform q); bins 2-4 and 6-8, then 1, 3, 6 and 9, are absent
    for depths in ((0.05, 0.15, 0.55, 0.58, 0.91, 0.12), (0.0, 0.25, 0.5, 0.55, 0.75, 0.8, 1.0)):
        batch = collate(_batch(depths), 0, depths=True)
        nll, labelled = _per_token(model, batch)
        bins = [min(int(d * 10), 9) for d in batch["depths"].tolist()]
        expected, q = _reference_group_dro([nll[s][labelled[s]] for s in range(len(bins))], bins, q, eta)
        assert 0 < len(set(bins)) < 10
        loss = objective(model, batch)
        assert torch.allclose(objective.dro.q, q, rtol=1e-12, atol=0)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
        assert torch.allclose(_grads(model, loss), _grads(model, expected), rtol=1e-10, atol=1e-14)
    assert q.max() > q.min() and set(objective.metrics()) == {f"debias/q@{k / 10}" for k in range(10)}


def test_group_dro_bin_losses_are_means_over_every_data_parallel_rank():
    """Two ranks (an `all_sum` that adds the other rank's tensor): the same q on both, the mean of their losses
    (what train/loss logs) and of their gradients (what DeepSpeed applies) are the reference's on the union."""
    model, eta = _tiny_model(), 0.5
    rows = _batch((0.05, 0.15, 0.55, 0.58, 0.91, 0.12))
    shards = [collate(rows[:2], 0, depths=True), collate(rows[2:], 0, depths=True)]  # bin 1 on both ranks
    cfg = DebiasConfig(objective="group_dro", bins=10, eta=eta)
    sent = []  # each rank's contribution to the collective
    for batch in shards:
        objective_of(cfg, 2, lambda t: sent.append(t.clone()) or t.clone())(model, batch)
    ranks = [objective_of(cfg, 2, lambda t, r=r: t + sent[1 - r]) for r in range(2)]
    losses = [objective(model, batch) for objective, batch in zip(ranks, shards)]
    per_sample, bins = [], []
    for batch in shards:
        nll, labelled = _per_token(model, batch)
        per_sample += [nll[s][labelled[s]] for s in range(len(batch["depths"]))]
        bins += [min(int(d * 10), 9) for d in batch["depths"].tolist()]
    expected, q = _reference_group_dro(per_sample, bins, torch.full((10,), 0.1, dtype=torch.float64), eta)
    assert torch.equal(ranks[0].dro.q, ranks[1].dro.q) and torch.allclose(ranks[0].dro.q, q, rtol=1e-12, atol=0)
    assert ((losses[0] + losses[1]) / 2).item() == pytest.approx(expected.item(), rel=1e-12)
    mean_grad = (_grads(model, losses[0]) + _grads(model, losses[1])) / 2
    assert torch.allclose(mean_grad, _grads(model, expected), rtol=1e-10, atol=1e-14)


def test_group_dro_weighs_a_bin_q_times_its_presence_rate():
    """Micro-batches of B samples drawn with replacement from the bins with probabilities r_k, q fixed (eta = 0).
    The loss is sum_k q_k sum_{s in k} nll_s / n_k (n_k: bin k's tokens in the micro-batch), so the weight
    d loss / d nll of bin k's tokens totals W_k = q_k when the bin is present and 0 otherwise:
    E[W_k] = q_k P(present) = q_k (1 - (1 - r_k)^B). W_k / q_k is Bernoulli, so over N draws its mean is within
    5 sqrt(p(1-p)/N) of p except with probability ~6e-7 per bin. The renormalised loss (until 2026-12-01),
    W_k = q_k [present] / sum_present q, misses this by many of those widths."""
    K, B, N = 10, 8, 20000
    r = np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01])
    q = torch.tensor([0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.13, 0.14, 0.15, 0.16], dtype=torch.float64)
    dro = GroupDRO(K, 0.0)
    dro.q = q.clone()
    rng = np.random.default_rng(0)
    weight, renormalised = np.zeros((N, K)), np.zeros((N, K))
    for i in range(N):
        bins = rng.choice(K, size=B, p=r)
        counts = torch.from_numpy(rng.integers(1, 5, size=B).astype(np.float64))  # answer tokens per sample
        sums = counts.clone().requires_grad_()  # the value is irrelevant: the weights are the gradient
        dro.loss(sums, counts, torch.from_numpy((bins + 0.5) / K), lambda t: t.clone()).backward()
        weight[i] = np.bincount(bins, weights=(sums.grad * counts).numpy(), minlength=K)
        present = np.bincount(bins, minlength=K) > 0
        renormalised[i] = q.numpy() * present / q.numpy()[present].sum()
    assert torch.equal(dro.q, q)  # eta = 0 keeps q
    p = 1 - (1 - r) ** B
    width = 5 * np.sqrt(p * (1 - p) / N)
    np.testing.assert_array_less(np.abs(weight.mean(0) / q.numpy() - p), width)
    assert (np.abs(renormalised.mean(0) / q.numpy() - p) > 10 * width).any()  # the test tells them apart


def test_group_dro_with_one_sample_per_micro_batch_is_not_erm():
    """One sample per micro-batch: loss = q_k x its mean NLL, so each step's gradient is the plain one times the
    q of the sample's bin (the renormalised loss gave the plain loss, q cancelling)."""
    model = _tiny_model()
    objective = objective_of(DebiasConfig(objective="group_dro", bins=10, eta=0.0), 2, lambda t: t.clone())
    objective.dro.q = torch.tensor([0.3, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.54], dtype=torch.float64)
    ratios = []
    for row, q in zip(_batch((0.05, 0.95)), (0.3, 0.54)):  # bin 0, then bin 9
        batch = collate([row], 0, depths=True)
        plain = _grads(model, causal_lm_loss(model, batch))
        dro = _grads(model, objective(model, batch))
        assert objective(model, batch).item() == pytest.approx(q * causal_lm_loss(model, batch).item(), rel=1e-12)
        assert torch.allclose(dro, _grads(model, q * causal_lm_loss(model, batch)), rtol=1e-10, atol=1e-14)
        ratios.append((dro @ plain / (plain @ plain)).item())
    # (the model's own backward rounds a gradient times 0.3 to ~1e-8 of 0.3 times the gradient)
    assert ratios == pytest.approx([0.3, 0.54], rel=1e-6)


def test_one_bin_and_beta_zero_are_the_plain_loss():
    model, rows = _tiny_model(), _batch()
    batch = collate(rows, 0, depths=True)
    plain = causal_lm_loss(model, batch)
    one_bin = objective_of(DebiasConfig(objective="group_dro", bins=1), 2, lambda t: t.clone())
    flat = objective_of(DebiasConfig(objective="depth_weight", prior_power=0.0, prior_alpha=0.5), 2, lambda t: t)
    assert one_bin(model, batch).item() == pytest.approx(plain.item(), rel=1e-12)
    assert flat(model, batch).item() == pytest.approx(plain.item(), rel=1e-12)


def test_depth_weight_loss_weights_each_samples_tokens():
    model, rows = _tiny_model(), _batch()
    batch = collate(rows, 0, depths=True)
    objective = objective_of(DebiasConfig(objective="depth_weight", prior_power=1.0, prior_alpha=0.4), 2, lambda t: t)
    nll, labelled = _per_token(model, batch)
    w = depth_weights(batch["depths"], 2, 0.4, 1.0, 5.0)
    expected = sum(w[s] * nll[s][labelled[s]].sum() for s in range(len(rows))) / labelled.sum()
    assert objective(model, batch).item() == pytest.approx(expected.item(), rel=1e-12)


def test_depth_weight_follows_the_latest_fitted_alpha():
    objective = objective_of(DebiasConfig(objective="depth_weight"), 4, lambda t: t)
    assert objective.alpha is None
    objective.observe({"prior/vanilla/alpha": 0.37, "prior/chunked/alpha": 0.5})
    assert objective.alpha == 0.37
    objective.observe({"prior/chunked/alpha": 0.45})
    assert objective.alpha == 0.45
    fixed = objective_of(DebiasConfig(objective="depth_weight", prior_alpha=0.2), 4, lambda t: t)
    fixed.observe({"prior/vanilla/alpha": 0.37})
    assert fixed.alpha == 0.2


def test_packed_and_padded_batches_give_the_same_sample_sums():
    model, rows = _tiny_model(), _batch()
    padded = collate(rows, 0, depths=True)
    packed = collate_packed([rows[:3], rows[3:]], 64, 0, depths=True)
    assert torch.equal(padded["depths"], packed["depths"])
    from models.training.loss import labelled_nll

    sums = []
    for batch in (padded, packed):
        nll, _ = labelled_nll(model, batch, per_token=True)
        sums.append(sample_sums(nll, batch["labels"][:, 1:], batch["sample_ids"], len(rows)))
    assert torch.allclose(sums[0][0], sums[1][0], rtol=1e-10)
    assert torch.equal(sums[0][1], sums[1][1])
    assert sums[0][1].tolist() == [2 + i % 3 for i in range(len(rows))]


def test_group_dro_state_round_trips_and_checks_bins():
    dro = GroupDRO(4, 0.1)
    dro.update(torch.tensor([1.0, 0.0, 2.0, 0.3]))
    again = GroupDRO(4, 0.1)
    again.load_state_dict(json.loads(json.dumps(dro.state_dict())))
    assert torch.equal(again.q, dro.q)
    with pytest.raises(ValueError, match="debias.bins"):
        GroupDRO(5, 0.1).load_state_dict(dro.state_dict())


def _bin_loss_weights(cap=100.0):
    """Four bins, averages m = (2, -, 1, 4) with bin 1 not seen yet, gamma = 2, rate 0.25."""
    weights = BinLossWeights(4, 0.25, 2.0, cap)
    weights.average = torch.tensor([2.0, 0.0, 1.0, 4.0], dtype=torch.float64)
    weights.seen = torch.tensor([True, False, True, True])
    return weights


# bins 0, 1, 2, 3, 3; per-sample losses 1.5, 2, 0.5, 2.5 and none (no answer token left)
LW_DEPTHS = torch.tensor([0.1, 0.3, 0.6, 0.9, 0.95], dtype=torch.float64)
LW_SUMS = torch.tensor([3.0, 6.0, 0.5, 10.0, 0.0], dtype=torch.float64)
LW_COUNTS = torch.tensor([2.0, 3.0, 1.0, 4.0, 0.0], dtype=torch.float64)


def test_loss_weight_weights_and_averages_by_hand():
    weights = _bin_loss_weights()
    w = weights.step(LW_SUMS, LW_COUNTS, LW_DEPTHS, lambda t: t.clone())
    # mean of the seen averages 7/3: ratios 6/7, 1 (bin 1 unseen: the mean), 3/7, 12/7, 12/7, squared
    raw = torch.tensor([36 / 49, 1.0, 9 / 49, 144 / 49, 144 / 49], dtype=torch.float64)
    assert torch.allclose(w, raw / raw.mean(), rtol=1e-14, atol=0)
    assert w.mean().item() == pytest.approx(1.0, abs=1e-15) and w[3] > w[0] > w[2]  # more loss, more weight
    # updated after weighting: 0.75 m + 0.25 l for seen bins, the first loss for bin 1; sample 4 has no loss
    assert weights.average.tolist() == [1.875, 2.0, 0.875, 3.625] and weights.seen.all()
    weights.step(LW_SUMS * math.nan, LW_COUNTS, LW_DEPTHS, lambda t: t.clone())  # a step train.py skips
    assert weights.average.tolist() == [1.875, 2.0, 0.875, 3.625]
    # clipped at 1.5: both bin-3 samples, the other three scaled to make up the mean (raw 36, 49, 9 of 94, x 2)
    clipped = _bin_loss_weights(cap=1.5).step(LW_SUMS, LW_COUNTS, LW_DEPTHS, lambda t: t.clone())
    expected = torch.tensor([72 / 94, 98 / 94, 18 / 94, 1.5, 1.5], dtype=torch.float64)
    assert torch.allclose(clipped, expected, rtol=1e-14, atol=0) and clipped.mean().item() == pytest.approx(1.0)


def test_loss_weight_averages_are_over_every_data_parallel_rank():
    """Two ranks (an `all_sum` that adds the other rank's tensor) end with the averages of the union's step."""
    union = _bin_loss_weights()
    union.step(LW_SUMS, LW_COUNTS, LW_DEPTHS, lambda t: t.clone())
    shards = [slice(0, 2), slice(2, 5)]
    sent = []  # each rank's contribution to the collective
    for part in shards:
        _bin_loss_weights().step(LW_SUMS[part], LW_COUNTS[part], LW_DEPTHS[part], lambda t: sent.append(t) or t)
    ranks = [_bin_loss_weights() for _ in shards]
    for r, (weights, part) in enumerate(zip(ranks, shards)):
        weights.step(LW_SUMS[part], LW_COUNTS[part], LW_DEPTHS[part], lambda t, r=r: t + sent[1 - r])
        assert torch.equal(weights.average, union.average) and torch.equal(weights.seen, union.seen)


def test_loss_weight_starts_as_the_plain_loss_then_weights_by_the_measured_bin_losses():
    model = _tiny_model()
    objective = objective_of(DebiasConfig(objective="loss_weight", bins=10, loss_ema=0.5), 2, lambda t: t.clone())
    first, second = collate(_batch((0.05, 0.15, 0.55, 0.58, 0.91, 0.12)), 0, depths=True), collate(
        _batch((0.06, 0.92, 0.3, 0.57)), 0, depths=True)
    assert objective(model, first).item() == pytest.approx(causal_lm_loss(model, first).item(), rel=1e-12)
    nll, labelled = _per_token(model, first)
    per_sample = [nll[s][labelled[s]].mean() for s in range(6)]
    m = {0: per_sample[0], 1: (per_sample[1] + per_sample[5]) / 2, 5: (per_sample[2] + per_sample[3]) / 2,
         9: per_sample[4]}  # one step: each seen bin's average is its first mean
    assert objective.metrics() == pytest.approx(
        {f"debias/bin_loss@{k / 10}": v.item() for k, v in m.items()} | {"debias/weight_max": 1.0,
                                                                         "debias/weight_min": 1.0}, rel=1e-12)
    mean = sum(m.values()) / 4
    raw = torch.stack([m[0] / mean, m[9] / mean, torch.ones((), dtype=torch.float64), m[5] / mean])  # bin 3 unseen
    w = raw / raw.mean()
    nll, labelled = _per_token(model, second)
    expected = sum(w[s] * nll[s][labelled[s]].sum() for s in range(4)) / labelled.sum()
    assert objective(model, second).item() == pytest.approx(expected.item(), rel=1e-12)


def test_loss_weight_state_round_trips_and_resumes_to_the_same_weights():
    model = _tiny_model()
    cfg = DebiasConfig(objective="loss_weight", bins=4, loss_ema=0.3, loss_power=1.5, max_weight=2.0)
    batches = [collate(_batch(tuple(np.random.default_rng(i).uniform(size=5))), 0, depths=True) for i in range(4)]
    whole = objective_of(cfg, 2, lambda t: t.clone())
    expected = [(whole(model, b).item(), whole.metrics()) for b in batches]
    first = objective_of(cfg, 2, lambda t: t.clone())
    for batch in batches[:2]:
        first(model, batch)
    resumed = objective_of(cfg, 2, lambda t: t.clone())
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [(resumed(model, b).item(), resumed.metrics()) for b in batches[2:]] == expected[2:]
    assert resumed.state_dict() == whole.state_dict() and expected[3][1]["debias/weight_max"] > 1
    with pytest.raises(ValueError, match="debias.bins"):
        objective_of(replace(cfg, bins=5), 2, lambda t: t).load_state_dict(whole.state_dict())
    with pytest.raises(ValueError, match="no loss_weight state"):
        resumed.load_state_dict({"alpha": None})


def _offsets(law: DepthLaw, n: int, free: int = 20000, **in2) -> np.ndarray:
    cfg = DataConfig()
    cfg.in2.depth_law = law
    for key, value in in2.items():
        setattr(cfg.in2, key, value)
    draw, rng = offset_law(cfg), random.Random(0)
    return np.array([draw(free, rng) for _ in range(n)]) / free


def test_valley_depths_pass_a_ks_test_against_their_law():
    depths = _offsets(DepthLaw.valley, 4000, prior_layers=4, prior_alpha=0.5, prior_power=1.0)
    grid = np.linspace(0, 1, 20001)
    density = depth_prior(grid, 4, 0.5) ** -1.0
    cdf = integrate.cumulative_trapezoid(density, grid, initial=0)
    cdf /= cdf[-1]
    law = lambda x: np.interp(x, grid, cdf)  # noqa: E731
    assert stats.kstest(depths, law).pvalue > 0.01
    assert stats.kstest(depths, "uniform").pvalue < 1e-6  # the test can tell the laws apart
    assert stats.kstest(_offsets(DepthLaw.beta, 4000, depth_beta=[2.0, 2.0]), stats.beta(2, 2).cdf).pvalue > 0.01
    assert stats.kstest(_offsets(DepthLaw.uniform, 4000), "uniform").pvalue > 0.01


def test_a_saved_run_config_with_the_old_valley_keys_reads_under_the_prior_names():
    from omegaconf import OmegaConf

    from data_builders.config import as_data_config

    old = OmegaConf.create({"in2": {"depth_law": "valley", "valley_layers": 4, "valley_alpha": 0.3,
                                    "valley_power": 2.0}})
    c = as_data_config(old).in2
    assert (c.depth_law, c.prior_layers, c.prior_alpha, c.prior_power) == (DepthLaw.valley, 4, 0.3, 2.0)


def test_valley_law_needs_the_layer_count():
    cfg = DataConfig()
    cfg.in2.depth_law = DepthLaw.valley
    with pytest.raises(ValueError, match="data.in2.prior_layers"):
        validate_data(cfg)


def test_ramped_depth_law_starts_uniform_and_is_read_in_order(compose_cfg, tmp_path):
    from data_builders.build import build_datasets

    cfg = as_train_config(compose_cfg(*TINY, "data.num_train=600", "data.in2.depth_law=ends",
                                      "data.in2.depth_ends=0.1", "data.in2.depth_ramp=0.5"))
    bundle = build_datasets(cfg.data, None)
    depths = np.array(bundle.train["depth"])
    middle = (depths > 0.1) & (depths < 0.9)
    assert middle[:100].mean() > 0.4  # mostly uniform at first
    assert middle[300:].mean() < 0.05  # the ends law after the ramp (a few budgets leave no free token)
    assert bundle.stats["depth_histogram"]["train"][4] == int(((depths >= 0.4) & (depths < 0.5)).sum())


def test_retrieval_mix_never_uses_an_evaluation_item():
    from analysis.evaluation.config import EvalConfig
    from analysis.evaluation.probes import build_probes
    from data_builders.needle_mix import protected_strings
    from data_builders.probes import synthetic_filler

    tok = train_bpe_tokenizer(synthetic_filler(300) + ["0123456789 secret code {}"], 400)
    evaluation = build_probes(EvalConfig(probes=["needle", "kv"], probe_examples=5), tok)
    protected = protected_strings(i for items in evaluation.values() for i in items)
    rows = retrieval_samples(tok, 60, 512, ["needle", "kv"], seed=1, protected=protected)
    texts = [tok.decode(r["input_ids"]) for r in rows]
    assert not [s for s in protected for t in texts if s in t]
    # Answers the generator itself would give are dropped when protected: the filter is not vacuous.
    first = retrieval_samples(tok, 20, 512, ["needle", "kv"], seed=7)
    taken = {tok.decode([t for t in r["labels"] if t >= 0][:-1]).strip() for r in first}
    again = retrieval_samples(tok, 20, 512, ["needle", "kv"], seed=7, protected=taken)
    assert not {tok.decode([t for t in r["labels"] if t >= 0][:-1]).strip() for r in again} & taken
    assert all(len(r["input_ids"]) <= 512 and 0 <= r["depth"] <= 1 for r in rows)


def test_mdqa_mix_rows_are_reference_prompts_with_one_answering_document():
    from data_builders.probes import load_template, synthetic_filler

    tok = train_bpe_tokenizer(synthetic_filler(300), 400)
    rows = retrieval_samples(tok, 12, 512, ["mdqa"], seed=3)
    instruction = load_template("mdqa").split("\n")[0]
    for row in rows:
        answer = tok.decode([t for t in row["labels"] if t >= 0][:-1]).strip()
        prompt = tok.decode(row["input_ids"][: row["labels"].index(next(t for t in row["labels"] if t >= 0))])
        documents = [line for line in prompt.split("\n") if line.startswith("Document [")]
        question = prompt.split("Question: ")[1].split("\n")[0]
        titles = [d.split("(Title: ")[1].split(")")[0] for d in documents]
        assert prompt.startswith(instruction) and len(documents) >= 2 and len(row["input_ids"]) <= 512
        gold = [k for k, title in enumerate(titles) if title in question]  # the person the question names
        assert len(gold) == 1 and answer in documents[gold[0]]  # the answer is in the gold document
        assert not [d for k, d in enumerate(documents) if k != gold[0] and answer in d]  # and in no other one
        assert row["depth"] == pytest.approx(gold[0] / (len(documents) - 1))


def test_mixed_rows_replace_the_tail_of_each_batch_and_resume_exactly():
    data = [{"input_ids": [i + 1] * 3, "labels": [-100, i + 1, i + 1], "depth": i / 40} for i in range(40)]
    mix = [{"input_ids": [99, 98, 97], "labels": [-100, 98, 97], "depth": k / 10} for k in range(10)]
    stream = BatchStream(data, 4, 0, seed=0, depths=True, mix=mix, mix_rows=1)
    batches = [next(it) for it in [iter(stream)] for _ in range(5)]
    assert all(b["input_ids"][-1, 0] == 99 and (b["input_ids"][:-1, 0] != 99).all() for b in batches)
    assert [b["depths"][-1].item() for b in batches] == [0.0, 0.1, 0.2, 0.3, 0.4]
    resumed = BatchStream(data, 4, 0, seed=0, depths=True, mix=mix, mix_rows=1)
    resumed.position = 3
    again = next(iter(resumed))
    assert torch.equal(again["input_ids"], batches[3]["input_ids"]) and torch.equal(again["depths"],
                                                                                    batches[3]["depths"])


def test_debias_settings_that_cannot_run_fail_at_start_up(compose_cfg):
    cases = [
        (["debias=depth_weight"], "debias.prior_alpha"),
        (["debias=needle_mix", "data.packing=true"], "data.packing=false"),
        (["debias=needle_mix", "debias.needle_mix.share=0.01"], "mixed rows"),
        (["debias=depth_weight", "debias.prior_alpha=0.5", "debias.max_weight=0.5"], "debias.max_weight"),
        (["debias=loss_weight", "debias.max_weight=0.5"], "debias.max_weight"),
        (["debias=loss_weight", "debias.loss_ema=0"], "debias.loss_ema"),
        (["debias=loss_weight", "debias.loss_power=-1"], "debias.loss_power"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            validate(as_train_config(compose_cfg(*TINY, *overrides)), DistInfo())


def test_debias_presets_combine(compose_cfg):
    cfg = as_train_config(compose_cfg(*TINY, "debias=[depth_sampling,group_dro]"))
    assert cfg.debias.objective == "group_dro"
    assert cfg.data.in2.depth_law == DepthLaw.valley and cfg.data.in2.prior_layers == 2  # the model's


def test_every_arm_of_the_debias_study_composes_validates_and_has_its_own_name(compose_cfg):
    """Each job of `python train.py -m +exp=debias_study`: the experiment plus one choice of its swept `debias`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from analysis.study import arm_name
    from models.build import Attention, DiffMode
    from tests.conftest import CONF_DIR

    swept = OmegaConf.load(CONF_DIR / "exp" / "debias_study.yaml").hydra.sweeper.params.debias
    sweep = OverridesParser.create().parse_overrides([f"debias={swept}"])[0]
    arms = {}
    for choice in sweep.sweep_string_iterator():
        override = f"debias={choice}"
        cfg = as_train_config(compose_cfg("+exp=debias_study", "model.pretrained=/some/checkpoint", override))
        validate(cfg, DistInfo())
        arms[arm_name([override])] = cfg
    assert list(arms) == ["none", "group_dro", "loss_weight", "middle_ramp", "depth_sampling+group_dro",
                          "diff_retrofit"]
    assert {name: cfg.debias.objective for name, cfg in arms.items()} == {
        "none": "mean", "group_dro": "group_dro", "loss_weight": "loss_weight",
        "middle_ramp": "mean", "depth_sampling+group_dro": "group_dro", "diff_retrofit": "mean"}
    laws = {name: cfg.data.in2.depth_law for name, cfg in arms.items()}
    assert laws.pop("middle_ramp") == DepthLaw.beta and laws.pop("depth_sampling+group_dro") == DepthLaw.valley
    assert set(laws.values()) == {DepthLaw.uniform}
    ramp = arms["middle_ramp"].data.in2
    assert ramp.depth_beta == [2.0, 2.0] and ramp.depth_ramp > 0
    diff = arms["diff_retrofit"].model
    assert (diff.attention, diff.diff.mode) == (Attention.diff_v1, DiffMode.retrofit)
    assert {cfg.model.attention for name, cfg in arms.items() if name != "diff_retrofit"} == {Attention.standard}


@pytest.mark.parametrize("objective, settings, prefix", [
    ("group_dro", ["debias=[group_dro,needle_mix]", "debias.needle_mix.kinds=[needle]", "debias.needle_mix.pool=16",
                   "debias.eta=0.5"], "debias/q@"),
    ("loss_weight", ["debias=loss_weight", "debias.bins=2", "debias.loss_ema=0.5", "debias.loss_power=2"],
     "debias/bin_loss@"),
])
def test_debias_state_resume_is_bitwise_exact(compose_cfg, tmp_path, objective, settings, prefix):
    arm = [*settings, "trainer.max_steps=4"]
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_cfg(*TINY, *arm), full)
    run(compose_cfg(*TINY, *arm, "trainer.save_every=2"), part)
    shutil.rmtree(part / "checkpoints" / "step-4")
    lines = [line for line in (part / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run(compose_cfg(*TINY, *arm, "trainer.resume_from=latest"), part)

    def logged(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: {k: v for k, v in r.items() if k == "train/loss" or k.startswith(prefix)}
                for r in rows if "train/loss" in r}

    states = [json.loads((d / "checkpoints" / "step-4" / "trainer_state.json").read_text())["debias"][objective]
              for d in (full, part)]
    per_bin = states[0]["q" if objective == "group_dro" else "average"]
    assert states[0] == states[1] and max(per_bin) > min(per_bin)  # the state moved, and resumed to the same bits
    expected, resumed = logged(full), logged(part)
    assert len(expected[4]) == 1 + len(per_bin)  # the loss and every bin (loss_weight's two bins both seen)
    assert [resumed[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]
