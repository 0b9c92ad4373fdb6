"""Reward shaping: what the rewards phase does to the outcome before any credit (:class:`RewardShaping`), and the
penalty for responses that did not stop by themselves (ProRL's "stop properly" penalty).

A response is *truncated* when the engine stopped it at the token limit (vLLM's finish reason
``"length"``) instead of at an end-of-sequence or stop token. OpenRLHF 0.11's
``--reward.stop_properly_penalty_coef c`` changes only those samples' outcome rewards:

* ``0 <= c <= 1``: the reward is multiplied by ``c`` (``c = 0``: a truncated response earns nothing);
* ``c < 0``: the reward is replaced by ``c`` (a fixed negative reward).

OpenRLHF applies it to the raw rewards, before any group baseline and before ``--reward.clip_range``;
the scores (accuracy, the DAPO group filter) are not changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_stop_properly_coef(coef: float) -> float:
    """``coef`` when OpenRLHF accepts it (``<= 1``); a ``ValueError`` naming the flag otherwise."""
    if not coef <= 1:  # also refuses NaN
        raise ValueError(f"--reward.stop_properly_penalty_coef must be in [0, 1] (a factor) or negative "
                         f"(a fixed reward), got {coef}")
    return float(coef)


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards ``[B]`` with the truncated samples' (``truncated`` ``[B]`` bool) rewards scaled by ``coef``
    (``coef`` in [0, 1]) or set to ``coef`` (``coef < 0``). Returns a new float tensor (at least float32)."""
    coef = check_stop_properly_coef(coef)
    if rewards.shape != truncated.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and truncated {tuple(truncated.shape)} must both be [B]")
    out = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).clone()
    hit = truncated.to(torch.bool)
    out[hit] = coef if coef < 0 else out[hit] * coef
    return out


@dataclass
class RewardShaping:
    """The rewards phase's switches, each named after its flag: DAPO's group filter (``--algo.dynamic_filtering_*``:
    a prompt group stays when its mean score lies strictly inside ``dynamic_filtering_range``, and the step refills
    the groups it drops in at most ``dynamic_filtering_max_rounds`` rounds), the truncation penalty
    (``--reward.stop_properly_penalty_coef``, None: off) and ``--reward.clip_range`` (SHAPE/MRT clamp the outcome
    into it as it comes; the outcome estimators clamp their baselined outcome, as OpenRLHF)."""

    dynamic_filtering_enable: bool = False
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    dynamic_filtering_max_rounds: int = 32
    clip_range: tuple[float, float] = (-10.0, 10.0)
    stop_properly_penalty_coef: float | None = None

    def __post_init__(self) -> None:
        self.dynamic_filtering_range, self.clip_range = tuple(self.dynamic_filtering_range), tuple(self.clip_range)
        if self.stop_properly_penalty_coef is not None:
            self.stop_properly_penalty_coef = check_stop_properly_coef(self.stop_properly_penalty_coef)
