"""The policy losses of ``--actor.policy_loss_type`` (algorithms/loss.py) where OpenRLHF has nothing to compare with:
CISPO against a hand computation of MiniMax-M1's objective, the log-ratio clamp on a token whose ratio overflows
float32 (finite loss and gradient, OpenRLHF's PolicyLoss values), and the settings' refusals. PPO and GSPO against
OpenRLHF's own ``PolicyLoss`` on random inputs: test_openrlhf_differential.py."""

from __future__ import annotations

import math

import pytest
import torch

from openrlhf_shape.actor.optim import POLICY_LOSS_TYPES, OptimSettings
from openrlhf_shape.algorithms.loss import LOSS_TYPES, LOG_RATIO_CLAMP, policy_loss


@pytest.fixture(scope="module")
def openrlhf_loss():
    from openrlhf_source import load_loss_module

    return load_loss_module()


def test_cispo_is_the_papers_objective_by_hand():
    """MiniMax-M1 eq. 4-5: J = 1 / sum_i |o_i| sum_i sum_t sg(r^_it) A_it log pi(o_it), r^ = clip(r, 1 - eL, 1 + eH).
    Two responses of 3 and 2 tokens (the third slot of row 1 is padding holding junk). Ratios (old = 0 so r = pi):
    row 0: 1.5, 0.5, 5.0; row 1: 1.1, 0.25. With eL = 1 (no lower bound) and eH = 3 (weight <= 4): weights
    1.5, 0.5, 4.0 / 1.1, 0.25; the loss is -J and d loss / d logp_t = -w_t A_t / 5 for every valid token, clipped
    or not."""
    pi = torch.tensor([[1.5, 0.5, 5.0], [1.1, 0.25, 7.0]])
    lp = pi.log().requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 3.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, m = policy_loss(lp, torch.zeros(2, 3), adv, mask, eps_low=1.0, eps_high=3.0, loss_type="cispo")
    w = [1.5, 0.5, 4.0, 1.1, 0.25]
    a = [1.0, -1.0, 2.0, -0.5, 3.0]
    logp = [math.log(x) for x in (1.5, 0.5, 5.0, 1.1, 0.25)]
    assert loss.item() == pytest.approx(-sum(wi * ai * li for wi, ai, li in zip(w, a, logp)) / 5, rel=1e-6)
    loss.backward()
    got = lp.grad[mask].tolist()
    assert got == pytest.approx([-wi * ai / 5 for wi, ai in zip(w, a)], rel=1e-6)
    assert lp.grad[1, 2] == 0  # padding
    assert m["clipfrac_high_sum"].item() == 1 and m["clipfrac_low_sum"].item() == 0  # the 5.0 weight (A > 0)
    # a two-sided clip [0.8, 1.28]: the 0.5 and 0.25 ratios are lifted to 0.8, whatever their advantage's sign
    _, m2 = policy_loss(pi.log(), torch.zeros(2, 3), adv, mask, eps_low=0.2, eps_high=0.28, loss_type="cispo")
    assert (m2["clipfrac_low_sum"].item(), m2["clipfrac_high_sum"].item()) == (2, 2)


