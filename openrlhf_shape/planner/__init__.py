"""Dry-run planner: placement map, per-GPU memory by phase and step time from a model's config.json.

``memory.py`` holds the formulas (one function per term), ``cost.py`` the step-time model,
``assumptions.py`` the printed, overridable hardware/rate assumptions (``--plan.*``), ``plan.py``
puts a training config through them and ``report.py`` prints the result. No torch, Ray or GPU.
"""

from openrlhf_shape.planner.memory import megatron_update_peak_bytes

__all__ = ["megatron_update_peak_bytes"]
