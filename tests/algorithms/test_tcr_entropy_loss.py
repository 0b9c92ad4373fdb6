"""TCR, entropy and the policy loss."""

import math

import pytest
import torch

from openrlhf_shape.algorithms import (
    policy_loss,
    redistribute_token_credit,
    tcr_weights,
    token_entropy,
    token_log_probs_and_entropy,
)


def test_tcr_hand_computed():
    ent = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0])
    seg = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    mask = torch.ones(5, dtype=torch.bool)
    out = redistribute_token_credit(adv, ent, seg, mask, beta=0.5, delta_min=0.5, delta_max=1.5)
    sigma = math.sqrt(2 / 3)  # population std of 1, 2, 3
    raw = torch.tensor([1 + 0.5 * (-1 / (sigma + 1e-6)), 1.0, 1 + 0.5 * (1 / (sigma + 1e-6))])  # .39, 1, 1.61
    assert torch.allclose(out[:3], 2.0 * raw.clamp(0.5, 1.5), atol=1e-5)
    out_wide = redistribute_token_credit(adv, ent, seg, mask, beta=0.5, delta_min=0.1, delta_max=2.0)
    assert torch.allclose(out_wide[:3], 2.0 * raw, atol=1e-5)
    assert torch.allclose(out[3:], torch.tensor([-1.0, -1.0]))  # constant entropy: w = 1


def test_tcr_average_tokens_keep_segment_advantage_and_bounds():
    torch.manual_seed(0)
    ent = torch.rand(200) * 4
    seg = torch.arange(200) // 50
    w = tcr_weights(ent, seg, torch.ones(200, dtype=torch.bool), beta=3.0, delta_min=0.7, delta_max=1.2)
    assert (w >= 0.7).all() and (w <= 1.2).all()
    assert (w == 0.7).any() and (w == 1.2).any()  # clipping is active with a big beta
    w_avg = tcr_weights(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    assert w_avg[1].item() == pytest.approx(1.0)


def test_tcr_one_token_segments_and_padding():
    ent = torch.tensor([[0.3, 9.0, 1.0, 2.0, 7.0, 7.0]])
    seg = torch.tensor([[0, 1, 2, 2, 3, 3]])
    mask = torch.tensor([[True, True, True, True, False, False]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.5, 4.0, 4.0]])
    out = redistribute_token_credit(adv, ent, seg, mask)
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == -2.0  # one-token segments unchanged
    assert out[0, 4:].tolist() == [0.0, 0.0]  # padding ignored and zeroed
    # padding's entropy does not enter segment 2's statistics
    out2 = redistribute_token_credit(adv, ent.clone().index_fill_(1, torch.tensor([4, 5]), -50.0), seg, mask)
    assert torch.equal(out, out2)


def test_tcr_batched_rows_independent():
    torch.manual_seed(1)
    ent = torch.rand(3, 30)
    seg = (torch.arange(30) // 7)[None].expand(3, 30)
    mask = torch.ones(3, 30, dtype=torch.bool)
    w = tcr_weights(ent, seg, mask)
    for i in range(3):
        assert torch.allclose(w[i], tcr_weights(ent[i], seg[i], mask[i]))


def test_entropy_matches_float64_reference_and_chunking():
    torch.manual_seed(0)
    logits = torch.randn(7, 5, 301) * 3
    for temp in (1.0, 0.6):
        ref = torch.distributions.Categorical(logits=logits.double() / temp).entropy()
        got = token_entropy(logits, temperature=temp)
        assert got.dtype == torch.float32 and got.shape == (7, 5)
        assert torch.allclose(got.double(), ref, atol=1e-5)
        assert torch.equal(token_entropy(logits, temp, chunk_size=3), token_entropy(logits, temp, chunk_size=35))
    bf = logits.to(torch.bfloat16)
    ref_bf = torch.distributions.Categorical(logits=bf.double()).entropy()
    assert torch.allclose(token_entropy(bf).double(), ref_bf, atol=1e-4)


def test_log_probs_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(4, 9, 50, requires_grad=True)
    ids = torch.randint(0, 50, (4, 9))
    lp, ent = token_log_probs_and_entropy(logits, ids, temperature=0.7, chunk_size=5)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    assert torch.allclose(ent, token_entropy(logits.detach(), 0.7), atol=1e-6)
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="token ids"):
        token_log_probs_and_entropy(logits, ids + 100)
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(logits, temperature=0)


def test_policy_loss_clip_higher_hand_computed():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, m = policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # token 0: ratio 1.5, A>0 -> clipped at 1.28 -> -1.28; token 1: ratio .5, A<0 -> max(-.5*-1?..)
    # -min(0.5*-1, 0.8*-1) = 0.8; token 2: ratio 1.1 unclipped -> -2.2; token 3 masked.
    expected = (-1.28 + 0.8 - 2.2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["num_tokens"].item() == 3
    assert m["clipfrac_high_sum"].item() == 1 and m["clipfrac_low_sum"].item() == 1
    loss.backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == 0.0  # clipped tokens: no gradient
    assert lp.grad[0, 2].item() == pytest.approx(-2.0 * 1.1 / 3, abs=1e-6)


def test_policy_loss_global_token_normalisation_sums_micro_batches():
    torch.manual_seed(0)
    lp = torch.randn(4, 6) * 0.1
    old = lp + torch.randn(4, 6) * 0.05
    adv = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    full, _ = policy_loss(lp, old, adv, mask)
    n = int(mask.sum())
    parts = [policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_global_tokens=n)[0]
             for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_policy_loss_dual_clip_and_padding_inf():
    lp = torch.tensor([[3.0, 0.0]])  # ratio e^3 ~ 20 on a negative advantage
    old = torch.tensor([[0.0, float("-inf")]])
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.tensor([[True, False]])
    plain, _ = policy_loss(lp, old, adv, mask)
    dual, _ = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(3.0), rel=1e-5)
    assert dual.item() == pytest.approx(3.0)
    assert torch.isfinite(plain)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(lp, old[:, :1], adv, mask)