def test_cispo_keeps_the_gradient_that_ppo_clips_away():
    """One token, ratio 1.5, A = +1: PPO (clip 1.28) gives it no gradient; CISPO weights it by the clipped 1.28."""
    lp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    args = (torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    policy_loss(lp, *args, eps_low=0.2, eps_high=0.28)[0].backward()
    assert lp.grad.item() == 0.0
    lp.grad = None
    policy_loss(lp, *args, eps_low=0.2, eps_high=0.28, loss_type="cispo")[0].backward()
    assert lp.grad.item() == pytest.approx(-1.28)


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_an_overflowing_log_ratio_keeps_loss_and_gradient_finite(openrlhf_loss, loss_type, dual_clip):
    """Token log-ratios of +300 and -300 (exp(300) overflows float32) beside ordinary ones, both advantage signs:
    the loss and its gradient stay finite. PPO: they are OpenRLHF's PolicyLoss values (it clamps at 20 too). GSPO:
    OpenRLHF clamps nothing, and the first sequence's mean log-ratio (99.8) overflows there."""
    lp = torch.tensor([[300.0, -1.0, 0.3], [-300.0, 0.2, -0.1], [1.0, 45.0, 0.0]], requires_grad=True)
    old = torch.zeros(3, 3)
    adv = torch.tensor([[-1.0, 0.5, 2.0], [1.0, -2.0, 0.5], [1.0, -1.0, 0.3]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    loss, _ = policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, loss_type=loss_type)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    theirs_fn = openrlhf_loss["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
                                            policy_loss_type=loss_type)
    lp2 = lp.detach().clone().requires_grad_()
    theirs = theirs_fn(lp2, old, adv, action_mask=mask.float(), batch_num_tokens=mask.sum().float(),
                       global_batch_size=torch.tensor(3.0))[0]
    theirs.backward()
    if loss_type == "ppo":  # OpenRLHF clamps the PPO log-ratio at +-20 too
        assert torch.isfinite(theirs)
        torch.testing.assert_close(loss, theirs, rtol=1e-6, atol=0)
        torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-6, atol=1e-9)
    else:
        assert not (torch.isfinite(theirs) and torch.isfinite(lp2.grad).all())


@pytest.mark.parametrize("level, mode", [("token", "clip"), ("token", "mask"), ("seq", "mask")])
def test_an_overflowing_rollout_mismatch_keeps_the_corrected_loss_finite(openrlhf_loss, level, mode):
    """Trainer and engine log-probs 100 nats apart on one token (exp overflows): the correction weights, the loss and
    its gradient stay finite; within the clamp (the other row) they are OpenRLHF's."""
    from openrlhf_shape.algorithms.rollout_correction import RolloutCorrectionConfig, rollout_correction_weights

    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.3, -2.2]])
    rollout = old + torch.tensor([[-100.0, 0.1, -0.2], [0.2, -0.1, 0.05]])
    lp, adv, mask = old + 0.05, torch.tensor([[1.0, -1.0, 0.5], [-0.5, 1.0, 2.0]]), torch.ones(2, 3, dtype=torch.bool)
    w, _ = rollout_correction_weights(old, rollout, mask, RolloutCorrectionConfig(level, mode))
    lp = lp.requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, is_weights=w)
    loss.backward()
    assert torch.isfinite(w).all() and torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    fn = openrlhf_loss["PolicyLoss"](clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level=level,
                                     is_correction_mode=mode)
    keep = torch.tensor([[False] * 3, [True] * 3])
    ours_row = policy_loss(lp.detach(), old, adv, keep, is_weights=w)[0]
    theirs_row = fn(lp.detach(), old, adv, action_mask=keep.float(), rollout_log_probs=rollout)[0]
    assert ours_row.item() == pytest.approx(theirs_row.item(), rel=1e-6)


def test_the_clamp_is_openrlhfs_twenty():
    assert LOG_RATIO_CLAMP == 20.0
    lp = torch.tensor([[25.0]])  # ratio e^20 (clamped), A = -1: the loss is e^20, finite, no gradient
    loss, m = policy_loss(lp.requires_grad_(), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert m["approx_kl_sum"].item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_settings_and_refusals_name_the_flag():
    assert POLICY_LOSS_TYPES == LOSS_TYPES  # actor/optim.py keeps its own copy (torch-free)
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"--actor\.policy_loss_type 'grpo'"):
        policy_loss(lp, lp, lp, mask, loss_type="grpo")
    with pytest.raises(ValueError, match=r"--actor\.dual_clip .* cispo"):
        policy_loss(lp, lp, lp, mask, dual_clip=3.0, loss_type="cispo")
    with pytest.raises(ValueError, match="gspo applies no rollout-correction weights"):
        policy_loss(lp, lp, lp, mask, is_weights=torch.ones(1, 2), loss_type="gspo")
    with pytest.raises(ValueError, match="eps_low < 1"):
        policy_loss(lp, lp, lp, mask, eps_low=1.0, loss_type="gspo")
    policy_loss(lp, lp, lp, mask, eps_low=5.0, eps_high=3.0, loss_type="cispo")  # no lower bound: fine
    assert OptimSettings(policy_loss_type="cispo").policy_clip_low_high == (1.0, 3.0)
    assert OptimSettings(policy_loss_type="gspo", eps_clip_low_high=(3e-4, 4e-4)).policy_clip_low_high == (3e-4, 4e-4)
    with pytest.raises(ValueError, match="policy_loss_type"):
        OptimSettings(policy_loss_type="grpo")
    with pytest.raises(ValueError, match="dual_clip"):
        OptimSettings(policy_loss_type="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="cispo_eps_clip_low_high"):
        OptimSettings(cispo_eps_clip_low_high=(-0.1, 3.0))


def test_the_flags_reach_the_ranks():
    """``--actor.policy_loss_type`` (OpenRLHF's name and values, and cispo) and ``--actor.cispo_eps_clip_low_high``
    on a command line reach the optimiser settings both backends read."""
    from openrlhf_shape.config import load_config

    for kind in ("gspo", "cispo"):
        cfg = load_config(None, ["--actor.policy_loss_type", kind, "--actor.cispo_eps_clip_low_high", "0.5", "2"])
        rank = cfg.optim_config()
        assert (rank.policy_loss_type, tuple(rank.cispo_eps_clip_low_high)) == (kind, (0.5, 2.0))
    assert load_config(None, []).optim_config().policy_loss_type == "ppo"
    with pytest.raises(Exception, match="policy_loss_type"):
        load_config(None, ["--actor.policy_loss_type", "sapo"])
