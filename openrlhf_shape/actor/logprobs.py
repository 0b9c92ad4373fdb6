"""Vocab-parallel, chunked log-probs and entropy from final hidden states.

Given hidden states [N, hidden] at the positions that predict response tokens and the local
vocab shard of the output weight [V/tp, hidden], compute per position (at temperature T, i.e.
on logits / T, in float32):

    log p(target) = z_target - logsumexp(z)
    H             = logsumexp(z) - sum_v softmax(z)_v z_v

with the three reductions (max, sum exp, sum p*z) done over the TP group. Work is split into
chunks of ``chunk_size`` positions, so the largest float32 temporary is [chunk, V/tp]: never
[tokens, vocab]. With gradients, each chunk is recomputed in backward (activation checkpoint),
so the kept activations are the [N, hidden] inputs only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """Sum over the TP group forward; identity backward (the loss is replicated on TP ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        if group is None or dist.get_world_size(group) == 1:
            return x
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _allreduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    inv_temperature: float,
    group,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden [c, h], weight [V/tp, h], targets [c] (global ids) -> (logp [c], H [c])."""
    # bf16 on GPU: Float16Module hands the last stage float32 hidden states; match the weight.
    z = torch.matmul(hidden.to(weight.dtype), weight.t()).float() * inv_temperature  # [c, V/tp]
    with torch.no_grad():
        zmax = z.max(dim=-1).values
        _allreduce(zmax, group, dist.ReduceOp.MAX)
    z = z - zmax.unsqueeze(-1)
    e = torch.exp(z)
    sum_e = _AllReduceSumIdentityGrad.apply(e.sum(dim=-1), group)
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _AllReduceSumIdentityGrad.apply(picked * in_shard.to(picked.dtype), group)
    log_sum_e = torch.log(sum_e)
    logp = picked - log_sum_e
    if with_entropy:
        with torch.no_grad():
            pz = _allreduce((e.detach() * z.detach()).sum(dim=-1), group)
            entropy = log_sum_e.detach() - pz / sum_e.detach()
    else:
        entropy = torch.zeros_like(logp).detach()
    return logp, entropy


def vocab_parallel_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    checkpoint_chunks: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of ``targets`` and full-vocab entropy, float32 [N] each.

    ``hidden``: [N, h] final hidden states (after the final norm), replicated over TP.
    ``weight``: [V/tp, h] this rank's vocab shard, rows ``vocab_start .. vocab_start + V/tp``.
    ``targets``: [N] global token ids. The entropy carries no gradient; the log-prob does when
    ``hidden``/``weight`` require grad (chunks are then recomputed in backward unless
    ``checkpoint_chunks=False``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden [N, h] and weight [V/tp, h] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    n = hidden.shape[0]
    if n == 0:
        # Empty but still attached to hidden/weight, so a micro-batch without response tokens
        # (or a DP rank's fully masked filler) still gives a loss that backward accepts.
        empty = hidden[:0, 0].float() + weight[:0, 0].float()
        return empty, empty.detach()
    inv_t = 1.0 / float(temperature)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    use_ckpt = needs_grad if checkpoint_chunks is None else (checkpoint_chunks and needs_grad)
    logps, ents = [], []
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]
        t = targets[start : start + chunk_size]
        if use_ckpt:
            lp, en = checkpoint(
                _chunk, h, weight, t, vocab_start, inv_t, tp_group, with_entropy, use_reentrant=False
            )
        else:
            lp, en = _chunk(h, weight, t, vocab_start, inv_t, tp_group, with_entropy)
        logps.append(lp)
        ents.append(en.detach())
    return torch.cat(logps), torch.cat(ents)
