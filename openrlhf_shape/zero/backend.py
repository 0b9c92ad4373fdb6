"""The DeepSpeed ZeRO backend's record (:class:`~openrlhf_shape.actor.backends.Backend`): its worker, the rank config
it is handed, the model checks before anything starts, the dtype it trains in."""

from __future__ import annotations

from typing import Any

from openrlhf_shape.actor.backends import Backend, register
from openrlhf_shape.platform import Platform
from openrlhf_shape.zero.config import ZeroConfig


def rank_config(cfg: Any) -> ZeroConfig:
    """``--ds.*`` and the ``--actor.*`` optimiser settings; Megatron's model parallelism and routing replay refused
    (ZeRO shards over data parallelism; its context parallelism is ``--ds.ring_attn_size``)."""
    m = cfg.megatron
    if m.context_parallel_size != 1:
        raise ValueError("--megatron.context_parallel_size is Megatron's context parallelism; --actor.backend deepspeed "
                         "does not read it: set it to 1 (the DeepSpeed backend's flag is --ds.ring_attn_size) or use "
                         "--actor.backend megatron")
    if m.tensor_model_parallel_size != 1 or m.pipeline_model_parallel_size != 1:
        raise ValueError("--actor.backend deepspeed shards over data parallelism only: set "
                         "--megatron.tensor_model_parallel_size 1 and --megatron.pipeline_model_parallel_size 1 "
                         "(or use --actor.backend megatron for TP/PP)")
    if m.routing_replay != "none":
        raise ValueError(f"--megatron.routing_replay {m.routing_replay}: routing replay is for a mixture-of-experts "
                         "policy on --actor.backend megatron; set --megatron.routing_replay none (docs/moe.md)")
    return cfg.zero_config()  # its own errors name the flags (--megatron.use_distributed_optimizer: unread here)


def check_model(cfg: Any, model_config: Any, model_dir: str) -> None:
    if getattr(model_config, "num_experts", None):
        raise ValueError(
            f"--actor.backend deepspeed: {model_dir} is a mixture-of-experts model ({model_config.model_type}); the "
            "DeepSpeed backend names its experts as transformers 5 holds them (one fused mlp.experts.gate_up_proj per "
            "layer), not per expert as the engine's checkpoint does, so the weight sync cannot load them; use "
            "--actor.backend megatron (docs/moe.md)")


def trainer_dtype(cfg: Any, platform: Platform) -> str:
    return {"auto": platform.trainer_dtype, "bf16": "bfloat16", "fp32": "float32"}[cfg.ds.param_dtype]


DEEPSPEED = register(Backend("deepspeed", worker="openrlhf_shape.zero.worker:ZeroRankWorker", rank_config=rank_config,
                             check_model=check_model, trainer_dtype=trainer_dtype, dtype_flag="ds.param_dtype"))
