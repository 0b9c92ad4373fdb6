"""The backend-neutral training settings (``openrlhf_shape/actor/optim.py``): defaults, the refusals that name
the field, the schedule's derived values, and that both backends hold the same class."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_shape.actor.optim import AdamConfig, OptimConfig, OptimSettings


def test_defaults_are_openrlhfs():
    """OpenRLHF 0.11.2's --actor.* defaults (tests/config/test_openrlhf_defaults.py checks them against its parser):
    AdamW betas (0.9, 0.95), cosine_with_min_lr to 0.1 x the peak after 3% warm-up (ceil), clip 0.2 on both sides."""
    cfg = OptimConfig()
    assert cfg.eps_clip_low_high == (0.2, 0.2) and cfg.adam == AdamConfig(lr=1e-6, betas=(0.9, 0.95))
    assert (cfg.lr_scheduler, cfg.max_norm, cfg.total_steps) == ("cosine_with_min_lr", 1.0, 1000)
    assert cfg.min_lr_rate == pytest.approx(0.1) and cfg.warmup_steps == 30


def test_eps_clip_on_both_sides_unless_low_high_is_given():
    assert OptimSettings(eps_clip=0.3).clip_bounds == (0.3, 0.3)
    assert OptimSettings(eps_clip=0.3, eps_clip_low_high=(0.2, 0.28)).clip_bounds == (0.2, 0.28)
    # a rank reads the resolved pair
    assert OptimConfig(eps_clip=0.1).eps_clip_low_high == (0.1, 0.1)
    with pytest.raises(ValueError, match=r"OptimSettings\.eps_clip must be in \[0, 1\)"):
        OptimSettings(eps_clip=1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"lr_scheduler": "exp"}, "lr_scheduler"),
        ({"min_lr": 1.0, "adam": AdamConfig(lr=1e-3)}, "min_lr"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"lr_warmup_steps": 10, "total_steps": 5}, "lr_warmup_steps"),
        ({"lr_warmup_ratio": 1.0}, "lr_warmup_ratio"),
        ({"micro_batch_max_tokens": 0}, "micro_batch_max_tokens"),
        ({"entropy_chunk_size": 0}, "entropy_chunk_size"),
        ({"total_steps": 0}, "total_steps"),
        ({"max_norm": -1.0}, "max_norm"),
        ({"eps_clip_low_high": (1.0, 0.28)}, "eps_clip_low_high"),
    ],
)
def test_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"OptimConfig\.{field}"):
        OptimConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [({"lr": 0.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
                                           ({"eps": 0.0}, "eps"), ({"weight_decay": -0.1}, "weight_decay")])
def test_adam_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"AdamConfig\.{field}"):
        AdamConfig(**kwargs)


def test_schedule_values():
    cfg = OptimConfig(adam=AdamConfig(lr=1e-3), min_lr=1e-4, lr_warmup_ratio=0.25, total_steps=9)
    assert cfg.warmup_steps == 3 and cfg.min_lr_rate == pytest.approx(0.1)  # ceil(2.25): OpenRLHF's count
    assert dataclasses.replace(cfg, lr_warmup_steps=1).warmup_steps == 1  # steps win over the ratio
    # --actor.min_lr (absolute, ours) wins over --actor.min_lr_ratio, whose default (OpenRLHF's 0.1) is always set
    assert dataclasses.replace(cfg, min_lr_ratio=0.5).min_lr_rate == pytest.approx(0.1)
    assert dataclasses.replace(cfg, min_lr=None, min_lr_ratio=0.5).min_lr_rate == 0.5
    assert dataclasses.replace(cfg, min_lr=None, min_lr_ratio=None).min_lr_rate == 0.0


def test_both_backends_hold_the_one_optimiser_config():
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.zero.config import ZeroConfig

    for rank_cfg in (MegatronConfig, ZeroConfig):
        optim = {f.name: f for f in dataclasses.fields(rank_cfg)}["optim"]
        assert optim.type in (OptimConfig, "OptimConfig"), rank_cfg
        own = {f.name for f in dataclasses.fields(rank_cfg)} - {"optim"}
        assert not own & {f.name for f in dataclasses.fields(OptimConfig)}, rank_cfg  # no setting in two places
    assert issubclass(OptimConfig, OptimSettings)


def test_flat_scenario_dicts_reach_the_class_that_owns_each_field():
    """The multi-process scenarios hand one flat dict; ``testing/rank_configs.py`` sorts it by field owner."""
    from openrlhf_shape.testing.rank_configs import megatron_config, replaced, zero_config

    cfg = megatron_config({"tensor_model_parallel_size": 2, "lr": 2e-3, "max_norm": 0.5, "micro_batch_max_tokens": 96})
    assert (cfg.tensor_model_parallel_size, cfg.optim.adam.lr, cfg.optim.max_norm) == (2, 2e-3, 0.5)
    var = replaced(cfg, sequence_parallel=True, micro_batch_max_tokens=40)
    assert var.sequence_parallel and var.optim.micro_batch_max_tokens == 40 and var.optim.adam.lr == 2e-3
    assert zero_config({"lr": 2e-3}, zero_stage=3).optim.adam.lr == 2e-3
    with pytest.raises(TypeError, match="tensor_model_parallel_size"):  # a Megatron layout is not a ZeRO field
        zero_config({"tensor_model_parallel_size": 2})
