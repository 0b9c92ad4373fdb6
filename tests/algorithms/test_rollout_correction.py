"""Rollout/trainer mismatch correction (TIS / ICEPOP / sequence-mask TIS) on a hand-computed batch.

Two responses; rollout probabilities p and trainer probabilities q of the sampled tokens:
    row 0: p = (0.2, 0.5, 0.8), q = (0.4, 0.5, 0.2)  -> w = q/p = (2, 1, 0.25)
    row 1: p = (0.4, 0.1),      q = (0.6, 0.8)       -> w = (1.5, 8)      (third slot is padding)
"""

import math

import pytest
import torch

from openrlhf_shape.algorithms import (
    RolloutCorrectionConfig,
    policy_loss,
    rollout_correction_weights,
    rollout_mismatch_metrics,
)

P = torch.tensor([[0.2, 0.5, 0.8], [0.4, 0.1, 0.3]])
Q = torch.tensor([[0.4, 0.5, 0.2], [0.6, 0.8, 0.9]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
ROLL, OLD = P.log(), Q.log()


def _w(level, mode, gating="ratio", threshold=(0.5, 5.0)):
    return rollout_correction_weights(OLD, ROLL, MASK, RolloutCorrectionConfig(level, mode, gating, threshold))


def test_token_clip_is_truncated_importance_sampling():
    w, m = _w("token", "clip")
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5], [1.5, 5.0, 0.0]]))
    assert m["filtered_frac"] == pytest.approx(2 / 5)  # 0.25 and 8 are outside [0.5, 5]
    assert m["weight/mean"] == pytest.approx((2 + 1 + 0.5 + 1.5 + 5) / 5)


def test_token_mask_drops_tokens_and_keeps_survivor_weights():
    w, m = _w("token", "mask")
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0], [1.5, 0.0, 0.0]]))
    assert m["filtered_frac"] == pytest.approx(0.4)


def test_seq_mask_uses_the_geometric_mean():
    # row 0: (2 * 1 * 0.25)^(1/3) = 0.794 kept; row 1: sqrt(1.5 * 8) = 3.46 > 3 dropped
    w, m = _w("seq", "mask", threshold=(0.5, 3.0))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert m["filtered_frac"] == pytest.approx(0.5)


def test_divergence_gates():
    # tv per token: |p - q| = (0.2, 0, 0.6), (0.2, 0.7); upper bound 0.25
    w, m = _w("token", "mask", "tv", RolloutCorrectionConfig.band([0.25]))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0], [1.5, 0.0, 0.0]]))
    # binary KL per token, by hand: row 0 (0.091516, 0, 0.831777) mean 0.307764;
    # row 1 (0.081093, 1.145725) mean 0.613409 -> with bound 0.5 row 1 is dropped
    w, m = _w("seq", "mask", "binary_kl", (0.0, 0.5))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.25], [0.0, 0.0, 0.0]]))
    w, _ = _w("seq", "mask", "binary_kl", (0.0, 0.62))
    assert torch.allclose(w[1], torch.tensor([1.5, 8.0, 0.0]))
    w, _ = _w("seq", "mask", "binary_kl", (0.0, 0.60))
    assert torch.allclose(w[1], torch.zeros(3))


def test_off_gives_unit_weights():
    w, m = _w("off", "mask")
    assert torch.equal(w, MASK.float()) and m["filtered_frac"] == 0.0


def test_mismatch_metrics_by_hand():
    m = rollout_mismatch_metrics(OLD, ROLL, MASK)
    logs = [math.log(2), 0.0, math.log(0.25), math.log(1.5), math.log(8)]
    assert m["abs_log_ratio/mean"] == pytest.approx(sum(abs(x) for x in logs) / 5, rel=1e-5)
    assert m["abs_log_ratio/max"] == pytest.approx(math.log(8), rel=1e-5)
    assert m["kl"] == pytest.approx(-sum(logs) / 5, rel=1e-5)
    assert m["seq_abs_log_ratio/max"] == pytest.approx((math.log(1.5) + math.log(8)) / 2, rel=1e-5)
    assert m["tokens"] == 5.0
    same = rollout_mismatch_metrics(OLD, OLD.clone(), MASK)
    assert same["abs_log_ratio/max"] == 0.0 and same["kl"] == 0.0


def test_policy_loss_applies_the_weights():
    # log_probs = old (ratio 1) and advantage 1: each token's loss is -1, weighted by w
    lp = OLD.clone().requires_grad_(True)
    adv = torch.ones_like(lp)
    w, _ = _w("token", "mask")
    loss, _ = policy_loss(lp, OLD, adv, MASK, is_weights=w)
    assert float(loss.detach()) == pytest.approx(-(2 + 1 + 1.5) / 5)  # the token count stays 5
    loss.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[1, 1] == 0 and lp.grad[0, 0] == pytest.approx(-2 / 5)
    plain, _ = policy_loss(OLD.clone(), OLD, adv, MASK)
    assert float(plain) == pytest.approx(-1.0)


def test_bad_settings_name_the_flag():
    f = "--algo.advantage.is_correction_"
    with pytest.raises(ValueError, match=f"{f}mode clip clamps a per-token weight"):
        RolloutCorrectionConfig("seq", "clip").validate()
    with pytest.raises(ValueError, match=f"{f}gating tv is a divergence"):
        RolloutCorrectionConfig("token", "mask", "tv", (0.5, 5.0)).validate()
    with pytest.raises(ValueError, match="must contain 1"):
        RolloutCorrectionConfig("token", "mask", "ratio", RolloutCorrectionConfig.band([0.5])).validate()
    with pytest.raises(ValueError, match=f"{f}level 'tok'"):
        RolloutCorrectionConfig("tok").validate()
    with pytest.raises(ValueError, match="HIGH or LOW HIGH"):
        RolloutCorrectionConfig.band([1, 2, 3])
