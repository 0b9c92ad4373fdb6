"""A :class:`~openrlhf_shape.cluster.placement.PlacementPlan` made real in Ray.

One placement group per node of the plan, ``STRICT_PACK`` (all its bundles on one node), one bundle
per GPU: ``{"GPU": 1, "CPU": cpus_per_bundle}`` (``{"CPU": ...}`` alone when the plan runs on CPU
slots, ``gpus=False``). A per-node group is what makes the plan's node assignment binding: one
group of all bundles with ``PACK`` lets Ray spread bundles wherever it likes, and a TP group could
straddle two nodes.

* Megatron rank ``r`` runs on its bundle with ``num_gpus`` 1 (0.5 when colocated: the engine worker
  on the same bundle takes the other half, so Ray refuses a second rank on that GPU; a third each when the
  reference model's rank shares the bundle too, a quarter with the reward model's as well, a fifth with the
  critic's). Reference, reward-model and critic rank ``r`` run on their own bundles the same way (a half each when
  ``--train.colocate_critic_reward`` puts critic and reward model on one GPU).
* Engine ``e`` at TP 1: the engine actor IS the vLLM worker (in-process executor) and takes the GPU
  share of its bundle. At TP > 1: the engine actor sits on its worker-0 bundle with no GPU, inside
  the node's group with ``placement_group_capture_child_tasks=True``; vLLM's Ray executor then
  finds that group with ``ray.util.get_current_placement_group()`` and places worker ``i`` on bundle
  ``VLLM_RAY_BUNDLE_INDICES[i]`` (local indices in that node's group), each taking
  ``VLLM_RAY_PER_WORKER_GPUS`` of a GPU (vLLM 0.32's default executor, ``RayExecutorV2``:
  vllm/v1/executor/ray_executor_v2.py, ``_init_executor``; the older ``ray_executor.py`` reads the same
  variables; tests/contracts holds both to it).
* The rendezvous (``MASTER_ADDR``/port of torch.distributed) comes from rank 0's actor on rank 0's
  node: :func:`rendezvous_from` asks it for its node IP and a free port there.
"""

from __future__ import annotations

import math
from typing import Any

from openrlhf_shape.cluster.placement import (
    FLAG_ENGINE_TP,
    FLAG_ENGINES,
    FLAG_GPUS_PER_NODE,
    FLAG_NUM_NODES,
    FLAG_TP,
    FLAG_WORLD,
    PlacementPlan,
    role_slots,
)


def node_gpu_capacity() -> list[tuple[str, float]]:
    """(node_id, GPUs declared) of every alive Ray node."""
    import ray

    return [(n["NodeID"], float(n.get("Resources", {}).get("GPU", 0.0))) for n in ray.nodes() if n.get("Alive")]


def check_capacity(plan: PlacementPlan, nodes: list[tuple[str, float]]) -> None:
    """Refuse early, naming the flags, when the cluster cannot host the plan's per-node groups
    (a placement group that cannot be placed otherwise waits forever)."""
    need = sorted(plan.node_bundles, reverse=True)
    have = sorted((int(g) for _, g in nodes if g >= 1), reverse=True)
    ok = len(have) >= len(need) and all(h >= n for h, n in zip(have, need))
    if not ok:
        raise ValueError(
            f"the Ray cluster cannot host this layout: it needs {len(need)} node(s) with {list(need)} free GPUs "
            f"(TP groups and engines kept inside a node; {FLAG_GPUS_PER_NODE} = {plan.gpus_per_node}) but the "
            f"cluster's nodes declare {have or 'no'} GPUs. Add nodes, or lower {FLAG_WORLD} / {FLAG_TP} / "
            f"{FLAG_ENGINES} / {FLAG_ENGINE_TP}, or set {FLAG_GPUS_PER_NODE} / {FLAG_NUM_NODES} to the real cluster"
        )


