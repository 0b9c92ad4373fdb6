"""SHAPE maths: pure torch, no Ray / vLLM / Megatron imports.

Public, stable API (see docs/architecture.md):
``token_entropy``, ``entropy_cutpoints``, ``dynamic_gamma``, ``shape_segment_advantages``,
``mrt_segment_advantages``, ``grpo_advantages``, ``redistribute_token_credit``, ``policy_loss``,
plus ``ShapeConfig`` and the batched helpers in :mod:`.pipeline`. The estimators are registered by name in
``ESTIMATOR_REGISTRY`` (:mod:`.estimators`: the paper's; :mod:`.reinforce`: OpenRLHF's outcome estimators, with
their maths in :mod:`.returns`; :mod:`.gae`: PPO's GAE over a critic's values), the segmentation modes in ``SEGMENTATIONS`` (:mod:`.segmentation`).
"""

from openrlhf_shape.algorithms.advantages import (
    dynamic_gamma,
    grpo_advantages,
    mrt_segment_advantages,
    outcome_baseline,
    segment_gamma,
    segment_to_token_advantages,
    shape_segment_advantages,
)
from openrlhf_shape.algorithms.config import ReturnConfig, ShapeConfig
from openrlhf_shape.algorithms.estimators import ESTIMATOR_REGISTRY, AdvantageEstimator, get_estimator, register
from openrlhf_shape.algorithms import reinforce  # noqa: F401  (registers OpenRLHF's outcome estimators)
from openrlhf_shape.algorithms import gae  # noqa: F401  (registers OpenRLHF's GAE, which needs a critic)
from openrlhf_shape.algorithms.returns import baselined_outcomes, discounted_returns, outcome_token_rewards, whiten
from openrlhf_shape.algorithms.entropy import token_entropy, token_log_probs_and_entropy
from openrlhf_shape.algorithms.loss import policy_loss
from openrlhf_shape.algorithms.metrics import (
    gain_by_start_regime,
    gain_contribution_percent,
    potential_drop_rate,
)
from openrlhf_shape.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    rollout_correction_weights,
    rollout_mismatch_metrics,
)
from openrlhf_shape.algorithms.pipeline import (
    AdvantageResult,
    boundaries_as_lists,
    compute_token_advantages,
    pad_potentials,
    segment_batch,
)
from openrlhf_shape.algorithms.adaptive_probes import AdaptiveProbeRule, estimator_moments, stopping_outcomes
from openrlhf_shape.algorithms.segmentation import (
    SEGMENTATIONS,
    Segmentation,
    boundaries_to_segment_ids,
    delimiter_cutpoints,
    entropy_cutpoints,
    get_segmentation,
    register_segmentation,
    segment_lengths,
    uniform_cutpoints,
)
from openrlhf_shape.algorithms.tcr import redistribute_token_credit, tcr_weights

__all__ = [
    "ESTIMATOR_REGISTRY",
    "SEGMENTATIONS",
    "AdvantageEstimator",
    "Segmentation",
    "AdaptiveProbeRule",
    "estimator_moments",
    "stopping_outcomes",
    "AdvantageResult",
    "ReturnConfig",
    "RolloutCorrectionConfig",
    "get_estimator",
    "get_segmentation",
    "register",
    "register_segmentation",
    "segment_gamma",
    "ShapeConfig",
    "baselined_outcomes",
    "boundaries_as_lists",
    "boundaries_to_segment_ids",
    "compute_token_advantages",
    "delimiter_cutpoints",
    "discounted_returns",
    "dynamic_gamma",
    "entropy_cutpoints",
    "gain_by_start_regime",
    "gain_contribution_percent",
    "grpo_advantages",
    "mrt_segment_advantages",
    "outcome_token_rewards",
    "outcome_baseline",
    "pad_potentials",
    "policy_loss",
    "potential_drop_rate",
    "redistribute_token_credit",
    "rollout_correction_weights",
    "rollout_mismatch_metrics",
    "segment_batch",
    "segment_lengths",
    "segment_to_token_advantages",
    "shape_segment_advantages",
    "tcr_weights",
    "token_entropy",
    "token_log_probs_and_entropy",
    "uniform_cutpoints",
    "whiten",
]
