"""``--reward.stop_properly_penalty_coef`` (algorithms/length_penalty.py): a worked batch by hand and against
OpenRLHF 0.11.2's own ``apply_stop_properly_penalty`` (it imports on CPU) on the same batch."""

import pytest
import torch

from openrlhf_shape.algorithms.length_penalty import check_stop_properly_coef, stop_properly_penalty

# Four samples: rewards 1, 0.5, 0, 20 (a plug-in's raw reward, before --reward.clip_range); 2nd and 4th truncated.
REWARDS = torch.tensor([1.0, 0.5, 0.0, 20.0])
TRUNCATED = torch.tensor([False, True, False, True])


@pytest.mark.parametrize("coef, want", [
    (0.0, [1.0, 0.0, 0.0, 0.0]),  # ProRL v2's recipe: a truncated response earns nothing
    (0.5, [1.0, 0.25, 0.0, 10.0]),  # scaled
    (1.0, [1.0, 0.5, 0.0, 20.0]),  # no change
    (-0.5, [1.0, -0.5, 0.0, -0.5]),  # set to the coefficient
])
def test_worked_batch_by_hand(coef, want):
    got = stop_properly_penalty(REWARDS, TRUNCATED, coef)
    assert got.tolist() == want
    assert REWARDS.tolist() == [1.0, 0.5, 0.0, 20.0]  # the input is not modified


@pytest.mark.parametrize("coef", [0.0, 0.3, 1.0, -0.5, -2.0])
def test_equals_openrlhfs_own_function(coef):
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.length_penalty import apply_stop_properly_penalty

    torch.manual_seed(0)
    rewards, truncated = torch.rand(6) * 3 - 1, torch.tensor([True, False, True, True, False, False])
    # OpenRLHF works on micro-batches of experiences, in place
    exps = [Experience(rewards=rewards[:4].clone(), truncated=truncated[:4]),
            Experience(rewards=rewards[4:].clone(), truncated=truncated[4:])]
    assert apply_stop_properly_penalty(exps, coef) == int(truncated.sum())
    theirs = torch.cat([e.rewards for e in exps])
    assert torch.equal(stop_properly_penalty(rewards, truncated, coef), theirs)


def test_dtype_and_refusals():
    assert stop_properly_penalty(torch.tensor([1, 2]), torch.tensor([True, False]), 0.5).dtype == torch.float32
    for bad in (1.5, float("nan")):
        with pytest.raises(ValueError, match=r"--reward\.stop_properly_penalty_coef"):
            check_stop_properly_coef(bad)
    with pytest.raises(ValueError, match=r"\[B\]"):
        stop_properly_penalty(REWARDS, TRUNCATED[:3], 0.0)
