"""Collectives of context parallelism with their gradients (backend-neutral: both backends' CP ranks use them).

:func:`gather_over_cp`: every CP rank's tensor (K/V of an attention); backward: the sum of every rank's gradient,
each rank keeping its own slice (a reduce-scatter, written as an all-reduce because gloo has no reduce-scatter).

:func:`sum_over_cp`: per-token results (log-probs, entropy) that each CP rank computed at its own positions, put back
into the micro-batch's order on every CP rank (forward: all-reduce of disjoint parts; backward: identity). Every CP rank
then computes the same loss from the same values and each rank's gradient flows into its own positions only, so the
parameter gradients summed over the CP ranks are the gradient of that loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherOverCp(torch.autograd.Function):
    """``x`` ``[t_local, ...]`` -> ``[cp, t_local, ...]`` (every rank's ``x``, by CP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries' gradient for each rank's keys
        return grad[dist.get_rank(ctx.group)], None


class _SumOverCp(torch.autograd.Function):
    """Forward: the sum over the CP group (of parts that are zero outside each rank's positions); backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherOverCp.apply(x, group)


def sum_over_cp(local: torch.Tensor, held: torch.Tensor, group) -> torch.Tensor:
    """``local`` ``[n]`` values at the positions ``held`` (``[N]`` bool, ``n`` True) -> ``[N]`` on every CP rank."""
    full = local.new_zeros(held.shape[0]).index_put((held.nonzero(as_tuple=True)[0],), local)
    return _SumOverCp.apply(full, group)
