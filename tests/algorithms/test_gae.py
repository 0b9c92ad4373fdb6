"""GAE (``--algo.advantage.estimator gae``, ``--algo.advantage.gamma``, ``--algo.advantage.lambd``): hand computations
on worked responses, and OpenRLHF 0.11.2's own ``compute_advantages_and_returns`` (its installed source, run on CPU:
tests/algorithms/openrlhf_source.py) on seeded random batches: ragged masks (with holes, as an agent's environment
tokens make), KL in the reward on and off, gamma and lambd below 1, whitening with and without the std."""

import pytest
import torch

from openrlhf_shape.algorithms import ReturnConfig, ShapeConfig, compute_token_advantages, get_estimator
from openrlhf_shape.algorithms.gae import gae_advantages_and_returns

V = torch.tensor([[0.5, 0.6, 0.8]])
ONE = torch.ones(1, 3, dtype=torch.bool)
REW = torch.tensor([[0.0, 0.0, 1.0]])  # R = 1 on the last token


def test_undiscounted_gae_is_the_outcome_minus_the_value():
    """gamma = lambd = 1: A_t = R - V_t = [0.5, 0.4, 0.2], and every return is R."""
    adv, ret = gae_advantages_and_returns(REW, V, ONE)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.2]]))
    assert torch.allclose(ret, torch.ones(1, 3))


def test_discounted_gae_hand_computed():
    """gamma = lambd = 0.5: delta = [0.5*0.6 - 0.5, 0.5*0.8 - 0.6, 1 - 0.8] = [-0.2, -0.2, 0.2];
    A_2 = 0.2, A_1 = -0.2 + 0.25 * 0.2 = -0.15, A_0 = -0.2 + 0.25 * -0.15 = -0.2375; G = A + V."""
    adv, ret = gae_advantages_and_returns(REW, V, ONE, gamma=0.5, lambd=0.5)
    want = torch.tensor([[-0.2375, -0.15, 0.2]])
    assert torch.allclose(adv, want)
    assert torch.allclose(ret, want + V)


def test_lambd_zero_is_the_one_step_td_error_and_padding_is_zero():
    """lambd = 0: A_t = delta_t; a padded position gets 0 and its value (junk here) is never read."""
    mask = torch.tensor([[True, True, False]])
    values = torch.tensor([[0.5, 0.6, 99.0]])
    adv, ret = gae_advantages_and_returns(torch.tensor([[0.0, 1.0, 7.0]]), values, mask, gamma=0.9, lambd=0.0)
    assert torch.allclose(adv, torch.tensor([[0.9 * 0.6 - 0.5, 1.0 - 0.6, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.9 * 0.6, 1.0, 0.0]]))


def _random_batch(seed: int, b: int = 8, width: int = 9, holes: bool = False):
    """Outcomes mostly 0/1 with some beyond --reward.clip_range, values in (-1, 1), KL, ragged lengths 1..width;
    ``holes``: some positions inside responses masked out (an agent's environment tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if holes:
        hole = (torch.rand(b, width, generator=g) < 0.25) & (torch.arange(width)[None, :] < lengths[:, None] - 1)
        mask = mask & ~hole
    rewards = torch.where(torch.rand(b, generator=g) < 0.7, (torch.rand(b, generator=g) > 0.5).float(),
                          torch.rand(b, generator=g) * 30 - 10)
    values = torch.rand(b, width, generator=g) * 2 - 1
    kl = torch.rand(b, width, generator=g) * 0.4 - 0.1
    return rewards, values, mask, kl


CASES = [  # (OpenRLHF flags, our ReturnConfig)
    ([], ReturnConfig()),
    (["--algo.advantage.gamma", "0.9"], ReturnConfig(gamma=0.9)),
    (["--algo.advantage.lambd", "0.95"], ReturnConfig(lambd=0.95)),
    (["--algo.advantage.gamma", "0.8", "--algo.advantage.lambd", "0.5"], ReturnConfig(gamma=0.8, lambd=0.5)),
    (["--algo.advantage.gamma", "0.9", "--algo.advantage.lambd", "0.9", "--algo.advantage.no_std_norm"],
     ReturnConfig(0.9, True, 0.9)),
]


@pytest.fixture(scope="module")
def openrlhf():
    from openrlhf_source import openrlhf_gae

    return openrlhf_gae


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("flags, returns", CASES, ids=["".join(c[0]) or "defaults" for c in CASES])
def test_equals_openrlhf_compute_advantages_and_returns(openrlhf, flags, returns, kl_coef, holes):
    rewards, values, mask, kl = _random_batch(seed=len(flags) + int(kl_coef * 100) + 7 * holes, holes=holes)
    theirs_adv, theirs_ret = openrlhf(flags, rewards, values, mask, kl, kl_coef)
    est = get_estimator("gae", ShapeConfig(), returns)
    res = compute_token_advantages(est, mask, rewards, 1, mask.shape[1], values=values,
                                   token_rewards=-kl_coef * kl if kl_coef else None, reward_clip_range=(-10.0, 10.0))
    assert torch.allclose(res.token_advantages[mask], theirs_adv[mask].float(), atol=1e-5)
    assert torch.allclose(res.returns[mask], theirs_ret[mask].float(), atol=1e-5)
    assert (res.token_advantages[~mask] == 0).all() and (res.returns[~mask] == 0).all()
    assert res.token_advantages[mask].abs().max() > 0.1  # a real signal was compared, not zeros


def test_gae_needs_values_and_lambd_is_refused_elsewhere():
    est = get_estimator("gae", ShapeConfig(), ReturnConfig(gamma=0.9, lambd=0.95, no_std_norm=True))
    assert est.needs_critic and not est.needs_segments and est.whitens and est.discounts_returns
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_token_advantages(est, ONE, torch.tensor([1.0]), 1, 3)
    for name in ("reinforce", "grpo", "shape"):
        assert not get_estimator(name, ShapeConfig()).needs_critic
        with pytest.raises(ValueError, match=r"--algo.advantage.lambd 0.9: only --algo.advantage.estimator gae"):
            get_estimator(name, ShapeConfig(), ReturnConfig(lambd=0.9))
    with pytest.raises(ValueError, match=r"--algo.advantage.lambd: .*\[0, 1\]"):
        ReturnConfig(lambd=1.5)
