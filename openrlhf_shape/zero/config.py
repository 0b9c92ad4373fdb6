"""Configuration of the DeepSpeed ZeRO actor backend and the DeepSpeed JSON it produces.

The optimiser, LR schedule, micro-batching and policy-loss settings are the ones the Megatron
backend reads (:class:`~openrlhf_shape.megatron.config.MegatronConfig`: ``lr``, ``min_lr``,
warmup, decay style, Adam betas/eps, weight decay, ``clip_grad``, ``eps_clip_*``,
``micro_batch_max_tokens``, ``entropy_chunk_size``, ``recompute_activations``, ``seed``), built from
the backend-neutral flags ``--actor.*`` / ``--train.max_tokens_per_gpu`` (``TrainConfig.zero_config``),
so one flag set drives either backend. :class:`ZeroConfig` adds what only DeepSpeed has (``--ds.*``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from openrlhf_shape.megatron.config import MegatronConfig

_ZERO_STAGES = (0, 1, 2, 3)
_PARAM_DTYPES = ("auto", "bf16", "fp32")


@dataclass
class ZeroConfig:
    """One DeepSpeed actor rank's settings.

    ``train``: the backend-neutral training settings (a :class:`MegatronConfig`; its TP/PP must be
    1: ZeRO shards over data parallelism only). ``zero_stage``: 0 (plain DP), 1 (optimizer states
    sharded), 2 (+ gradients), 3 (+ parameters). ``adam_offload``: Adam moments and fp32 master
    weights live in host memory and are updated by ``DeepSpeedCPUAdam``. ``param_dtype``: ``auto``
    is bf16 on GPU ranks and fp32 on CPU ranks. ``zero3_param_persistence_threshold``: ZeRO-3 keeps
    parameters with fewer elements than this unpartitioned (DeepSpeed's default 1e5; tests use 0
    so that every tensor of a tiny model is really sharded). ``reduce_bucket_elems``: gradient
    reduce bucket in elements. ``attn_implementation``: the Hugging Face attention kernel
    (``sdpa``; ``flash_attention_2`` on GPU when installed; ``eager``).
    """

    train: MegatronConfig = field(default_factory=MegatronConfig)
    zero_stage: int = 2
    adam_offload: bool = False
    param_dtype: str = "auto"
    zero3_param_persistence_threshold: int = 100_000
    reduce_bucket_elems: int = 50_000_000
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if self.zero_stage not in _ZERO_STAGES:
            raise ValueError(f"--ds.zero_stage must be one of {_ZERO_STAGES}, got {self.zero_stage!r}")
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"--ds.param_dtype must be one of {_PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.adam_offload and self.zero_stage == 0:
            raise ValueError("--ds.adam_offload needs --ds.zero_stage 1, 2 or 3 (ZeRO-Offload moves the sharded "
                             "optimizer states to host memory)")
        t = self.train
        if t.tensor_model_parallel_size != 1 or t.pipeline_model_parallel_size != 1:
            raise ValueError(
                "--actor.backend deepspeed shards over data parallelism only: set "
                "--megatron.tensor_model_parallel_size 1 and --megatron.pipeline_model_parallel_size 1 "
                "(or use --actor.backend megatron for TP/PP)")
        if t.use_distributed_optimizer:
            raise ValueError("--megatron.use_distributed_optimizer is a Megatron switch; with --actor.backend "
                             "deepspeed use --ds.zero_stage to shard")
        if self.zero3_param_persistence_threshold < 0 or self.reduce_bucket_elems < 1:
            raise ValueError("zero3_param_persistence_threshold must be >= 0 and reduce_bucket_elems >= 1")

    # ------------------------------------------------------------------ derived
    @property
    def use_bf16(self) -> bool:
        """bf16 parameters? ``auto`` is resolved by each rank from the profile the driver handed it
        (:meth:`for_platform`), so a driver without a GPU still gives GPU ranks bf16; reading it
        unresolved is an error (no second CPU/GPU decision)."""
        if self.param_dtype == "auto":
            raise ValueError("ZeroConfig.param_dtype is 'auto' here: resolve it for the rank's profile with "
                             "for_platform(platform) first (openrlhf_shape/platform.py decides CPU vs GPU once)")
        return self.param_dtype == "bf16"

    def for_platform(self, platform) -> "ZeroConfig":
        """This config with ``param_dtype`` auto decided by ``platform`` (an ``openrlhf_shape.platform.Platform``)."""
        if self.param_dtype != "auto":
            return self
        return dataclasses.replace(self, param_dtype="bf16" if platform.megatron_dtype == "bfloat16" else "fp32")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.use_bf16 else torch.float32


    def ds_config(self, *, on_gpu: bool) -> dict[str, Any]:
        """The DeepSpeed JSON. One optimizer step = one ``engine.step()`` after the last micro-batch's
        backward (the trainer marks the accumulation boundary itself), so DeepSpeed's own batch sizes
        are 1 x 1 and gradients are reduced once per step."""
        t = self.train
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "reduce_bucket_size": self.reduce_bucket_elems,
            "allgather_bucket_size": self.reduce_bucket_elems,
            "overlap_comm": False,
            "contiguous_gradients": True,
        }
        if self.zero_stage == 3:
            zero.update({
                "stage3_param_persistence_threshold": self.zero3_param_persistence_threshold,
                "stage3_prefetch_bucket_size": self.reduce_bucket_elems,
                "stage3_gather_16bit_weights_on_model_save": False,
            })
        if self.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(on_gpu)}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(t.clip_grad),
            "zero_optimization": zero,
            "bf16": {"enabled": self.use_bf16},
            "fp16": {"enabled": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }


def zero_config_from(train: MegatronConfig, ds: Optional[Any] = None) -> ZeroConfig:
    """``ds``: the trainer's ``ds`` section (zero_stage, adam_offload, param_dtype, ...) or None.

    ``--megatron.use_distributed_optimizer`` is Megatron's way to shard the optimizer; a preset that
    sets it runs on DeepSpeed with ``--actor.backend deepspeed`` alone (ZeRO shards by its stage), so
    it is dropped here. TP/PP > 1 still refuse (DeepSpeed here is data-parallel only)."""
    train = dataclasses.replace(train, use_distributed_optimizer=False)
    if ds is None:
        return ZeroConfig(train=train)
    own = {f.name: getattr(ds, f.name) for f in dataclasses.fields(ZeroConfig) if f.name != "train" and hasattr(ds, f.name)}
    return ZeroConfig(train=train, **own)
