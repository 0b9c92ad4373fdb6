"""Context parallelism's load-balanced sequence split (pure torch: which positions each CP rank holds).

A sequence (a padded micro-batch's row, or each document of a packed one) of length ``n``, a multiple of
``2 x cp``, is cut into ``2 x cp`` equal chunks; CP rank ``r`` holds chunks ``r`` and ``2 x cp - 1 - r``, in that
order. Causal attention makes late chunks costlier than early ones, so pairing an early with a late chunk gives
every rank the same work: megatron-core's split (``get_batch_on_this_cp_rank``; per document for THD, the
documents padded to a multiple of ``2 x cp``), which its RoPE (``get_pos_emb_on_this_cp_rank``,
``_apply_rotary_pos_emb_thd``) and TE's context-parallel attention expect.

:class:`CpShard` is one rank's view of a :class:`~openrlhf_shape.actor.batching.MicroBatch`: the global positions it
holds (in its local order), and which of the micro-batch's response-predicting positions are among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def chunk_positions(start: int, length: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global positions of CP rank ``cp_rank``'s two chunks of the sequence ``[start, start + length)``."""
    if length % (2 * cp_size):
        raise ValueError(f"a sequence split over {cp_size} context-parallel ranks needs a length that is a multiple "
                         f"of 2 x {cp_size}, got {length} (pad it: actor/batching.py does)")
    size = length // (2 * cp_size)
    first = start + cp_rank * size
    second = start + (2 * cp_size - 1 - cp_rank) * size
    return list(range(first, first + size)) + list(range(second, second + size))


def sequences_of(mb) -> list[tuple[int, int]]:
    """``(start, end)`` of each sequence the split applies to: the documents of a packed micro-batch (padded
    boundaries), the whole row of a padded one."""
    if mb.cu_seqlens is not None:
        return list(zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]))
    return [(0, int(mb.input_ids.shape[1]))]


@dataclass
class CpShard:
    """One CP rank's part of a micro-batch.

    ``index``: ``[t_local]`` global positions held, in local order (``input_ids[:, index]`` is the rank's input).
    ``resp_local``: ``[N]`` bool, True where the micro-batch's response-predicting position is held here.
    ``resp_rows`` / ``resp_pos``: ``[n]`` (``n = resp_local.sum()``) the row and *local* position of those.
    ``local_bounds``: ``(start, end)`` of each sequence in local positions (each of length ``2 x chunk``).
    """

    index: torch.Tensor
    resp_local: torch.Tensor
    resp_rows: torch.Tensor
    resp_pos: torch.Tensor
    local_bounds: list[tuple[int, int]]


def cp_shard(mb, cp_size: int, cp_rank: int) -> CpShard:
    """This rank's :class:`CpShard` of ``mb`` (a :class:`~openrlhf_shape.actor.batching.MicroBatch`)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    seqs = sequences_of(mb)
    positions: list[int] = []
    for a, b in seqs:
        positions.extend(chunk_positions(a, b - a, cp_size, cp_rank))
    index = torch.tensor(positions, dtype=torch.long)
    inverse = torch.full((int(mb.input_ids.shape[1]),), -1, dtype=torch.long)
    inverse[index] = torch.arange(len(positions), dtype=torch.long)
    local_of_resp = inverse[mb.resp_pos]
    resp_local = local_of_resp >= 0
    bounds = [(a // cp_size, b // cp_size) for a, b in seqs]
    return CpShard(index=index, resp_local=resp_local, resp_rows=mb.resp_rows[resp_local],
                   resp_pos=local_of_resp[resp_local], local_bounds=bounds)
