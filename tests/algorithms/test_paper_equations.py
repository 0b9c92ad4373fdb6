"""SHAPE maths against the paper's own numbers and appendix A theorems."""

import itertools
import random

import pytest
import torch

from openrlhf_shape.algorithms import (
    ShapeConfig,
    dynamic_gamma,
    get_estimator,
    grpo_advantages,
    mrt_segment_advantages,
    shape_segment_advantages,
)


@pytest.mark.parametrize(
    "gamma, expected_f",
    [(1.0, 0.250), (0.9, 0.1625), (0.8, 0.075), (0.7, -0.0125), (0.6, -0.100)],
)
def test_table5_shaping_reward(gamma, expected_f):
    # Table 5: F = gamma * Phi_{k+1} - Phi_k for Phi 5/8 -> 7/8. With R = 0 and alpha = 1, A_k = F.
    phi = torch.tensor([5 / 8, 7 / 8])
    a = shape_segment_advantages(phi, torch.tensor([3.0]), 0.0, alpha=1.0, fixed_gamma=gamma)
    assert a.shape == (1,)
    assert a.item() == pytest.approx(expected_f, abs=1e-6)


def test_table5_through_dynamic_gamma():
    # The same numbers reached through eq. 8: gamma = 1 - (L / L_ref)(1 - gamma_min) with gamma_min 0.5.
    lengths = torch.tensor([0.0, 20.0, 40.0, 60.0, 80.0])
    g = dynamic_gamma(lengths, gamma_min=0.5, l_ref=100.0)
    assert torch.allclose(g, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6]))
    phi = torch.tensor([[5 / 8, 7 / 8]] * 5)
    a = shape_segment_advantages(phi, lengths[:, None], torch.zeros(5), alpha=1.0, gamma_min=0.5, l_ref=100.0)
    assert torch.allclose(a[:, 0], torch.tensor([0.25, 0.1625, 0.075, -0.0125, -0.1]), atol=1e-6)


def test_dynamic_gamma_floor_and_linear_decay():
    g = dynamic_gamma(torch.tensor([0.0, 50.0, 100.0, 1000.0]), gamma_min=0.9, l_ref=100.0)
    assert torch.allclose(g, torch.tensor([1.0, 0.95, 0.9, 0.9]))


def test_shape_advantage_hand_computed():
    # K = 3, R = 1, alpha 0.3, gamma_min 0.9, L_ref 100; lengths 50, 100, 10.
    phi = torch.tensor([0.25, 0.5, 0.375, 1.0])
    lengths = torch.tensor([50.0, 100.0, 10.0])
    a = shape_segment_advantages(phi, lengths, 1.0, alpha=0.3, gamma_min=0.9, l_ref=100.0)
    gam = [0.95, 0.9, 0.99]
    want = [1 + 0.3 * (gam[0] * 0.5 - 0.25), 1 + 0.3 * (gam[1] * 0.375 - 0.5), 1 + 0.3 * (gam[2] * 1.0 - 0.375)]
    assert torch.allclose(a, torch.tensor(want), atol=1e-6)


def test_mrt_hand_computed():
    phi = torch.tensor([0.25, 0.5, 0.0])  # K = 2, R = 0
    a = mrt_segment_advantages(phi, 0.0, alpha=0.3)
    assert torch.allclose(a, torch.tensor([-0.3 * 0.25, -0.3 * 0.5]))


