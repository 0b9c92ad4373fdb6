"""Context-parallel flags (issue 36, item 2): ``--megatron.context_parallel_size`` and ``--ds.ring_attn_size`` /
``--ds.ring_attn_head_stride`` reach the rank configs, and every bad combination is refused naming the flag."""

from __future__ import annotations

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.megatron.config import MegatronConfig, MegatronSettings
from openrlhf_shape.zero.config import ZeroSettings


def test_flags_reach_the_rank_configs():
    cfg = load_config(None, ["--actor.num_gpus_per_node", "4", "--megatron.context_parallel_size", "2",
                             "--megatron.tensor_model_parallel_size", "2", "--train.batch_size", "128"])
    mcfg = cfg.megatron_config()
    assert mcfg.context_parallel_size == 2 and mcfg.data_parallel_size(4) == 1
    ds = load_config(None, ["--actor.backend", "deepspeed", "--actor.num_gpus_per_node", "4",
                            "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2"]).zero_config()
    assert (ds.ring_attn_size, ds.ring_attn_head_stride) == (2, 2)


@pytest.mark.parametrize("flags, match", [
    (["--actor.num_gpus_per_node", "2", "--megatron.context_parallel_size", "4"], "--megatron.context_parallel_size"),
    (["--actor.num_gpus_per_node", "6", "--megatron.context_parallel_size", "4"], "TP x PP x CP"),
    (["--megatron.context_parallel_size", "0"], "--megatron.context_parallel_size must be an integer >= 1"),
    (["--actor.backend", "deepspeed", "--megatron.context_parallel_size", "2", "--actor.num_gpus_per_node", "2"],
     "--ds.ring_attn_size"),
    (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2"], "--megatron.context_parallel_size"),
    (["--actor.backend", "deepspeed", "--ds.ring_attn_size", "3", "--actor.num_gpus_per_node", "4"],
     "--ds.ring_attn_size"),
    (["--actor.backend", "deepspeed", "--ds.ring_attn_head_stride", "0"], "--ds.ring_attn_head_stride"),
])
def test_bad_context_parallel_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, flags)


def test_context_parallel_refusals_say_why():
    assert MegatronConfig(context_parallel_size=2).data_parallel_size(8) == 4
    with pytest.raises(ValueError, match="context_parallel_size"):
        MegatronConfig(context_parallel_size=2, tensor_model_parallel_size=2).data_parallel_size(6)
    with pytest.raises(ValueError, match="recorded routing would have to be gathered over the CP group"):
        MegatronSettings(context_parallel_size=2, routing_replay="r2")
    # MoE router losses run under CP (their scale: tests/megatron/test_context_parallel_composed_on_cpu.py)
    assert MegatronSettings(context_parallel_size=2, moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-3).moe_z_loss_coeff
    with pytest.raises(ValueError, match="--ds.ring_attn_size must be an integer >= 1"):
        ZeroSettings(ring_attn_size=0)
    # what every sequence is padded to: 2 x CP chunks, each a multiple of TP under sequence parallel
    assert MegatronConfig(context_parallel_size=2).sequence_multiple == 4
    assert MegatronConfig(context_parallel_size=2, tensor_model_parallel_size=2,
                          sequence_parallel=True).sequence_multiple == 8
    assert MegatronConfig().sequence_multiple == 1
