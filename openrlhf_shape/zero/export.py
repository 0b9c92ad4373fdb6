"""HF-named full weights out of a DeepSpeed rank: size-bounded buckets (the vLLM weight sync) and
HF directories.

Under ZeRO-3 each parameter lives as 1/dp partitions; a bucket's parameters are gathered together
(``deepspeed.zero.GatheredParameters`` over that bucket only, a collective all ranks join in
lockstep), copied to host on rank 0, and released before the next bucket: the full model is never
materialised. Bucket boundaries come from the full sizes (``ds_numel``), so every rank cuts the same
buckets without talking. ZeRO-0/1/2 keep full parameters on every rank: nothing to gather.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.actor.hf_dir import write_hf_dir
from openrlhf_shape.actor.value_model import export_config
from openrlhf_shape.zero.model import hf_named_parameters

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.zero.state import ZeroState


def plan_buckets(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of at most ``bucket_bytes`` (full size); a bigger tensor gets its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
    cur: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in named:
        nb = int(getattr(p, "ds_numel", p.numel())) * p.element_size()  # ZeRO-3 full size
        if cur and size + nb > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += nb
    if cur:
        buckets.append(cur)
    return buckets


def iter_buckets(state: "ZeroState", bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank 0: lists of (HF name, detached CPU copy); other ranks: ``[]`` at the same iterations."""
    keep = dist.get_rank() == 0
    zero3 = state.cfg.zero_stage == 3
    if zero3:
        import deepspeed
    # a value model's parameters carry OpenRLHF's names already (model.*, <prefix>.weight)
    named = hf_named_parameters(state.policy) if state.value_format is None else list(state.policy.named_parameters())
    for bucket in plan_buckets(named, bucket_bytes):
        params = [p for _, p in bucket]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else contextlib.nullcontext():
            out = [(name, p.detach().to("cpu", copy=True).contiguous()) for name, p in bucket] if keep else []
        yield out


def export_hf_dir(state: "ZeroState", out_dir: str, *, shard_bytes: int = 2 << 30) -> None:
    """safetensors shards + index + config + the source dir's tokenizer files, written atomically (collective); a
    value model's directory is OpenRLHF's."""
    write_hf_dir(iter_buckets(state, shard_bytes), out_dir, export_config(state.hf_config, state.value_format),
                 state.cfg.params_dtype, state.hf_dir)
