"""The critic's update on DeepSpeed ranks, CPU/gloo: ``init_critic`` + ``train_values`` on two data-parallel ranks
under ZeRO-2 and ZeRO-3 equal plain torch updates of the Hugging Face value model (same loss, AdamW, clipping, LR
schedule: tests/support/critic_reference.py); a ZeRO-2 checkpoint taken after one update and loaded into a fresh
critic continues as if uninterrupted; a ZeRO-3 critic started from a causal LM (its head drawn) trains as the
reference. Every comparison goes through ``export_hf``, OpenRLHF's value-model directory."""

from __future__ import annotations

import math
import os

import pytest
import torch

from mg_helpers import TRAIN_CFG, VALUE_HEAD_SEED
from support.critic_reference import CRITIC_CLIP, critic_batch, critic_optim, reference_updates

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")  # value_scenarios.py
STEPS = 2
PARAM_TOL = 1e-5
KEYS = ("critic_loss", "critic_grad_norm", "critic_lr", "critic_clipfrac", "values")


@pytest.fixture(scope="module")
def batch(tiny_value_model, ragged_batch):
    return critic_batch(tiny_value_model, ragged_batch)


@pytest.fixture(scope="module")
def runs(tiny_value_model, tiny_models, batch, tmp_path_factory) -> dict:
    from openrlhf_shape.actor.launch import run_ranks
    from rank_sequence import run_sequence
    from support.preload import spawn_preloaded

    out = tmp_path_factory.mktemp("zero_critic")
    common = dict(backend="deepspeed", cfg=TRAIN_CFG, value_dir=tiny_value_model, batch=batch, steps=STEPS,
                  value_clip=CRITIC_CLIP)
    stages = {"zero2": dict(zero={"zero_stage": 2}, ckpt_dir=str(out / "ckpt"), save_at=1),
              "zero3": dict(zero={"zero_stage": 3, "zero3_param_persistence_threshold": 0},
                            causal_dir=tiny_models["qwen3"], head_seed=VALUE_HEAD_SEED)}
    res = run_sequence(2, [("value_scenarios:critic_run", dict(export_dir=str(out / name), **common, **extra))
                           for name, extra in stages.items()], timeout=600, env={"DS_ACCELERATOR": "cpu"})
    return {**{name: r[0] for name, r in zip(stages, res)}, "root": out}


def _weights(path) -> dict:
    from openrlhf_shape.actor.value_model import load_value_model

    return load_value_model(str(path), dtype=torch.float32).state_dict()


def _max_gap(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference(tiny_value_model, batch):
    from openrlhf_shape.zero.config import ZeroConfig

    return reference_updates(tiny_value_model, batch, critic_optim(ZeroConfig().optim), STEPS)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_critic_equals_torch_reference_on_cpu(runs, reference, stage):
    want, ref_metrics = reference
    assert _max_gap(_weights(runs["root"] / stage / "final"), want) <= PARAM_TOL
    for mine, ref in zip(runs[stage]["metrics"], ref_metrics):
        for key in KEYS:
            assert math.isclose(mine[key], ref[key], rel_tol=1e-5, abs_tol=1e-6), (key, mine[key], ref[key])


def test_zero_resume_equals_uninterrupted_on_cpu(runs):
    root = runs["root"] / "zero2"
    assert _max_gap(_weights(root / "resumed"), _weights(root / "final")) <= 1e-6
    assert runs["zero2"]["resumed"][0]["critic_step"] == STEPS


def test_zero3_critic_from_causal_lm_equals_torch_reference_on_cpu(runs, tiny_models, batch):
    from openrlhf_shape.zero.config import ZeroConfig

    want, ref_metrics = reference_updates(tiny_models["qwen3"], batch, critic_optim(ZeroConfig().optim), 1,
                                          head_seed=VALUE_HEAD_SEED)
    assert _max_gap(_weights(runs["root"] / "zero3" / "drawn"), want) <= PARAM_TOL
    assert math.isclose(runs["zero3"]["drawn"]["critic_grad_norm"], ref_metrics[0]["critic_grad_norm"], rel_tol=1e-5)
