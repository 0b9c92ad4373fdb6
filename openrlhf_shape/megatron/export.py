"""HF-named weights out of the Megatron model: size-bounded buckets (vLLM sync) and HF directories.

The bridge's ``export_weights`` is a generator that all TP and PP ranks iterate in lockstep (it
all-gathers TP shards and broadcasts across PP per parameter), so every rank sees every full
tensor and can compute the same bucket boundaries. Rank 0 keeps detached CPU copies (at TP1 the
bridge yields views of live parameters); other ranks yield empty buckets at the same points.
Memory stays near one bucket plus the largest gathered tensor.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.actor.hf_dir import nbytes, write_hf_dir
from openrlhf_shape.actor.value_model import export_config
from openrlhf_shape.megatron.state import ActorState


def iter_hf_tensors(state: ActorState) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) in bridge order on every rank; tied weights appear once."""
    seen: set[str] = set()
    for name, tensor in state.bridge.export_weights(state.model_chunks):
        if name in seen:  # tied embeddings at PP>1 come from both ends of the pipeline
            continue
        seen.add(name)
        yield name, tensor


def iter_buckets(state: ActorState, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``bucket_bytes`` (a bigger tensor gets its own bucket).

    Rank 0: lists of (name, detached CPU copy). Other ranks: ``[]`` at the same iterations.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    keep = dist.get_rank() == 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    count = 0
    for name, tensor in iter_hf_tensors(state):
        nb = nbytes(tensor)
        if count and size + nb > bucket_bytes:
            yield bucket if keep else []
            bucket, size, count = [], 0, 0
        if keep:
            bucket.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
        size += nb
        count += 1
    if count:
        yield bucket if keep else []


def export_hf_dir(state: ActorState, out_dir: str, *, shard_bytes: int = 2 << 30) -> None:
    """Write safetensors shards (about ``shard_bytes`` each) + index + config + tokenizer files to
    ``out_dir`` atomically (collective). A value model's directory is OpenRLHF's (its head ``<prefix>.weight``)."""
    write_hf_dir(iter_buckets(state, shard_bytes), out_dir, export_config(state.hf_config, state.value_format),
                 state.cfg.params_dtype, state.hf_dir)
