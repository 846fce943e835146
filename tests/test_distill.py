"""models.training.distill: Pos2Distill's position-weighted forward KL against an independent numpy version (fp64),
its gradient path, its mask, its weights' rule, the guard KL, and the config's checks."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.training.distill import DistillConfig, adaptive_weights, guard_kl, position_kd_loss


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_reference(s, t, mask, gold, temperature, preserve, strong):
    """Loops, as the formula reads: per-sample mean forward KL, the reference's weights, T^2 sum w KL; and the
    gradient w.r.t. the student logits with the weights held fixed: T w_i / n_i (q - p) at each response token."""
    B = s.shape[0]
    kl, n = np.zeros(B), mask.sum(1)
    for i in range(B):
        for j in np.flatnonzero(mask[i]):
            lp, lq = np_log_softmax(t[i, j] / temperature), np_log_softmax(s[i, j] / temperature)
            kl[i] += np.sum(np.exp(lp) * (lp - lq))
        kl[i] /= n[i]
    gold = np.full(B, strong + 1) if gold is None else np.asarray(gold)
    w = np.zeros(B)
    weak = sorted(set(gold.tolist()) - {strong})
    means = np.array([kl[gold == p].mean() for p in weak])
    coefs = np.exp(means) / np.exp(means).sum() * len(weak)
    for p, c in zip(weak, coefs):
        g = gold == p
        w[g] = c / g.sum() * kl[g] / kl[g].max()
    w[gold == strong] = preserve
    grad = np.zeros_like(s)
    for i in range(B):
        for j in np.flatnonzero(mask[i]):
            p, q = np.exp(np_log_softmax(t[i, j] / temperature)), np.exp(np_log_softmax(s[i, j] / temperature))
            grad[i, j] = temperature * w[i] / n[i] * (q - p)
    return temperature ** 2 * np.sum(w * kl), grad, w


def logits(shape, seed, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@pytest.mark.parametrize("gold, temperature, preserve", [
    (None, 2.0, 1.0),  # one weak position: w_i = KL_i / (2 max KL)
    ([4, 0], 1.0, 0.7),  # a weak sample (alone: weight 1) and a preserve sample
    ([3, 3], 0.5, 1.0),
])
def test_loss_matches_numpy_2x3x5(gold, temperature, preserve):
    s, t = logits((2, 3, 5), 0), logits((2, 3, 5), 1)  # (B, T, V)
    mask = torch.tensor([[True, True, False], [True, False, True]])  # (B, T)
    student = s.clone().requires_grad_()
    g = None if gold is None else torch.tensor(gold)
    loss, stats = position_kd_loss(student, t, mask, g, temperature=temperature, preserve=preserve)
    loss.backward()
    want, grad, w = np_reference(s.numpy(), t.numpy(), mask.numpy(), gold, temperature, preserve, 0)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - want) < 1e-10
    # the weights are constants of the step: the gradient is w_i dKL_i only
    np.testing.assert_allclose(student.grad.numpy(), grad, rtol=0, atol=1e-10)
    assert stats["weight_mean"] == pytest.approx(w.mean(), abs=1e-12)
    assert stats["tokens"] == 4.0


def test_loss_matches_numpy_several_positions():
    """4 samples, two weak positions (the softmax over their mean KLs) and a preserve sample."""
    s, t = logits((4, 3, 5), 2), logits((4, 3, 5), 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    gold = [2, 5, 2, 0]
    student = s.clone().requires_grad_()
    loss, _ = position_kd_loss(student, t, mask, torch.tensor(gold), temperature=1.3, preserve=0.5)
    loss.backward()
    want, grad, _ = np_reference(s.numpy(), t.numpy(), mask.numpy(), gold, 1.3, 0.5, 0)
    assert abs(loss.item() - want) < 1e-10
    np.testing.assert_allclose(student.grad.numpy(), grad, rtol=0, atol=1e-10)


def test_identical_logits_zero_loss_and_gradient():
    s = logits((3, 4, 7), 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    student = s.clone().requires_grad_()
    # a preserve sample too: its weight is 1, so its zero gradient is the KL's own, not a zero weight's
    loss, stats = position_kd_loss(student, s.clone(), mask, torch.tensor([0, 3, 3]))
    loss.backward()
    assert loss.item() == 0.0
    assert stats["kl_max"] == 0.0
    assert student.grad.abs().max().item() < 1e-12


def test_gradient_reaches_the_student_only():
    s, t = logits((2, 3, 5), 5), logits((2, 3, 5), 6)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    student, teacher = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss, _ = position_kd_loss(student, teacher, mask, torch.tensor([1, 0]))
    loss.backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad[mask].abs().sum() > 0
    policy, base = s.clone().requires_grad_(), t.clone().requires_grad_()
    guard_kl(policy, base, mask).backward()
    assert base.grad is None and policy.grad[mask].abs().sum() > 0


def test_masked_positions_do_not_count():
    s, t = logits((2, 4, 5), 7), logits((2, 4, 5), 8)
    mask = torch.tensor([[True, False, True, False], [False, True, True, True]])
    gold = torch.tensor([2, 2])
    student = s.clone().requires_grad_()
    loss, _ = position_kd_loss(student, t, mask, gold)
    loss.backward()
    s2, t2 = s.clone(), t.clone()
    s2[~mask] = logits((int((~mask).sum()), 5), 9, scale=50.0)
    t2[~mask] = logits((int((~mask).sum()), 5), 10, scale=50.0)
    s2[0, 1, 0] = float("inf")  # padding may hold anything
    student2 = s2.clone().requires_grad_()
    loss2, _ = position_kd_loss(student2, t2, mask, gold)
    loss2.backward()
    assert loss2.item() == loss.item()
    assert torch.equal(student2.grad[mask], student.grad[mask])
    assert student2.grad[~mask].abs().max().item() == 0.0
    assert guard_kl(s2, t2, mask).item() == guard_kl(s, t, mask).item()


def test_weights_follow_the_reference_rule():
    kl = torch.tensor([0.5, 1.0, 0.2, 0.4, 3.0, 0.3], dtype=torch.float64)  # (B,)
    gold = torch.tensor([3, 3, 7, 7, 0, 7])  # positions 3 and 7 weak, 0 strong
    w = adaptive_weights(kl, gold, preserve=0.8)
    # strong samples weigh `preserve`, whatever their KL
    assert w[4].item() == 0.8
    # within a position: in proportion to the KL, the largest at c_p / |G_p|
    assert w[1] / w[0] == pytest.approx(2.0)
    assert w[3] / w[5] == pytest.approx(0.4 / 0.3) and w[2] / w[3] == pytest.approx(0.5)
    # across positions: the one further from the teacher (mean KL 0.75 > 0.3) gets the larger softmax share
    c3, c7 = w[1] * 2, w[3] * 3
    assert c3 > c7
    assert (c3 + c7).item() == pytest.approx(2.0)  # K softmax: mean 1 over the K = 2 weak positions
    assert (c3 / c7).item() == pytest.approx(np.exp(0.75 - 0.3))
    # more disagreement at one position raises its share and lowers the other's
    kl2 = kl.clone()
    kl2[2] = 2.0
    w2 = adaptive_weights(kl2, gold, preserve=0.8)
    assert w2[2] * 3 > w2[1] * 2  # position 7 (mean KL 0.9 now, its max sample 2) overtakes 3 (0.75)
    # weights are detached constants
    assert not adaptive_weights(kl.clone().requires_grad_(), gold).requires_grad


def test_weights_in_the_loss_favour_the_sample_that_disagrees_more():
    t = logits((2, 3, 6), 11)
    s = t.clone()
    s[0] += 0.1 * logits((3, 6), 12)  # sample 0 close to the teacher
    s[1] += 2.0 * logits((3, 6), 13)  # sample 1 far
    mask = torch.ones(2, 3, dtype=torch.bool)
    student = s.clone().requires_grad_()
    loss, stats = position_kd_loss(student, t, mask, torch.tensor([5, 5]))
    loss.backward()
    # one position, two samples: w = (1/2) KL_i / max KL, so the far sample weighs 1/2 and the close one less
    assert stats["weight_max"] == pytest.approx(0.5)
    assert student.grad[1].norm() > 10 * student.grad[0].norm()


def test_empty_sample_and_bf16():
    s, t = logits((2, 3, 5), 14), logits((2, 3, 5), 15)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    loss, stats = position_kd_loss(s, t, mask, torch.tensor([2, 3]))
    only, _ = position_kd_loss(s[:1], t[:1], mask[:1], torch.tensor([2]))
    assert loss.item() == only.item() and stats["tokens"] == 2.0
    # bf16 in: log-softmax and loss in float32, equal to the float32 computation on the same (rounded) values
    sb, tb = s.bfloat16(), t.bfloat16()
    lb, _ = position_kd_loss(sb, tb, mask)
    l32, _ = position_kd_loss(sb.float(), tb.float(), mask)
    assert lb.dtype == torch.float32 and lb.item() == l32.item()


def test_guard_kl_by_hand():
    s, t = logits((2, 3, 5), 16), logits((2, 3, 5), 17)
    mask = torch.tensor([[True, False, False], [True, True, True]])  # 1 and 3 tokens: token mean != sample mean
    temperature = 1.5
    got = guard_kl(s, t, mask, temperature=temperature)
    toks = []
    for i, j in zip(*np.nonzero(mask.numpy())):
        lp = np_log_softmax(t.numpy()[i, j] / temperature)  # base
        lq = np_log_softmax(s.numpy()[i, j] / temperature)  # policy
        toks.append(np.sum(np.exp(lp) * (lp - lq)))
    assert abs(got.item() - temperature ** 2 * np.mean(toks)) < 1e-10
    reverse = guard_kl(t, s, mask, temperature=temperature)  # the other direction is another number
    assert abs(reverse.item() - got.item()) > 1e-3
    assert guard_kl(s, t, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("key, value", [
    ("temperature", -1.0), ("temperature", 0.0), ("temperature", float("nan")),
    ("preserve", -0.5), ("strong_position", -1), ("strong_position", 1.5),
])
def test_config_validate_names_the_key(key, value):
    DistillConfig().validate()  # the defaults are the reference's and valid
    assert dataclasses.asdict(DistillConfig()) == {"temperature": 1.0, "preserve": 1.0, "strong_position": 0}
    with pytest.raises(ValueError, match=f"distill.{key}="):
        DistillConfig(**{key: value}).validate()
    s = logits((1, 2, 3), 18)
    with pytest.raises(ValueError, match=f"distill.{key}="):
        position_kd_loss(s, s, torch.ones(1, 2, dtype=torch.bool), **{key: value})
