"""Comparisons the packing tests of both backends share (tests/megatron, tests/zero): packed against padded
micro-batches of the same model, weights and tokens."""

from __future__ import annotations

import torch

from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from openrlhf_shape.batch import LogProbs


def merged(results: list[dict], arch: str, layout: str, n: int) -> LogProbs:
    """One layout's log-probs and entropy of every sample, in batch order, from all ranks' results."""
    return merge_rank_outputs([r[arch][layout]["logprobs"] for r in results], n)


def worst_grad_rel_diff(packed: dict[str, torch.Tensor], padded: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over parameters of ||g_packed - g_padded|| / ||g_padded|| (a parameter without gradient in both
    layouts, e.g. an expert no token reached, counts 0) and the parameter where it is largest."""
    assert packed.keys() == padded.keys()
    worst, where = 0.0, ""
    for name, ref in padded.items():
        diff = float((packed[name] - ref).norm())
        scale = float(ref.norm())
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        if rel > worst:
            worst, where = rel, name
    return worst, where


def computed_positions(micro_batches: list[dict]) -> int:
    return sum(int(torch.Size(mb["shape"]).numel()) for mb in micro_batches)
