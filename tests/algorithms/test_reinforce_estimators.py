"""OpenRLHF's critic-free estimators (grpo / group_norm, reinforce, reinforce_baseline, rloo, dr_grpo,
flash_reinforce): hand computations on worked batches, and OpenRLHF 0.11.2's own
``compute_advantages_and_returns`` (its installed source, run on CPU: tests/algorithms/openrlhf_source.py) on the
same inputs."""

import math

import pytest
import torch

from openrlhf_shape.algorithms import ReturnConfig, ShapeConfig, compute_token_advantages, get_estimator

# Worked batch: 2 prompts x n = 3, outcomes R = [1, 0, 1 | 0, 0, 1], lengths [3, 1, 2 | 2, 3, 1] (T = 3).
R = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
LENGTHS = torch.tensor([3, 1, 2, 2, 3, 1])
MASK = torch.arange(3)[None, :] < LENGTHS[:, None]
# Outcome terms r_i by hand (every token of response i gets r_i: gamma 1, no per-token reward, no whitening):
HAND = {
    # leave-one-out: R_i - mean of the other two of its prompt
    "rloo": [1 - (0 + 1) / 2, 0 - (1 + 1) / 2, 1 - (1 + 0) / 2, 0 - (0 + 1) / 2, 0 - (0 + 1) / 2, 1 - (0 + 0) / 2],
    # R_i - group mean (2/3 and 1/3)
    "dr_grpo": [1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3],
    # (R_i - mean) / (unbiased std + 1e-9); both groups have std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    "grpo": [x / (math.sqrt(1 / 3) + 1e-9) for x in (1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3)],
    # R_i - batch mean (1/2)
    "flash_reinforce": [0.5, -0.5, 0.5, -0.5, -0.5, 0.5],
    # R_i - group mean, whitened over the 12 valid tokens: token mean (3/3 - 2/3 + 2/3 - 2/3 - 3/3 + 2/3) / 12 = 0,
    # variance (3 + 4 + 2 + 2 + 3 + 4) / 9 / 12 = 1/6, so each r_i times sqrt(6)
    "reinforce_baseline": [x * math.sqrt(6) for x in (1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3)],
}


def _advantages(name: str, rewards, mask, n: int, returns: ReturnConfig | None = None, **kw) -> torch.Tensor:
    est = get_estimator(name, ShapeConfig(), returns)
    res = compute_token_advantages(est, mask, rewards, n, max_response_len=mask.shape[1], **kw)
    assert res.segment_advantages is None and (res.token_advantages[~mask] == 0).all()
    return res.token_advantages


@pytest.mark.parametrize("name", sorted(HAND))
def test_outcome_terms_hand_computed(name):
    adv = _advantages(name, R, MASK, 3)
    want = torch.tensor(HAND[name])[:, None].expand(-1, 3)
    assert torch.allclose(adv[MASK], want[MASK], atol=1e-6), adv


def test_group_norm_is_grpo():
    from openrlhf_shape.config.compat import translate

    assert translate([("algo.advantage.estimator", "group_norm")]) == [("algo.advantage.estimator", "grpo")]


