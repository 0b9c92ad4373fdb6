"""Advantage estimators as objects registered by name (``--algo.advantage.estimator``).

An estimator turns one step's padded batch into segment (or sequence) advantages. SHAPE (eq. 8-9)
and MRT (eq. 2) work on segments and need boundaries and probe potentials; GRPO works on whole
sequences and needs neither. The paper's ablations are options of :class:`ShapeConfig`, not
estimators: ``fixed_gamma`` (constant gamma_k), ``tcr off`` (no token credit redistribution),
``segmentation uniform|delimiter`` (instead of entropy-based segmentation).

A new estimator: subclass :class:`AdvantageEstimator` and decorate it with ``@register("name")``; the
registry is the one list of names (``--algo.advantage.estimator`` accepts exactly its keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from openrlhf_shape.algorithms.advantages import (
    grpo_advantages,
    mrt_segment_advantages,
    segment_gamma,
    shape_segment_advantages,
)
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.algorithms.metrics import describe, discount_instruments

ESTIMATOR_REGISTRY: dict[str, type["AdvantageEstimator"]] = {}


def register(name: str) -> Callable[[type["AdvantageEstimator"]], type["AdvantageEstimator"]]:
    """Class decorator: make an estimator available under ``name``."""

    def wrap(cls: type["AdvantageEstimator"]) -> type["AdvantageEstimator"]:
        if name in ESTIMATOR_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        cls.name = name
        ESTIMATOR_REGISTRY[name] = cls
        return cls

    return wrap


def get_estimator(name: str, cfg: ShapeConfig) -> "AdvantageEstimator":
    """The estimator registered as ``name`` (``--algo.advantage.estimator``), bound to ``cfg`` and checked
    against the paper's bounds that apply to it."""
    if name not in ESTIMATOR_REGISTRY:
        raise ValueError(
            f"--algo.advantage.estimator: unknown estimator {name!r}; choose one of {tuple(ESTIMATOR_REGISTRY)}"
        )
    return ESTIMATOR_REGISTRY[name](cfg)


@dataclass
class SegmentInputs:
    """What a segment-level estimator reads (B responses, K = max segments).

    ``potentials``: ``[B, K+1]`` Phi_0..Phi_K, 0 beyond each row's last; ``seg_len``: ``[B, K]``
    tokens (0 for absent segments); ``num_segments``: ``[B]`` long; ``rewards``: ``[B]`` raw outcomes R; ``outcome``: ``[B]`` R after
    the outcome baseline (``--shape.outcome_baseline``); ``max_response_len``: tokens, for L_ref.
    """

    potentials: torch.Tensor
    seg_len: torch.Tensor
    num_segments: torch.Tensor
    rewards: torch.Tensor
    outcome: torch.Tensor
    max_response_len: int


class AdvantageEstimator:
    """Base class. ``needs_segments``: the estimator needs segmentation and probe potentials.
    ``shaped``: alpha scales its shaping term (appendix A.1's bound applies); ``discounted``: it discounts
    by gamma_k (appendix A.2's bound against the probe count applies)."""

    name: ClassVar[str] = ""
    needs_segments: ClassVar[bool] = True
    shaped: ClassVar[bool] = False
    discounted: ClassVar[bool] = False

    def __init__(self, cfg: ShapeConfig):
        self.cfg = cfg
        if self.shaped:
            cfg.check_task_consistency()

    def check_reward_sign(self, m: int, probes_flag: str = "--probe.num_probes") -> None:
        """Appendix A.2 for up to ``m`` probes per state, where it applies (:meth:`ShapeConfig.check_reward_sign`)."""
        if self.discounted:
            self.cfg.check_reward_sign(m, probes_flag)

    def segment_advantages(self, x: SegmentInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B, K]`` segment advantages (values at absent segments are ignored) and metrics."""
        raise NotImplementedError(f"{type(self).__name__} is sequence-level")

    def sequence_advantages(self, grouped_rewards: torch.Tensor) -> torch.Tensor:
        """``[prompts, n]`` rewards -> ``[prompts, n]`` advantages (sequence-level estimators)."""
        raise NotImplementedError(f"{type(self).__name__} is segment-level")


@register("shape")
class ShapeEstimator(AdvantageEstimator):
    """SHAPE (eq. 9): ``A_k = R + alpha * (gamma_k * Phi_{k+1} - Phi_k)``, gamma_k from eq. 8."""

    shaped = discounted = True

    def segment_advantages(self, x: SegmentInputs) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        l_ref = cfg.resolved_l_ref(x.max_response_len)
        adv = shape_segment_advantages(x.potentials, x.seg_len, x.outcome, alpha=cfg.alpha, gamma_min=cfg.gamma_min,
                                       l_ref=l_ref, fixed_gamma=cfg.fixed_gamma)
        gamma = segment_gamma(x.seg_len, cfg.gamma_min, l_ref, cfg.fixed_gamma)
        valid = torch.arange(x.seg_len.shape[1])[None, :] < x.num_segments[:, None]
        metrics = describe(gamma[valid], "shape/gamma")
        metrics.update(discount_instruments(x.potentials, gamma, x.num_segments, cfg.alpha))
        return adv, metrics


@register("mrt")
class MrtEstimator(AdvantageEstimator):
    """MRT (eq. 2): ``A_k = R' + alpha * (R - Phi_k)`` (R' = R after the outcome baseline)."""

    shaped = True

    def segment_advantages(self, x: SegmentInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return mrt_segment_advantages(x.potentials, x.rewards, self.cfg.alpha, outcome_term=x.outcome), {}


@register("grpo")
class GrpoEstimator(AdvantageEstimator):
    """GRPO: the group-normalised outcome for every token of the response."""

    needs_segments = False

    def sequence_advantages(self, grouped_rewards: torch.Tensor) -> torch.Tensor:
        return grpo_advantages(grouped_rewards)
