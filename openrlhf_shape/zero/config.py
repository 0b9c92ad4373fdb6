"""Configuration of the DeepSpeed ZeRO actor backend and the DeepSpeed JSON it produces.

:class:`ZeroSettings` is what only DeepSpeed has (the flag tree's ``ds`` section: ``--ds.*``);
:class:`ZeroConfig` is what a rank is handed: those plus ``optim``, the training settings both
backends share (:class:`~openrlhf_shape.actor.optim.OptimConfig`: Adam, LR schedule, clipping,
policy-loss clip, micro-batch budget, seed), so one flag set drives either backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from openrlhf_shape.actor.optim import OptimConfig

_ZERO_STAGES = (0, 1, 2, 3)
_PARAM_DTYPES = ("auto", "bf16", "fp32")


@dataclass
class ZeroSettings:
    """DeepSpeed's own settings (``--ds.*``).

    ``zero_stage``: 0 (plain DP), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
    ``adam_offload``: Adam moments and fp32 master weights live in host memory and are updated by
    ``DeepSpeedCPUAdam``. ``param_dtype``: ``auto`` is bf16 on GPU ranks and fp32 on CPU ranks.
    ``zero3_param_persistence_threshold``: ZeRO-3 keeps parameters with fewer elements than this
    unpartitioned (DeepSpeed's default 1e5; tests use 0 so that every tensor of a tiny model is
    really sharded). ``reduce_bucket_elems``: gradient reduce bucket in elements.
    ``attn_implementation``: the Hugging Face attention kernel (``sdpa``; ``flash_attention_2`` on
    GPU when installed; ``eager``).
    ``value_head_prefix``: the name of a value model's head (``<prefix>.weight``) for the reward model and the critic
    when their config.json names none (OpenRLHF's ``--ds.value_head_prefix``; both backends read it).
    ``ring_attn_size``: context parallelism, OpenRLHF's ring attention: groups of this many consecutive ranks share
    one data-parallel shard and split each packed micro-batch into that many contiguous pieces
    (:mod:`openrlhf_shape.zero.ring_attention`); ``ring_attn_head_stride``: KV heads all-gathered at once there.
    """

    zero_stage: int = 2
    adam_offload: bool = False
    param_dtype: str = "auto"
    zero3_param_persistence_threshold: int = 100_000
    reduce_bucket_elems: int = 50_000_000
    attn_implementation: str = "sdpa"
    ring_attn_size: int = 1
    ring_attn_head_stride: int = 1
    value_head_prefix: str = "score"

    def __post_init__(self) -> None:
        if self.param_dtype == "fp16":
            raise ValueError("--ds.param_dtype: fp16 needs dynamic loss scaling, which this trainer does not run; "
                             "use bf16 (or fp32 on CPU)")
        if self.zero_stage not in _ZERO_STAGES:
            raise ValueError(f"--ds.zero_stage must be one of {_ZERO_STAGES}, got {self.zero_stage!r}")
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"--ds.param_dtype must be one of {_PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.adam_offload and self.zero_stage == 0:
            raise ValueError("--ds.adam_offload needs --ds.zero_stage 1, 2 or 3 (ZeRO-Offload moves the sharded "
                             "optimizer states to host memory)")
        for name in ("ring_attn_size", "ring_attn_head_stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--ds.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.value_head_prefix, str) or not self.value_head_prefix.isidentifier():
            raise ValueError(f"--ds.value_head_prefix must name a module attribute (OpenRLHF's default: score), got "
                             f"{self.value_head_prefix!r}")
        if self.zero3_param_persistence_threshold < 0 or self.reduce_bucket_elems < 1:
            raise ValueError("zero3_param_persistence_threshold must be >= 0 and reduce_bucket_elems >= 1")


@dataclass
class ZeroConfig(ZeroSettings):
    """One DeepSpeed actor rank's settings: :class:`ZeroSettings` and ``optim``. ZeRO shards over data
    parallelism only (the trainer refuses ``--megatron.*`` TP/PP > 1 with this backend)."""

    optim: OptimConfig = field(default_factory=OptimConfig)

    # ------------------------------------------------------------------ derived
    @property
    def ranks_per_replica(self) -> int:
        """Ranks that hold one data-parallel shard: a ring attention group (``ring_attn_size``)."""
        return self.ring_attn_size

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
        return dataclasses.replace(self, param_dtype="bf16" if platform.trainer_dtype == "bfloat16" else "fp32")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.use_bf16 else torch.float32


    def ds_config(self, *, on_gpu: bool) -> dict[str, Any]:
        """The DeepSpeed JSON. One optimizer step = one ``engine.step()`` after the last micro-batch's
        backward (the trainer marks the accumulation boundary itself), so DeepSpeed's own batch sizes
        are 1 x 1 and gradients are reduced once per step."""
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
            "gradient_clipping": float(self.optim.max_norm),
            "zero_optimization": zero,
            "bf16": {"enabled": self.use_bf16},
            "fp16": {"enabled": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }

    def ds_reference_config(self) -> dict[str, Any]:
        """The DeepSpeed JSON of the reference model (forward only, no optimizer): ZeRO-3 partitions its
        parameters as the actor's; any other stage shards nothing a model without optimizer has (stage 0)."""
        zero: dict[str, Any] = {"stage": 3 if self.zero_stage == 3 else 0}
        if self.zero_stage == 3:
            zero.update({"stage3_param_persistence_threshold": self.zero3_param_persistence_threshold,
                         "stage3_prefetch_bucket_size": self.reduce_bucket_elems})
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                "bf16": {"enabled": self.use_bf16}, "fp16": {"enabled": False}, "steps_per_print": 1 << 30,
                "wall_clock_breakdown": False}
