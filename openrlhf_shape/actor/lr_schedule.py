"""The learning-rate schedule of the actor (``OptimConfig``'s fields), as a pure function of the optimizer step.

It is the schedule the Megatron backend runs (``OptimizerParamScheduler`` built in
``megatron/worker.py``), written out so the DeepSpeed backend follows it step for step: linear
warmup from ``lr / (warmup + 1)`` to ``lr`` over ``warmup`` steps, then ``constant``, ``linear`` or
``cosine`` decay to ``final_lr`` at ``total_steps``, ``final_lr`` after. The trainer sets the value on
the optimizer before each step, so the state to checkpoint is the step count alone.
"""

from __future__ import annotations

import math

from openrlhf_shape.actor.optim import OptimConfig


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the first update uses ``lr_at(cfg, 0)``)."""
    warmup, max_lr, min_lr = cfg.warmup_steps, cfg.adam.lr, cfg.final_lr
    init_lr = max_lr / (warmup + 1)
    if warmup > 0 and step <= warmup:
        return init_lr + (max_lr - init_lr) * float(step) / float(warmup)
    if cfg.lr_scheduler == "constant":
        return max_lr
    if step > cfg.total_steps:
        return min_lr
    ratio = float(step - warmup) / float(cfg.total_steps - warmup)
    if cfg.lr_scheduler == "linear":
        coeff = 1.0 - ratio
    elif cfg.lr_scheduler == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # OptimConfig validates the style
        raise ValueError(f"unknown lr_scheduler {cfg.lr_scheduler!r}")
    return min_lr + coeff * (max_lr - min_lr)
