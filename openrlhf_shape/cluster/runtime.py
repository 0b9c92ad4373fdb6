"""Start the trainer's cluster side in one call: placement plan -> placement groups -> Megatron
rank actors (rendezvous on rank 0's node) and vLLM engine actors on their bundles -> the weight
sync owned by the trainer's engine group -> the colocation lifecycle.

The trainer uses this on CPU and GPU alike. On CPU (tests, the demo) the bundles are CPU slots
(``{"CPU": c}``) on the local node; colocation then runs the same transitions (Megatron storages
really go to "host" and back, engines refuse to generate or load while asleep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openrlhf_shape.cluster.placement import PlacementPlan, plan_placement


@dataclass
class ClusterRuntime:
    plan: PlacementPlan
    placement: Any  # RayPlacement
    actor: Any  # MegatronActorGroup
    engine_handles: list
    engines: Any  # EngineGroup
    sync: Any  # EngineWeightSync
    lifecycle: Any  # Lifecycle

    def shutdown(self) -> None:
        try:
            self.sync.close()
        finally:
            self.placement.remove()


def plan_for(cfg, on_gpu: bool) -> PlacementPlan:
    """The plan for a TrainConfig. CPU: every slot on the local node (gpus_per_node = all slots)."""
    r, m, t = cfg.rollout, cfg.megatron, cfg.trainer
    etp = cfg.engine.tensor_parallel_size
    if on_gpu:
        gpn, nodes = t.gpus_per_node, t.num_nodes
    else:
        gpn, nodes = max(m.world_size + r.num_engines * etp, etp, m.tensor_model_parallel_size), None
    return plan_placement(world_size=m.world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                          num_engines=r.num_engines, engine_tp=etp, colocate=r.colocate, gpus_per_node=gpn,
                          num_nodes=nodes, rollout_gpus=r.num_gpus)


def start_cluster(cfg, mcfg, engine_cfg, *, on_gpu: bool, threads_per_rank: int | None,
                  env: dict[str, str] | None = None) -> ClusterRuntime:
    """Everything the PPO loop drives; the engines start while the Megatron ranks connect."""
    from openrlhf_shape.cluster.lifecycle import Lifecycle
    from openrlhf_shape.cluster.ray_placement import RayPlacement
    from openrlhf_shape.cluster.sync_driver import EngineWeightSync
    from openrlhf_shape.rollout.engine import EngineGroup, create_ray_engines
    from openrlhf_shape.trainer.actor_group import make_actor_group

    r = cfg.rollout
    plan = plan_for(cfg, on_gpu)
    c_rank, c_engine = cfg.actor.num_cpus_per_rank, r.num_cpus_per_engine
    cpus = (c_rank + c_engine) if plan.colocate else max(c_rank, c_engine)
    placement = RayPlacement(plan, cpus_per_bundle=cpus, gpus=on_gpu)
    try:
        engine_handles = create_ray_engines(r.num_engines, engine_cfg, num_cpus_per_engine=c_engine,
                                            placement=placement, wait_ready=False)
        actor = make_actor_group(cfg, mcfg, num_cpus_per_rank=c_rank, num_threads_per_rank=threads_per_rank,
                                 placement=placement, env=env)  # --actor.backend megatron | deepspeed
        import ray

        ray.get([h.ready.remote() for h in engine_handles])
        engines = EngineGroup(engine_handles)
        transport = "collective" if r.weight_sync == "auto" else r.weight_sync
        sync = EngineWeightSync(engine_handles, cfg.engine.tensor_parallel_size, transport=transport,
                                backend="nccl" if on_gpu else "gloo")
    except BaseException:
        placement.remove()
        raise
    lifecycle = Lifecycle(actor, engines, sync, r.weight_sync_bucket_mb << 20, colocate=plan.colocate)
    return ClusterRuntime(plan, placement, actor, engine_handles, engines, sync, lifecycle)


def connect_sync(rt: ClusterRuntime) -> None:
    """After the Megatron model exists: form the sync group (rank 0 sends)."""
    rt.sync.connect(rt.actor.actors[0])
