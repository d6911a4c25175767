"""Pure pieces of the distillation stages: the loss, the learning-rate schedule, the NaN policy."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_tc.distill.losses import IGNORE, LossWeights, distill_loss, next_token_labels
from megatron_tc.distill.numerics import NonFiniteError, NonFiniteGuard, all_finite
from megatron_tc.distill.schedule import LRSchedule, apply_lr, remember_peak_lr


def test_labels_stop_at_document_ends_and_the_last_position():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    assert next_token_labels(ids, doc).tolist() == [[6, IGNORE, 8, 9, IGNORE]]
    assert next_token_labels(ids, None).tolist() == [[6, 7, 8, 9, IGNORE]]


def test_loss_equals_a_direct_computation_of_masked_kl_ce_and_hidden_mse():
    g = torch.Generator().manual_seed(0)
    B, T, V, d = 2, 6, 11, 4
    s, t = torch.randn(B, T, V, generator=g, dtype=torch.float64), torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    hs, ht = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    temp, w_ce, w_h = 2.0, 0.3, 0.5
    loss, parts = distill_loss(s, t, ids, V, LossWeights(temp, w_ce, w_h), doc_ids=doc,
                               student_hidden=hs, teacher_hidden=ht)
    labels = next_token_labels(ids, doc)
    keep = labels != IGNORE
    kl_tok = F.kl_div(F.log_softmax(s / temp, -1), F.log_softmax(t / temp, -1), log_target=True,
                      reduction="none").sum(-1)
    kl = kl_tok[keep].mean()
    ce = F.cross_entropy(s[keep], labels[keep])
    hidden = (hs - ht).pow(2).mean()
    expected = temp**2 * kl + w_ce * ce + w_h * hidden
    assert torch.allclose(loss, expected, rtol=1e-10), (loss, expected)
    assert torch.allclose(parts["kl"], kl) and torch.allclose(parts["ce"], ce)


def test_gradient_flows_to_the_student_only():
    s = torch.randn(1, 4, 7, requires_grad=True)
    t = torch.randn(1, 4, 7, requires_grad=True)
    loss, _ = distill_loss(s, t, torch.randint(0, 7, (1, 4)), 7, LossWeights())
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_linearly_then_decays_to_the_floor(kind):
    sched = LRSchedule(total_steps=10, warmup_steps=2, kind=kind, min_ratio=0.1)
    factors = [sched.factor(s) for s in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0
    if kind == "constant":
        assert set(factors[2:]) == {1.0}
    else:
        assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
        assert math.isclose(sched.factor(10), 0.1) and sched.factor(100) == sched.factor(10)
    # a quarter of the way through the decay (step 4 of 2..10), where the two shapes differ
    if kind == "cosine":
        assert math.isclose(sched.factor(6), 0.1 + 0.9 * 0.5)  # half way
        assert math.isclose(sched.factor(4), 0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)))  # 0.868
    if kind == "linear":
        assert math.isclose(sched.factor(4), 0.1 + 0.9 * 0.75)  # 0.775


def test_each_parameter_group_follows_the_schedule_from_its_own_peak():
    groups = [{"lr": 1e-3}, {"lr": 1e-2}]
    remember_peak_lr(groups)
    sched = LRSchedule(total_steps=4, warmup_steps=2)
    assert apply_lr(groups, sched, 0) == pytest.approx(5e-4)
    assert groups[1]["lr"] == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule(total_steps=4, min_ratio=2.0)


def test_nan_policy_counts_skips_and_aborts():
    assert all_finite(torch.tensor(1.0)) and not all_finite(torch.tensor(float("nan")))
    guard = NonFiniteGuard("skip", max_skipped=1)
    guard.record(3, "loss")
    assert guard.skipped == 1
    with pytest.raises(NonFiniteError, match="2 steps skipped"):
        guard.record(4, "gradient")
    with pytest.raises(NonFiniteError, match="step 7: non-finite loss.*nan_policy=abort"):
        NonFiniteGuard("abort", 10).record(7, "loss")
    with pytest.raises(ValueError, match="nan_policy"):
        NonFiniteGuard("ignore", 1)
