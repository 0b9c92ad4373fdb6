"""Write an HF model directory from buckets of (HF name, CPU tensor), atomically: the export step of
every training backend (Megatron's bridge export and DeepSpeed's gathered parameters both feed it)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

import torch
import torch.distributed as dist

_WEIGHT_FILES = (".safetensors", ".bin", ".pt")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_hf_dir(buckets: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str, hf_config,
                 params_dtype: torch.dtype, hf_dir: str) -> None:
    """Collective HF export (both backends; every rank calls it and iterates ``buckets``, whose
    production may gather across ranks): rank 0 writes each bucket of (HF name, CPU tensor) as one
    safetensors shard under ``<out_dir>.tmp`` as it comes (memory stays near one bucket; other ranks
    get empty buckets), then numbers the shards ``model-i-of-n``, writes the index, the config with
    ``params_dtype`` and the source dir's non-weight files (tokenizer, generation config, chat
    template), and moves the directory onto ``out_dir`` in one rename. Without a process group the
    one process writes."""
    from safetensors.torch import save_file

    final = os.path.abspath(out_dir)
    tmp = final + ".tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0  # one process (an HF model's save): no group
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
            total += nbytes(t)
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
    if dist.is_initialized():
        dist.barrier()