def test_grpo_hand_computed_and_constant_groups():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = grpo_advantages(r)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased
    assert torch.allclose(a[0], (r[0] - 0.5) / (std + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        grpo_advantages(torch.ones(3, 1))


def _random_trajectory(rng, k_max=8, m=8):
    k = rng.randint(1, k_max)
    phi = [rng.randint(0, m) / m for _ in range(k + 1)]
    lengths = [rng.randint(1, 400) for _ in range(k)]
    return phi, lengths


def _total(phi, lengths, r, alpha, gamma_min, l_ref=100.0):
    a = shape_segment_advantages(torch.tensor(phi), torch.tensor(lengths, dtype=torch.float32), r,
                                 alpha=alpha, gamma_min=gamma_min, l_ref=l_ref)
    return float(a.sum())


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.49])
def test_appendix_a1_task_consistency_holds_below_half(alpha):
    # Appendix A.1 under its own assumptions: potentials anywhere on the m = 8 grid (the last one
    # included), gamma in [gamma_min, 1]. Every correct total must beat every incorrect total.
    rng = random.Random(0)
    correct = [_total(*_random_trajectory(rng), 1.0, alpha, 0.9) for _ in range(400)]
    wrong = [_total(*_random_trajectory(rng), 0.0, alpha, 0.9) for _ in range(400)]
    # The adversarial corners of the proof must be in the comparison too.
    correct.append(_total([1.0, 0.0], [400], 1.0, alpha, 0.9))
    wrong.append(_total([0.0, 1.0], [1], 0.0, alpha, 0.9))
    assert min(correct) > max(wrong)
    # and the proof's bounds: min correct >= 1 - alpha, max wrong <= alpha
    assert min(correct) >= 1 - alpha - 1e-6 and max(wrong) <= alpha + 1e-6


@pytest.mark.parametrize("alpha", [0.5, 0.7])
def test_appendix_a1_fails_at_half_or_more(alpha):
    correct = _total([1.0, 0.0], [400], 1.0, alpha, 0.9)  # 1 - alpha
    wrong = _total([0.0, 1.0], [0], 0.0, alpha, 0.9)  # alpha (gamma = 1 for L = 0)
    assert not correct > wrong


def test_appendix_a1_with_terminal_potential_equal_to_outcome():
    # Our implementation fixes Phi_K = R; consistency then holds with margin for any alpha < 1.
    rng = random.Random(1)
    for _ in range(300):
        phi, lengths = _random_trajectory(rng)
        good = _total(phi[:-1] + [1.0], lengths, 1.0, 0.45, 0.9)
        phi2, lengths2 = _random_trajectory(rng)
        bad = _total(phi2[:-1] + [0.0], lengths2, 0.0, 0.45, 0.9)
        assert good > bad


def test_appendix_a2_sign_consistency_bound():
    # gamma above 7/8 keeps F > 0 for 7/8 -> 1; at or below it the sign flips (or F = 0).
    for g, positive in [(0.9, True), (0.876, True), (0.875, False), (0.8, False)]:
        f = shape_segment_advantages(torch.tensor([7 / 8, 1.0]), torch.tensor([1.0]), 0.0, alpha=1.0, fixed_gamma=g)
        assert (f.item() > 0) == positive
    # every improving step on the m = 8 grid gets F > 0 at gamma_min = 0.9, worst length
    for lo, hi in itertools.combinations(range(9), 2):
        f = shape_segment_advantages(torch.tensor([lo / 8, hi / 8]), torch.tensor([1e6]), 0.0, alpha=1.0,
                                     gamma_min=0.9, l_ref=1.0)
        assert f.item() > 0


def test_appendix_a3_monotone_in_start_potential_and_length():
    rng = random.Random(2)
    for _ in range(300):
        delta = rng.uniform(-0.5, 0.5)
        phi_a, phi_b = sorted(rng.uniform(max(0, -delta), min(1, 1 - delta)) for _ in range(2))
        L = torch.tensor([rng.uniform(0, 300)])
        f_a = shape_segment_advantages(torch.tensor([phi_a, phi_a + delta]), L, 0.0, alpha=1.0, gamma_min=0.9, l_ref=100)
        f_b = shape_segment_advantages(torch.tensor([phi_b, phi_b + delta]), L, 0.0, alpha=1.0, gamma_min=0.9, l_ref=100)
        assert f_b.item() <= f_a.item() + 1e-6  # non-increasing in Phi_k (fixed Delta, L)
        phi = torch.tensor([phi_a, phi_a + delta])
        l1, l2 = sorted([rng.uniform(0, 300), rng.uniform(0, 300)])
        g1 = shape_segment_advantages(phi, torch.tensor([l1]), 0.0, alpha=1.0, gamma_min=0.9, l_ref=100)
        g2 = shape_segment_advantages(phi, torch.tensor([l2]), 0.0, alpha=1.0, gamma_min=0.9, l_ref=100)
        assert g2.item() <= g1.item() + 1e-6  # non-increasing in L_k


