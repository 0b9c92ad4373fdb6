"""The critic's update on Megatron ranks, CPU/gloo: ``init_critic`` + ``train_values`` at world 1 equal plain torch
updates of the Hugging Face value model (same loss, AdamW, clipping, LR schedule: tests/support/critic_reference.py);
TP2, TP2 with sequence parallel and PP2 equal world 1; a checkpoint taken after one update and loaded into a fresh
critic continues as if uninterrupted; a critic started from a causal LM (its head drawn) trains as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from mg_helpers import HERE, TRAIN_CFG, VALUE_HEAD_SEED
from support.critic_reference import CRITIC_CLIP, CRITIC_OPTIM, critic_batch, critic_optim, reference_updates

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2
PARAM_TOL = 1e-5


@pytest.fixture(scope="module")
def batch(tiny_value_model, ragged_batch):
    return critic_batch(tiny_value_model, ragged_batch)


@pytest.fixture(scope="module")
def runs(tiny_value_model, tiny_models, batch, tmp_path_factory) -> dict:
    from openrlhf_shape.actor.launch import run_ranks
    from rank_sequence import run_sequence
    from support.preload import spawn_preloaded

    out = tmp_path_factory.mktemp("mg_critic")
    common = dict(backend="megatron", value_dir=tiny_value_model, batch=batch, steps=STEPS, value_clip=CRITIC_CLIP)
    world1 = run_ranks("value_scenarios:critic_run", 1, timeout=300, extra_pythonpath=[HERE], spawner=spawn_preloaded,
                       kwargs=dict(cfg=TRAIN_CFG, export_dir=str(out / "world1"), ckpt_dir=str(out / "ckpt1"),
                                   save_at=1, causal_dir=tiny_models["qwen3"], head_seed=VALUE_HEAD_SEED, **common))
    layouts = {"tp2": {"tensor_model_parallel_size": 2},
               "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
               "pp2": {"pipeline_model_parallel_size": 2}}
    world2 = run_sequence(2, [("value_scenarios:critic_run", dict(cfg={**TRAIN_CFG, **extra},
                                                                  export_dir=str(out / name), **common))
                              for name, extra in layouts.items()], timeout=600)
    return {"world1": world1[0], **{name: r[0] for name, r in zip(layouts, world2)}, "root": out}


def _weights(path) -> dict:
    from openrlhf_shape.actor.value_model import load_value_model

    return load_value_model(str(path), dtype=torch.float32).state_dict()


def _max_gap(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_world1_equals_torch_reference_on_cpu(runs, tiny_value_model, batch):
    from openrlhf_shape.megatron.config import MegatronConfig

    optim = critic_optim(MegatronConfig().optim)
    want, ref_metrics = reference_updates(tiny_value_model, batch, optim, STEPS)
    start = _weights(tiny_value_model)
    got = _weights(runs["root"] / "world1" / "final")
    assert _max_gap(want, start) > 100 * PARAM_TOL  # the updates moved the model
    assert _max_gap(got, want) <= PARAM_TOL
    for mine, ref in zip(runs["world1"]["metrics"], ref_metrics):
        for key in ("critic_loss", "critic_grad_norm", "critic_lr", "critic_clipfrac", "values"):
            assert math.isclose(mine[key], ref[key], rel_tol=1e-5, abs_tol=1e-6), (key, mine[key], ref[key])
    assert 0 < ref_metrics[0]["critic_clipfrac"] < 1  # the clip acts on some tokens, not all
    assert ref_metrics[0]["critic_grad_norm"] > CRITIC_OPTIM["max_norm"]  # the clipping acts


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
def test_layouts_equal_world1_on_cpu(runs, layout):
    """The head replicated over TP gets its gradient once (grad norm and loss as world 1's), with and without
    sequence parallel; PP2's last stage holds it."""
    for mine, ref in zip(runs[layout]["metrics"], runs["world1"]["metrics"]):  # Adam hides a gradient's scale:
        for key in ("critic_loss", "critic_grad_norm", "critic_lr", "critic_clipfrac", "values"):  # the norm shows it
            assert math.isclose(mine[key], ref[key], rel_tol=1e-5, abs_tol=1e-6), (key, mine[key], ref[key])
    assert _max_gap(_weights(runs["root"] / layout / "final"), _weights(runs["root"] / "world1" / "final")) <= PARAM_TOL


def test_resume_equals_uninterrupted_on_cpu(runs):
    root = runs["root"] / "world1"
    assert _max_gap(_weights(root / "resumed"), _weights(root / "final")) <= 1e-6
    assert runs["world1"]["resumed"][0]["critic_step"] == STEPS
    assert math.isclose(runs["world1"]["resumed"][0]["critic_loss"], runs["world1"]["metrics"][-1]["critic_loss"],
                        rel_tol=1e-6)


def test_critic_from_causal_lm_equals_torch_reference_on_cpu(runs, tiny_models, batch):
    """The critic started from the actor's causal LM (OpenRLHF's default): its head drawn as the HF loader draws it,
    then trained as the reference trains it."""
    from openrlhf_shape.megatron.config import MegatronConfig

    want, ref_metrics = reference_updates(tiny_models["qwen3"], batch, critic_optim(MegatronConfig().optim), 1,
                                          head_seed=VALUE_HEAD_SEED)
    assert _max_gap(_weights(runs["root"] / "world1" / "drawn"), want) <= PARAM_TOL
    assert math.isclose(runs["world1"]["drawn"]["critic_grad_norm"], ref_metrics[0]["critic_grad_norm"], rel_tol=1e-5)
