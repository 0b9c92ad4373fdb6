"""Outcome rewards: Math-Verify in a process pool with deadlines, answer extraction, and the
OpenRLHF-compatible reward plug-in (``--reward.remote_url``); the same reward path judges SHAPE/MRT's
probes (``RewardComputer.score_probes``, ``--probe.scorer``) and the held-out eval."""

from openrlhf_shape.rewards.computer import RewardComputer, RewardConfig
from openrlhf_shape.rewards.extract import extract_answer, extract_last_boxed
from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer
from openrlhf_shape.rewards.plugin import RewardPluginError, load_reward_fn

__all__ = [
    "MathVerifyScorer",
    "RewardComputer",
    "RewardConfig",
    "RewardPluginError",
    "extract_answer",
    "extract_last_boxed",
    "load_reward_fn",
]
