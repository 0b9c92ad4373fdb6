"""Start the trainer's cluster side in one call: placement plan -> placement groups -> training
rank actors (rendezvous on rank 0's node), the reference model's rank actors (with KL), the reward model's (with
``--reward.model_name_or_path``), the critic's (with ``--algo.advantage.estimator gae``) and vLLM engine actors on their bundles -> the weight sync owned by the trainer's engine group -> the colocation lifecycle.

The trainer uses this on CPU and GPU alike. On CPU (tests, the demo) the bundles are CPU slots
(``{"CPU": c}``) on the local node; colocation then runs the same transitions (the ranks' storages
really go to "host" and back, engines refuse to generate or load while asleep).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from openrlhf_shape.cluster.placement import PlacementPlan, plan_for, resolve_weight_sync
from openrlhf_shape.platform import Platform

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.cluster.lifecycle import Lifecycle
    from openrlhf_shape.cluster.rank_group import RankGroup
    from openrlhf_shape.cluster.ray_placement import RayPlacement
    from openrlhf_shape.rollout.group import EngineGroup
    from openrlhf_shape.weight_sync.driver import EngineWeightSync

log = logging.getLogger("openrlhf_shape")  # the trainer's logger (its console and train.log)


@dataclass
class ClusterRuntime:
    plan: PlacementPlan
    placement: RayPlacement
    platform: Platform  # the run's CPU/GPU profile, as handed to every rank and engine
    ranks: RankGroup  # the policy's training ranks (--actor.*: either backend)
    engines: EngineGroup
    sync: EngineWeightSync
    lifecycle: Lifecycle
    refs: RankGroup | None = None  # the reference model's ranks (--algo.kl.init_coef > 0; --ref.*)
    rms: RankGroup | None = None  # the reward model's ranks (--reward.model_name_or_path; --reward.num_*)
    critics: RankGroup | None = None  # the critic's ranks (--algo.advantage.estimator gae; --critic.*)

    def shutdown(self) -> None:
        try:
            self.sync.close()
        finally:
            self.placement.remove()


def make_rank_group(cfg, placement, platform: Platform, role: str = "actor") -> RankGroup:
    """The ranks of ``--actor.backend`` (its record's worker and rank config: ``actor/backends.py``) on
    ``placement``'s bundles under ``platform``. ``role="reference"``: the reference model's ranks (``--ref.*``), the
    same backend and layout, built by ``init_reference`` (forward only, free MoE routing); ``role="reward"``: the
    reward model's (``--reward.num_*``), built by ``init_value_model``; ``role="critic"``: the critic's
    (``--critic.num_*``), built by ``init_critic``."""
    from openrlhf_shape.cluster.rank_group import RankGroup

    backend, world = cfg.backend(), cfg.actor.world_size
    world = {"actor": world, "reference": cfg.ref.world_size(world), "reward": cfg.reward.world_size(world),
             "critic": cfg.critic.world_size(world)}[role]
    return RankGroup(backend.worker, backend.rank_config(cfg), world, placement, platform, role=role)


def start_cluster(cfg, engine_cfg, platform: Platform) -> ClusterRuntime:
    """Everything the PPO loop drives; the engines start while the training ranks connect.

    ``platform``: the run's profile (``openrlhf_shape/platform.py``, decided once by the driver). It
    sets the bundles' GPUs, the actors' CPU shares and threads and the weight-sync backend here, and
    is handed to every rank actor and engine actor (they do not decide CPU vs GPU themselves)."""
    import ray

    from openrlhf_shape.cluster.doctor import check_shared_output
    from openrlhf_shape.cluster.lifecycle import Lifecycle
    from openrlhf_shape.cluster.ray_placement import RayPlacement
    from openrlhf_shape.rollout.group import start_engines
    from openrlhf_shape.weight_sync.driver import EngineWeightSync

    r = cfg.rollout
    plan = plan_for(cfg, platform.on_gpu)
    c_rank, c_engine = platform.cpus_per_rank, platform.cpus_per_engine
    groups = 1 + bool(plan.refs) + bool(plan.rms) + bool(plan.critics)  # rank processes on a colocated bundle
    paired = 2 if plan.critics and plan.critics[0].bundle in {s.bundle for s in plan.rms} else 1  # critic + reward
    cpus = (c_rank * groups + c_engine) if plan.colocate else max(c_rank * paired, c_engine)
    placement = RayPlacement(plan, cpus_per_bundle=cpus, gpus=platform.gpus_per_bundle > 0)
    refs = rms = critics = None
    try:
        check_shared_output(cfg, placement.rank_node_ids())  # multi-node: checkpoints need a shared filesystem
        engines = start_engines(engine_cfg, cfg.vllm.num_engines, platform=platform, placement=placement, wait_ready=False,
                                max_restarts=r.max_engine_restarts, stall_timeout_s=r.engine_stall_timeout,
                                standby=r.engine_standby and r.max_engine_restarts > 0)
        ranks = make_rank_group(cfg, placement, platform)  # --actor.backend's worker
        if plan.refs:  # --algo.kl.init_coef > 0: the reference model's ranks, a world of their own
            refs = make_rank_group(cfg, placement, platform, role="reference")
        if plan.rms:  # --reward.model_name_or_path: the reward model's ranks, a world of their own
            rms = make_rank_group(cfg, placement, platform, role="reward")
        if plan.critics:  # --algo.advantage.estimator gae: the critic's ranks, a world of their own
            critics = make_rank_group(cfg, placement, platform, role="critic")
        ray.get([h.ready.remote() for h in engines.engines])
        transport, why = resolve_weight_sync(r.weight_sync, plan, platform.on_gpu)
        log.info("weight sync: %s (%s)", transport, why)
        sync = EngineWeightSync(engines.engines, cfg.vllm.tensor_parallel_size, transport=transport,
                                backend=platform.collective_backend, timeout_s=r.weight_sync_timeout,
                                pin_memory=platform.pin_memory)
    except BaseException:
        placement.remove()
        raise
    lifecycle = Lifecycle(ranks, engines, sync, cfg.vllm.weight_sync_bucket_mb << 20, colocate=plan.colocate, refs=refs,
                          rms=rms, critics=critics, ref_offload=cfg.ref.offload, rm_offload=cfg.reward.offload)
    if not cfg.train.async_enable:  # the ranks hold the engines' weights until the update: a replacement gets them
        engines.restore_weights = lifecycle.restore_engine
    return ClusterRuntime(plan, placement, platform, ranks, engines, sync, lifecycle, refs, rms, critics)


def connect_sync(rt: ClusterRuntime) -> None:
    """After the actor's model exists: form the sync group (rank 0 sends)."""
    rt.sync.connect(rt.ranks.actors[0])


def restart_ranks(rt: ClusterRuntime, model_dir: str) -> None:
    """A rank died (``--train.max_restarts``): every rank group torn down and started again on its bundles, the models
    built from ``model_dir`` (the reward model's and the critic's from their own directories again; the caller then loads the newest
    complete checkpoint), and the weight sync formed again over the same engines (kept: not restarted) with the new rank 0 as its sender. The lifecycle keeps its phase."""
    rt.ranks.restart()
    log.info("actor: %s", rt.ranks.init_model(model_dir))
    if rt.refs is not None:
        rt.refs.restart()
        log.info("reference model (%d ranks): %s", rt.refs.world_size, rt.refs.init_reference(model_dir))
    if rt.rms is not None:
        rt.rms.restart()
        log.info("reward model (%d ranks): %s", rt.rms.world_size, rt.rms.init_value_model(rt.rms.value_dir, rt.rms.head_seed))
    if rt.critics is not None:
        rt.critics.restart()
        log.info("critic (%d ranks): %s", rt.critics.world_size, rt.critics.init_critic(*rt.critics.critic_args))
    rt.sync.reconnect(rt.engines.engines, sender=rt.ranks.actors[0])  # the lifecycle holds this same sync
