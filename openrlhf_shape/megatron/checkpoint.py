"""Atomic Megatron distributed checkpoints (model, optimizer, RNG, step, trainer extra).

Layout of one checkpoint directory (written through :func:`openrlhf_shape.checkpoint_dir.staged_checkpoint_dir`:
all ranks write into ``<dir>.tmp``; rank 0 renames it to ``<dir>`` after a barrier, so a crash
never leaves a directory that looks complete):

    <dir>/dist/            megatron dist_checkpointing (torch_dist): model + optimizer
    <dir>/rng/rank<r>.pt   per-rank RNG states (python, torch, Megatron tracker)
    <dir>/meta.json        step (the LR schedule is a function of it), parallel layout, trainer ``extra``
    <dir>/COMPLETE         written last, before the rename

Assumes a filesystem shared by all ranks. ``openrlhf_shape.checkpoint_dir.latest_checkpoint(root)``
finds the newest complete one.
"""

from __future__ import annotations

import contextlib
import os
import queue
from typing import Iterator

import torch
import torch.distributed as dist

from openrlhf_shape.checkpoint_dir import read_complete_meta, staged_checkpoint_dir
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.rng import capture_rng, restore_rng


def _sharded_state_dict(state: ActorState, *, is_loading: bool) -> dict:
    model_sd = state.model.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": state.cfg.dist_optimizer_ckpt_format}
    if state.cfg.use_distributed_optimizer or not is_loading:
        # A fresh optimizer has no Adam state: the distributed one's ``sharded_state_dict(is_loading=True)`` asserts,
        # and a save before the first step (--critic.freezing_steps: the actor frozen) would leave the Adam keys out.
        # Zero state with step 0 is what Adam's first step starts from anyway (a load overwrites it).
        for inner in _inner_optimizers(state.optimizer):
            for p in [p for group in inner.param_groups for p in group["params"]]:
                st = inner.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p.data), torch.zeros_like(p.data)
                    st["step"] = torch.zeros((), dtype=torch.float32)
    opt_sd = state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": opt_sd}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer: one, or one per part of a ``ChainedOptimizer``
    (a MoE model with expert parallelism has a dense and an expert part, reduced over different groups)."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def _write_results_in_process() -> None:
    """Hand megatron-core's checkpoint writer an in-process queue for its write results.

    megatron-core 0.16.1's ``FileSystemWriterAsync`` makes that queue once per process with a *spawn*-context
    ``multiprocessing.Manager``: a fresh interpreter that re-imports the rank's main module, 2-7 s at a run's first
    checkpoint (``time/checkpoint`` 2.4-7.6 s at step 1, 0.15-0.24 s after, on the CPU test runs) and one more
    process per rank for the rest of the run. It needs a process-shared queue only for megatron's asynchronous
    saves, whose write function runs in another process; ``dist_checkpointing.save`` as called here is synchronous
    (``AsyncRequest.execute_sync`` runs the write function in this process, which puts its results in the queue and
    reads them back with ``get_nowait``), so a thread queue carries them. Should a later megatron-core move the
    synchronous write out of the process, the results would not arrive and the save would fail with "results_queue
    should not be empty": loud, not silent. Set only while megatron has none (a queue it made itself is kept)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def save_distributed_checkpoint(state: ActorState, ckpt_dir: str, extra: dict) -> None:
    """Write ``state`` (model, optimizer, RNG, step) and the trainer's ``extra`` atomically;
    every rank calls it (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    _write_results_in_process()
    meta = {"step": state.step, "layout": state.layout(), "hf_dir": state.hf_dir, "extra": extra}
    with staged_checkpoint_dir(ckpt_dir, ("dist", "rng"), meta) as tmp:
        dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), os.path.join(tmp, "dist"))
        rng = {**capture_rng(state.platform.on_gpu), "tracker": get_cuda_rng_tracker().get_states()}
        torch.save(rng, os.path.join(tmp, "rng", f"rank{dist.get_rank()}.pt"))


def load_distributed_checkpoint(state: ActorState, ckpt_dir: str) -> dict:
    """Restore what :func:`save_distributed_checkpoint` wrote into ``state`` (built with the same
    model; any layout, see docs/architecture.md); returns the trainer's ``extra``."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    path, meta = read_complete_meta(ckpt_dir)
    same_layout = meta["layout"] == state.layout()
    sd = _sharded_state_dict(state, is_loading=True)
    loaded = dist_checkpointing.load(sd, os.path.join(path, "dist"))
    state.model.module.load_state_dict(loaded["model"], strict=True)
    state.step = int(meta["step"])
    with torch.no_grad():  # distributed-optimizer main params are views: no autograd here
        _load_optimizer_state(state, loaded["optimizer"], state.step)
    rng_file = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if same_layout and os.path.isfile(rng_file):
        # RNG streams only line up when every rank plays the same role as when saved.
        rng = torch.load(rng_file, weights_only=False)
        restore_rng(rng, state.platform.on_gpu)
        get_cuda_rng_tracker().set_states(rng["tracker"])
    dist.barrier()
    return dict(meta.get("extra") or {})


@contextlib.contextmanager
def _missing_step_tolerated(optimizer) -> Iterator[None]:
    """mcore 0.16.1's fully_reshardable load copies every key of each live Adam state from the loaded
    per-parameter tensors, but those never carry ``step`` (it is skipped on purpose): KeyError 'step'
    (seen with bf16 on an H100; docs/gpu_results.md). Keep the live ``step`` for that copy; the
    caller sets the right per-parameter ``step`` afterwards."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        inner = getattr(opt, "optimizer", None)
        if orig is None or inner is None:
            continue

        def tolerant(model_param, tensors, _orig=orig, _opt=opt, _inner=inner):
            if "step" not in tensors and not _opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                group_index, group_order = _opt.model_param_group_index_map[model_param]
                live = _inner.state[_inner.param_groups[group_index]["params"][group_order]]
                if "step" in live:
                    tensors = {**tensors, "step": live["step"]}
            return _orig(model_param, tensors)

        opt._set_main_param_and_optimizer_states = tolerant
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method


def _load_optimizer_state(actor: ActorState, state: dict, step: int) -> None:
    """Load optimizer state; with the distributed optimizer, give each parameter its own Adam ``step``.

    mcore 0.16.1 without TE/Apex hands back Adam's per-parameter ``step`` as 0 or as one tensor
    shared by all parameters, so bias correction is wrong after resume (silent loss drift). Every
    successful optimizer step updates every parameter, so each ``step`` equals the saved step count.
    """
    per_param = state.get("state") if isinstance(state, dict) else None
    if not actor.cfg.use_distributed_optimizer and per_param and "common_step" not in per_param:
        # mcore saves the shared Adam step only when it is non-zero: a checkpoint before the first step (a frozen
        # actor, --critic.freezing_steps) has none, and torch's Adam refuses a state without one
        per_param["common_step"] = torch.tensor(float(step), dtype=torch.float32)
    with _missing_step_tolerated(actor.optimizer):
        actor.optimizer.load_state_dict(state)
    if actor.cfg.use_distributed_optimizer:
        for inner in _inner_optimizers(actor.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    st = inner.state.get(p)
                    if st is not None and "exp_avg" in st:
                        st["step"] = torch.tensor(float(step), dtype=torch.float32)
