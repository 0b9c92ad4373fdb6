"""The state of one Megatron rank, as an explicit object.

The rank worker (:mod:`openrlhf_shape.megatron.worker`) owns one :class:`ActorState` and hands it to
the functions that do the work, each module one concern: build (:mod:`~openrlhf_shape.megatron.build`), forward
and train step (:mod:`~openrlhf_shape.megatron.step`, with the MoE router losses of
:mod:`~openrlhf_shape.megatron.router_loss`), checkpoint (:mod:`~openrlhf_shape.megatron.checkpoint`) and export
(:mod:`~openrlhf_shape.megatron.export`). They read and write only what is here; none imports the worker.
Parallel ranks and groups are Megatron's ``parallel_state`` (process-wide once the worker initialised it); the
RNG states live in Python/torch/Megatron's tracker and are saved and
restored by the checkpoint module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.platform import Platform


@dataclass
class ActorState:
    """Model, optimizer and counters of one rank.

    ``cfg`` is resolved for ``platform`` (``bf16`` and ``layer_spec`` concrete). ``model`` is the
    DDP-wrapped model chunk when training (its ``.module`` is the Float16Module or GPTModel), or
    the bare forward-only module (``optimizer`` None). ``step`` counts successful optimizer steps (skipped
    non-finite updates do not count; the LR is a function of it: :func:`~openrlhf_shape.actor.lr_schedule.lr_at`).
    """

    cfg: MegatronConfig
    platform: Platform
    rank: int
    world_size: int
    dp_size: int
    model: Any = None
    optimizer: Any = None
    bridge: Any = None  # the mbridge bridge (HF <-> Megatron names and shards)
    tconfig: Any = None  # Megatron's TransformerConfig of the model
    hf_config: Any = None
    hf_dir: Optional[str] = None  # the HF directory the model was built from (config/tokenizer source)
    routing: Any = None  # MoE routing replay's hooks on the model (--megatron.routing_replay), None without
    value_format: Any = None  # a value model's ValueHeadFormat (megatron/value.py), None for a policy
    step: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.platform.on_gpu else torch.device("cpu")

    @property
    def gpt(self):
        """The GPTModel inside the DDP and Float16Module wrappers."""
        model = self.model
        while hasattr(model, "module"):
            model = model.module
        return model

    @property
    def model_chunks(self) -> list:
        """The model as Megatron's list of (virtual pipeline) chunks."""
        return [] if self.model is None else [self.model]

    def layout(self) -> dict[str, Any]:
        """The parallel layout a checkpoint records (RNG states only line up within one layout)."""
        cfg = self.cfg
        return {
            "tp": cfg.tensor_model_parallel_size,
            "pp": cfg.pipeline_model_parallel_size,
            "dp": self.dp_size,
            "world_size": self.world_size,
            "use_distributed_optimizer": cfg.use_distributed_optimizer,
            # the expert-parallel RNG stream is per expert rank: it lines up only within one EP x ETP layout
            "ep": cfg.expert_model_parallel_size,
            "etp": cfg.expert_tensor_parallel,
            # context parallelism, recorded only when on (checkpoints written before it existed compare equal)
            **({"cp": cfg.context_parallel_size} if cfg.context_parallel_size > 1 else {}),
        }

    def require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("call init_model(hf_dir) before using the worker")

    def require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs a model built with init_model(hf_dir, train=True)")
