"""The actor's learning-rate schedule (``--actor.lr_scheduler``), as a pure function of the optimizer step.

OpenRLHF 0.11.2 builds its scheduler with transformers' ``get_scheduler(name, num_warmup_steps=ceil(total x
lr_warmup_ratio), num_training_steps=total)``, passing ``min_lr_rate=min_lr_ratio`` to the two ``*_with_min_lr``
schedules only. :data:`SCHEDULES` holds the names accepted here, each the multiplier of ``adam.lr`` transformers'
schedule of that name computes at a step (tests/actor/test_lr_schedule.py holds them equal, step for step). Both
backends set ``lr_at(cfg, step)`` on their optimizer before each update, so a checkpoint needs the step count alone.

Warm-up starts at 0 (the first update of a warmed-up run has LR 0, as in OpenRLHF); ``constant`` never warms up and
``linear`` / ``cosine`` decay to 0. Ours: ``--actor.lr_warmup_steps`` replaces the warm-up count, ``--actor.min_lr``
(absolute) the floor, as transformers' ``min_lr`` argument does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol


class _Adam(Protocol):
    lr: float


class ScheduleInputs(Protocol):
    """What the schedule reads of ``actor/optim.py``'s ``OptimConfig`` (which imports this module to check its name)."""

    adam: _Adam
    lr_scheduler: str
    min_lr_rate: float
    warmup_steps: int
    total_steps: int


def _ramp(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int, warmup: int, total: int, floor: float) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int, floor: float) -> float:
    return _ramp(step, warmup) if step < warmup else 1.0


def _linear(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return _ramp(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """Half a cosine from 1 after warm-up to ``floor`` at ``total`` (past it the cosine climbs again, as
    transformers' does; a run never steps past its total)."""
    if step < warmup:
        return _ramp(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, (0.5 * (1.0 + math.cos(math.pi * progress))) * (1 - floor) + floor)


def _cosine_warmup_with_min_lr(step: int, warmup: int, total: int, floor: float) -> float:
    """transformers' variant that counts from 1: warm-up (k + 1) / warmup, the decay one step ahead."""
    if step < warmup:
        return (step + 1.0) / max(1.0, float(warmup))
    progress = (step - warmup + 1.0) / max(1.0, float(total - warmup))
    return max(0.0, (0.5 * (1.0 + math.cos(math.pi * progress))) * (1 - floor) + floor)


@dataclass(frozen=True)
class Schedule:
    """One ``--actor.lr_scheduler`` value: ``factor(step, warmup, total, floor)``, the LR over ``adam.lr``;
    ``warms_up``: it reads the warm-up count; ``has_floor``: it decays to ``min_lr_ratio`` x ``adam.lr``."""

    factor: Callable[[int, int, int, float], float]
    warms_up: bool = True
    has_floor: bool = False


SCHEDULES: dict[str, Schedule] = {  # the one list of accepted names (OpenRLHF's default first)
    "cosine_with_min_lr": Schedule(_cosine, has_floor=True),
    "cosine_warmup_with_min_lr": Schedule(_cosine_warmup_with_min_lr, has_floor=True),
    "cosine": Schedule(_cosine),
    "linear": Schedule(_linear),
    "constant_with_warmup": Schedule(_constant_with_warmup),
    "constant": Schedule(_constant, warms_up=False),
}


def lr_at(cfg: ScheduleInputs, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the first update uses ``lr_at(cfg, 0)``), absolute."""
    schedule = SCHEDULES[cfg.lr_scheduler]
    floor = cfg.min_lr_rate if schedule.has_floor else 0.0
    return cfg.adam.lr * schedule.factor(step, cfg.warmup_steps, cfg.total_steps, floor)


def apply_lr(optimizer, cfg: ScheduleInputs, step: int) -> float:
    """Set every param group of ``optimizer`` to ``lr_at(cfg, step)``; returns the LR the optimizer now holds."""
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return float(optimizer.param_groups[0]["lr"])
