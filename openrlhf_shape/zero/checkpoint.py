"""Atomic DeepSpeed checkpoints: model, optimizer (ZeRO partitions), schedule step, RNG, trainer extra.

Layout (all ranks write into ``<dir>.tmp``; rank 0 renames it to ``<dir>`` after a barrier, so a
crash never leaves a directory that looks complete; the same markers as the Megatron backend, so
:func:`openrlhf_shape.megatron.checkpoint.latest_checkpoint` finds either kind):

    <dir>/ds/              DeepSpeed's own checkpoint (``engine.save_checkpoint``, tag ``state``):
                           module weights + each rank's ZeRO optimizer partition (fp32 masters, Adam)
    <dir>/rng/rank<r>.pt   per-rank RNG states (python, torch, numpy, CUDA)
    <dir>/meta.json        backend, step (the LR schedule is a function of it), layout, trainer ``extra``
    <dir>/COMPLETE         written last, before the rename

Assumes a filesystem shared by all ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from openrlhf_shape.megatron.checkpoint import COMPLETE_MARKER, TMP_SUFFIX
from openrlhf_shape.rng import capture_rng, restore_rng

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.zero.worker import ZeroRankWorker

BACKEND = "deepspeed"
_TAG = "state"


def _layout(worker: "ZeroRankWorker") -> dict[str, Any]:
    return {"dp": worker.dp_size, "zero_stage": worker.cfg.zero_stage, "adam_offload": worker.cfg.adam_offload}


def save_checkpoint(worker: "ZeroRankWorker", ckpt_dir: str, extra: dict) -> None:
    final = os.path.abspath(ckpt_dir)
    tmp = final + TMP_SUFFIX
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "ds"))
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    worker.engine.save_checkpoint(os.path.join(tmp, "ds"), tag=_TAG, client_state={"step": worker.step})
    torch.save(capture_rng(worker.platform.on_gpu), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {"backend": BACKEND, "step": worker.step, "layout": _layout(worker), "hf_dir": worker.hf_dir,
                "extra": extra}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write("ok\n")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()


def load_checkpoint(worker: "ZeroRankWorker", ckpt_dir: str) -> dict:
    path = os.path.abspath(ckpt_dir)
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); use latest_checkpoint(root) to find one")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("backend") != BACKEND:
        raise ValueError(
            f"{path} was written by the Megatron backend; resume it with --actor.backend megatron, or start the "
            "DeepSpeed run from its weights (openrlhf-shape convert megatron, then --actor.model_name_or_path)")
    if meta["layout"]["zero_stage"] != worker.cfg.zero_stage:
        raise ValueError(f"{path} holds ZeRO-{meta['layout']['zero_stage']} optimizer partitions; resume with "
                         f"--ds.zero_stage {meta['layout']['zero_stage']}")
    worker.engine.load_checkpoint(os.path.join(path, "ds"), tag=_TAG, load_optimizer_states=True,
                                  load_lr_scheduler_states=False, load_module_strict=True)
    worker.step = int(meta["step"])
    worker._set_lr()
    rng_file = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if meta["layout"] == _layout(worker) and os.path.isfile(rng_file):
        restore_rng(torch.load(rng_file, weights_only=False), worker.platform.on_gpu)
    dist.barrier()
    return dict(meta.get("extra") or {})
