"""KL to the reference policy (openrlhf_shape/algorithms/kl.py): k1 / k2 / k3, the penalty in the reward and in the
loss, the coefficient controller. Each against a hand computation on one worked batch, and against OpenRLHF 0.11's
own functions on the same inputs (its ``models/utils.py`` and ``kl_controller.py`` load by path on CPU; the
``openrlhf.models`` package itself does not: it imports flash-attn)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from openrlhf_shape.algorithms.kl import (
    KLController,
    approx_kl,
    check_estimator,
    kl_loss_sum,
    kl_penalty_returns,
    masked_sample_mean,
)
from support.modules import load_file

# The worked batch: two responses of 3 and 2 tokens (right-padded to 4); padding holds junk on purpose.
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.2, -3.0, -7.0, 3.0]])
REF = torch.tensor([[-1.5, -0.5, -1.0, 5.0], [-0.7, -1.0, 0.0, -4.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
# r = LOGP - REF on valid tokens: [0.5, 0, -1] and [0.5, -2]
K1 = [[0.5, 0.0, -1.0], [0.5, -2.0]]
K2 = [[0.125, 0.0, 0.5], [0.125, 2.0]]
K3 = [[math.exp(-0.5) - 0.5, 0.0, math.e - 2.0], [math.exp(-0.5) - 0.5, math.exp(2.0) - 3.0]]  # e^-r - 1 + r
HAND = {"k1": K1, "k2": K2, "k3": K3}


def _valid(t: torch.Tensor) -> list[list[float]]:
    return [t[0, :3].tolist(), t[1, :2].tolist()]


def _load_openrlhf(relpath: str, name: str):
    """One OpenRLHF 0.11.2 source file as a module (by path: its package __init__ needs flash-attn)."""
    import openrlhf

    return load_file(os.path.join(os.path.dirname(openrlhf.__file__), relpath), name)


@pytest.fixture(scope="module")
def openrlhf_utils():
    return _load_openrlhf("models/utils.py", "openrlhf_models_utils_for_kl_test")  # imports deepspeed (CPU: fine)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_equal_the_hand_computation(estimator):
    got = _valid(approx_kl(LOGP, REF, estimator))
    for row, want in zip(got, HAND[estimator]):
        assert row == pytest.approx(want, abs=1e-6)


def test_clamping_as_openrlhf():
    """r = -12: k1 -> -10; k2 = 72 -> 10; k3 evaluated at r = -10 (e^10 - 11 = 22015.47) -> 10. r = 30: k1 -> 10,
    k2 -> 10, k3 = e^-30 + 29 -> 10. The k3 gradient stays finite where r < -10 (r was clamped before exp)."""
    lp = torch.tensor([[-12.0, 30.0]], requires_grad=True)
    ref = torch.zeros(1, 2)
    assert approx_kl(lp, ref, "k1").tolist() == [[-10.0, 10.0]]
    assert approx_kl(lp, ref, "k2").tolist() == [[10.0, 10.0]]
    k3 = approx_kl(lp, ref, "k3")
    assert k3.tolist() == [[10.0, 10.0]]
    k3.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.tolist() == [[0.0, 0.0]]  # both clamped: no gradient


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_equal_openrlhf(openrlhf_utils, estimator):
    """Random log-probs over the clamp edges: OpenRLHF's compute_approx_kl, value for value."""
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(6, 9, generator=g) * 15, -torch.rand(6, 9, generator=g) * 15
    want = openrlhf_utils.compute_approx_kl(lp, ref, kl_estimator=estimator)
    assert torch.equal(approx_kl(lp, ref, estimator), want)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_gradient_equals_openrlhf(openrlhf_utils, estimator):
    """``--algo.kl.unbiased_gradient``: the estimator's value, the gradient w * r (w = pi / pi_old, capped at 10)."""
    g = torch.Generator().manual_seed(1)
    base, ref, old = -torch.rand(4, 5, generator=g) * 4, -torch.rand(4, 5, generator=g) * 4, -torch.rand(4, 5, generator=g) * 4
    ours_in, theirs_in = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ours = approx_kl(ours_in, ref, estimator, old_log_probs=old, unbiased_gradient=True)
    theirs = openrlhf_utils.compute_approx_kl(theirs_in, ref, log_probs_old=old, kl_estimator=estimator,
                                              unbiased_gradient=True)
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    w = (base - old).exp().clamp(max=10.0)
    assert torch.allclose(ours_in.grad, w * (base - ref), atol=1e-6)  # by hand
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=0, rtol=0)


