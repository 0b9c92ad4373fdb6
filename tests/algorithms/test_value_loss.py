"""The critic's loss (``--critic.value_clip``): a hand-computed clip, and OpenRLHF 0.11.2's own ``ValueLoss`` (its
installed ``models/loss.py`` source, run on CPU: tests/algorithms/openrlhf_source.py) on seeded random batches, value
and gradient, token level (what OpenRLHF's critic uses) and sequence level, with this call's counts and with global
counts over micro-batches."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.algorithms.loss import value_loss


@pytest.fixture(scope="module")
def theirs():
    from openrlhf_source import load_loss_module

    return load_loss_module()


def test_clip_hand_computed():
    """V_old 0, V 1, G 2, eps 0.5: clipped V 0.5 -> (0.5 - 2)^2 = 2.25 > (1 - 2)^2 = 1, so 0.5 * 2.25, gradient 0
    (held by the clip); G -1: 2.25 vs 4 -> 0.5 * 4, gradient V - G = 2."""
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss, m = value_loss(v, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.5)
    assert loss.item() == pytest.approx((0.5 * 2.25 + 0.5 * 4) / 2)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, 2.0 / 2]]))
    assert m["value_clipfrac_sum"].item() == 1 and m["num_tokens"].item() == 2


def _batch(seed: int, b: int, t: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if b > 2:
        mask[1] = False  # a sample with no valid token
    old = torch.randn(b, t, generator=g)
    values = old + 0.6 * torch.randn(b, t, generator=g)
    returns = old + torch.randn(b, t, generator=g)
    return values, old, returns, mask


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 33)])
@pytest.mark.parametrize("clip", [None, 0.2, 0.5])
@pytest.mark.parametrize("token_level", [True, False])
def test_equals_openrlhfs_value_loss(theirs, shape, clip, token_level):
    values, old, returns, mask = _batch(sum(shape) + int((clip or 0) * 10), *shape)
    if shape[0] == 1:
        mask[0, 0] = True
    mine_v = values.clone().requires_grad_()
    their_v = values.clone().requires_grad_()
    ours, _ = value_loss(mine_v, old, returns, mask, clip, token_level=token_level)
    ref = theirs["ValueLoss"](clip, token_level_loss=token_level)(their_v, old, returns, action_mask=mask.float())
    assert torch.allclose(ours, ref, atol=1e-6), (ours, ref)
    ours.backward()
    ref.backward()
    assert torch.allclose(mine_v.grad, their_v.grad, atol=1e-6)
    assert ours.item() > 0


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batches_over_global_counts_equal_openrlhfs(theirs, token_level):
    """Two micro-batches of one mini-batch, each normalised by the mini-batch's counts (OpenRLHF's batch_num_tokens /
    global_batch_size at dp_size 1): their sum is the whole batch's loss, on both sides."""
    values, old, returns, mask = _batch(5, 6, 11)
    tokens, samples = mask.sum().float(), (mask.sum(-1) > 0).sum().float()
    total_ours = total_theirs = 0.0
    for idx in (slice(0, 3), slice(3, 6)):
        ours, _ = value_loss(values[idx], old[idx], returns[idx], mask[idx], 0.5, token_level=token_level,
                             num_global_tokens=tokens, num_global_samples=samples)
        ref = theirs["ValueLoss"](0.5, token_level_loss=token_level)(
            values[idx], old[idx], returns[idx], action_mask=mask[idx].float(), dp_size=1, batch_num_tokens=tokens,
            global_batch_size=samples)
        assert torch.allclose(ours, ref, atol=1e-6)
        total_ours, total_theirs = total_ours + ours, total_theirs + ref
    whole, _ = value_loss(values, old, returns, mask, 0.5, token_level=token_level)
    assert torch.allclose(total_ours, whole, atol=1e-6) and torch.allclose(total_theirs, whole, atol=1e-6)


def test_inputs_are_checked():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"--critic.value_clip must be >= 0"):
        value_loss(x, x, x, x.bool(), -0.1)
    with pytest.raises(ValueError, match=r"one shape \[B, T\]"):
        value_loss(x, x, torch.zeros(2, 4), x.bool())
