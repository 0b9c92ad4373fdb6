"""The pure parts of partial rollouts in the trainer (trainer/partial.py, trainer/schedule.py): the per-response
version metrics on a hand example, and a checkpoint of the other mode or cut refused with the flag to change."""

import pytest

from openrlhf_shape.rollout.partial import PartialRolloutPool
from openrlhf_shape.trainer.partial import version_metrics
from openrlhf_shape.trainer.schedule import check_resumable


def test_version_metrics_by_hand():
    # three responses: tokens of versions 0,0,1 / 1,1 / 0 (the engines now hold version 1)
    m = version_metrics([[0, 0, 1], [1, 1], [0]], current=1)
    assert m["rollout/response_versions"] == [[0, 1], [1], [0]]
    assert m["partial/multi_version_share"] == pytest.approx(1 / 3)
    assert m["partial/versions_per_response/mean"] == pytest.approx(4 / 3)
    assert m["partial/token_age/mean"] == pytest.approx(3 / 6)  # ages 1,1,0,0,0,1


def test_a_checkpoint_of_the_other_mode_or_cut_is_refused_naming_the_flag():
    partial = {"async_pending": "step_000001.pt", "async_staleness": 1, "partial_rollout": 8}
    plain = {"async_pending": "step_000001.pt", "async_staleness": 1}
    check_resumable(partial, True, 1, partial_chunk=8)
    check_resumable(plain, True, 1, partial_chunk=0)
    with pytest.raises(ValueError, match=r"--train\.partial_rollout_enable: .* cut every 8 tokens"):
        check_resumable(partial, True, 1, partial_chunk=0)
    with pytest.raises(ValueError, match=r"--train\.partial_rollout_enable: .* cut every 8 tokens"):
        check_resumable(partial, True, 1, partial_chunk=16)
    with pytest.raises(ValueError, match=r"without partial rollouts.*resume without --train\.partial_rollout_enable"):
        check_resumable(plain, True, 1, partial_chunk=8)
    pool = PartialRolloutPool(8, 24, 2, run_seed=0)
    with pytest.raises(ValueError, match=r"--rollout\.partial_chunk_tokens 4: .* cut at 8"):
        PartialRolloutPool(4, 24, 2, run_seed=0).load_state_dict(pool.state_dict())
    with pytest.raises(ValueError, match=r"--rollout\.partial_chunk_tokens 25"):
        PartialRolloutPool(25, 24, 2, run_seed=0)
