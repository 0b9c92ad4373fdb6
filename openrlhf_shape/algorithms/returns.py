"""Outcome baselines, per-token rewards, discounted returns and whitening: the maths of OpenRLHF's
critic-free estimators (REINFORCE++, RLOO, ...; the estimators themselves are in :mod:`.reinforce`).

Semantics are OpenRLHF 0.11.2's (``RemoteExperienceMaker.compute_advantages_and_returns`` and
``openrlhf.models.utils.compute_reward``, read, not copied). For a batch of B responses, n per prompt:

1. the outcome R_i becomes r_i by a baseline (:func:`baselined_outcomes`);
2. r_i, clipped into ``--reward.clip_range``, is the reward of the response's last token, and a per-token
   reward (KL in the reward: ``-kl_coef * KL_t``) is added on every token (:func:`outcome_token_rewards`);
3. the advantage of token t is the return ``G_t = sum_{t' >= t} gamma^(t'-t) rew_{t'}`` (:func:`discounted_returns`);
4. some estimators whiten G over every valid token of the batch (:func:`whiten`).

Shapes: rewards ``[prompts, n]`` or ``[B]``, token tensors ``[B, T]`` right-padded, ``mask[i, t]`` True on
response tokens; padding positions come out 0.
"""

from __future__ import annotations

import torch

from openrlhf_shape.algorithms.advantages import grpo_advantages

OUTCOME_TERMS = ("none", "leave_one_out", "group_mean", "group_norm", "batch_mean")
GROUP_NORM_EPS = 1e-9  # OpenRLHF's group_norm divides by std + 1e-9
WHITEN_VAR_FLOOR = 1e-8  # OpenRLHF's whitening floors the variance at 1e-8


def _float(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN/inf")
    return t


def baselined_outcomes(rewards, kind: str) -> torch.Tensor:
    """``[prompts, n]`` outcomes R -> ``[prompts, n]`` outcome terms r.

    ``none``: r = R. ``leave_one_out`` (RLOO): R minus the mean of the other n-1 samples of its prompt.
    ``group_mean``: R minus its prompt's mean. ``group_norm``: that divided by the prompt's unbiased std
    + 1e-9. ``batch_mean``: R minus the mean of the whole batch (every prompt).
    """
    r = _float(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(f"rewards must be [prompts, n], got shape {tuple(r.shape)}")
    n = r.shape[1]
    if kind in ("leave_one_out", "group_mean", "group_norm") and n < 2:
        raise ValueError(f"the {kind} baseline needs >= 2 samples per prompt (--rollout.n_samples_per_prompt), got {n}")
    if kind == "none":
        return r.clone()
    if kind == "leave_one_out":
        return r - (r.sum(-1, keepdim=True) - r) / (n - 1)
    if kind == "group_mean":
        return r - r.mean(-1, keepdim=True)
    if kind == "group_norm":
        return grpo_advantages(r, eps=GROUP_NORM_EPS)
    if kind == "batch_mean":
        return r - r.mean()
    raise ValueError(f"unknown outcome term {kind!r}; choose one of {OUTCOME_TERMS}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B]`` long: each row's last True position (the response's last token)."""
    mask = mask.bool()
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if not mask.any(-1).all():
        raise ValueError("every response needs at least one token (a row of the mask is empty)")
    return mask.shape[1] - 1 - mask.long().flip(-1).argmax(-1)


def outcome_token_rewards(outcome, mask: torch.Tensor, token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: ``outcome`` ``[B]`` on each response's last token, plus ``token_rewards``
    ``[B, T]`` (e.g. ``-kl_coef * KL``, OpenRLHF's KL in the reward) on every token; 0 where ``mask`` is False."""
    mask = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32)
    r = _float(outcome, "outcome")
    if r.shape != (mask.shape[0],):
        raise ValueError(f"outcome must be [B] = [{mask.shape[0]}], got {tuple(r.shape)}")
    out.scatter_(1, last_token_index(mask)[:, None], r[:, None])
    if token_rewards is not None:
        extra = _float(token_rewards, "token_rewards")
        if extra.shape != mask.shape:
            raise ValueError(f"token_rewards must be [B, T] = {tuple(mask.shape)}, got {tuple(extra.shape)}")
        out = out + extra
    return torch.where(mask, out, torch.zeros_like(out))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = rew_t + gamma * G_{t+1}`` over every position (``G_T = 0``), rewards zeroed where ``mask`` is
    False; returns ``[B, T]`` float32, 0 at padding. As OpenRLHF, gamma applies per position, so a masked
    position inside a response (an agent's environment tokens) still counts one step of discount."""
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    mask = mask.bool()
    rew = torch.where(mask, _float(token_rewards, "token_rewards"), torch.zeros(()))
    if float(gamma) == 1.0:  # undiscounted: a reversed cumulative sum
        ret = rew.flip(-1).cumsum(-1).flip(-1)
    else:
        ret = torch.zeros_like(rew)
        running = torch.zeros(rew.shape[0])
        for t in range(rew.shape[1] - 1, -1, -1):
            running = rew[:, t] + float(gamma) * running
            ret[:, t] = running
    return torch.where(mask, ret, torch.zeros_like(ret))


def whiten(advantages: torch.Tensor, mask: torch.Tensor, std_norm: bool = True) -> torch.Tensor:
    """``(A - mean) / std`` over every valid token of the batch (``[B, T]`` -> ``[B, T]``, 0 at padding).

    mean and the population variance are taken over the valid tokens; the variance is floored at 1e-8.
    ``std_norm`` False (``--algo.advantage.no_std_norm``): ``A - mean`` only.
    """
    mask = mask.bool()
    adv = torch.where(mask, _float(advantages, "advantages"), torch.zeros(()))
    count = mask.sum()
    if count == 0:
        raise ValueError("whitening needs at least one valid token")
    out = torch.where(mask, adv - adv.sum() / count, torch.zeros(()))
    if std_norm:
        var = torch.linalg.vector_norm(out) ** 2 / count  # padding is 0 in out, so it adds nothing
        out = out * var.clamp(min=WHITEN_VAR_FLOOR).rsqrt()
    return out
