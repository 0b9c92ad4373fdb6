"""Ring attention (context parallelism) on the DeepSpeed backend: ``--ds.ring_attn_size``, ``--ds.ring_attn_head_stride``.

OpenRLHF's meaning. The ranks form groups of ``ring_attn_size`` consecutive ranks (its device mesh ``(dp, sp)``);
the ranks of one group hold the same data-parallel shard. A micro-batch is packed (one row of samples, position ids
restarting at 0 per sample), padded at its end to a multiple of the ring size, and cut into that many contiguous
pieces: ring rank r holds tokens ``[r L, (r + 1) L)`` (a sample may straddle pieces; its position ids travel with its
tokens, so RoPE sees the sample's own positions). OpenRLHF runs ring-flash-attn's varlen llama3 kernel there: it
all-gathers K/V over the group, ``ring_attn_head_stride`` KV heads at a time (a memory knob: fewer heads gathered at
once), and attends with the packed samples' causal mask.

Here the same in torch, as a Hugging Face attention function (:data:`ATTENTION_NAME`, registered in transformers'
``AttentionInterface``; transformers builds no mask for an implementation it has no mask function for, so the
function makes its own): all-gather K/V (:func:`~openrlhf_shape.actor.cp_comm.gather_over_cp`, with gradients)
``head_stride`` KV heads at a time, then SDPA with the mask ``same sample and key position <= query position`` in
the micro-batch's global positions. The worker sets the micro-batch's layout (:func:`ring_layout`) around each
forward. CPU twin only: on GPU this holds a whole micro-batch's K/V per head group on each rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from openrlhf_shape.actor.cp_comm import gather_over_cp

ATTENTION_NAME = "shape_ring"


@dataclass
class RingLayout:
    """One micro-batch on one ring rank: ``doc`` ``[T]`` the sample index of every global position (the padding
    tail a sample of its own), ``start`` the first global position this rank holds, ``group`` the ring group,
    ``head_stride`` KV heads gathered at once."""

    doc: torch.Tensor
    start: int
    group: Any
    head_stride: int


_CURRENT: list[Optional[RingLayout]] = [None]


@contextlib.contextmanager
def ring_layout(layout: RingLayout) -> Iterator[None]:
    """Make ``layout`` the one the attention function reads during a forward (and its backward's recompute)."""
    saved = _CURRENT[0]
    _CURRENT[0] = layout
    try:
        yield
    finally:
        _CURRENT[0] = saved


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)
    return ATTENTION_NAME


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query ``[1, heads, L, d]``, key/value ``[1, kv_heads, L, d]`` (this rank's piece) -> ``[1, L, heads, d]``."""
    layout = _CURRENT[0]
    if layout is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside zero.ring_attention.ring_layout (the "
                           "DeepSpeed worker sets it around each micro-batch under --ds.ring_attn_size > 1)")
    if attention_mask is not None:
        raise ValueError("ring attention takes packed micro-batches without an attention mask")
    heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
    rep, stride = heads // kv_heads, layout.head_stride
    doc = layout.doc  # [L, T] bool below: query start + i may see key j (same sample, j <= start + i)
    q_pos = torch.arange(layout.start, layout.start + length, device=doc.device)
    k_pos = torch.arange(doc.shape[0], device=doc.device)
    allowed = (doc[q_pos][:, None] == doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    outs = []
    for g in range(0, kv_heads, stride):
        # [ring, 1, s, L, d] -> [1, s, T, d]: the group's pieces in ring-rank order are the micro-batch's order
        k = torch.cat(gather_over_cp(key[:, g:g + stride].contiguous(), layout.group).unbind(0), dim=2)
        v = torch.cat(gather_over_cp(value[:, g:g + stride].contiguous(), layout.group).unbind(0), dim=2)
        q = query[:, g * rep:(g + stride) * rep]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, dropout_p=dropout,
                                                   enable_gqa=rep > 1))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None
