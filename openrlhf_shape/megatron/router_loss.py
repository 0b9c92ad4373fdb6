"""The MoE router losses (``--megatron.moe_aux_loss_coeff``, ``--megatron.moe_z_loss_coeff``) as a token mean over the
whole mini-batch, whatever the data, tensor, context parallel or micro-batch layout (docs/moe.md).

Megatron's router adds each loss to the backward itself; what this module sets is the weight it gets
(:func:`router_loss_scale`) and which tokens count (:func:`router_padding_mask`: padding and fillers do not).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.actor.batching import MicroBatch
from openrlhf_shape.megatron.state import ActorState


def router_losses_on(state: ActorState) -> bool:
    cfg = state.cfg
    return bool(getattr(state.tconfig, "num_moe_experts", None)) and (cfg.moe_aux_loss_coeff > 0 or cfg.moe_z_loss_coeff > 0)


@contextlib.contextmanager
def router_loss_scale(state: ActorState, mbs: list[MicroBatch], *, forward_only: bool) -> Iterator[None]:
    """Scale the MoE router losses (load-balancing, z) to a token mean over the whole mini-batch.

    With ``calculate_per_token_loss`` Megatron's router adds ``loss x (tokens of the micro-batch on this
    rank)`` to the backward and expects ``finalize_model_grads`` to divide every gradient by the global
    token count; we skip that division (the policy loss is already a global token mean), so the schedule's
    backward scale for the router losses (``MoEAuxLossAutoScaler``, set to 1 after each forward) is replaced
    by S / (unpadded tokens of every micro-batch on every data-parallel rank; :func:`router_padding_mask`),
    S the size of the router's TP x CP group (1 without SP / CP).
    Why S: under sequence or context parallelism each of the S ranks holds 1/S of a micro-batch's tokens. The
    z-loss share is the local mean x coeff / S, weighted by the local token count: the S shares add up to 1/S
    of the micro-batch's z-loss x its token count, hence x S. The load-balancing shares are partial sums of the
    micro-batch's loss whose weight is already the group's token count (``get_tokens_per_expert_and_token_count``
    all-reduces the per-expert counts in place, so its "local" count is the group's); x S would count them S
    times, so :func:`_router_token_weight` sets that weight to the group's count / S.
    Result: ``coeff x sum over layers of the token-weighted mean over micro-batches of Megatron's
    per-micro-batch loss``, whatever the data, tensor, context parallel or micro-batch layout.
    """
    if forward_only or not router_losses_on(state):
        yield
        return
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    valid = sum(int((~router_padding_mask(mb)).sum()) for mb in mbs)
    tokens = torch.tensor([float(valid)], dtype=torch.float64, device=state.device)
    dist.all_reduce(tokens, group=mpu.get_data_parallel_group())
    factor = mpu.get_tensor_and_context_parallel_world_size() / float(tokens.item())
    orig = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def set_loss_scale(scale: torch.Tensor) -> None:
        orig.__func__(scale * factor)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale)
    try:
        with _router_token_weight():
            yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = orig


@contextlib.contextmanager
def _router_token_weight() -> Iterator[None]:
    """The load-balancing loss share's token weight on every rank = the micro-batch's unpadded tokens over the
    router's reduce group / the group's size, so that :func:`router_loss_scale`'s factor S (which the z-loss needs)
    counts it once. megatron-core 0.16.1 returns the group's count as ``local_num_tokens`` (its all-reduce of the
    per-expert counts is in place); the weight set here does not depend on that."""
    from megatron.core.transformer.moe import router as moe_router

    orig = moe_router.get_tokens_per_expert_and_token_count

    def counts(routing_map: torch.Tensor, reduce_group, topk: int | None = None, with_padding_mask: bool = False):
        per_expert, _local, total = orig(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        return per_expert, total / reduce_group.size(), total

    moe_router.get_tokens_per_expert_and_token_count = counts
    try:
        yield
    finally:
        moe_router.get_tokens_per_expert_and_token_count = orig


def router_padding_mask(mb: MicroBatch) -> torch.Tensor:
    """[rows, seq] bool for Megatron's MoE router, True = left out of the router losses: padding (right padding of
    a padded micro-batch, the tail of a packed one), and all but the first token of a filler micro-batch (a fully masked one would divide by zero token counts inside
    Megatron's loss functions; its one token is a pad).

    Without it a pad position whose embedding is zero (HF zero-initialises the ``padding_idx`` row) sends the
    z-loss through RMSNorm at a zero input, which amplifies by 1/sqrt(eps): measured 436 vs 10.2 grad norm."""
    if not mb.rows:
        mask = torch.ones_like(mb.input_ids, dtype=torch.bool)
        mask[0, 0] = False
        return mask
    return mb.padding_mask()