class RayPlacement:
    """Owns the per-node placement groups of a plan and hands out Ray actor options per slot.

    Args:
        plan: the pure layout.
        cpus_per_bundle: CPUs reserved in each bundle (shared by the rank and the engine worker on it).
        gpus: True on a GPU cluster (bundles hold one GPU); False for CPU slots (tests, the CPU demo).
        timeout_s: how long to wait for the groups to be placed before raising.
    """

    def __init__(self, plan: PlacementPlan, *, cpus_per_bundle: float = 1.0, gpus: bool = True,
                 timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.gpus = gpus
        self.cpus_per_bundle = cpus_per_bundle
        if gpus:
            check_capacity(plan, node_gpu_capacity())
        bundle = {"CPU": cpus_per_bundle, **({"GPU": 1.0} if gpus else {})}
        self.groups = [
            placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name="")
            for n in plan.node_bundles
        ]
        ready = [g.ready() for g in self.groups]
        done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if pending:
            self.remove()
            raise TimeoutError(
                f"{len(pending)} of {len(ready)} per-node placement groups ({list(plan.node_bundles)} bundles of "
                f"{bundle}) were not placed within {timeout_s:.0f} s: the cluster lacks free GPUs/CPUs of that "
                f"shape (other jobs?). Check `ray status`, or lower {FLAG_WORLD} / {FLAG_ENGINES}"
            )

    # ---- slots -------------------------------------------------------------------------------
    def _strategy(self, bundle: int, capture_child_tasks: bool = False):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node, local = self.plan.bundle_node(bundle)
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[node], placement_group_bundle_index=local,
            placement_group_capture_child_tasks=capture_child_tasks,
        )

    def _gpu_share(self, role: str = "actor") -> float:
        """What each process on a shared GPU takes: rank + engine worker colocated (+ a reference, reward-model and
        critic rank), else 1; disaggregated, a half for the critic and the reward model on one GPU
        (``--train.colocate_critic_reward``). Rounded down, so the shares of one GPU never add up to more than 1."""
        if not self.gpus:
            return 0.0
        plan = self.plan
        if not plan.colocate:
            paired = bool(plan.critics) and plan.critics[0].bundle in {s.bundle for s in plan.rms}
            return 0.5 if paired and role in ("reward", "critic") else 1.0
        sharers = 2 + bool(plan.refs) + bool(plan.rms) + bool(plan.critics)
        return math.floor(10_000 / sharers) / 10_000

    def rank_gpu_share(self, role: str = "actor") -> float:
        return self._gpu_share(role)

    def engine_gpu_share(self) -> float:
        """GPU share of each engine worker (vLLM's per-worker GPUs at TP > 1)."""
        return self._gpu_share()

    def rank_options(self, rank: int, num_cpus: float, *, role: str = "actor") -> dict[str, Any]:
        """``actor_cls.options(**...)`` for rank ``rank`` of ``role``'s group (:data:`ROLE_SLOTS`)."""
        slot = role_slots(self.plan, role)[rank]
        return dict(num_cpus=num_cpus, num_gpus=self.rank_gpu_share(role), scheduling_strategy=self._strategy(slot.bundle))

    def engine_options(self, engine: int, num_cpus: float) -> dict[str, Any]:
        """Options for engine ``engine``'s actor, plus ``env`` (env vars vLLM's Ray executor reads)."""
        workers = self.plan.engine_workers(engine)
        if not workers:
            raise IndexError(f"engine {engine} is not in the plan ({self.plan.num_engines} engines)")
        env: dict[str, str] = {}
        if len(workers) == 1:
            opts = dict(num_cpus=num_cpus, num_gpus=self.engine_gpu_share(),
                        scheduling_strategy=self._strategy(workers[0].bundle))
        else:
            # The actor only drives vLLM's Ray workers; they take the GPUs of the engine's bundles.
            opts = dict(num_cpus=num_cpus, num_gpus=0,
                        scheduling_strategy=self._strategy(workers[0].bundle, capture_child_tasks=True))
            env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(self.plan.bundle_node(w.bundle)[1]) for w in workers)
            env["VLLM_RAY_PER_WORKER_GPUS"] = str(self.engine_gpu_share())
        return {"options": opts, "env": env}

    def rank_node_ids(self) -> list[str]:
        """The Ray node id of every Megatron rank's bundle (the nodes that write checkpoint shards)."""
        from ray.util.placement_group import placement_group_table

        tables = [placement_group_table(g)["bundles_to_node_id"] for g in self.groups]
        return [tables[node][local] for node, local in (self.plan.bundle_node(s.bundle) for s in self.plan.ranks)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in getattr(self, "groups", []):
            try:
                remove_placement_group(g)
            except Exception:  # pragma: no cover - best effort on teardown
                pass
        self.groups = []


def local_endpoint() -> dict[str, Any]:
    """This process's node id, node IP and a free port: the rendezvous rank 0 offers the others."""
    import ray

    from openrlhf_shape.actor.launch import free_port

    # Bound on every interface: the other ranks connect from other nodes.
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "port": free_port("")}


def rendezvous_from(rank0_actor) -> dict[str, Any]:
    """Ask rank 0's actor (method ``endpoint``) for its node id, IP and a free port."""
    import ray

    return ray.get(rank0_actor.endpoint.remote())


def spawn_rank_actors(placement: RayPlacement, actor_cls, *, num_cpus: float,
                      args_for_rank, role: str = "actor") -> tuple[list, dict[str, Any]]:
    """Start one actor of ``actor_cls`` (a ``ray.remote`` class) per rank of ``role``'s group on its bundle (the
    reference's or reward model's ranks: a world of its own, with its own rendezvous).

    ``args_for_rank(rank)`` gives the constructor's positional args. The actors must not join
    torch.distributed in their constructor: this function then asks rank 0's actor (method
    ``endpoint``) for the rendezvous on rank 0's node and returns ``(actors, endpoint)``; the caller
    passes ``endpoint["ip"]`` / ``endpoint["port"]`` to every rank.
    """
    actors = []
    for rank in range(len(role_slots(placement.plan, role))):
        opts = placement.rank_options(rank, num_cpus, role=role)
        actors.append(actor_cls.options(**opts).remote(*args_for_rank(rank)))
    return actors, rendezvous_from(actors[0])
