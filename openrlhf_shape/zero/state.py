"""The state of one DeepSpeed rank, as an explicit object (as :mod:`openrlhf_shape.megatron.state` is
for a Megatron rank).

The rank worker (:mod:`openrlhf_shape.zero.worker`) owns one :class:`ZeroState` and hands it to the
checkpoint (:mod:`~openrlhf_shape.zero.checkpoint`) and export (:mod:`~openrlhf_shape.zero.export`)
functions, which read and write only what is here; neither imports the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from openrlhf_shape.actor.lr_schedule import apply_lr
from openrlhf_shape.platform import Platform
from openrlhf_shape.zero.config import ZeroConfig


@dataclass
class ZeroState:
    """Engine, optimizer, counters of one rank. ``cfg`` is resolved for ``platform``. ``engine`` is the
    ``deepspeed.DeepSpeedEngine`` (None before ``init_model``); ``step`` counts successful optimizer
    steps (skipped non-finite updates do not count; the LR schedule is a function of it)."""

    cfg: ZeroConfig
    platform: Platform
    rank: int
    world_size: int
    dp_size: int
    engine: Any = None
    base_optimizer: Any = None  # the torch/DeepSpeed Adam the engine wraps
    hf_config: Any = None
    hf_dir: Optional[str] = None  # the HF directory the model was loaded from (config/tokenizer source)
    value_format: Any = None  # a value model's ValueHeadFormat (zero/value.py), None for a policy
    step: int = 0

    @property
    def policy(self):
        """The wrapped :class:`~openrlhf_shape.zero.model.PolicyModule`."""
        return self.engine.module

    def layout(self) -> dict[str, Any]:
        """The layout a checkpoint records (RNG states only line up within one layout)."""
        return {"dp": self.dp_size, "zero_stage": self.cfg.zero_stage, "adam_offload": self.cfg.adam_offload}

    def apply_lr(self) -> float:
        """Set the optimizer's learning rate to the schedule's value at ``step``; returns it."""
        return apply_lr(self.engine.optimizer, self.cfg.optim, self.step)

    def require_model(self) -> None:
        if self.engine is None:
            raise RuntimeError("call init_model(hf_dir) before using the worker")

    def require_optimizer(self, what: str) -> None:
        if self.base_optimizer is None:
            raise RuntimeError(f"{what} needs a model built with init_model(hf_dir) (this rank holds a forward-only "
                               "reference model)")
