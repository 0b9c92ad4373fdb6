"""Dry-run planner: placement map, per-GPU memory by phase and step time from a model's config.json.

``memory.py`` holds the formulas (one function per term), ``cost.py`` the step-time model,
``lengths.py`` the response-length distribution (lognormal cut at the cap) and its tail, ``packing.py`` the
tokens the ranks compute (the trainer's own micro-batch plan), ``async_cost.py`` the one-step-off schedule,
``split.py`` the async engine:trainer split search, ``assumptions.py`` the printed, overridable hardware/rate
assumptions (``--plan.*``), ``plan.py`` puts a training config through them and ``report.py`` prints the
result. No Ray or GPU (torch only through the config and the micro-batch planner it imports).
"""

from openrlhf_shape.planner.memory import megatron_update_peak_bytes

__all__ = ["megatron_update_peak_bytes"]
