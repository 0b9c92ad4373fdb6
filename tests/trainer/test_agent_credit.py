"""Credit for agent episodes (``--train.agent_func_path``) on a hand-computed worked example: segments, SHAPE's
segment advantages and TCR act on the policy's own tokens only; the environment's replies get no boundary, no
advantage and no place in a segment's length or entropy statistics; probes start from states that end in the
policy's turn or right after a whole reply.

No engine: the experience maker's segment and advantage phases on a hand-made batch (what they compute is what
the step computes; tests/trainer/test_agent_experience.py runs them on real episodes).
"""

import pytest
import torch

from openrlhf_shape.algorithms import ShapeConfig, get_estimator
from openrlhf_shape.batch import ActionColumns, ExperienceBatch, length_mask
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.probes import ProbeConfig, ProbeSuffixes, estimate_potentials
from openrlhf_shape.trainer.experience import ShapeExperienceMaker

# Row 0, an agent's episode: the policy's tokens at columns 0, 1, 4, 5; the environment's reply at 2, 3 and a
# closing reply at 6. Row 1: a plain response (4 policy tokens), the same values at its policy tokens.
POLICY = [[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]]
LENGTHS = [7, 4]
# Entropies: at the policy's tokens 1, 3 (first segment) and 2, 2 (second); 9 in the replies, which would move
# the TCR statistics and the entropy quantile if they were read.
ENTROPY = [[1.0, 3.0, 9.0, 9.0, 2.0, 2.0, 9.0], [1.0, 3.0, 2.0, 2.0, 0.0, 0.0, 0.0]]


def _batch() -> ExperienceBatch:
    width = max(LENGTHS)
    resp = length_mask(LENGTHS, width)
    return ExperienceBatch(
        items=[None, None], sequences=[[5] + [7] * LENGTHS[0], [5] + [7] * LENGTHS[1]], prompt_lens=[1, 1],
        texts=["", ""], response_mask=resp, rewards=torch.tensor([1.0, 1.0]),
        entropy=torch.tensor(ENTROPY) * resp, action_mask=torch.tensor(POLICY, dtype=torch.bool),
    )


@pytest.fixture(scope="module")
def maker(tiny_tokenizer):
    """SHAPE, uniform segmentation in K = 2 (the worked example's boundary does not depend on entropy), alpha 0.3,
    gamma_min 0.9, L_ref = max_tokens / K = 8 / 2 = 4, TCR beta 0.5 clipped to [0.5, 1.5]."""
    cfg = ShapeConfig(segmentation="uniform", num_segments=2, min_segment_len=1, alpha=0.3, gamma_min=0.9)
    return ShapeExperienceMaker(get_estimator("shape", cfg), SamplingConfig(n=1, max_tokens=8),
                                ProbeConfig(num_probes=16), engines=None, logprobs_fn=None, reward=None,
                                tokenizer=tiny_tokenizer)


def test_action_columns_map_policy_tokens_both_ways():
    cols = ActionColumns.of(torch.tensor(POLICY, dtype=torch.bool))
    assert cols.positions[0].tolist() == [0, 1, 4, 5] and cols.positions[1].tolist() == [0, 1, 2, 3]
    assert cols.mask.all()
    ent = torch.tensor(ENTROPY)
    assert cols.gather(ent).tolist() == [[1.0, 3.0, 2.0, 2.0], [1.0, 3.0, 2.0, 2.0]]
    assert cols.scatter(cols.gather(ent)).tolist() == [[1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 0.0],
                                                       [1.0, 3.0, 2.0, 2.0, 0.0, 0.0, 0.0]]
    assert cols.to_response(torch.tensor([[2, -1], [1, 3]])).tolist() == [[4, -1], [1, 3]]


