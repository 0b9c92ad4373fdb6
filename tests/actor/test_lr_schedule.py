"""The actor's LR schedule (``actor/lr_schedule.py``, what both backends set before each update) against the scheduler
OpenRLHF 0.11.2 builds (its own ``_ds_init_train_model`` statements, run from the installed source over transformers'
``get_scheduler``), step for step and exactly, for every accepted name; our two extras against ``get_scheduler``'s own
arguments for them; names OpenRLHF would pass that we do not take are refused, naming the accepted ones."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from openrlhf_shape.actor.lr_schedule import SCHEDULES, lr_at
from openrlhf_shape.actor.optim import AdamConfig, OptimConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "algorithms"))

# (optimizer steps of the run, warm-up ratio, min LR ratio): OpenRLHF's defaults, a run shorter than 1 / ratio (the
# warm-up ceil still gives one step), a long warm-up, a run of one step, and no floor
RUNS = [(40, 0.03, 0.1), (7, 0.03, 0.1), (12, 0.25, 0.3), (1, 0.03, 0.1), (20, 0.1, 0.0), (9, 0.0, 0.5)]


def _sequence(scheduler, optimizer, steps: int) -> list[float]:
    """The LR each of ``steps`` updates runs with (DeepSpeed steps the scheduler after each update)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _sgd(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("total, warmup_ratio, min_lr_ratio", RUNS)
def test_lr_at_is_the_scheduler_openrlhf_builds(name, total, warmup_ratio, min_lr_ratio):
    from openrlhf_source import openrlhf_lr_scheduler

    lr = 3e-6
    cfg = OptimConfig(adam=AdamConfig(lr=lr), lr_scheduler=name, lr_warmup_ratio=warmup_ratio,
                      min_lr_ratio=min_lr_ratio, total_steps=total)
    opt = _sgd(lr)
    theirs = openrlhf_lr_scheduler(opt, dict(scheduler_steps=total, lr_scheduler=name, lr_warmup_ratio=warmup_ratio,
                                             min_lr_ratio=min_lr_ratio))
    steps = total + 3  # past the end too: the schedule's formula, as transformers' runs on
    assert [lr_at(cfg, k) for k in range(steps)] == _sequence(theirs, opt, steps)


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.warms_up])
def test_our_warmup_steps_are_get_schedulers_num_warmup_steps(name):
    from transformers import get_scheduler

    cfg = OptimConfig(adam=AdamConfig(lr=1e-3), lr_scheduler=name, lr_warmup_steps=3, total_steps=10)
    opt = _sgd(1e-3)
    kwargs = {"min_lr_rate": cfg.min_lr_ratio} if SCHEDULES[name].has_floor else {}
    theirs = get_scheduler(name, opt, num_warmup_steps=3, num_training_steps=10, scheduler_specific_kwargs=kwargs)
    assert [lr_at(cfg, k) for k in range(12)] == _sequence(theirs, opt, 12)


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.has_floor])
def test_our_absolute_min_lr_is_get_schedulers_min_lr(name):
    from transformers import get_scheduler

    cfg = OptimConfig(adam=AdamConfig(lr=2e-3), lr_scheduler=name, min_lr=2e-4, lr_warmup_ratio=0.2, total_steps=11)
    opt = _sgd(2e-3)
    theirs = get_scheduler(name, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=11,
                           scheduler_specific_kwargs={"min_lr": 2e-4})
    assert [lr_at(cfg, k) for k in range(13)] == _sequence(theirs, opt, 13)


def test_the_first_update_of_a_warm_up_runs_at_zero_as_openrlhfs():
    """OpenRLHF's default over 10 updates: ceil(0.3) = 1 warm-up step, so the first update has LR 0."""
    cfg = OptimConfig(adam=AdamConfig(lr=1e-6), total_steps=10)
    assert (cfg.lr_scheduler, cfg.warmup_steps) == ("cosine_with_min_lr", 1)
    assert lr_at(cfg, 0) == 0.0 and lr_at(cfg, 1) == 1e-6 and lr_at(cfg, 10) == pytest.approx(1e-7)


@pytest.mark.parametrize("name", ["cosine_with_restarts", "polynomial", "inverse_sqrt", "warmup_stable_decay", "exp"])
def test_other_names_are_refused_naming_the_accepted(name):
    with pytest.raises(ValueError, match="lr_scheduler must be one of cosine_with_min_lr, .*constant"):
        OptimConfig(lr_scheduler=name)


@pytest.mark.parametrize("kwargs, flag", [
    ({"lr_scheduler": "constant", "lr_warmup_steps": 2}, "lr_warmup_steps 2: constant never warms up"),
    ({"lr_scheduler": "linear", "min_lr": 1e-7}, "min_lr 1e-07: linear has no floor"),
    ({"lr_scheduler": "cosine", "min_lr": 1e-7}, "min_lr 1e-07: cosine has no floor"),
])
def test_our_extras_are_refused_where_the_schedule_would_not_read_them(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        OptimConfig(**kwargs)
    zero = {k: 0 if k in ("lr_warmup_steps", "min_lr") else v for k, v in kwargs.items()}
    OptimConfig(**zero)  # 0 is what the schedule does anyway


def test_a_ratio_the_schedule_does_not_read_is_said_once_at_load(caplog):
    """OpenRLHF accepts (and ignores) a warm-up ratio with constant and a floor with linear; so do we, saying so."""
    from openrlhf_shape.config import load_config

    with caplog.at_level("WARNING"):
        cfg = load_config(None, ["--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0.1"])
    said = [r.message for r in caplog.records if "does not read it" in r.message]
    assert said == ["--actor.lr_warmup_ratio 0.1: --actor.lr_scheduler constant does not read it, as in OpenRLHF "
                    "(transformers' schedules: constant_with_warmup warms up, cosine_with_min_lr decays to the floor)"]
    assert {lr_at(cfg.optim_config(), k) for k in range(cfg.total_optimizer_steps())} == {cfg.actor.adam.lr}
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(None, ["--actor.lr_scheduler", "linear", "--actor.min_lr_ratio", "0.2"])
        load_config(None, ["--actor.lr_scheduler", "constant_with_warmup", "--actor.lr_warmup_ratio", "0.1"])
    assert [r.message.split(":")[0] for r in caplog.records if "does not read it" in r.message] == [
        "--actor.min_lr_ratio 0.2"]


def test_the_presets_schedules():
    """The demo keeps its constant LR from the first update; the paper's presets warm up over 10% from 0."""
    from pathlib import Path

    from openrlhf_shape.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    demo = load_config(str(configs / "cpu-smoke.yaml"), [], check_paths=False)
    assert {lr_at(demo.optim_config(), k) for k in range(demo.total_optimizer_steps())} == {demo.actor.adam.lr}
    paper = load_config(str(configs / "qwen3-8b.yaml"), [], check_paths=False).optim_config()
    assert (paper.lr_scheduler, paper.lr_warmup_ratio) == ("constant_with_warmup", 0.1) and paper.warmup_steps > 1
    assert lr_at(paper, 0) == 0.0 < lr_at(paper, 1) < paper.adam.lr == lr_at(paper, paper.warmup_steps)
