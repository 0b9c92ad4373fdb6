"""Atomic DeepSpeed checkpoints: model, optimizer (ZeRO partitions), schedule step, RNG, trainer extra.

Layout (written through :func:`openrlhf_shape.checkpoint_dir.staged_checkpoint_dir`, as the Megatron
backend's: all ranks write into ``<dir>.tmp``; rank 0 renames it to ``<dir>`` after a barrier, so a
crash never leaves a directory that looks complete; the same markers, so
:func:`openrlhf_shape.checkpoint_dir.latest_checkpoint` finds either kind):

    <dir>/ds/              DeepSpeed's own checkpoint (``engine.save_checkpoint``, tag ``state``):
                           module weights + each rank's ZeRO optimizer partition (fp32 masters, Adam)
    <dir>/rng/rank<r>.pt   per-rank RNG states (python, torch, numpy, CUDA)
    <dir>/meta.json        backend, step (the LR schedule is a function of it), layout, trainer ``extra``
    <dir>/COMPLETE         written last, before the rename

Assumes a filesystem shared by all ranks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from openrlhf_shape.checkpoint_dir import read_complete_meta, staged_checkpoint_dir
from openrlhf_shape.rng import capture_rng, restore_rng

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.zero.state import ZeroState

BACKEND = "deepspeed"
_TAG = "state"


def save_checkpoint(state: "ZeroState", ckpt_dir: str, extra: dict) -> None:
    """Write the engine's state, RNG and the trainer's ``extra`` atomically; every rank calls it (collective)."""
    meta = {"backend": BACKEND, "step": state.step, "layout": state.layout(), "hf_dir": state.hf_dir, "extra": extra}
    with staged_checkpoint_dir(ckpt_dir, ("ds", "rng"), meta) as tmp:
        state.engine.save_checkpoint(os.path.join(tmp, "ds"), tag=_TAG, client_state={"step": state.step})
        torch.save(capture_rng(state.platform.on_gpu), os.path.join(tmp, "rng", f"rank{dist.get_rank()}.pt"))


def load_checkpoint(state: "ZeroState", ckpt_dir: str) -> dict:
    path, meta = read_complete_meta(ckpt_dir)
    if meta.get("backend") != BACKEND:
        raise ValueError(
            f"{path} was written by the Megatron backend; resume it with --actor.backend megatron, or start the "
            "DeepSpeed run from its weights (openrlhf-shape convert megatron, then --actor.model_name_or_path)")
    if meta["layout"]["zero_stage"] != state.cfg.zero_stage:
        raise ValueError(f"{path} holds ZeRO-{meta['layout']['zero_stage']} optimizer partitions; resume with "
                         f"--ds.zero_stage {meta['layout']['zero_stage']}")
    state.engine.load_checkpoint(os.path.join(path, "ds"), tag=_TAG, load_optimizer_states=True,
                                  load_lr_scheduler_states=False, load_module_strict=True)
    state.step = int(meta["step"])
    state.apply_lr()
    rng_file = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if meta["layout"] == state.layout() and os.path.isfile(rng_file):
        restore_rng(torch.load(rng_file, weights_only=False), state.platform.on_gpu)
    dist.barrier()
    return dict(meta.get("extra") or {})
