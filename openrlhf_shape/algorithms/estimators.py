"""Advantage estimators as objects registered by name (``--algo.advantage.estimator``).

An estimator turns one step's padded batch into segment (or token) advantages. SHAPE (eq. 8-9)
and MRT (eq. 2) work on segments and need boundaries and probe potentials; OpenRLHF's outcome
estimators (GRPO, REINFORCE++, RLOO, ...: :mod:`.reinforce`) work on whole responses and need neither.
The paper's ablations are options of :class:`ShapeConfig`, not estimators: ``fixed_gamma`` (constant
gamma_k), ``tcr`` (token credit redistribution; on by default for SHAPE only, the paper gives MRT uniform
credit), ``segmentation uniform|delimiter`` (instead of entropy-based segmentation); docs/algorithms.md
maps them to the paper's tables.

A new estimator is one module: subclass :class:`AdvantageEstimator`, decorate it with ``@register("name")`` and
import the module before the run (registration happens at import); the registry is the one list of names
(``--algo.advantage.estimator`` accepts exactly its keys, plus OpenRLHF's aliases: config/openrlhf.py), and what
the rest of the trainer asks of an estimator it reads from the class's capability flags, never its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from openrlhf_shape.algorithms.advantages import (
    mrt_segment_advantages,
    segment_gamma,
    shape_segment_advantages,
)
from openrlhf_shape.algorithms.config import ReturnConfig, ShapeConfig
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


def names_with(flag: str, value: bool = True) -> list[str]:
    """The registered estimators whose capability ``flag`` (e.g. ``"whitens"``) is ``value``, for messages."""
    return [n for n, cls in ESTIMATOR_REGISTRY.items() if getattr(cls, flag) == value]


def get_estimator(name: str, cfg: ShapeConfig, returns: ReturnConfig | None = None) -> "AdvantageEstimator":
    """The estimator registered as ``name`` (``--algo.advantage.estimator``), bound to ``cfg`` (``--shape.*``)
    and ``returns`` (``--algo.advantage.gamma`` / ``no_std_norm``; default: gamma 1, whitening with std) and
    checked against the bounds that apply to it."""
    if name not in ESTIMATOR_REGISTRY:
        raise ValueError(
            f"--algo.advantage.estimator: unknown estimator {name!r}; choose one of {tuple(ESTIMATOR_REGISTRY)}"
        )
    return ESTIMATOR_REGISTRY[name](cfg, returns)


@dataclass
class SequenceInputs:
    """What an outcome (sequence-level) estimator reads (B responses of T tokens, n per prompt, contiguous).

    ``rewards``: ``[B]`` outcomes R as the reward function gave them; ``mask``: ``[B, T]`` bool, True on
    response tokens; ``group_size``: n; ``token_rewards``: ``[B, T]`` reward added on every token, or None
    (KL in the reward: ``-kl_coef * KL_t``, OpenRLHF's ``compute_reward``); ``reward_clip_range``: the
    outcome term is clipped into it after the baseline (``--reward.clip_range``), or None; ``values``: ``[B, T]``
    the critic's value per token, for the estimators that need a critic (``needs_critic``), else None.
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    token_rewards: torch.Tensor | None = None
    reward_clip_range: tuple[float, float] | None = None
    values: torch.Tensor | None = None


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
    by gamma_k (appendix A.2's bound against the probe count applies). ``default_tcr``: token credit
    redistribution when ``--shape.tcr`` is unset. ``needs_group``: it compares the n samples of a prompt
    (n >= 2). ``discounts_returns`` / ``whitens``: ``--algo.advantage.gamma`` / ``no_std_norm`` apply to it.
    ``needs_critic``: it reads a critic's values (GAE; ``--algo.advantage.lambd`` applies to it)."""

    name: ClassVar[str] = ""
    needs_segments: ClassVar[bool] = True
    shaped: ClassVar[bool] = False
    discounted: ClassVar[bool] = False
    default_tcr: ClassVar[bool] = False
    needs_group: ClassVar[bool] = False
    discounts_returns: ClassVar[bool] = False
    whitens: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False

    def __init__(self, cfg: ShapeConfig, returns: ReturnConfig | None = None):
        self.cfg = cfg
        self.returns = returns if returns is not None else ReturnConfig()
        if self.shaped:
            cfg.check_task_consistency()
        self._check_returns()

    def _check_returns(self) -> None:
        """Refuse return settings this estimator would ignore (OpenRLHF resets gamma to 1 with a warning and
        ignores no_std_norm; here a setting that does nothing is an error that says so)."""
        if self.returns.gamma != 1.0 and not self.discounts_returns:
            raise ValueError(
                f"--algo.advantage.gamma {self.returns.gamma}: only --algo.advantage.estimator "
                f"{' or '.join(names_with('discounts_returns'))} discounts returns; {self.name} needs gamma 1 (drop "
                "the flag)" + ("; SHAPE's own discount is --shape.gamma_min" if self.needs_segments else ""))
        if self.returns.no_std_norm and not self.whitens:
            raise ValueError(
                f"--algo.advantage.no_std_norm: {self.name} does not whiten advantages (only "
                f"{' and '.join(names_with('whitens'))} do); drop the flag, or use --algo.advantage.estimator dr_grpo "
                "for a group baseline without std division")
        if self.returns.lambd != 1.0 and not self.needs_critic:
            raise ValueError(
                f"--algo.advantage.lambd {self.returns.lambd}: only --algo.advantage.estimator "
                f"{' or '.join(names_with('needs_critic'))} (with a critic) reads GAE's lambda; {self.name} needs 1 "
                "(drop the flag)")

    @property
    def uses_tcr(self) -> bool:
        """Token credit redistribution: ``--shape.tcr`` when given, else the estimator's default."""
        return self.default_tcr if self.cfg.tcr is None else bool(self.cfg.tcr)

    def check_reward_sign(self, m: int, probes_flag: str = "--probe.num_probes") -> None:
        """Appendix A.2 for up to ``m`` probes per state, where it applies (:meth:`ShapeConfig.check_reward_sign`)."""
        if self.discounted:
            self.cfg.check_reward_sign(m, probes_flag)

    def segment_advantages(self, x: SegmentInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B, K]`` segment advantages (values at absent segments are ignored) and metrics."""
        raise NotImplementedError(f"{type(self).__name__} is sequence-level")

    def token_advantages(self, x: SequenceInputs) -> torch.Tensor:
        """``[B, T]`` token advantages, 0 at padding (sequence-level estimators)."""
        raise NotImplementedError(f"{type(self).__name__} is segment-level")

    def advantages_and_returns(self, x: SequenceInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` token advantages and the critic's ``[B, T]`` targets (estimators with ``needs_critic``)."""
        raise NotImplementedError(f"{type(self).__name__} trains no critic")


@register("shape")
class ShapeEstimator(AdvantageEstimator):
    """SHAPE (eq. 9): ``A_k = R + alpha * (gamma_k * Phi_{k+1} - Phi_k)``, gamma_k from eq. 8."""

    shaped = discounted = default_tcr = True

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
    """MRT (eq. 2): ``A_k = R' + alpha * (R - Phi_k)`` (R' = R after the outcome baseline), the same A_k on
    every token of segment k (no TCR unless ``--shape.tcr on``)."""

    shaped = True

    def segment_advantages(self, x: SegmentInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return mrt_segment_advantages(x.potentials, x.rewards, self.cfg.alpha, outcome_term=x.outcome), {}
