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
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.megatron.state import ActorState

_WEIGHT_FILES = (".safetensors", ".bin", ".pt")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_hf_dir(buckets: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str, hf_config,
                 params_dtype: torch.dtype, hf_dir: str) -> None:
    """Collective HF export (both backends; every rank calls it and iterates ``buckets``, whose
    production may gather across ranks): rank 0 writes each bucket of (HF name, CPU tensor) as one
    safetensors shard under ``<out_dir>.tmp`` as it comes (memory stays near one bucket; other ranks
    get empty buckets), then numbers the shards ``model-i-of-n``, writes the index, the config with
    ``params_dtype`` and the source dir's non-weight files (tokenizer, generation config, chat
    template), and moves the directory onto ``out_dir`` in one rename."""
    from safetensors.torch import save_file

    final = os.path.abspath(out_dir)
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    for bucket in buckets:
        if not rank0:
            continue
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(dict(bucket), os.path.join(tmp, fname), metadata={"format": "pt"})
        files.append(fname)
        for name, t in bucket:
            weight_map[name] = fname
            total += _nbytes(t)
    if rank0:
        n = len(files)
        renamed = {old: f"model-{i:05d}-of-{n:05d}.safetensors" for i, old in enumerate(files, start=1)}
        for old, new in renamed.items():
            os.replace(os.path.join(tmp, old), os.path.join(tmp, new))
        index = {"metadata": {"total_size": total},
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
    dist.barrier()


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
    """Write safetensors shards (about ``shard_bytes`` each) + index + config + tokenizer files to
    ``out_dir`` atomically (collective)."""
    write_hf_dir(iter_buckets(state, shard_bytes), out_dir, state.hf_config, state.cfg.params_dtype, state.hf_dir)