def test_segments_and_advantages_cover_only_the_policys_tokens(maker):
    """By hand: both rows have 4 policy tokens, so the uniform boundary is policy token 2 (row 0: column 4, the
    first token after the reply), segment lengths 2 and 2, gamma = max(0.9, 1 - (2/4)(0.1)) = 0.95. With
    Phi = (0.5, 0.25, R = 1): A_1 = 1 + 0.3 (0.95 * 0.25 - 0.5) = 0.92125, A_2 = 1 + 0.3 (0.95 * 1 - 0.25) = 1.21.
    TCR: segment 1's entropies 1, 3 (mean 2, std 1) give w = 1 -/+ 0.5 = 0.5, 1.5; segment 2's are equal, w = 1."""
    exp = _batch()
    boundaries = maker.segment(exp).value
    assert boundaries.tolist() == [[2], [2]]  # counted in policy tokens
    assert exp.action_columns().to_response(boundaries).tolist() == [[4], [2]]  # the probes' states
    potentials = torch.tensor([[0.5, 0.25, 1.0], [0.5, 0.25, 1.0]])
    out = maker.advantages(exp, boundaries, potentials)
    a1, a2 = 1 + 0.3 * (0.95 * 0.25 - 0.5), 1 + 0.3 * (0.95 * 1.0 - 0.25)
    w_lo, w_hi = 1 - 0.5 / (1 + 1e-6), 1 + 0.5 / (1 + 1e-6)
    want = torch.tensor([[a1 * w_lo, a1 * w_hi, 0, 0, a2, a2, 0], [a1 * w_lo, a1 * w_hi, a2, a2, 0, 0, 0]])
    torch.testing.assert_close(out.value.advantages, want, rtol=0, atol=1e-6)
    assert out.metrics["shape/segment_length/mean"] == 2.0  # the reply's tokens are in no segment
    assert out.metrics["adv/token/mean"] == pytest.approx(float(want[torch.tensor(POLICY, dtype=torch.bool)].mean()))


def test_train_batch_loss_mask_is_the_policys_tokens():
    exp = _batch()
    exp.old_log_probs = exp.advantages = torch.zeros(2, 7)
    tb = exp.train_batch([0, 1], temperature=1.0)
    assert tb.loss_mask.tolist() == [[bool(x) for x in row] for row in POLICY]
    assert exp.select([0]).loss_mask().tolist() == [[bool(x) for x in POLICY[0]]]


def test_a_probe_state_inside_an_environment_reply_is_refused(tiny_tokenizer):
    """Boundary 3 of row 0 would probe from prompt + y[:3], which ends inside the reply at columns 2-3."""
    suffixes = ProbeSuffixes.from_tokenizer(tiny_tokenizer, ProbeConfig())
    policy = [[bool(x) for x in POLICY[0]]]
    with pytest.raises(ValueError, match="inside an environment reply"):
        estimate_potentials(None, [[5]], [[7] * 7], [[3]], ["1"], [1.0], None, ProbeConfig(), suffixes=suffixes,
                            policy_tokens=policy)
    with pytest.raises(ValueError, match="inside an environment reply"):  # the closing reply, too
        estimate_potentials(None, [[5]], [[7] * 7], [[1, 6]], ["1"], [1.0], None, ProbeConfig(), suffixes=suffixes,
                            policy_tokens=policy)


def test_reinforce_discounts_over_the_replies_positions_as_openrlhf(tiny_tokenizer):
    """OpenRLHF's REINFORCE++ on an agent's episode: the outcome sits on the policy's last token and the return is
    discounted per position of the response, the reply's positions included (its action mask zeroes their rewards,
    not their time steps), then whitened over the policy's tokens. By hand, gamma 0.5, R = 1, mean-only whitening:
    row 0 (policy at 0, 1, 4, 5) returns 0.5^5, 0.5^4, 0.5, 1; row 1 (policy at 0..3) 0.5^3, 0.5^2, 0.5, 1; minus
    their mean over the 8 policy tokens; 0 in the replies."""
    from openrlhf_shape.algorithms import ReturnConfig

    est = get_estimator("reinforce", ShapeConfig(), ReturnConfig(gamma=0.5, no_std_norm=True))
    maker = ShapeExperienceMaker(est, SamplingConfig(n=1, max_tokens=8), ProbeConfig(), engines=None,
                                 logprobs_fn=None, reward=None, tokenizer=tiny_tokenizer)
    exp = maker.advantages(_batch(), None, None).value
    ret = torch.tensor([[0.5 ** 5, 0.5 ** 4, 0, 0, 0.5, 1, 0], [0.5 ** 3, 0.5 ** 2, 0.5, 1, 0, 0, 0]])
    policy = torch.tensor(POLICY, dtype=torch.bool)
    want = torch.where(policy, ret - ret[policy].mean(), torch.zeros(()))
    torch.testing.assert_close(exp.advantages, want, rtol=0, atol=1e-6)
