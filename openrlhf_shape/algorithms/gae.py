"""GAE (``--algo.advantage.estimator gae``): PPO's advantages from a critic's values, with OpenRLHF 0.11.2's semantics
(``RemoteExperienceMaker.compute_advantages_and_returns`` / ``get_advantages_and_returns`` and
``openrlhf.models.utils.compute_reward``, read, not copied).

For B responses right-padded to T tokens (``mask[i, t]`` True on response tokens), values V ``[B, T]`` (the critic's
estimate before each token, per token) and the outcome R ``[B]``:

1. per-token reward: ``rew_t = clip(R) * [t = last token] - kl_coef * KL_t`` (:func:`.returns.outcome_token_rewards`;
   no group baseline: the critic is the baseline);
2. rewards and values are zeroed off the mask; for every position, from the end,
   ``delta_t = rew_t + gamma * V_{t+1} - V_t`` (``V_T = 0``) and ``A_t = delta_t + gamma * lambd * A_{t+1}``;
   the critic's target is ``G_t = A_t + V_t``;
3. the advantages (not the returns) are whitened over every valid token of the batch (``--algo.advantage.no_std_norm``:
   mean only).

As OpenRLHF, gamma and lambd apply per position: a masked position inside a response (an agent's environment tokens)
has V = 0 and reward 0 and still counts one step. Outputs are 0 off the mask.
"""

from __future__ import annotations

import torch

from openrlhf_shape.algorithms.estimators import AdvantageEstimator, SequenceInputs, register
from openrlhf_shape.algorithms.returns import outcome_token_rewards, whiten


def gae_advantages_and_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                               gamma: float = 1.0, lambd: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns, both ``[B, T]`` float32, 0 off ``mask``.

    ``token_rewards`` ``[B, T]`` (reward per token), ``values`` ``[B, T]`` (V per token), ``mask`` ``[B, T]`` bool;
    ``gamma``, ``lambd`` in [0, 1]. Returns (A, G = A + V), neither whitened."""
    for name, x in (("gamma", gamma), ("lambd", lambd)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"--algo.advantage.{name} must lie in [0, 1], got {x}")
    mask = mask.bool()
    if token_rewards.shape != mask.shape or values.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and values {tuple(values.shape)} must be "
                         f"[B, T] = {tuple(mask.shape)}")
    zero = torch.zeros(())
    rew = torch.where(mask, token_rewards.to(torch.float32), zero)
    val = torch.where(mask, values.to(torch.float32), zero)
    if not (torch.isfinite(rew).all() and torch.isfinite(val).all()):
        raise ValueError("token rewards and values must be finite on the response tokens")
    next_val = torch.cat([val[:, 1:], torch.zeros(val.shape[0], 1)], dim=1)
    delta = rew + float(gamma) * next_val - val
    adv = torch.zeros_like(delta)
    running = torch.zeros(delta.shape[0])
    decay = float(gamma) * float(lambd)
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + decay * running
        adv[:, t] = running
    returns = adv + val
    return torch.where(mask, adv, zero), torch.where(mask, returns, zero)


@register("gae")
class GaeEstimator(AdvantageEstimator):
    """PPO's GAE over the critic's values (module doc); needs ``SequenceInputs.values``."""

    needs_segments = False
    needs_critic = discounts_returns = whitens = True

    def advantages_and_returns(self, x: SequenceInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(whitened advantages, returns for the critic), both ``[B, T]``, 0 off the mask."""
        if x.values is None:
            raise ValueError("--algo.advantage.estimator gae needs the critic's values [B, T] (SequenceInputs.values)")
        outcome = torch.as_tensor(x.rewards, dtype=torch.float32)
        if x.reward_clip_range is not None:  # OpenRLHF's compute_reward clamps R before placing it
            outcome = outcome.clamp(float(x.reward_clip_range[0]), float(x.reward_clip_range[1]))
        rew = outcome_token_rewards(outcome, x.mask, x.token_rewards)
        adv, returns = gae_advantages_and_returns(rew, x.values, x.mask, self.returns.gamma, self.returns.lambd)
        return whiten(adv, x.mask, std_norm=not self.returns.no_std_norm), returns

    def token_advantages(self, x: SequenceInputs) -> torch.Tensor:
        return self.advantages_and_returns(x)[0]