def test_kl_in_the_reward_by_hand():
    """coef 0.1, k1: token rewards -0.1 * kl; return to go (undiscounted) per valid token:
    row 0: kl [0.5, 0, -1] -> [-0.1 (0.5 + 0 - 1), -0.1 (0 - 1), -0.1 (-1)] = [0.05, 0.1, 0.1];
    row 1: kl [0.5, -2] -> [0.15, 0.2]; padding 0."""
    kl = approx_kl(LOGP, REF, "k1")
    got = kl_penalty_returns(kl, MASK, 0.1)
    assert _valid(got)[0] == pytest.approx([0.05, 0.1, 0.1], abs=1e-7)
    assert _valid(got)[1] == pytest.approx([0.15, 0.2], abs=1e-7)
    assert got[0, 3] == 0 and (got[1, 2:] == 0).all()
    assert torch.equal(kl_penalty_returns(kl, MASK, -0.5), torch.zeros(2, 4))  # a negative coefficient is 0


def test_kl_in_the_reward_equals_openrlhf(openrlhf_utils):
    """OpenRLHF's compute_reward (outcome at the last valid token plus -coef * kl on every token), then its
    experience maker's undiscounted cumulative return (rewards masked by the action mask, summed from the end):
    the KL part is ours, the outcome part is the constant R on every valid token."""
    g = torch.Generator().manual_seed(2)
    lp, ref = -torch.rand(3, 6, generator=g) * 3, -torch.rand(3, 6, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    outcome = torch.tensor([1.0, 0.0, 0.5])
    kl = openrlhf_utils.compute_approx_kl(lp, ref, kl_estimator="k3")
    token_rewards = openrlhf_utils.compute_reward(outcome, 0.05, kl, action_mask=mask) * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(3)
    for t in reversed(range(6)):  # OpenRLHF's get_cumulative_returns at gamma 1
        running = token_rewards[:, t] + running
        returns[:, t] = running
    ours = outcome[:, None] * mask + kl_penalty_returns(approx_kl(lp, ref, "k3"), mask, 0.05)
    assert torch.allclose(ours, returns, atol=1e-6)


def test_kl_in_the_loss_by_hand():
    """k3 summed over valid tokens = 2 (e^-0.5 - 0.5) + (e - 2) + (e^2 - 3); its gradient per valid token is
    1 - e^{-r} (r = 0.5, 0, -1, 0.5, -2), 0 at padding."""
    lp = LOGP.clone().requires_grad_(True)
    total = kl_loss_sum(lp, REF, MASK, "k3")
    want = 2 * (math.exp(-0.5) - 0.5) + (math.e - 2) + (math.exp(2) - 3)
    assert float(total) == pytest.approx(want, abs=1e-5)
    total.backward()
    r = [[0.5, 0.0, -1.0], [0.5, -2.0]]
    for got, rr in zip(_valid(lp.grad), r):
        assert got == pytest.approx([1 - math.exp(-x) for x in rr], abs=1e-6)
    assert lp.grad[0, 3] == 0 and (lp.grad[1, 2:] == 0).all()


def test_sample_means_for_the_kl_metric():
    """OpenRLHF's per-sample ``kl`` info: each row's masked mean (k1: -1/6 and -3/4)."""
    got = masked_sample_mean(approx_kl(LOGP, REF, "k1"), MASK)
    assert got.tolist() == pytest.approx([-1 / 6, -0.75], abs=1e-7)
    assert masked_sample_mean(torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.bool)).tolist() == [0.0]


def test_adaptive_controller_by_hand_and_equal_to_openrlhf():
    """target 0.1, horizon 1000, 64 samples a step: kl 0.3 -> error clipped to 0.2 -> x1.0128; kl 0.05 -> -0.5
    clipped to -0.2 -> x0.9872; kl 0.11 -> 0.1 -> x1.0064. OpenRLHF's AdaptiveKLController gives the same values."""
    ours = KLController(0.01, target=0.1, horizon=1000)
    theirs = _load_openrlhf("trainer/ppo_utils/kl_controller.py", "openrlhf_kl_controller_for_test").AdaptiveKLController(
        0.01, 0.1, 1000)
    want = 0.01
    for kl, factor in ((0.3, 1.0128), (0.05, 0.9872), (0.11, 1.0064)):
        ours.update(kl, 64)
        theirs.update(kl, 64)
        want *= factor
        assert ours.value == pytest.approx(want, rel=1e-12)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)
    fixed = KLController(0.02)
    fixed.update(5.0, 64)
    assert fixed.value == 0.02 and not fixed.adaptive
    copy = KLController(0.0, target=0.1)
    copy.load_state_dict(ours.state_dict())
    assert copy.value == ours.value


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="--algo.kl.estimator"):
        check_estimator("k4")
    with pytest.raises(ValueError, match="--algo.kl.init_coef"):
        KLController(-0.1)
    with pytest.raises(ValueError, match="--algo.kl.target"):
        KLController(0.1, target=0.0)
    with pytest.raises(ValueError, match="--algo.kl.horizon"):
        KLController(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="one shape"):
        approx_kl(LOGP, REF[:, :2])
