"""``ShapeConfig``: the advantage estimator's settings with the paper's defaults, validated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from openrlhf_shape.algorithms.segmentation import SEGMENTATIONS

OUTCOME_BASELINES = ("none", "group_mean", "group_norm", "group_norm_scaled")
ENTROPY_SOURCES = ("trainer", "engine")

# Appendix A.1 (task consistency) needs alpha < 0.5. Appendix A.2 (reward-sign consistency): with m
# probes the potentials lie on the grid {0, 1/m, ..., 1}; the worst improving step is Phi (m-1)/m -> 1,
# whose shaping term gamma * 1 - (m-1)/m is positive only when gamma > (m-1)/m.
ALPHA_BOUND = 0.5


def gamma_min_bound(num_probes: int) -> float:
    """Appendix A.2 bound ``(m - 1) / m``: gamma must exceed it for m = ``num_probes`` probes."""
    return (num_probes - 1) / num_probes


@dataclass
class ShapeConfig:
    """Settings of the advantage estimators (``--shape.*``); which estimator reads them is
    ``--algo.advantage.estimator`` (:func:`openrlhf_shape.algorithms.estimators.get_estimator` binds the two).

    Defaults follow the paper (alpha 0.3, gamma_min 0.9, K 8); TCR
    defaults (beta 0.5, delta 0.5..1.5) are ours (the paper is silent). ``l_ref`` None means
    ``max_response_len / num_segments`` (resolved by :meth:`resolved_l_ref`). ``tcr`` None means the
    estimator's own default (:attr:`AdvantageEstimator.uses_tcr`): on for SHAPE, off for MRT, whose
    segment advantage the paper broadcasts uniformly to the segment's tokens (section 3, "Uniform Token Credit").
    """

    alpha: float = 0.3
    gamma_min: float = 0.9
    l_ref: float | None = None
    fixed_gamma: float | None = None  # ablation: constant gamma_k
    num_segments: int = 8  # K
    segmentation: str = "entropy"  # a registered mode (algorithms/segmentation.py:SEGMENTATIONS)
    entropy_threshold: float | None = None  # absolute tau; None = per-response quantile
    entropy_quantile: float = 0.8
    # where the token entropies SHAPE reads (segmentation, TCR) come from: "trainer" (the old-log-prob forward) or
    # "engine" (vLLM's sampler, from the logits each token was drawn from: rollout/sampled_entropy.py; each response
    # is then segmented as it finishes and its first probe round runs inside the generate call, rollout/tail.py)
    entropy_source: str = "trainer"
    min_segment_len: int = 8
    delimiter: str = "\n\n"
    tcr: bool | None = None  # None: on for shape, off for mrt (the paper); true/false forces it for either
    tcr_beta: float = 0.5
    tcr_delta_min: float = 0.5
    tcr_delta_max: float = 1.5
    tcr_eps: float = 1e-6
    outcome_baseline: str = "none"
    # console alarm for length collapse (openrlhf_shape/trainer/length_alarm.py); 0 = off
    length_alarm_fraction: float = 0.3
    length_alarm_window: int = 3
    allow_unsafe_hparams: bool = False  # --shape.allow_unsafe_hparams
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(flag: str, msg: str) -> ValueError:
            return ValueError(f"--shape.{flag}: {msg}")

        if self.segmentation not in SEGMENTATIONS:
            raise bad("segmentation", f"unknown segmentation {self.segmentation!r}; choose one of {tuple(SEGMENTATIONS)}")
        if self.entropy_source not in ENTROPY_SOURCES:
            raise bad("entropy_source", f"unknown source {self.entropy_source!r}; choose one of {ENTROPY_SOURCES}")
        if self.outcome_baseline not in OUTCOME_BASELINES:
            raise bad("outcome_baseline", f"unknown baseline {self.outcome_baseline!r}; choose one of {OUTCOME_BASELINES}")
        if not 0.0 <= self.alpha:
            raise bad("alpha", f"must be >= 0, got {self.alpha}")
        if not 0.0 < self.gamma_min <= 1.0:
            raise bad("gamma_min", f"must lie in (0, 1], got {self.gamma_min}")
        if self.fixed_gamma is not None and not 0.0 < self.fixed_gamma <= 1.0:
            raise bad("fixed_gamma", f"must lie in (0, 1], got {self.fixed_gamma}")
        if self.l_ref is not None and not self.l_ref > 0:
            raise bad("l_ref", f"must be > 0 tokens (or unset for max_response_len / K), got {self.l_ref}")
        if not 1 <= self.num_segments <= 256:
            raise bad("num_segments", f"K must lie in [1, 256], got {self.num_segments}")
        if not 0.0 <= self.entropy_quantile <= 1.0:
            raise bad("entropy_quantile", f"must lie in [0, 1], got {self.entropy_quantile}")
        if self.min_segment_len < 1:
            raise bad("min_segment_len", f"must be >= 1 token, got {self.min_segment_len}")
        if not self.tcr_beta >= 0:
            raise bad("tcr_beta", f"must be >= 0, got {self.tcr_beta}")
        if not 0.0 <= self.tcr_delta_min <= 1.0 <= self.tcr_delta_max:
            raise bad(
                "tcr_delta_min",
                f"need 0 <= delta_min <= 1 <= delta_max so average tokens keep A_k; got "
                f"delta_min={self.tcr_delta_min}, delta_max={self.tcr_delta_max}",
            )
        if not self.tcr_eps > 0:
            raise bad("tcr_eps", f"must be > 0, got {self.tcr_eps}")
        if not self.delimiter:
            raise bad("delimiter", "must be a non-empty string")

    def check_task_consistency(self) -> None:
        """Appendix A.1 (alpha < 0.5), for the estimators whose shaping alpha scales (SHAPE, MRT)."""
        if self.alpha >= ALPHA_BOUND and not self.allow_unsafe_hparams:
            raise ValueError(
                f"--shape.alpha: alpha={self.alpha} >= {ALPHA_BOUND} breaks strong task consistency (paper appendix "
                "A.1: a correct trajectory's total reward is only guaranteed to exceed every incorrect one's "
                f"when alpha < 0.5). Use alpha < 0.5, or pass --shape.allow_unsafe_hparams to run anyway."
            )

    def check_reward_sign(self, m: int, probes_flag: str = "--probe.num_probes") -> None:
        """Appendix A.2 with up to ``m`` probes per state, for the estimator that discounts by gamma (SHAPE; the
        one place it is checked; m is owned by :class:`~openrlhf_shape.rollout.probes.ProbeConfig`, named by
        ``probes_flag``)."""
        if self.allow_unsafe_hparams:
            return
        name, g = ("gamma_min", self.gamma_min) if self.fixed_gamma is None else ("fixed_gamma", self.fixed_gamma)
        bound = gamma_min_bound(m)
        if g <= bound:
            raise ValueError(
                f"--shape.{name}: {g} <= (m-1)/m = {m - 1}/{m} = {bound:.4g} for m = {m} probes ({probes_flag}) breaks "
                f"reward-sign consistency (paper appendix A.2: potentials lie on the grid k/{m}, and the "
                f"step from Phi = {m - 1}/{m} to 1 must get a positive shaping reward gamma - {m - 1}/{m}, "
                "which needs gamma > (m-1)/m; the paper's gamma_min = 0.7 ablation collapsed). Raise "
                f"--shape.{name} into ({bound:.4g}, 1], lower {probes_flag}, or pass "
                "--shape.allow_unsafe_hparams to run anyway."
            )

    def resolved_l_ref(self, max_response_len: int) -> float:
        """L_ref in tokens: the configured value, else ``max_response_len / K``."""
        if self.l_ref is not None:
            return float(self.l_ref)
        if max_response_len < 1:
            raise ValueError(f"max_response_len must be >= 1, got {max_response_len}")
        return float(max_response_len) / float(self.num_segments)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReturnConfig:
    """``--algo.advantage.gamma``, ``--algo.advantage.no_std_norm`` and ``--algo.advantage.lambd``: how OpenRLHF's
    estimators (:mod:`openrlhf_shape.algorithms.reinforce`, :mod:`openrlhf_shape.algorithms.gae`) turn per-token
    rewards into advantages.

    ``gamma``: the return's discount per token, in [0, 1] (only ``reinforce`` and ``gae`` discount; the others need 1).
    ``no_std_norm``: whitening keeps the mean subtraction and drops the std division (only for the
    estimators that whiten: ``reinforce``, ``reinforce_baseline``, ``gae``). ``lambd``: GAE's lambda in [0, 1]
    (only ``gae``; the others need 1).
    """

    gamma: float = 1.0
    no_std_norm: bool = False
    lambd: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise ValueError(f"--algo.advantage.gamma: the return's per-token discount must lie in [0, 1], got {self.gamma}")
        if not 0.0 <= float(self.lambd) <= 1.0:
            raise ValueError(f"--algo.advantage.lambd: GAE's lambda must lie in [0, 1], got {self.lambd}")
