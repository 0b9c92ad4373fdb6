"""The numbers of a training config the planner needs, read from either layout of ``TrainConfig``
(flat sections: ``rollout.n_samples_per_prompt``, ``actor.micro_batch_max_tokens``; or the
composed one: ``sampling.n``, ``engine.tensor_parallel_size``, ``megatron.micro_batch_max_tokens``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _first(cfg: Any, *paths: str, default: Any = None) -> Any:
    for path in paths:
        obj = cfg
        for part in path.split("."):
            if not hasattr(obj, part):
                break
            obj = getattr(obj, part)
        else:
            return obj
    if default is not None:
        return default
    raise AttributeError(f"training config has none of {paths}")


@dataclass(frozen=True)
class RunShape:
    pretrain: str
    rollout_batch_size: int
    n_samples: int
    max_prompt_len: int
    max_new_tokens: int
    max_model_len: int
    num_engines: int
    engine_tp: int
    gpu_memory_utilization: float
    kv_cache_gib: float
    colocate: bool
    train_batch_size: int
    max_epochs: int
    micro_batch_max_tokens: int
    entropy_chunk_size: int
    tp: int
    pp: int
    world_size: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: bool
    gpus_per_rank: float
    estimator: str
    num_segments: int
    num_probes: int
    probe_max_tokens: int
    think_suffix: str
    ep: int = 1  # --megatron.expert_model_parallel_size
    etp: int | None = None  # expert tensor parallel: megatron.expert_tensor_parallel_size if the config has one, else TP (megatron-core's default)
    backend: str = "megatron"  # --actor.backend
    zero_stage: int = 2  # --ds.zero_stage (deepspeed backend)
    adam_offload: bool = False  # --ds.adam_offload (deepspeed backend)


def run_shape(cfg: Any) -> RunShape:
    return RunShape(
        pretrain=_first(cfg, "actor.pretrain"),
        rollout_batch_size=_first(cfg, "rollout.rollout_batch_size"),
        n_samples=_first(cfg, "sampling.n", "rollout.n_samples_per_prompt"),
        max_prompt_len=_first(cfg, "data.max_prompt_len"),
        max_new_tokens=_first(cfg, "sampling.max_tokens", "rollout.max_new_tokens"),
        max_model_len=int(cfg.max_model_len()),
        num_engines=_first(cfg, "rollout.num_engines"),
        engine_tp=_first(cfg, "engine.tensor_parallel_size", "rollout.engine_tensor_parallel_size"),
        gpu_memory_utilization=_first(cfg, "engine.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
        kv_cache_gib=_first(cfg, "engine.kv_cache_gib", "rollout.kv_cache_gib"),
        colocate=bool(_first(cfg, "rollout.colocate")),
        train_batch_size=_first(cfg, "actor.train_batch_size"),
        max_epochs=_first(cfg, "actor.max_epochs"),
        micro_batch_max_tokens=_first(cfg, "megatron.micro_batch_max_tokens", "actor.micro_batch_max_tokens"),
        entropy_chunk_size=_first(cfg, "megatron.entropy_chunk_size", "actor.entropy_chunk_size"),
        tp=_first(cfg, "megatron.tensor_model_parallel_size"),
        pp=_first(cfg, "megatron.pipeline_model_parallel_size"),
        world_size=_first(cfg, "megatron.world_size"),
        sequence_parallel=bool(_first(cfg, "megatron.sequence_parallel")),
        distributed_optimizer=bool(_first(cfg, "megatron.use_distributed_optimizer")),
        recompute=bool(_first(cfg, "megatron.recompute_activations")),
        gpus_per_rank=float(_first(cfg, "megatron.gpus_per_rank")),
        estimator=_first(cfg, "shape.estimator"),
        num_segments=_first(cfg, "shape.num_segments"),
        num_probes=_first(cfg, "shape.num_probes"),
        probe_max_tokens=_first(cfg, "shape.probe_max_tokens"),
        think_suffix=_first(cfg, "probe.think_suffix", default="x" * 105),
        ep=int(_first(cfg, "megatron.expert_model_parallel_size", default=1)),
        etp=getattr(getattr(cfg, "megatron", None), "expert_tensor_parallel_size", None),
        backend=str(_first(cfg, "actor.backend", default="megatron")),
        zero_stage=int(_first(cfg, "ds.zero_stage", default=2)),
        adam_offload=bool(getattr(getattr(cfg, "ds", None), "adam_offload", False)),
    )
