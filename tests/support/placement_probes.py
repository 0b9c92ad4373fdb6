"""Light probe actors/tasks for the simulated-cluster placement tests: each reports where Ray
put it (node id, GPU ids, CUDA_VISIBLE_DEVICES). They live in the package so Ray workers can import
them (functions defined in a test module are pickled by reference).

The probes are cheap only while Ray reuses worker processes: a task that needs a runtime env no idle
worker has (distinct ``env_vars``) starts a new process (~1 s of CPU), so the probes take the engine's
environment as an argument."""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from openrlhf_shape.cluster.ray_placement import local_endpoint


def report() -> dict:
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


@ray.remote
def probe_slot() -> dict:
    return report()


@ray.remote
def probe_engine(env: dict[str, str]) -> list[dict]:
    """Engine actor's slot. ``env``: the variables ``RayPlacement.engine_options`` hands the engine (the
    trainer puts them in the actor's ``runtime_env``; a probe takes them as an argument, because Ray starts a
    fresh worker process for every distinct runtime env and the probes would then cost one process per
    engine). At TP > 1: one worker per VLLM_RAY_BUNDLE_INDICES entry in the current placement group,
    ``num_cpus=0, num_gpus=VLLM_RAY_PER_WORKER_GPUS``, as vLLM's Ray executor."""
    me = report()
    indices = env.get("VLLM_RAY_BUNDLE_INDICES", "")
    if not indices:
        return [me]
    pg = ray.util.get_current_placement_group()
    assert pg is not None, "the engine actor must run inside its node's placement group (capture child tasks)"
    share = float(env["VLLM_RAY_PER_WORKER_GPUS"])
    # One worker probe at a time: a bundle's GPU is fixed when its group is placed, so this reports what
    # concurrent workers would, and the node's idle worker process serves them all (no new process each).
    workers = []
    for b in indices.split(","):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=int(b),
                                                    placement_group_capture_child_tasks=True)
        workers.append(ray.get(probe_slot.options(num_cpus=0, num_gpus=share, scheduling_strategy=strategy).remote()))
    assert not me["gpu_ids"], "at TP > 1 the engine actor itself holds no GPU"
    return workers


@ray.remote
class RankProbe:
    """Stands in for a Megatron rank actor: no torch.distributed in the constructor."""

    def __init__(self, rank: int):
        self.rank = rank

    def endpoint(self) -> dict:
        return local_endpoint()

    def report(self) -> dict:
        return report()
