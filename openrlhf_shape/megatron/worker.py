"""One Megatron rank of the actor (a :class:`~openrlhf_shape.actor.protocol.RankWorker`): the process group and
Megatron's parallel state, the colocation guards, and the rank interface over its
:class:`~openrlhf_shape.megatron.state.ActorState`. The work is done by functions of the state, one module per
concern: build (:mod:`~openrlhf_shape.megatron.build`), forward and train step (:mod:`~openrlhf_shape.megatron.step`,
MoE router losses in :mod:`~openrlhf_shape.megatron.router_loss`), checkpoint and export; none imports the worker.

SPMD: every rank of the job receives the same calls in the same order with the same arguments
(the whole batch); each rank takes its own data-parallel shard. CPU or GPU comes from the platform
profile handed to the rank (``openrlhf_shape/platform.py``): under a CPU profile the CPU patches
(:mod:`openrlhf_shape.megatron.cpu`) are applied and every public method runs inside the
CUDA->CPU device mode; under a GPU profile nothing of that is active and the only differences are
the layer spec (transformer-engine), the dtype (bf16) and the backend (NCCL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from openrlhf_shape.actor.protocol import STATE_GROUPS
from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.batch import SequenceBatch, TrainBatch, ValueBatch
from openrlhf_shape.megatron import cpu as cpu_compat
from openrlhf_shape.megatron import step
from openrlhf_shape.megatron.build import build_model
from openrlhf_shape.megatron.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.megatron.export import export_hf_dir, iter_buckets
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.platform import Platform
from openrlhf_shape.rng import seed_all


class MegatronRankWorker:
    """Owns one Megatron rank (plain class; :class:`openrlhf_shape.cluster.rank_group.RankActor` hosts it); its model,
    optimizer and step count are ``self.state``.

    ``platform``: the run's profile as handed by the driver (a :class:`Platform` or its dict). A rank
    without a driver (the subprocess ranks of ``actor/launch.py``, ``convert``) passes
    ``detect_platform()`` of its own process: the caller decides, never the worker.
    """

    def __init__(self, cfg: MegatronConfig, *, rank: int, world_size: int, master_addr: str, master_port: int,
                 platform: Platform | dict):
        self.platform = Platform.from_dict(platform)
        self.rank = rank
        self.world_size = world_size
        self.on_cpu = self.platform.on_cpu
        cfg.check_device(self.platform)
        cfg = cfg.for_platform(self.platform)
        self.state = ActorState(cfg=cfg, platform=self.platform, rank=rank, world_size=world_size,
                                dp_size=cfg.data_parallel_size(world_size))
        cpu_compat.apply_cpu_patches(self.platform)  # on GPU only the no-transformer-engine MoE router patch
        if not self.on_cpu:
            n_dev = torch.cuda.device_count()
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(n_dev, 1))) if n_dev > 1 else 0)
        with self._mode():
            if not dist.is_initialized():
                dist.init_process_group(
                    backend=self.platform.collective_backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(minutes=30),
                )
            from megatron.core import parallel_state as mpu
            from megatron.core import tensor_parallel

            mpu.initialize_model_parallel(
                tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                context_parallel_size=cfg.context_parallel_size,
                expert_model_parallel_size=cfg.expert_model_parallel_size,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,  # None: the TP size (megatron's default)
            )
            seed_all(cfg.optim.seed)
            tensor_parallel.model_parallel_cuda_manual_seed(cfg.optim.seed)
        from openrlhf_shape.actor.offload import StateOffloader

        self.offloader = StateOffloader(on_gpu=self.platform.on_gpu)

    def _mode(self):
        return cpu_compat.cpu_device_mode() if self.on_cpu else contextlib.nullcontext()

    @property
    def cfg(self) -> MegatronConfig:
        """The rank's settings, resolved for its profile (they live in the state)."""
        return self.state.cfg

    @cfg.setter
    def cfg(self, cfg: MegatronConfig) -> None:  # a configuration for the next init_model (tests vary it on a rank)
        self.state.cfg = cfg.for_platform(self.platform)

    def _require_onloaded(self, groups: tuple[str, ...], what: str) -> None:
        """Colocation guard: ``what`` needs these state groups in device memory."""
        missing = [g for g in groups if g in self.offloader.offloaded]
        if missing:
            raise RuntimeError(f"{what} while {', '.join(missing)} are offloaded to host; onload_states() first "
                               "(the colocation lifecycle orders this)")

    def offload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        """Move parameter / gradient / optimizer storages to host memory (colocation)."""
        self.state.require_model()
        from openrlhf_shape.megatron.offload import state_tensors

        freed = self.offloader.offload(state_tensors(self.state.model_chunks, self.state.optimizer), groups)
        return {"offloaded_bytes": float(freed), "offloaded": sorted(self.offloader.offloaded)}

    def onload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        """Bring offloaded groups back (bit for bit)."""
        self.state.require_model()
        restored = self.offloader.onload(groups)
        return {"onloaded_bytes": float(restored), "offloaded": sorted(self.offloader.offloaded)}

    # ------------------------------------------------------------------ model
    def init_model(self, hf_dir: str, *, load_weights: bool = True, train: bool = True) -> dict:
        """Build the GPT model through the bridge, load HF weights, build the optimizer
        (:func:`~openrlhf_shape.megatron.build.build_model`: ``load_weights=False`` keeps Megatron's random
        initialisation, ``train=False`` builds a forward-only model; ``train_step`` and checkpoints then refuse)."""
        with self._mode():
            return build_model(self.state, hf_dir, load_weights=load_weights, train=train)

    def init_reference(self, hf_dir: str) -> dict:
        """The reference model: ``hf_dir``'s weights in this rank's layout, forward only (no DDP buffers, no optimizer;
        free MoE routing: OpenRLHF's reference replays no rollout routing)."""
        self.state.cfg = dataclasses.replace(self.state.cfg, routing_replay="none")
        return {**self.init_model(hf_dir, train=False), "reference": True}

    def init_value_model(self, hf_dir: str, *, default_prefix: str | None = None, head_seed: int | None = None) -> dict:
        """A value model (reward model / critic in OpenRLHF's format, :mod:`openrlhf_shape.megatron.value`) in this
        rank's layout, forward only; ``head_seed`` draws a head for a directory without one (a causal LM). Its head is
        ``<prefix>.weight``: config.json's ``value_head_prefix``, else ``default_prefix``, else the rank config's
        (``--ds.value_head_prefix``)."""
        from openrlhf_shape.megatron.value import build_value_model

        self.state.cfg = dataclasses.replace(self.state.cfg, routing_replay="none")
        prefix = default_prefix or self.cfg.value_head_prefix
        with self._mode():
            return build_value_model(self.state, hf_dir, default_prefix=prefix, head_seed=head_seed)

    def compute_values(self, batch: SequenceBatch | dict) -> dict:
        """Forward only; results on the last PP stage / TP rank 0, ``{}`` elsewhere: ``{"indices", "values"}``, per
        sample of prompt P and response R its raw values ``[R + 1]`` float32 (index j < R: response token j's state;
        R: the whole sequence's, the reward model's score), un-normalised."""
        from openrlhf_shape.megatron.value import values

        self._require_onloaded(("params",), "compute_values")
        self.state.require_model()
        if self.state.value_format is None:
            raise RuntimeError("compute_values needs a value model: init_value_model(hf_dir) first")
        with self._mode():
            return values(self.state, batch)

    def init_critic(self, hf_dir: str, optim: OptimConfig, value_clip: float | None = 0.5,
                    head_seed: int | None = None, *, default_prefix: str | None = None) -> dict:
        """The critic: ``hf_dir``'s value model in this rank's layout, trainable with its own optimiser and LR
        schedule ``optim`` (``TrainConfig.critic_optim_config()``: ``--critic.adam.*``, lr, warm-up, schedule,
        max_norm); ``value_clip``: ``--critic.value_clip`` of :meth:`train_values`. ``compute_values``,
        checkpoints and ``export_hf`` (``--critic.save_value_network``: OpenRLHF's value-model directory) then
        act on it."""
        from openrlhf_shape.megatron.value import build_value_model

        self.state.cfg = dataclasses.replace(self.state.cfg, routing_replay="none", optim=optim)
        self.value_clip = value_clip
        prefix = default_prefix or self.cfg.value_head_prefix  # as init_value_model's
        with self._mode():
            return build_value_model(self.state, hf_dir, default_prefix=prefix, head_seed=head_seed, train=True)

    def train_values(self, batch: ValueBatch) -> dict:
        """One optimizer step of the critic over the whole mini-batch (``megatron/critic.py``): OpenRLHF's clipped
        value loss of ``batch.old_values`` / ``returns`` / ``loss_mask`` (``[B, T]``) over its valid tokens.
        Returns float metrics under OpenRLHF's names (``critic_loss``, ``values``, ``critic_lr``,
        ``critic_grad_norm``), identical on all ranks."""
        from openrlhf_shape.megatron.critic import train_values

        self.state.require_optimizer("train_values")
        self._require_onloaded(STATE_GROUPS, "train_values")
        if self.state.value_format is None:
            raise RuntimeError("train_values needs a critic: init_critic(hf_dir, optim) first")
        with self._mode():
            return train_values(self.state, batch, value_clip=self.value_clip)

    # ------------------------------------------------------------------ log-probs / entropy
    def compute_logprobs_and_entropy(self, batch: SequenceBatch | dict) -> dict:
        """Forward only. Returns results on the last PP stage / TP rank 0, ``{}`` elsewhere.

        ``batch``: a :class:`~openrlhf_shape.batch.SequenceBatch` (or the same fields as a mapping).
        Output (gathered by :func:`openrlhf_shape.actor.rank_outputs.merge_rank_outputs`): ``{"indices": [i], "log_probs": [Tensor[T_i] f32 cpu], "entropy": [...]}`` where
        position j is the log-prob / full-vocab entropy (logits / temperature) of response token j.
        With ``--megatron.routing_replay`` r2 (recorded here) or r3 (``batch.routed_experts`` replayed) the output
        also carries ``"routed_experts"``: per sample ``[L_i, layers, top_k]``, to hand to :meth:`train_step`.
        ``"micro_batches"``: how many forward micro-batches of at most ``optim.forward_budget`` tokens
        (``--rollout.max_tokens_per_gpu``) this data-parallel rank ran.
        """
        self._require_onloaded(("params",), "compute_logprobs_and_entropy")
        self.state.require_model()
        with self._mode():
            return step.logprobs_and_entropy(self.state, batch)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer step over the whole mini-batch (this rank trains on its DP shard).

        ``batch``: a :class:`~openrlhf_shape.batch.TrainBatch` (old log-probs, advantages and loss
        mask as ``[B, T]``; optional rollout-correction weights ``is_weights`` ``[B, T]``; with
        ``--megatron.routing_replay`` r2/r3 ``routed_experts``, replayed in the forward and backward). The PPO/DAPO
        loss is normalised by the number of valid response tokens of the whole mini-batch. Returns
        float metrics, identical on all ranks.
        """
        self._require_onloaded(STATE_GROUPS, "train_step")
        self.state.require_model()
        self.state.require_optimizer("train_step")
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"train_step needs an openrlhf_shape.batch.TrainBatch, got {type(batch).__name__}")
        batch.validate()
        with self._mode():
            return step.train_step(self.state, batch)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str, extra: Optional[dict] = None) -> None:
        """Atomically write model + optimizer + RNG + step (+ ``extra``) to ``ckpt_dir``."""
        self.state.require_model()
        self.state.require_optimizer("save_checkpoint")
        self._require_onloaded(STATE_GROUPS, "save_checkpoint")
        with self._mode():
            save_distributed_checkpoint(self.state, ckpt_dir, extra or {})

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore everything saved by :meth:`save_checkpoint`; returns its ``extra``."""
        self.state.require_model()
        self.state.require_optimizer("load_checkpoint")
        with self._mode():
            return load_distributed_checkpoint(self.state, ckpt_dir)

    # ------------------------------------------------------------------ HF export
    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named weights in buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

        All ranks must iterate in lockstep (the bridge gathers TP shards and PP stages per
        parameter); rank 0 yields real buckets of detached CPU copies, other ranks yield ``[]``
        as often as rank 0 yields a bucket.
        """
        self.state.require_model()
        self._require_onloaded(("params",), "iter_hf_weights")
        with self._mode():
            yield from iter_buckets(self.state, bucket_bytes)

    def export_hf(self, out_dir: str) -> None:
        """Write an HF directory (safetensors + config + tokenizer) atomically to ``out_dir``."""
        self.state.require_model()
        with self._mode():
            export_hf_dir(self.state, out_dir)

    # ------------------------------------------------------------------ teardown
    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        """Destroy model-parallel state and the process group (idempotent)."""
        try:
            st = self.state
            st.model = st.optimizer = st.routing = None
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
