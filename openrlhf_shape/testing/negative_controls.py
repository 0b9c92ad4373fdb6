"""Deliberate conversion bugs for negative controls: a parity check must fail under them, which
shows that its tolerance is not vacuous."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def flat_qkv_conversion(bridge) -> Iterator[None]:
    """Inside the block, ``bridge`` (an mbridge bridge) converts Hugging Face q/k/v into Megatron's
    fused ``linear_qkv`` by plain concatenation ``[q; k; v]`` instead of interleaving them per KV
    group: the classic GQA loading bug. Every other weight converts as usual; the bridge is restored
    on exit. Load weights inside the block to get a model with that bug."""
    right = bridge._weight_to_mcore_format

    def wrong(name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        if "linear_qkv" in name and "layer_norm" not in name and len(hf_weights) == 3:
            return torch.cat(hf_weights, dim=0).contiguous()
        return right(name, hf_weights)

    bridge._weight_to_mcore_format = wrong
    try:
        yield
    finally:
        bridge._weight_to_mcore_format = right
