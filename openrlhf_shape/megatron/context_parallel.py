"""Context parallelism for the local attentions and the log-prob head (torch collectives over the CP group).

Each CP rank holds two chunks of every sequence (:mod:`openrlhf_shape.actor.cp_split`: chunks ``r`` and
``2 x cp - 1 - r`` of ``2 x cp``). Attention needs every earlier key of the sequence, so the local attentions
all-gather K and V over the CP group (:func:`~openrlhf_shape.actor.cp_comm.gather_over_cp`), put the chunks
back in sequence order and attend with the causal mask in global positions (:func:`cp_attention`). A query of chunk ``c`` (length ``L``) sees the keys ``[0, (c + 1) L)`` of its sequence,
the last ``L`` of them causally. This is the CPU twin of TE's context-parallel attention (a ring of K/V exchanges
on GPU); it holds a sequence's whole K/V on each rank, which is fine for the tiny models it runs here.

The log-prob head runs on each rank's own positions; :func:`~openrlhf_shape.actor.cp_comm.sum_over_cp` puts the
per-token results back into the micro-batch's order on every rank; megatron-core's DDP sums the parameter gradients
over data x context parallel ranks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from openrlhf_shape.actor.cp_comm import gather_over_cp, sum_over_cp

__all__ = ["causal_allowed", "cp_attention", "gather_over_cp", "sum_over_cp"]


def causal_allowed(offset: int, sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query ``i`` (global position ``offset + i``) may see key ``j`` (position j)."""
    return torch.arange(sk, device=device)[None, :] <= offset + torch.arange(sq, device=device)[:, None]


def _sequence_keys(gathered: torch.Tensor, a: int, b: int, cp: int) -> torch.Tensor:
    """The gathered ``[cp, t_local, ...]`` -> one sequence's keys ``[2 x cp x L, ...]`` in global order, for the
    sequence at local positions ``[a, b)`` (``b - a = 2L``: chunk r then chunk 2cp-1-r on rank r)."""
    half = (b - a) // 2
    first = [gathered[c, a:a + half] for c in range(cp)]
    second = [gathered[2 * cp - 1 - c, a + half:b] for c in range(cp, 2 * cp)]
    return torch.cat(first + second, dim=0)


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[tuple[int, int]], group,
                 attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Causal attention of this CP rank's queries over whole sequences.

    ``query`` ``[t_local, b, np, hn]``, ``key``/``value`` ``[t_local, b, ng, hn]`` (this rank's two chunks of each
    sequence, sequences at the local ``bounds``); ``attend(q [sq, b, np, hn], k [sk, b, ng, hn], v, allowed
    [sq, sk] bool)`` -> ``[sq, b, np * hn]``. Returns ``[t_local, b, np * hn]``.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keys, values = gather_over_cp(key, group), gather_over_cp(value, group)
    outs = []
    for a, b in bounds:
        half = (b - a) // 2
        k_seq, v_seq = _sequence_keys(keys, a, b, cp), _sequence_keys(values, a, b, cp)
        for j, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            q = query[a + j * half:a + (j + 1) * half]
            end = (chunk + 1) * half
            allowed = causal_allowed(chunk * half, half, end, query.device)
            outs.append(attend(q, k_seq[:end], v_seq[:end], allowed))
    return torch.cat(outs, dim=0)
