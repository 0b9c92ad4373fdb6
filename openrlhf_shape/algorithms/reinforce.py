"""OpenRLHF's critic-free estimators (``--algo.advantage.estimator``), with OpenRLHF 0.11.2's semantics.

Each takes the outcomes R ``[B]`` of one step (n samples per prompt) and returns token advantages ``[B, T]``
by the four stages of :mod:`.returns`; they differ in the outcome term r_i, the discount (gamma 1 unless
stated) and the whitening (none unless stated):

- ``reinforce`` (REINFORCE++): r_i = R_i; discount ``--algo.advantage.gamma``; whitened.
- ``reinforce_baseline``: r_i = R_i - the mean of its prompt's group; whitened.
- ``rloo``: r_i = R_i - the mean of the other n-1 samples of its prompt.
- ``dr_grpo``: r_i = R_i - the mean of its group (GRPO without the std division).
- ``grpo``: r_i = (R_i - group mean) / (group std + 1e-9).
- ``flash_reinforce``: r_i = R_i - the mean of the whole batch (for one sample per prompt).

(``grpo`` is OpenRLHF's ``group_norm``; ``--algo.advantage.estimator group_norm`` selects it.) r_i is clipped
into ``--reward.clip_range`` after the baseline, as OpenRLHF does. "Whitened": the returns of every valid
token of the batch are shifted to mean 0 and divided by their std (``--algo.advantage.no_std_norm``: mean
only). KL in the reward enters as :attr:`SequenceInputs.token_rewards` (``-kl_coef * KL_t`` on every token),
so with KL each token's advantage is its own return; without it every token of a response gets r_i (times
gamma^(T-1-t) under ``reinforce``), before whitening. ``gae`` needs a critic: :mod:`.gae`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from openrlhf_shape.algorithms.estimators import AdvantageEstimator, SequenceInputs, register
from openrlhf_shape.algorithms.returns import baselined_outcomes, discounted_returns, outcome_token_rewards, whiten


class OutcomeReturnEstimator(AdvantageEstimator):
    """Base of the outcome estimators: ``outcome_term`` names the baseline of :func:`baselined_outcomes`."""

    needs_segments = False
    outcome_term: ClassVar[str] = "none"

    def token_advantages(self, x: SequenceInputs) -> torch.Tensor:
        rewards = torch.as_tensor(x.rewards, dtype=torch.float32)
        if x.group_size < 1 or rewards.numel() % x.group_size:
            raise ValueError(f"batch {rewards.numel()} is not a multiple of group_size {x.group_size} "
                             "(--rollout.n_samples_per_prompt)")
        outcome = baselined_outcomes(rewards.view(-1, x.group_size), self.outcome_term).reshape(-1)
        if x.reward_clip_range is not None:  # OpenRLHF clips the baselined outcome, not the raw reward
            lo, hi = x.reward_clip_range
            outcome = outcome.clamp(float(lo), float(hi))
        if x.token_rewards is None and self.returns.gamma == 1.0:  # every return is the outcome: skip the sums
            returns = torch.where(x.mask.bool(), outcome[:, None], torch.zeros(()))
        else:
            returns = discounted_returns(outcome_token_rewards(outcome, x.mask, x.token_rewards), x.mask,
                                         self.returns.gamma)
        return whiten(returns, x.mask, std_norm=not self.returns.no_std_norm) if self.whitens else returns


@register("grpo")
class GrpoEstimator(OutcomeReturnEstimator):
    """GRPO (OpenRLHF's ``group_norm``): the group-normalised outcome on every token of the response."""

    outcome_term = "group_norm"
    needs_group = True


@register("reinforce")
class ReinforceEstimator(OutcomeReturnEstimator):
    """REINFORCE++: the raw outcome's discounted return, whitened over the batch."""

    outcome_term = "none"
    discounts_returns = whitens = True


@register("reinforce_baseline")
class ReinforceBaselineEstimator(OutcomeReturnEstimator):
    """REINFORCE++-baseline: the outcome minus its group's mean, whitened over the batch."""

    outcome_term = "group_mean"
    needs_group = whitens = True


@register("rloo")
class RlooEstimator(OutcomeReturnEstimator):
    """RLOO: the outcome minus the mean of the other samples of its prompt (leave-one-out)."""

    outcome_term = "leave_one_out"
    needs_group = True


@register("dr_grpo")
class DrGrpoEstimator(OutcomeReturnEstimator):
    """Dr. GRPO: the outcome minus its group's mean, without GRPO's std division."""

    outcome_term = "group_mean"
    needs_group = True


@register("flash_reinforce")
class FlashReinforceEstimator(OutcomeReturnEstimator):
    """FlashREINFORCE: the outcome minus the mean of the whole batch (for one sample per prompt)."""

    outcome_term = "batch_mean"
