"""The learning-rate schedule of the actor, as a pure function of the optimizer step.

It is the schedule the Megatron backend runs (``OptimizerParamScheduler`` built in
``megatron/worker.py``), written out so the DeepSpeed backend follows it step for step: linear
warmup from ``lr / (warmup + 1)`` to ``lr`` over ``warmup`` steps, then ``constant``, ``linear`` or
``cosine`` decay to ``min_lr`` at ``total_steps``, ``min_lr`` after. The trainer sets the value on
the optimizer before each step, so the state to checkpoint is the step count alone.
"""

from __future__ import annotations

import math

from openrlhf_shape.megatron.config import MegatronConfig


def lr_at(cfg: MegatronConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the first update uses ``lr_at(cfg, 0)``)."""
    warmup, max_lr, min_lr = cfg.warmup_steps, cfg.lr, cfg.min_lr
    init_lr = max_lr / (warmup + 1)
    if warmup > 0 and step <= warmup:
        return init_lr + (max_lr - init_lr) * float(step) / float(warmup)
    if cfg.lr_decay_style == "constant":
        return max_lr
    if step > cfg.total_steps:
        return min_lr
    ratio = float(step - warmup) / float(cfg.total_steps - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # MegatronConfig validates the style
        raise ValueError(f"unknown lr_decay_style {cfg.lr_decay_style!r}")
    return min_lr + coeff * (max_lr - min_lr)
