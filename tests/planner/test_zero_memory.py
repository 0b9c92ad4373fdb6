"""The planner's ZeRO memory formulas (``--actor.backend deepspeed``): what each stage shards, what
``--ds.adam_offload`` moves to the host, and the dry run of the 1.5B preset on either backend."""

from __future__ import annotations

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.planner.model import ModelShape, resolve_model_config
from openrlhf_shape.planner.zero_memory import zero_host_term, zero_memory

GiB = 1024**3


@pytest.fixture(scope="module")
def qwen2_1p5b() -> ModelShape:
    return ModelShape.from_file(resolve_model_config("/models/DeepSeek-R1-Distill-Qwen-1.5B", None))


def _by_name(mem) -> dict[str, int]:
    return {t.name: t.bytes for t in mem.terms}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_what_each_zero_stage_shards(qwen2_1p5b, stage):
    n, dp, bucket = qwen2_1p5b.total_params(), 8, 1000
    t = _by_name(zero_memory(qwen2_1p5b, dp=dp, stage=stage, micro_batch_tokens=4096, dtype="bf16",
                             reduce_bucket_elems=bucket))
    assert t["weights"] == (n * 2 // dp if stage == 3 else n * 2)
    assert t["grads"] == (n * 2 // dp + bucket * 2 if stage >= 2 else n * 2)
    assert t["optimizer"] == (n * 12 // dp if stage >= 1 else n * 12)  # fp32 master + Adam m, v
    assert ("ZeRO-3 gathered parameters" in t) == (stage == 3)


def test_adam_offload_moves_the_optimizer_to_host(qwen2_1p5b):
    n, dp = qwen2_1p5b.total_params(), 8
    on_gpu = zero_memory(qwen2_1p5b, dp=dp, stage=2, micro_batch_tokens=4096, adam_offload=True)
    kept = zero_memory(qwen2_1p5b, dp=dp, stage=2, micro_batch_tokens=4096)
    assert _by_name(on_gpu)["optimizer"] == 0 and not on_gpu.step  # DeepSpeedCPUAdam steps on the host
    assert kept.peak - on_gpu.peak >= n * 12 // dp
    assert zero_host_term(qwen2_1p5b, "bf16", dp, 2, ranks_on_node=8).bytes == n * 12 // dp * 8
    # fp32 weights (CPU): ZeRO still keeps an fp32 master partition (a clone); stage 0 steps the weights in place
    assert _by_name(zero_memory(qwen2_1p5b, dp=2, stage=1, micro_batch_tokens=512, dtype="fp32"))["optimizer"] == n * 12 // 2
    assert _by_name(zero_memory(qwen2_1p5b, dp=2, stage=0, micro_batch_tokens=512, dtype="fp32"))["optimizer"] == n * 8


def _dry(capsys, *argv: str) -> str:
    assert main(["train", "--config", "configs/deepseek-r1-distill-qwen-1.5b.yaml", *argv, "--dry_run"]) == 0
    return capsys.readouterr().out


def _margin(out: str) -> float:
    return float(out.split("FITS: smallest margin ")[1].split(" GiB")[0])


def test_dry_run_of_the_1p5b_preset_on_either_backend(capsys):
    mg = _dry(capsys)
    z2 = _dry(capsys, "--actor.backend", "deepspeed", "--ds.zero_stage", "2")
    z3 = _dry(capsys, "--actor.backend", "deepspeed", "--ds.zero_stage", "3")
    off = _dry(capsys, "--actor.backend", "deepspeed", "--ds.adam_offload")
    assert "distributed optimizer" in mg and "ZeRO" not in mg
    assert "(ZeRO-2: every rank holds them all)" in z2 and "/ DP 8 (ZeRO-2: partitioned)" in z2
    assert "/ DP 8 (ZeRO-3: partitioned)" in z3 and "ZeRO-3 gathered parameters" in z3
    assert "on host (--ds.adam_offload)" in off and "Adam states offloaded (--ds.adam_offload)" in off
    # ZeRO-3 shards the bf16 weights too: more room than ZeRO-2 in the tightest phase
    assert _margin(z3) > _margin(z2)