def test_reinforce_discounts_then_whitens_hand_computed():
    """R = [1, 0], lengths 3 and 2, gamma 0.5: returns [0.25, 0.5, 1 | 0, 0]; token mean 1.75 / 5 = 0.35,
    deviations [-0.1, 0.15, 0.65 | -0.35, -0.35], population variance 0.7 / 5 = 0.14."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rewards = torch.tensor([1.0, 0.0])
    dev = torch.tensor([-0.1, 0.15, 0.65, -0.35, -0.35])
    adv = _advantages("reinforce", rewards, mask, 1, ReturnConfig(gamma=0.5))
    assert torch.allclose(adv[mask], dev / math.sqrt(0.14), atol=1e-6)
    centred = _advantages("reinforce", rewards, mask, 1, ReturnConfig(gamma=0.5, no_std_norm=True))
    assert torch.allclose(centred[mask], dev, atol=1e-6)
    undiscounted = _advantages("reinforce", rewards, mask, 1, ReturnConfig(no_std_norm=True))
    assert torch.allclose(undiscounted[mask], torch.tensor([0.4, 0.4, 0.4, -0.6, -0.6]), atol=1e-6)  # mean 3/5


def test_kl_in_the_reward_hand_computed():
    """Per-token reward -kl_coef * KL on every token (OpenRLHF's KL in the reward), R = [1, 0] for one prompt.

    reinforce_baseline: r = [0.5, -0.5]; token rewards [-0.1, -0.2 + 0.5 | -0.3, 0 - 0.5]; returns
    [0.2, 0.3 | -0.8, -0.5]; mean -0.2; deviations [0.4, 0.5, -0.6, -0.3], variance 0.86 / 4 = 0.215.
    rloo: r = [1, -1]; returns [0.7, 0.8 | -1.3, -1.0]; not whitened."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0])
    token_rewards = torch.tensor([[-0.1, -0.2], [-0.3, 0.0]])
    dev = torch.tensor([[0.4, 0.5], [-0.6, -0.3]])
    adv = _advantages("reinforce_baseline", rewards, mask, 2, token_rewards=token_rewards)
    assert torch.allclose(adv, dev / math.sqrt(0.215), atol=1e-6)
    adv = _advantages("reinforce_baseline", rewards, mask, 2, ReturnConfig(no_std_norm=True), token_rewards=token_rewards)
    assert torch.allclose(adv, dev, atol=1e-6)
    adv = _advantages("rloo", rewards, mask, 2, token_rewards=token_rewards)
    assert torch.allclose(adv, torch.tensor([[0.7, 0.8], [-1.3, -1.0]]), atol=1e-6)


def test_outcome_is_clipped_after_the_baseline():
    """OpenRLHF clips the baselined outcome: R = [30, 0] under dr_grpo gives r = [15, -15], clipped to
    [10, -10]; clipping R first would have given [5, -5]."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards = torch.tensor([30.0, 0.0])
    clipped = _advantages("dr_grpo", rewards, mask, 2, reward_clip_range=(-10.0, 10.0))
    assert torch.allclose(clipped, torch.tensor([[10.0, 10.0], [-10.0, -10.0]]))
    assert torch.allclose(_advantages("dr_grpo", rewards, mask, 2), torch.tensor([[15.0, 15.0], [-15.0, -15.0]]))


def _random_batch(seed: int, prompts: int = 3, n: int = 4, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rewards = torch.where(torch.rand(b, generator=g) < 0.7, (torch.rand(b, generator=g) > 0.5).float(),
                          torch.rand(b, generator=g) * 30 - 10)  # mostly 0/1, some beyond --reward.clip_range
    kl = torch.rand(b, width, generator=g) * 0.4 - 0.1
    return rewards, mask, kl


CASES = [  # (estimator, OpenRLHF flags beyond the estimator, our ReturnConfig)
    ("group_norm", [], ReturnConfig()),
    ("reinforce", [], ReturnConfig()),
    ("reinforce", ["--algo.advantage.gamma", "0.9"], ReturnConfig(gamma=0.9)),
    ("reinforce", ["--algo.advantage.gamma", "0.9", "--algo.advantage.no_std_norm"], ReturnConfig(0.9, True)),
    ("reinforce_baseline", [], ReturnConfig()),
    ("reinforce_baseline", ["--algo.advantage.no_std_norm"], ReturnConfig(no_std_norm=True)),
    ("rloo", [], ReturnConfig()),
    ("dr_grpo", [], ReturnConfig()),
    ("flash_reinforce", [], ReturnConfig()),
]


@pytest.fixture(scope="module")
def openrlhf():
    from openrlhf_source import openrlhf_advantages

    return openrlhf_advantages


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("name, flags, returns", CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in CASES])
def test_equals_openrlhf_compute_advantages_and_returns(openrlhf, name, flags, returns, kl_coef):
    n = 4
    rewards, mask, kl = _random_batch(seed=len(flags) + int(kl_coef * 100))
    argv = ["--algo.advantage.estimator", name, "--rollout.n_samples_per_prompt", str(n), *flags]
    theirs = openrlhf(argv, rewards, mask, kl, kl_coef)
    ours = _advantages("grpo" if name == "group_norm" else name, rewards, mask, n, returns,
                       token_rewards=-kl_coef * kl if kl_coef else None, reward_clip_range=(-10.0, 10.0))
    assert torch.allclose(ours[mask], theirs[mask].float(), atol=1e-5), (ours, theirs)
    assert ours[mask].abs().max() > 0.1  # a real signal was compared, not zeros


@pytest.mark.parametrize("name", ["grpo", "reinforce_baseline", "rloo", "dr_grpo", "flash_reinforce", "shape", "mrt"])
def test_a_gamma_other_than_one_is_refused_where_it_does_nothing(name):
    with pytest.raises(ValueError, match=r"--algo.advantage.gamma 0.9: only --algo.advantage.estimator reinforce"):
        get_estimator(name, ShapeConfig(), ReturnConfig(gamma=0.9))
    get_estimator("reinforce", ShapeConfig(), ReturnConfig(gamma=0.9))


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo", "flash_reinforce", "shape", "mrt"])
def test_no_std_norm_is_refused_where_nothing_is_whitened(name):
    with pytest.raises(ValueError, match=r"--algo.advantage.no_std_norm: .* does not whiten.*dr_grpo"):
        get_estimator(name, ShapeConfig(), ReturnConfig(no_std_norm=True))
    for whitening in ("reinforce", "reinforce_baseline"):
        get_estimator(whitening, ShapeConfig(), ReturnConfig(no_std_norm=True))


def test_group_estimators_need_two_samples_and_flags_are_named():
    for name in ("grpo", "reinforce_baseline", "rloo", "dr_grpo"):
        assert get_estimator(name, ShapeConfig()).needs_group
        with pytest.raises(ValueError, match="n_samples_per_prompt"):
            _advantages(name, torch.tensor([1.0, 0.0]), torch.ones(2, 2, dtype=torch.bool), 1)
    for name in ("reinforce", "flash_reinforce"):  # one sample per prompt is their regime
        assert not get_estimator(name, ShapeConfig()).needs_group
        assert _advantages(name, torch.tensor([1.0, 0.0]), torch.ones(2, 2, dtype=torch.bool), 1).abs().sum() > 0
    with pytest.raises(ValueError, match=r"--algo.advantage.gamma: .* \[0, 1\]"):
        ReturnConfig(gamma=1.5)
    with pytest.raises(ValueError, match="takes no per-token reward"):
        from openrlhf_shape.algorithms import boundaries_to_segment_ids  # noqa: F401  (segment path)

        compute_token_advantages(get_estimator("shape", ShapeConfig()), torch.ones(2, 4, dtype=torch.bool),
                                 torch.tensor([1.0, 0.0]), 2, 4, torch.rand(2, 4), torch.full((2, 1), -1),
                                 torch.tensor([[0.5, 1.0], [0.5, 0.0]]), token_rewards=torch.zeros(2, 4))
