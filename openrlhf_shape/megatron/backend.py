"""The Megatron backend's record (:class:`~openrlhf_shape.actor.backends.Backend`): its worker, the rank config it is
handed, the model checks before anything starts, the dtype it trains in."""

from __future__ import annotations

from typing import Any

from openrlhf_shape.actor.backends import Backend, register
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.platform import Platform


def rank_config(cfg: Any) -> MegatronConfig:
    """``--megatron.*`` and the ``--actor.*`` optimiser settings; DeepSpeed's ring attention and ZeRO-3 / offload
    refused (this backend shards with its own flags)."""
    ds = cfg.ds
    if ds.ring_attn_size != 1:
        raise ValueError("--ds.ring_attn_size is the DeepSpeed backend's context parallelism; on --actor.backend "
                         "megatron use --megatron.context_parallel_size (and leave --ds.ring_attn_size 1)")
    if ds.zero_stage == 3 or ds.adam_offload:
        raise ValueError("--ds.zero_stage 3 / --ds.adam_offload configure the DeepSpeed backend; add --actor.backend "
                         "deepspeed, or shard on Megatron with --megatron.use_distributed_optimizer")
    return cfg.megatron_config()


def check_model(cfg: Any, model_config: Any, model_dir: str) -> None:
    """The layout against the model (heads % TP, layers % PP, experts over EP, ...) for the actor's ranks and the
    reference's; routing replay only for a mixture-of-experts model."""
    mcfg = cfg.megatron_config()
    mcfg.validate_against_model(model_config, cfg.actor.world_size)
    if cfg.algo.kl.enabled:  # the reference model runs the same layout on its own rank count
        mcfg.validate_against_model(model_config, cfg.ref.world_size(cfg.actor.world_size))
    if mcfg.routing_replay != "none" and not getattr(model_config, "num_experts", None):
        raise ValueError(f"--megatron.routing_replay {mcfg.routing_replay}: routing replay is for a mixture-of-experts "
                         f"policy; {model_dir} is dense: set --megatron.routing_replay none (docs/moe.md)")


def trainer_dtype(cfg: Any, platform: Platform) -> str:
    bf16 = cfg.megatron.bf16
    if bf16 and not platform.on_gpu:
        raise ValueError("--megatron.bf16 true: Megatron trains in bf16 on GPUs only, and this run has none; leave it "
                         "unset (auto: fp32 on CPU, bf16 on GPU) or give --megatron.bf16 false")
    return platform.trainer_dtype if bf16 is None else ("bfloat16" if bf16 else "float32")


MEGATRON = register(Backend("megatron", worker="openrlhf_shape.megatron.worker:MegatronRankWorker",
                            rank_config=rank_config, check_model=check_model, trainer_dtype=trainer_dtype,
                            dtype_flag="megatron.bf16"))
