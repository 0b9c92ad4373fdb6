"""openrlhf-shape: SHAPE (Stage-aware Hierarchical Advantage via Potential Estimation) RL training.

Sub-packages: ``algorithms`` (pure maths), ``rewards``, ``rollout`` (vLLM), ``megatron`` (actor
backend), ``trainer`` (Ray PPO loop), ``data``, ``eval``, ``cli``.
"""

__version__ = "0.1.0"
