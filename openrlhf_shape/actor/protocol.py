"""What a training backend's rank worker is: the interface the trainer, the Ray rank group
(:mod:`openrlhf_shape.cluster.rank_group`), the colocation lifecycle and the weight sync rely on.

Two backends implement it today: :class:`openrlhf_shape.megatron.worker.MegatronRankWorker` (TP/PP/DP,
the bridge) and :class:`openrlhf_shape.zero.worker.ZeroRankWorker` (DeepSpeed ZeRO on the HF model).
A third backend is a package with a class with these methods, its rank config and its record
(:mod:`openrlhf_shape.actor.backends`: worker, rank config from the flags, model checks, trainer dtype),
registered beside its flag section in ``config/tree.py``. Above the backends' packages only the dry-run
planner's memory model tells them apart by name (``tests/actor/test_backends.py``); everything else reads the record.

SPMD contract: every rank of a job receives the same calls in the same order with the same
arguments (the whole batch); each rank takes its own data-parallel shard. Collective methods
(marked below) must be called on all ranks.

Construction: ``Worker(cfg, *, rank, world_size, master_addr, master_port, platform)`` joins the
torch.distributed group at the rendezvous; ``platform`` is the driver's profile
(:class:`openrlhf_shape.platform.Platform` or its dict).
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol, runtime_checkable

import torch

from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.batch import SequenceBatch, TrainBatch, ValueBatch

STATE_GROUPS = ("params", "grads", "optimizer")  # what offload_states / onload_states move


@runtime_checkable
class RankWorker(Protocol):
    rank: int
    world_size: int

    def init_model(self, hf_dir: str) -> dict:
        """Build the model (and optimizer) from an HF directory; returns a description
        (``num_parameters``, ``model_type``, layout, ``backend``). Collective."""

    def init_reference(self, hf_dir: str) -> dict:
        """Build the reference model (``--algo.kl.init_coef`` > 0) from an HF directory: the same layout as
        :meth:`init_model` (TP/PP/EP, ZeRO partitioning), forward only: no gradients, no optimizer (``train_step``
        and checkpoints refuse). Returns :meth:`init_model`'s description with ``"reference": True``. Collective."""

    def compute_logprobs_and_entropy(self, batch: SequenceBatch) -> dict:
        """Forward only: ``{"indices": [i], "log_probs": [Tensor[T_i]], "entropy": [Tensor[T_i]]}`` (float32,
        CPU, response token j at position j) for the samples this rank holds results for, ``{}`` for a
        rank without any. Collective."""

    def train_step(self, batch: TrainBatch) -> dict:
        """One optimizer step over the mini-batch; float metrics identical on every rank
        (:func:`openrlhf_shape.actor.micro_batch_loss.step_metrics`). Collective."""

    def init_critic(self, hf_dir: str, optim: OptimConfig, value_clip: float | None = 0.5,
                    head_seed: int | None = None) -> dict:
        """Build the critic (``--algo.advantage.estimator gae``): ``hf_dir``'s value model (OpenRLHF's format; a causal
        LM gets a head drawn from ``head_seed``) in this rank's layout, trainable with its own optimiser and LR
        schedule ``optim`` (``TrainConfig.critic_optim_config()``); ``value_clip``: ``--critic.value_clip``.
        Checkpoints and :meth:`export_hf` then act on it. Collective."""

    def train_values(self, batch: ValueBatch) -> dict:
        """One critic optimizer step over the mini-batch (OpenRLHF's clipped value loss); float metrics identical on
        every rank (:func:`openrlhf_shape.actor.critic_loss.critic_metrics`). Collective."""

    def save_checkpoint(self, ckpt_dir: str, extra: Optional[dict] = None) -> None:
        """Atomically write model, optimizer, schedule step, RNG and ``extra``. Collective."""

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore what :meth:`save_checkpoint` wrote; returns its ``extra``. Collective."""

    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights in buckets of at most ``bucket_bytes`` (a bigger tensor: its own); rank 0
        yields detached CPU copies, the others ``[]`` at the same points. All ranks iterate in lockstep."""

    def export_hf(self, out_dir: str) -> None:
        """Write an HF directory atomically. Collective."""

    def offload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        """Move these state groups to host memory (colocation); ``{"offloaded_bytes", "offloaded"}``."""

    def onload_states(self, groups: tuple[str, ...] = STATE_GROUPS) -> dict:
        """Bring offloaded groups back bit for bit; ``{"onloaded_bytes", "offloaded"}``."""

    def shutdown(self) -> None:
        """Release the model and the process group (idempotent)."""