def test_shape_config_refuses_unsafe_hparams_and_cites_appendix():
    for estimator in ("shape", "mrt"):  # alpha scales their shaping term
        with pytest.raises(ValueError, match=r"--shape.alpha.*A\.1"):
            get_estimator(estimator, ShapeConfig(alpha=0.5))
    with pytest.raises(ValueError, match=r"--shape.gamma_min.*A\.2"):
        ShapeConfig(gamma_min=0.875).check_reward_sign(8)  # m = 8 probes (ProbeConfig owns m)
    with pytest.raises(ValueError, match=r"--shape.fixed_gamma.*A\.2"):
        ShapeConfig(fixed_gamma=0.7).check_reward_sign(8)
    cfg = ShapeConfig(alpha=0.6, gamma_min=0.7, allow_unsafe_hparams=True)
    assert get_estimator("shape", cfg).cfg.alpha == 0.6
    assert get_estimator("grpo", ShapeConfig(alpha=0.9)).name == "grpo"  # GRPO ignores alpha


@pytest.mark.parametrize("m", [4, 8, 16])
def test_a2_bound_follows_num_probes(m):
    bound = (m - 1) / m
    just_above, at = bound + 1e-3, bound
    # the bound is tight: just above it the worst step (m-1)/m -> 1 is rewarded, at it it is not
    f = shape_segment_advantages(torch.tensor([bound, 1.0]), torch.tensor([1.0]), 0.0, alpha=1.0, fixed_gamma=just_above)
    assert f.item() > 0
    f = shape_segment_advantages(torch.tensor([bound, 1.0]), torch.tensor([1.0]), 0.0, alpha=1.0, fixed_gamma=at)
    assert f.item() <= 1e-7
    ShapeConfig(gamma_min=min(1.0, just_above)).check_reward_sign(m)  # m is --probe.num_probes' (ProbeConfig's)
    for name in ("gamma_min", "fixed_gamma"):
        with pytest.raises(ValueError) as err:
            ShapeConfig(**{name: at}).check_reward_sign(m)
        msg = str(err.value)
        assert f"--shape.{name}" in msg and "--probe.num_probes" in msg and "--shape.allow_unsafe_hparams" in msg
        assert "A.2" in msg and f"{m - 1}/{m}" in msg
    ShapeConfig(gamma_min=at, allow_unsafe_hparams=True).check_reward_sign(m)
    get_estimator("mrt", ShapeConfig(gamma_min=at)).check_reward_sign(m)  # MRT has no gamma
    with pytest.raises(ValueError, match=r"--shape.gamma_min.*A\.2"):
        get_estimator("shape", ShapeConfig(gamma_min=at)).check_reward_sign(m)  # SHAPE discounts: the bound holds


def test_gamma_min_0_9_is_refused_with_16_probes():
    ShapeConfig(gamma_min=0.9).check_reward_sign(8)
    with pytest.raises(ValueError, match=r"--shape.gamma_min.*15/16"):
        ShapeConfig(gamma_min=0.9).check_reward_sign(16)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"num_segments": 0}, "num_segments"),
        ({"tcr_beta": -1}, "tcr_beta"),
        ({"tcr_delta_min": 1.2}, "tcr_delta_min"),
        ({"tcr_delta_max": 0.9}, "tcr_delta_min"),
        ({"segmentation": "commas"}, "segmentation"),
        ({"entropy_quantile": 1.5}, "entropy_quantile"),
        ({"l_ref": 0}, "l_ref"),
    ],
)
def test_shape_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ShapeConfig(**kwargs)


def test_l_ref_defaults_to_max_len_over_k():
    assert ShapeConfig(num_segments=8).resolved_l_ref(8192) == 1024.0
    assert ShapeConfig(l_ref=300).resolved_l_ref(8192) == 300.0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="lengths shape"):
        shape_segment_advantages(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0]), 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        shape_segment_advantages(torch.tensor([0.1, 1.2]), torch.tensor([1.0]), 1.0)
    with pytest.raises(ValueError, match="NaN"):
        shape_segment_advantages(torch.tensor([0.1, float("nan")]), torch.tensor([1.0]), 1.0)
    with pytest.raises(ValueError, match="K >= 1"):
        mrt_segment_advantages(torch.tensor([0.5]), 1.0)
