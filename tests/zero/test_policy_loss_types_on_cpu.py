"""``--actor.policy_loss_type gspo|cispo`` on both actor backends, CPU/gloo: two optimizer steps of each on the same
tiny Qwen3, batches and schedule, Megatron world 1 (all micro-batches on one rank) against DeepSpeed ZeRO-2 world 2
(the samples split over two data-parallel ranks, several micro-batches each). GSPO's loss is a mean over samples,
so each rank must divide by the mini-batch's global sample count, not its own (the batch holds one sample whose
response is empty: it counts for nothing); CISPO's is a token mean. The losses are finite and the backends agree
within the tolerances of tests/zero/test_zero_vs_megatron_on_cpu.py; PPO's (a Megatron variant of the same launch)
differs, so the loss type reached the ranks."""

from __future__ import annotations

import math

import pytest

from mg_helpers import TRAIN_CFG, run_layout
from openrlhf_shape.actor.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2
LOSS_TOL, GNORM_RTOL = 5e-5, 2e-4  # test_zero_vs_megatron_on_cpu.py's trajectory tolerances
CISPO = {"policy_loss_type": "cispo", "cispo_eps_clip_low_high": (1.0, 0.2)}  # a bound the drift reaches
GSPO = {"policy_loss_type": "gspo", "dual_clip": 3.0}


@pytest.fixture(scope="module")
def runs(tiny_models, ragged_batch):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    mg = run_layout(1, cfg={**TRAIN_CFG, **GSPO}, model_dirs={}, batch=ragged_batch, train_dir=tiny_models["qwen3"],
                    train_steps=STEPS, variants={"cispo": {**CISPO, "dual_clip": None},
                                                 "ppo": {"policy_loss_type": "ppo", "dual_clip": None}})[0]
    ds = run_ranks("zero_scenarios:zero_run", 2, timeout=600, env={"DS_ACCELERATOR": "cpu"}, extra_pythonpath=[here],
                   kwargs=dict(train_cfg=TRAIN_CFG, stages={"gspo": {"zero_stage": 2, **GSPO},
                                                            "cispo": {"zero_stage": 2, **CISPO}},
                               model_dirs={}, batch=ragged_batch, train_dir=tiny_models["qwen3"], train_steps=STEPS))
    return {"megatron": {"gspo": mg["metrics"], "cispo": mg["variants"]["cispo"]["metrics"],
                         "ppo": mg["variants"]["ppo"]["metrics"]},
            "deepspeed": {k: ds[0][k]["metrics"] for k in ("gspo", "cispo")},
            "deepspeed_rank1": {k: ds[1][k]["metrics"] for k in ("gspo", "cispo")}}


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_both_backends_train_the_loss_alike(runs, kind):
    mg, ds = runs["megatron"][kind], runs["deepspeed"][kind]
    assert len(mg) == len(ds) == STEPS
    for step, (a, b) in enumerate(zip(mg, ds)):
        assert a["skipped"] == b["skipped"] == 0.0, (kind, step)
        assert math.isfinite(a["loss"]) and math.isfinite(b["loss"]) and a["grad_norm"] > 0, (kind, step, a, b)
        assert a["loss"] == pytest.approx(b["loss"], abs=LOSS_TOL), (kind, step)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GNORM_RTOL), (kind, step)
        assert a["num_tokens"] == b["num_tokens"]
    assert runs["deepspeed_rank1"][kind] == ds  # every rank reports the step's (all-reduced) metrics


def test_the_loss_type_reaches_the_ranks(runs):
    """Same weights, batch and schedule: the first step's loss differs by type (PPO's token mean of -r A, GSPO's
    sample mean of its sequence-clipped surrogate, CISPO's token mean of -w A log pi)."""
    first = {k: runs["megatron"][k][0]["loss"] for k in ("ppo", "gspo", "cispo")}
    assert min(abs(first[a] - first[b]) for a, b in (("ppo", "gspo"), ("ppo", "cispo"), ("gspo", "cispo"))) > 1e-2
    assert runs["megatron"]["cispo"][0]["pg_clipfrac_high"] + runs["megatron"]["cispo"][0]["pg_clipfrac_low"] > 0
