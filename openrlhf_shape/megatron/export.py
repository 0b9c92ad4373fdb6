"""HF-named weights out of the Megatron model: size-bounded buckets (vLLM sync) and HF directories.

The bridge's ``export_weights`` is a generator that all TP and PP ranks iterate in lockstep (it
all-gathers TP shards and broadcasts across PP per parameter), so every rank sees every full
tensor and can compute the same bucket boundaries. Rank 0 keeps detached CPU copies (at TP1 the
bridge yields views of live parameters); other ranks yield empty buckets at the same points.
Memory stays near one bucket plus the largest gathered tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.megatron.state import ActorState

_WEIGHT_FILES = (".safetensors", ".bin", ".pt")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def finish_hf_dir(tmp: str, final: str, files: list[str], weight_map: dict[str, str], total_bytes: int,
                  hf_config, params_dtype: torch.dtype, hf_dir: str) -> None:
    """Rank 0's last part of an HF export (both backends): number the shard ``files`` (written in this
    order under ``tmp``) ``model-i-of-n``, write the index (``weight_map``: tensor name -> file), the config
    with ``params_dtype``, copy the source dir's non-weight files (tokenizer, generation config, chat
    template), then move ``tmp`` onto ``final`` in one rename."""
    n = len(files)
    renamed: dict[str, str] = {}
    for i, old in enumerate(files, start=1):
        new = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(tmp, old), os.path.join(tmp, new))
        renamed[old] = new
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    hf_config.torch_dtype = str(params_dtype).replace("torch.", "")
    hf_config.save_pretrained(tmp)
    for name in os.listdir(hf_dir):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path) and name not in _SKIP_FILES and not name.endswith(_WEIGHT_FILES):
            shutil.copy2(path, os.path.join(tmp, name))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


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
        nb = _nbytes(tensor)
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
    """Write safetensors shards + index + config + tokenizer files to ``out_dir`` atomically."""
    from safetensors.torch import save_file

    final = os.path.abspath(out_dir)
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = []
    total = 0
    for bucket in iter_buckets(state, shard_bytes):
        if rank0:
            shards.append(dict(bucket))
            # write each shard right away so memory stays near one shard
            idx = len(shards)
            fname = f"model-{idx:05d}.safetensors"
            save_file(shards[-1], os.path.join(tmp, fname), metadata={"format": "pt"})
            for name, t in bucket:
                weight_map[name] = fname
                total += _nbytes(t)
            shards[-1] = {}
    if rank0:
        finish_hf_dir(tmp, final, [f"model-{i:05d}.safetensors" for i in range(1, len(shards) + 1)], weight_map, total,
                      state.hf_config, state.cfg.params_dtype, state.hf_dir)
    dist.barrier()
