"""DeepSpeed backend pieces that need no process group: config checks, the DeepSpeed JSON, bucket planning,
trainer flags (its LR schedule: tests/actor/test_lr_schedule.py)."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.zero.config import ZeroConfig
from openrlhf_shape.zero.export import plan_buckets
from openrlhf_shape.platform import cpu_platform, gpu_platform


def test_config_refusals_name_the_flag():
    with pytest.raises(ValueError, match="--ds.zero_stage"):
        ZeroConfig(zero_stage=4)
    with pytest.raises(ValueError, match="--ds.adam_offload"):
        ZeroConfig(zero_stage=0, adam_offload=True)
    with pytest.raises(ValueError, match="--ds.param_dtype: fp16 needs dynamic loss scaling"):
        ZeroConfig(param_dtype="fp16")


def test_ds_config():
    z3 = ZeroConfig(optim=OptimConfig(max_norm=0.5), zero_stage=3, adam_offload=True, param_dtype="bf16",
                    zero3_param_persistence_threshold=0).ds_config(on_gpu=True)
    assert z3["zero_optimization"]["stage"] == 3 and z3["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert z3["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z3["bf16"] == {"enabled": True} and z3["gradient_clipping"] == 0.5
    assert z3["train_micro_batch_size_per_gpu"] == 1 and z3["gradient_accumulation_steps"] == 1
    z2 = ZeroConfig().for_platform(cpu_platform()).ds_config(on_gpu=False)
    assert "offload_optimizer" not in z2["zero_optimization"] and z2["bf16"]["enabled"] is False
    assert ZeroConfig().for_platform(gpu_platform()).ds_config(on_gpu=True)["bf16"]["enabled"] is True
    with pytest.raises(ValueError, match="for_platform"):  # auto is the handed profile's to decide, not this process's
        ZeroConfig().ds_config(on_gpu=False)


def test_bucket_plan_uses_full_sizes():
    ps = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 10, 30, 5, 5])]
    ps[2][1].ds_numel = 100  # a ZeRO-3 partition: the full size decides
    buckets = plan_buckets(ps, bucket_bytes=80)
    assert [[n for n, _ in b] for b in buckets] == [["p0", "p1"], ["p2"], ["p3", "p4"]]
    with pytest.raises(ValueError):
        plan_buckets(ps, 0)


def test_trainer_flags_reach_the_backend():
    from openrlhf_shape.config import load_config

    cfg = load_config("configs/deepseek-r1-distill-qwen-1.5b.yaml",
                      ["--actor.backend", "deepspeed", "--ds.zero_stage", "3", "--ds.adam_offload"], check_paths=False)
    z = cfg.zero_config()
    assert (z.zero_stage, z.adam_offload, z.optim.gradient_checkpointing_enable) == (3, True, True)  # + gradient checkpointing
    assert z.optim.adam.lr == cfg.actor.adam.lr and z.optim.micro_batch_max_tokens == cfg.train.max_tokens_per_gpu
    assert z.optim == cfg.megatron_config().optim  # one optimiser config, whichever backend
    # a preset's Megatron optimizer sharding does not stop it running on DeepSpeed (ZeRO shards by its stage)
    load_config(None, ["--megatron.use_distributed_optimizer", "true", "--actor.backend", "deepspeed"]).zero_config()
    with pytest.raises(ValueError, match="--actor.backend deepspeed"):
        load_config("configs/qwen3-4b.yaml", ["--ds.zero_stage", "3"], check_paths=False)
    with pytest.raises(ValueError, match="tensor_model_parallel_size 1"):
        load_config("configs/qwen3-8b.yaml", ["--actor.backend", "deepspeed"], check_paths=False)
    with pytest.raises(ValueError, match="--actor.backend"):
        load_config(None, ["--actor.backend", "fsdp"], check_paths=False)
