"""Several rank scenarios one after another in one launch (tests/megatron, tests/zero).

A rank subprocess spends ~4.5 s importing Megatron (DeepSpeed: ~3 s) and then meets its peers at a rendezvous; on the
two-core CI machine a world-4 launch pays that four times over. Layouts of the same world size differ only in their
model-parallel groups, so one launch runs them in sequence: each scenario but the last frees its worker's model and
model-parallel state and keeps the process group (``keep_group``), and the next scenario's worker builds its own
groups on it (the workers init the process group only when none is up). Every scenario still builds its model,
optimizer and groups from scratch; only the interpreter and the default process group carry over.
"""

from __future__ import annotations

import importlib
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def sequence_run(*, rank: int, world_size: int, master_addr: str, master_port: int, runs: list) -> list:
    """Rank side: ``runs`` is ``[(\"module:function\", kwargs), ...]``; each function is called as by ``run_ranks``
    plus ``keep_group`` (True for all but the last). Returns this rank's results, one per run."""
    results = []
    for i, (target, kwargs) in enumerate(runs):
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        results.append(fn(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                          keep_group=i + 1 < len(runs), **kwargs))
    return results


def run_sequence(world_size: int, runs: list, *, timeout: float, env: dict | None = None,
                 extra_pythonpath: list[str] | None = None) -> list[list]:
    """Pytest side: launch ``runs`` (see :func:`sequence_run`) on ``world_size`` ranks; per run, every rank's result
    in rank order (what ``run_ranks`` of that run alone returns)."""
    from openrlhf_shape.actor.launch import run_ranks
    from support.preload import spawn_preloaded

    per_rank = run_ranks("rank_sequence:sequence_run", world_size, kwargs={"runs": runs}, timeout=timeout, env=env,
                         extra_pythonpath=[HERE, *(extra_pythonpath or [])], spawner=spawn_preloaded)
    return [[ranks[i] for ranks in per_rank] for i in range(len(runs))]


def release_megatron(worker, keep_group: bool) -> None:
    """End a Megatron scenario: drop the model and the model-parallel groups; the process group too unless another
    scenario follows in this process (``keep_group``)."""
    if not keep_group:
        worker.shutdown()
        return
    from megatron.core import parallel_state as mpu

    worker.state.model = worker.state.optimizer = None
    mpu.destroy_model_parallel()


def release_zero(worker, keep_group: bool) -> None:
    """End a DeepSpeed scenario: drop the engine; the process group too unless another scenario follows."""
    if not keep_group:
        worker.shutdown()
        return
    if worker.state.engine is not None:
        worker.offloader.onload()
        worker._release_engine()
