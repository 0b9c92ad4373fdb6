"""Light probe actors/tasks for the simulated-cluster placement tests: each reports where Ray
put it (node id, GPU ids, CUDA_VISIBLE_DEVICES). They live in the package so Ray workers can import
them (functions defined in a test module are pickled by reference)."""

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
def probe_engine() -> list[dict]:
    """Engine actor's slot. At TP > 1: one worker per VLLM_RAY_BUNDLE_INDICES entry in the current
    placement group, ``num_cpus=0, num_gpus=VLLM_RAY_PER_WORKER_GPUS``, as vLLM's Ray executor."""
    me = report()
    indices = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "")
    if not indices:
        return [me]
    pg = ray.util.get_current_placement_group()
    assert pg is not None, "the engine actor must run inside its node's placement group (capture child tasks)"
    share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
    refs = [probe_slot.options(num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=int(b), placement_group_capture_child_tasks=True)).remote()
        for b in indices.split(",")]
    workers = ray.get(refs)
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
