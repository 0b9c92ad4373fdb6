"""Instruments of the advantage (issue 23): shaping vs outcome size, advantage by correctness, the
group-std-scaled outcome term that keeps the paper's task-consistency bound, the length-collapse alarm."""

import pytest
import torch

from openrlhf_shape.algorithms import ShapeConfig, get_estimator
from openrlhf_shape.algorithms.metrics import advantage_by_outcome, discount_instruments, shaping_to_outcome
from openrlhf_shape.algorithms.pipeline import compute_token_advantages
from openrlhf_shape.trainer.length_alarm import LengthCollapseAlarm


def test_advantage_by_outcome_separates_correct_and_wrong():
    adv = torch.tensor([[1.0, 3.0, 0.0], [0.5, 0.5, 0.5], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    m = advantage_by_outcome(adv, mask, torch.tensor([1.0, 0.0, 0.0]))
    assert m["adv/correct/mean"] == pytest.approx(2.0) and m["adv/correct/count"] == 1
    assert m["adv/wrong/mean"] == pytest.approx(-0.25) and m["adv/wrong/std"] == pytest.approx(0.75)
    assert m["adv/wrong/count"] == 2


def test_shaping_to_outcome_ratio():
    seg = torch.tensor([[1.2, 0.9], [0.1, -0.3]])
    m = shaping_to_outcome(seg, torch.tensor([1.0, 0.0]), torch.tensor([[True, True], [True, False]]))
    assert m["shape/shaping_abs/mean"] == pytest.approx((0.2 + 0.1 + 0.1) / 3)
    assert m["shape/shaping_to_outcome"] == pytest.approx(((0.2 + 0.1 + 0.1) / 3) / 0.5)
    assert "shape/shaping_to_outcome" not in shaping_to_outcome(seg, torch.zeros(2), torch.ones(2, 2, dtype=bool))


def _worst_case_group(alpha: float, baseline: str):
    """Two responses of one prompt, two 2-token segments each, gamma ~ 1: the correct one's potential
    falls 1 -> 0 (its worst shaping, -alpha), the wrong one's rises 0 -> 1 (its best, +alpha): appendix
    A.1's worst case. Returns (segment advantages [2, 2], metrics)."""
    cfg = ShapeConfig(alpha=alpha, outcome_baseline=baseline, tcr=False, num_segments=2,
                      allow_unsafe_hparams=alpha >= 0.5)
    mask = torch.ones(2, 4, dtype=torch.bool)
    res = compute_token_advantages(get_estimator("shape", cfg), mask, torch.tensor([1.0, 0.0]), group_size=2, max_response_len=100_000,
                                   boundaries=torch.tensor([[2], [2]]),
                                   potentials=torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    return res.segment_advantages, res.metrics


@pytest.mark.parametrize("baseline", ["none", "group_mean", "group_norm_scaled"])
def test_task_consistency_bound_alpha_half_holds_as_written(baseline):
    """Every correct segment's advantage exceeds every wrong one's for alpha < 0.5 and not beyond: the
    bound of appendix A.1 keeps its meaning under the scaled outcome term."""
    seg, m = _worst_case_group(0.49, baseline)
    assert seg[0].min() > seg[1].max()
    seg, _ = _worst_case_group(0.6, baseline)
    assert seg[0].min() < seg[1].max()  # past the bound the worst case breaks, as the paper says


def test_group_norm_moves_the_bound_and_scaled_is_group_mean_over_std():
    seg_norm, _ = _worst_case_group(0.6, "group_norm")
    assert seg_norm[0].min() > seg_norm[1].max()  # alpha 0.6 still "consistent": the bound moved to 1/(2 std)
    scaled, m = _worst_case_group(0.3, "group_norm_scaled")
    centred, _ = _worst_case_group(0.3, "group_mean")
    std = torch.tensor([1.0, 0.0]).std()
    assert torch.allclose(scaled, centred / std, atol=1e-6)
    # the shaping keeps its size relative to the outcome: alpha * 1 / 0.5 per segment
    assert m["shape/shaping_to_outcome"] == pytest.approx(0.3 / 0.5, rel=1e-4)


def test_discount_instruments_on_the_papers_gamma_bound_table():
    """Appendix A.2's table: a positive step Phi 5/8 -> 7/8 gets F = gamma * 7/8 - 5/8, which flips sign
    below gamma 5/7 (F = -0.0125 at 0.7). One response per gamma of the table, one segment each; a sixth
    row whose potential falls (not an improving step) and a padded segment beyond a row's last that
    would reverse (ignored)."""
    gammas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.7]
    phi = torch.tensor([[5 / 8, 7 / 8, 0.0]] * 5 + [[7 / 8, 5 / 8, 0.0]])
    phi[0, 2] = 1.0  # row 0 has a second, padded transition 7/8 -> 1
    gamma = torch.tensor([[g, 0.1] for g in gammas])  # gamma 0.1 on the padded segment would reverse it
    m = discount_instruments(phi, gamma, torch.ones(6, dtype=torch.long), alpha=0.3)
    assert m["shape/improving_transitions"] == 5
    assert m["shape/sign_reversal_rate"] == pytest.approx(2 / 5)  # gamma 0.7 and 0.6
    taxes = [0.3 * (1 - g) * 7 / 8 for g in gammas[:5]] + [0.3 * 0.3 * 5 / 8]
    assert m["shape/length_tax/mean"] == pytest.approx(sum(taxes) / 6)
    assert m["shape/length_tax/max"] == pytest.approx(0.3 * 0.4 * 7 / 8)


@pytest.mark.parametrize("gamma_min,reversed_share", [(0.9, 0.0), (0.7, 0.5)])
def test_sign_reversal_follows_the_appendix_bound_for_m_4(gamma_min, reversed_share):
    """With m = 4 probes the worst positive step is Phi 3/4 -> 1 (bound (m-1)/m = 0.75): a segment as long
    as L_ref gets gamma = gamma_min, so at 0.7 that step's shaping is 0.7 - 0.75 < 0 and at 0.9 it stays
    positive; the response's other improving step (0 -> 3/4) stays positive at both."""
    cfg = ShapeConfig(gamma_min=gamma_min, num_segments=2, min_segment_len=1, tcr=False,
                      allow_unsafe_hparams=gamma_min <= 0.75)
    res = compute_token_advantages(get_estimator("shape", cfg), torch.ones(1, 8, dtype=torch.bool), torch.tensor([1.0]), group_size=1,
                                   max_response_len=8, boundaries=torch.tensor([[4]]),
                                   potentials=torch.tensor([[0.0, 0.75, 1.0]]))
    m = res.metrics
    assert m["shape/gamma/mean"] == pytest.approx(gamma_min)
    assert m["shape/improving_transitions"] == 2
    assert m["shape/sign_reversal_rate"] == pytest.approx(reversed_share)
    assert m["shape/length_tax/mean"] == pytest.approx(0.3 * (1 - gamma_min) * (0.75 + 1.0) / 2)
    # the metric says what the advantage does: the reversed segment's advantage is below the outcome R
    assert (res.segment_advantages[0, 1] < 1.0) == (reversed_share > 0)


# Mean length and training accuracy per step of the CPU demo runs (docs/results/stale_lm_head): the
# paper-form SHAPE run whose answers collapsed to ~12 tokens, and GRPO's, which did not.
SHAPE_LEN = [45, 76, 33, 45, 25, 23, 21, 25, 13, 11, 13, 12]
SHAPE_ACC = [0.09, 0.09, 0.06, 0.31, 0.31, 0.16, 0.38, 0.41, 0.31, 0.16, 0.25, 0.25]
GRPO_LEN = [45, 88, 59, 58, 39, 32, 19, 42, 26, 19, 38, 47]
GRPO_ACC = [0.09, 0.06, 0.12, 0.19, 0.41, 0.19, 0.25, 0.31, 0.31, 0.38, 0.22, 0.25]


def _fired(lengths, accs, **kw) -> list[int]:
    alarm = LengthCollapseAlarm(**kw)
    steps = []
    for step, (length, acc) in enumerate(zip(lengths, accs), start=1):
        metrics = {"rollout/response_length/mean": length, "rollout/accuracy": acc}
        if alarm.update(step, metrics):
            assert metrics["alarm/length_collapse"] == 1.0
            steps.append(step)
    return steps


def test_length_alarm_fires_on_a_collapse_and_not_on_grpo():
    assert _fired(SHAPE_LEN, SHAPE_ACC) == [11, 12]  # e.g. step 12: 19.7 -> 12.0 tokens while accuracy 0.37 -> 0.22
    assert _fired(GRPO_LEN, GRPO_ACC) == []
    assert _fired(SHAPE_LEN, SHAPE_ACC, fraction=0.0) == []  # off
    # shorter answers with RISING accuracy are the paper's goal, not a collapse
    assert _fired([60, 60, 60, 30, 30, 30], [0.2, 0.2, 0.2, 0.4, 0.4, 0.4]) == []
    assert _fired([60, 60, 60, 30, 30, 30], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]) == [6]


def test_length_alarm_windows_span_a_resume():
    """Resumed after step 10 (its history restored from the logged steps), the alarm fires where the
    uninterrupted run's did; with an empty history it would stay silent for two windows."""
    rows = [{"step": 0, "eval/accuracy": 0.1}]  # the step-0 eval row has no rollout: not part of the history
    rows += [{"step": s, "rollout/response_length/mean": n, "rollout/accuracy": a}
             for s, (n, a) in enumerate(zip(SHAPE_LEN[:10], SHAPE_ACC[:10]), start=1)]
    uninterrupted = LengthCollapseAlarm()
    for row in rows[1:]:
        uninterrupted.update(row["step"], dict(row))
    resumed = LengthCollapseAlarm()
    resumed.restore(rows)
    assert resumed.history == uninterrupted.history
    for step in (11, 12):
        a = {"rollout/response_length/mean": SHAPE_LEN[step - 1], "rollout/accuracy": SHAPE_ACC[step - 1]}
        b = dict(a)
        assert resumed.update(step, a) and uninterrupted.update(step, b)
        assert a == b and a["alarm/length_drop"] > 0.3


def test_length_alarm_flags_are_validated():
    with pytest.raises(ValueError, match="--shape.length_alarm_fraction"):
        LengthCollapseAlarm(fraction=1.5)
    with pytest.raises(ValueError, match="--shape.length_alarm_window"):
        LengthCollapseAlarm(window=0)


def test_group_norm_scaled_bounds_the_scale_of_a_uniform_group():
    """A group whose rewards are all equal has no spread to divide by: its divisor is floored at 1/sqrt(n),
    the spread of a group with one right answer of n, where dividing by std + eps multiplied its shaping by
    1e6 and let one all-wrong group with moving potentials outweigh the whole batch."""
    cfg = ShapeConfig(alpha=0.3, outcome_baseline="group_norm_scaled", tcr=False, num_segments=2)
    centred = ShapeConfig(alpha=0.3, outcome_baseline="group_mean", tcr=False, num_segments=2)
    mask = torch.ones(6, 4, dtype=torch.bool)
    kw = dict(group_size=3, max_response_len=100_000, boundaries=torch.full((6, 1), 2),
              potentials=torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0],     # all wrong
                                       [0.0, 0.5, 1.0], [0.0, 1.0, 0.0], [0.0, 0.5, 0.0]]))  # one right
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    scaled = compute_token_advantages(get_estimator("shape", cfg), mask, rewards, **kw).segment_advantages
    plain = compute_token_advantages(get_estimator("shape", centred), mask, rewards, **kw).segment_advantages
    assert plain[:3].abs().max() > 0  # the all-wrong group's shaping: SHAPE's credit where GRPO has none
    assert torch.allclose(scaled[:3], plain[:3] * 3**0.5)  # floored divisor 1/sqrt(3)
    one_right = torch.tensor([1.0, 0.0, 0.0]).std()
    assert one_right == pytest.approx(3**-0.5)  # the floor is exactly the one-right group's spread
    assert torch.allclose(scaled[3:], plain[3:] / one_right, atol=1e-6)
