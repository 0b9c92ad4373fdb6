"""The actor's LR schedule (``actor/lr_schedule.py``, what the DeepSpeed backend sets before each step) against
Megatron-core's own ``OptimizerParamScheduler``, which the Megatron backend runs."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.actor.lr_schedule import lr_at
from openrlhf_shape.actor.optim import AdamConfig, OptimConfig


@pytest.mark.parametrize("style, warmup", [("cosine", 1), ("cosine", 0), ("linear", 3), ("constant", 2)])
def test_lr_schedule_is_megatrons(style, warmup):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = OptimConfig(adam=AdamConfig(lr=2e-3), min_lr=2e-4, lr_warmup_steps=warmup, lr_scheduler=style, total_steps=7)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.adam.lr)
    sched = OptimizerParamScheduler(opt, init_lr=cfg.adam.lr / (warmup + 1), max_lr=cfg.adam.lr, min_lr=cfg.min_lr,
                                    lr_warmup_steps=warmup, lr_decay_steps=cfg.total_steps, lr_decay_style=style,
                                    start_wd=0.0, end_wd=0.0, wd_incr_steps=cfg.total_steps, wd_incr_style="constant")
    for step in range(9):  # past the end: min_lr
        assert lr_at(cfg, step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-15, abs=0), step
        sched.step(increment=1)
