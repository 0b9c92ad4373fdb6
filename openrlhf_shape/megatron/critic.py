"""The critic's update on a Megatron rank (``--algo.advantage.estimator gae``): one optimizer step of OpenRLHF's
clipped value loss (:mod:`~openrlhf_shape.actor.critic_loss`) over a mini-batch, through the same pipeline schedule,
micro-batching, clipping and LR schedule as the policy's (:mod:`~openrlhf_shape.megatron.step`), on the value model
of :mod:`~openrlhf_shape.megatron.value` built trainable with the critic's ``--critic.*`` optimiser. A function of
the rank's :class:`~openrlhf_shape.megatron.state.ActorState`, run inside the worker's device mode.
"""

from __future__ import annotations

import torch

from openrlhf_shape.actor.batching import MicroBatch
from openrlhf_shape.actor.critic_loss import CRITIC_KEYS, critic_masks, critic_metrics, micro_batch_value_loss
from openrlhf_shape.batch import ValueBatch
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.megatron.step import plan, run_schedule, summed_update
from openrlhf_shape.megatron.value import state_values


def train_values(state: ActorState, batch: ValueBatch, *, value_clip: float | None) -> dict[str, float]:
    """One optimizer step of the critic over ``batch`` (the worker's ``train_values``): this rank's DP shard, the
    loss over the mini-batch's valid tokens (``value_clip``: ``--critic.value_clip``); a non-finite loss or gradient
    skips the update. Returns float metrics (:func:`~openrlhf_shape.actor.critic_loss.critic_metrics`), identical
    on all ranks."""
    batch.validate()
    masks = critic_masks(batch)
    num_global_tokens = int(masks.sum())

    def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
        vals, offsets = state_values(state, hidden, mb)
        loss, stats = micro_batch_value_loss(vals, offsets, mb, batch, masks, num_global_tokens, value_clip)
        return loss, torch.tensor(int(stats["num_tokens"]), dtype=torch.int), stats

    shard, mbs = plan(state, batch, forward_only=False)
    state.model.train()
    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()
    store = run_schedule(state, mbs, loss_fn, forward_only=False)
    sums, ok, grad_norm, lr = summed_update(state, store, bool(shard), CRITIC_KEYS)
    return critic_metrics(sums, grad_norm=grad_norm, lr=lr, ok=ok, step=state.step)
