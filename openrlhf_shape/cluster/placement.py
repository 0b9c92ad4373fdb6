"""Where every Megatron rank and every vLLM engine worker runs: a pure plan, no Ray; the weight-sync transport the
plan's layout allows (the transports' own constraints, ``weight_sync.choose_transport``).

The plan numbers GPUs as *bundles*: one bundle per GPU, node after node (node 0's GPUs first).
Bundle ``b`` lives on node ``slot.node`` as local GPU ``slot.gpu``; ``openrlhf_shape.cluster.ray_placement``
turns each node's bundles into one ``STRICT_PACK`` Ray placement group, so the plan's node
assignment is what Ray enforces.

Rules (each one a failure mode on a real cluster):

* Megatron rank ``r`` sits on bundle ``r``. Megatron's rank order puts TP innermost and PP
  outermost, ``rank = tp_rank + TP * (dp_rank + DP * pp_rank)``, so with ``gpus_per_node % TP == 0``
  every TP group lies inside one node (NVLink; NCCL across nodes for TP is the slow path).
* Every engine's ``engine_tp`` workers lie on one node (vLLM's TP all-reduce); an engine that
  does not fit in what is left of a node starts on the next node.
* Colocated (``colocate=True``): engines reuse the ranks' bundles, one engine worker per GPU
  (two processes per GPU: one rank, one engine worker; vLLM sleeps while Megatron trains).
* Disaggregated: engines get their own bundles after the ranks' (``rollout_gpus``, default
  ``num_engines * engine_tp``), disjoint from the ranks' GPUs.
* The reference model's ranks (``ref_world_size`` > 0, ``--algo.kl.init_coef`` > 0), in the actor's TP/PP
  layout: colocated, reference rank ``r`` shares actor rank ``r``'s bundle (three processes per GPU, the
  colocation lifecycle keeps the reference on host except during its forward); disaggregated, they get bundles
  of their own after the actor's and before the engines' (OpenRLHF's separate reference group).
* The reward model's ranks (``rm_world_size`` > 0, ``--reward.model_name_or_path``) follow the same rule: colocated,
  reward rank ``r`` shares actor rank ``r``'s bundle; disaggregated, bundles of their own after the reference's.
* The critic's ranks (``critic_world_size`` > 0, ``--algo.advantage.estimator gae``) too: colocated, on the actor's
  bundles; disaggregated, bundles of their own after the reward model's, or the reward model's own bundles with
  ``critic_on_reward`` (``--train.colocate_critic_reward``, OpenRLHF's flag: critic rank ``r`` on reward rank ``r``'s
  GPU, the two worlds equal).

Errors are ``ValueError`` naming the flags to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_shape.weight_sync import SyncLayout, choose_transport

# Flag names used in error messages (the trainer's dotted config keys).
FLAG_WORLD = "--actor.num_nodes x --actor.num_gpus_per_node"
FLAG_TP = "--megatron.tensor_model_parallel_size"
FLAG_PP = "--megatron.pipeline_model_parallel_size"
FLAG_ENGINES = "--vllm.num_engines"
FLAG_ENGINE_TP = "--vllm.tensor_parallel_size"
FLAG_COLOCATE = "--train.colocate_all"
FLAG_ROLLOUT_GPUS = "--rollout.num_gpus"
FLAG_GPUS_PER_NODE = "--train.gpus_per_node"
FLAG_NUM_NODES = "--train.num_nodes"


@dataclass(frozen=True)
class RankSlot:
    """One Megatron rank: global rank, node index, local GPU on that node, global bundle index and
    its (tp, pp, dp) coordinates in Megatron's order."""

    rank: int
    node: int
    gpu: int
    bundle: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


@dataclass(frozen=True)
class EngineSlot:
    """One vLLM engine worker: engine index, worker index inside the engine's TP group (0 hosts
    the engine actor itself), node, local GPU on that node, global bundle index."""

    engine: int
    worker: int
    node: int
    gpu: int
    bundle: int


@dataclass(frozen=True)
class PlacementPlan:
    """The whole layout. ``node_bundles[n]`` is how many bundles (GPUs) node ``n`` contributes;
    bundle ``b`` of node ``n`` has local index ``b - sum(node_bundles[:n])`` there."""

    ranks: tuple[RankSlot, ...]
    engines: tuple[EngineSlot, ...]
    num_bundles: int
    num_nodes: int
    colocate: bool
    master_rank_node: int
    gpus_per_node: int
    node_bundles: tuple[int, ...]
    tp: int
    pp: int
    dp: int
    engine_tp: int
    refs: tuple[RankSlot, ...] = ()  # the reference model's ranks (none without KL)
    rms: tuple[RankSlot, ...] = ()  # the reward model's ranks (none without --reward.model_name_or_path)
    critics: tuple[RankSlot, ...] = ()  # the critic's ranks (none without --algo.advantage.estimator gae)

    def bundle_node(self, bundle: int) -> tuple[int, int]:
        """(node, local index on that node) of a global bundle index."""
        start = 0
        for node, count in enumerate(self.node_bundles):
            if bundle < start + count:
                return node, bundle - start
            start += count
        raise IndexError(f"bundle {bundle} outside the plan's {self.num_bundles} bundles")

    def engine_workers(self, engine: int) -> tuple[EngineSlot, ...]:
        """The TP workers of one engine, worker 0 first."""
        return tuple(s for s in self.engines if s.engine == engine)

    @property
    def num_engines(self) -> int:
        return len({s.engine for s in self.engines})


# A rank group's role -> the plan's slots of its ranks.
ROLE_SLOTS = {"actor": "ranks", "reference": "refs", "reward": "rms", "critic": "critics"}


def role_slots(plan: PlacementPlan, role: str) -> tuple[RankSlot, ...]:
    """The slots of ``role``'s ranks (``actor``, ``reference``, ``reward`` or ``critic``) in ``plan``."""
    if role not in ROLE_SLOTS:
        raise ValueError(f"unknown rank group role {role!r}; one of {sorted(ROLE_SLOTS)}")
    return getattr(plan, ROLE_SLOTS[role])


def megatron_coords(rank: int, tp: int, pp: int, world_size: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank) of ``rank`` in Megatron's default order (TP fastest, PP slowest):
    ``rank = tp_rank + TP * (dp_rank + DP * pp_rank)``."""
    dp = world_size // (tp * pp)
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _place_groups(start: int, count: int, group: int, gpus_per_node: int) -> list[int]:
    """Global GPU index of the first GPU of each of ``count`` groups of ``group`` GPUs, placed from
    global GPU ``start`` on, never straddling a node boundary (a group that does not fit in what is
    left of a node starts on the next node)."""
    firsts: list[int] = []
    pos = start
    for _ in range(count):
        left_on_node = gpus_per_node - pos % gpus_per_node
        if left_on_node < group:
            pos += left_on_node
        firsts.append(pos)
        pos += group
    return firsts


def plan_placement(
    *,
    world_size: int,
    tp: int,
    pp: int,
    num_engines: int,
    engine_tp: int,
    colocate: bool,
    gpus_per_node: int,
    num_nodes: int | None = None,
    rollout_gpus: int | None = None,
    ref_world_size: int = 0,
    rm_world_size: int = 0,
    critic_world_size: int = 0,
    critic_on_reward: bool = False,
) -> PlacementPlan:
    """Plan Megatron ranks, reference ranks and vLLM engine workers on GPUs (see the module docstring for the rules).

    Args:
        world_size, tp, pp: Megatron world and its tensor / pipeline parallel sizes (DP derived).
        num_engines, engine_tp: vLLM engines and the tensor parallel size of each.
        colocate: engines share the ranks' GPUs (one engine worker per rank GPU).
        gpus_per_node: GPUs of every node.
        num_nodes: nodes available; None means as many as the plan needs.
        rollout_gpus: disaggregated only: GPUs of the engine pool (default ``num_engines * engine_tp``).
        ref_world_size, rm_world_size, critic_world_size: the reference model's, the reward model's and the critic's
            ranks (0: none); colocated each must equal ``world_size``.
        critic_on_reward: disaggregated, the critic on the reward model's GPUs (``--train.colocate_critic_reward``).
    Raises ``ValueError`` naming the flags when the shape is impossible."""
    _check_shape(world_size=world_size, tp=tp, pp=pp, num_engines=num_engines, engine_tp=engine_tp,
                 gpus_per_node=gpus_per_node, num_nodes=num_nodes)
    sides = (ref_world_size, rm_world_size, critic_world_size)
    ref_gpu, rm_gpu, critic_gpu = _side_groups(world_size, tp, pp, colocate, sides, critic_on_reward)
    own_ref = 0 if colocate else len(set(ref_gpu) | set(rm_gpu) | set(critic_gpu))  # the side groups' own GPUs
    total = _total_gpus(world_size, num_engines, engine_tp, colocate, rollout_gpus) + own_ref

    # Ranks: bundle r on global GPU r (nodes filled in order; TP | gpus_per_node keeps groups whole).
    rank_gpu = list(range(world_size))
    engine_gpu = _engine_gpus(world_size + own_ref, num_engines, engine_tp, colocate, gpus_per_node)

    used = sorted(set(rank_gpu) | set(ref_gpu) | set(rm_gpu) | set(critic_gpu) | {g for grp in engine_gpu for g in grp})
    nodes_needed = used[-1] // gpus_per_node + 1
    if num_nodes is not None:
        _need(nodes_needed <= num_nodes,
              f"the layout needs {nodes_needed} nodes of {gpus_per_node} GPUs ({world_size} rank GPUs"
              + (f" + {own_ref} reference / reward-model / critic GPUs" if own_ref else "")
              + ("" if colocate else f" + {total - world_size - own_ref} engine GPUs")
              + f", TP groups and engines kept inside a node) but {FLAG_NUM_NODES} = {num_nodes}; add nodes or "
              f"lower {FLAG_WORLD} / {FLAG_ENGINES} / {FLAG_ENGINE_TP}")

    bundle_of, local_of, per_node = _number_bundles(used, gpus_per_node, nodes_needed)
    ranks = _rank_slots(rank_gpu, tp, pp, gpus_per_node, bundle_of, local_of)
    refs, rms, critics = (_rank_slots(g, tp, pp, gpus_per_node, bundle_of, local_of) for g in (ref_gpu, rm_gpu, critic_gpu))
    engines = [EngineSlot(engine=e, worker=w, node=g // gpus_per_node, gpu=local_of[g], bundle=bundle_of[g])
               for e, grp in enumerate(engine_gpu) for w, g in enumerate(grp)]
    return PlacementPlan(
        ranks=ranks, engines=tuple(engines), num_bundles=len(used), num_nodes=nodes_needed,
        colocate=colocate, master_rank_node=ranks[0].node, gpus_per_node=gpus_per_node,
        node_bundles=tuple(per_node), tp=tp, pp=pp, dp=world_size // (tp * pp), engine_tp=engine_tp, refs=refs,
        rms=rms, critics=critics)


FLAG_REF = "--ref.num_nodes x --ref.num_gpus_per_node"


def _side_groups(world_size: int, tp: int, pp: int, colocate: bool, sizes: tuple[int, int, int],
                 critic_on_reward: bool) -> list[list[int]]:
    """Global GPUs of the reference's, the reward model's and the critic's ranks (``sizes``), checked: the actor's
    layout; colocated, one per actor rank; ``critic_on_reward`` (disaggregated, with a reward model) the critic's on
    the reward model's GPUs, the two worlds equal."""
    ref, rm, critic = sizes
    _check_ref(ref, world_size, tp, pp, colocate)
    _check_ref(rm, world_size, tp, pp, colocate, FLAG_RM, "reward model")
    _check_ref(critic, world_size, tp, pp, colocate, FLAG_CRITIC, "critic")
    on_rm = critic_on_reward and not colocate and rm > 0 and critic > 0
    _need(not on_rm or critic == rm, f"{FLAG_COLOCATE_CR}: critic rank r shares reward rank r's GPU, so {FLAG_CRITIC} "
          f"= {critic} must equal {FLAG_RM} = {rm}")
    ref_gpu, rm_gpu, critic_gpu = _side_gpus(world_size, (ref, rm, 0 if on_rm else critic), colocate)
    return [ref_gpu, rm_gpu, list(rm_gpu) if on_rm else critic_gpu]


def _side_gpus(world_size: int, sizes: tuple[int, ...], colocate: bool) -> list[list[int]]:
    """Global GPUs of each forward-only group (the reference's, the reward model's ranks): colocated, the actor's
    first ones; else GPUs of their own after the actor's, group after group (sizes are multiples of TP: groups stay
    whole)."""
    out, start = [], world_size
    for n in sizes:
        out.append(list(range(n)) if colocate else list(range(start, start + n)))
        start += 0 if colocate else n
    return out
FLAG_RM = "--reward.num_nodes x --reward.num_gpus_per_node"
FLAG_CRITIC = "--critic.num_nodes x --critic.num_gpus_per_node"
FLAG_COLOCATE_CR = "--train.colocate_critic_reward"


def _rank_slots(gpus: list[int], tp: int, pp: int, gpus_per_node: int, bundle_of: dict[int, int],
                local_of: dict[int, int]) -> tuple[RankSlot, ...]:
    """Rank ``r`` of a world of ``len(gpus)`` ranks on global GPU ``gpus[r]``, with its Megatron coordinates."""
    out = []
    for r, g in enumerate(gpus):
        t, p, d = megatron_coords(r, tp, pp, len(gpus))
        out.append(RankSlot(rank=r, node=g // gpus_per_node, gpu=local_of[g], bundle=bundle_of[g],
                            tp_rank=t, pp_rank=p, dp_rank=d))
    return tuple(out)


def _check_ref(ref_world: int, world: int, tp: int, pp: int, colocate: bool, flag: str = FLAG_REF,
               who: str = "reference") -> None:
    """The reference (or reward model: ``flag``, ``who``) runs the actor's TP x PP layout; colocated it pairs with
    the actor's ranks one for one."""
    if not ref_world:
        return
    _need(ref_world % (tp * pp) == 0,
          f"{flag} = {ref_world}: the {who} runs the actor's layout, so TP x PP = {tp * pp} must divide it")
    _need(not colocate or ref_world == world,
          f"{FLAG_COLOCATE}: the {who} shares the actor's GPUs one for one, so {flag} = {ref_world} must equal "
          f"{FLAG_WORLD} = {world}")


def _check_shape(*, world_size: int, tp: int, pp: int, num_engines: int, engine_tp: int, gpus_per_node: int,
                 num_nodes: int | None) -> None:
    """Sizes >= 1, TP x PP dividing the world, TP groups and engines that fit inside one node."""
    _need(gpus_per_node >= 1, f"{FLAG_GPUS_PER_NODE} must be >= 1 (got {gpus_per_node})")
    _need(world_size >= 1, f"{FLAG_WORLD} must be >= 1 (got {world_size})")
    _need(tp >= 1 and pp >= 1, f"{FLAG_TP} and {FLAG_PP} must be >= 1 (got TP={tp}, PP={pp})")
    _need(num_engines >= 1, f"{FLAG_ENGINES} must be >= 1 (got {num_engines})")
    _need(engine_tp >= 1, f"{FLAG_ENGINE_TP} must be >= 1 (got {engine_tp})")
    _need(world_size % (tp * pp) == 0,
          f"{FLAG_TP} x {FLAG_PP} = {tp} x {pp} = {tp * pp} must divide {FLAG_WORLD} = {world_size}")
    _need(tp <= gpus_per_node,
          f"{FLAG_TP} = {tp} is larger than a node ({FLAG_GPUS_PER_NODE} = {gpus_per_node}): a TP group "
          f"must stay inside one node; lower {FLAG_TP} (raise {FLAG_PP} instead)")
    _need(gpus_per_node % tp == 0,
          f"{FLAG_TP} = {tp} must divide {FLAG_GPUS_PER_NODE} = {gpus_per_node} so that no TP group "
          f"straddles two nodes")
    _need(engine_tp <= gpus_per_node,
          f"{FLAG_ENGINE_TP} = {engine_tp} is larger than a node ({FLAG_GPUS_PER_NODE} = {gpus_per_node}): "
          f"an engine's TP workers must stay inside one node")
    if num_nodes is not None:
        _need(num_nodes >= 1, f"{FLAG_NUM_NODES} must be >= 1 (got {num_nodes})")


def _total_gpus(world_size: int, num_engines: int, engine_tp: int, colocate: bool, rollout_gpus: int | None) -> int:
    """GPUs of the layout before alignment holes: the ranks' (colocated), or the ranks' plus the engine pool's."""
    engine_gpus = num_engines * engine_tp
    if colocate:
        _need(rollout_gpus is None or rollout_gpus == world_size,
              f"{FLAG_ROLLOUT_GPUS} = {rollout_gpus}: with {FLAG_COLOCATE} the engines share the ranks' "
              f"{world_size} GPUs; leave {FLAG_ROLLOUT_GPUS} unset")
        _need(engine_gpus <= world_size,
              f"{FLAG_COLOCATE}: {FLAG_ENGINES} x {FLAG_ENGINE_TP} = {num_engines} x {engine_tp} = {engine_gpus} "
              f"engine workers do not fit on the {world_size} rank GPUs ({FLAG_WORLD}); use at most "
              f"{world_size // engine_tp} engines or drop {FLAG_COLOCATE}")
        return world_size
    pool = engine_gpus if rollout_gpus is None else rollout_gpus
    _need(pool == engine_gpus,
          f"{FLAG_ROLLOUT_GPUS} = {pool} must equal {FLAG_ENGINES} x {FLAG_ENGINE_TP} = "
          f"{num_engines} x {engine_tp} = {engine_gpus}")
    return world_size + pool


def _engine_gpus(world_size: int, num_engines: int, engine_tp: int, colocate: bool,
                 gpus_per_node: int) -> list[list[int]]:
    """Global GPU indices of each engine's workers: groups of ``engine_tp`` inside a node, on the ranks' GPUs
    (colocated) or after them."""
    if colocate:
        firsts = _place_groups(0, num_engines, engine_tp, gpus_per_node)
        _need(firsts[-1] + engine_tp <= world_size,
              f"{FLAG_COLOCATE}: {num_engines} engines of {FLAG_ENGINE_TP} = {engine_tp} cannot be laid on the "
              f"{world_size} rank GPUs without an engine straddling two nodes ({FLAG_GPUS_PER_NODE} = "
              f"{gpus_per_node}); make {FLAG_ENGINE_TP} divide {FLAG_GPUS_PER_NODE} or use fewer engines")
    else:
        firsts = _place_groups(world_size, num_engines, engine_tp, gpus_per_node)
    return [[f + w for w in range(engine_tp)] for f in firsts]


def _number_bundles(used: list[int], gpus_per_node: int,
                    nodes_needed: int) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """(global GPU -> bundle index, global GPU -> local GPU index on its node, bundles per node) of the used GPUs
    in order. A local GPU index is the GPU's position among its node's bundles (0..count-1 there)."""
    bundle_of = {g: i for i, g in enumerate(used)}
    per_node = [0] * nodes_needed
    for g in used:
        per_node[g // gpus_per_node] += 1
    local_of: dict[int, int] = {}
    counters = [0] * nodes_needed
    for g in used:
        n = g // gpus_per_node
        local_of[g] = counters[n]
        counters[n] += 1
    return bundle_of, local_of, per_node


# ---------------------------------------------------------------------------------------------------
# Which weight-sync transport a plan can use: the registry decides (weight_sync.choose_transport)
# ---------------------------------------------------------------------------------------------------


def sync_group_devices(plan: PlacementPlan) -> list[tuple[int, int]]:
    """(node, local GPU) of every member of the weight-sync group in its rank order: the sender
    (Megatron rank 0) first, then engine ``e``'s worker ``w`` at ``1 + e * engine_tp + w``."""
    rank0 = next(r for r in plan.ranks if r.rank == 0)
    workers = sorted(plan.engines, key=lambda s: (s.engine, s.worker))
    return [(rank0.node, rank0.gpu)] + [(s.node, s.gpu) for s in workers]


def resolve_weight_sync(requested: str, plan: PlacementPlan, on_gpu: bool) -> tuple[str, str]:
    """(transport, why) for ``--rollout.weight_sync`` on this plan: the registered transports' own constraints on
    the plan's sync-group devices (:func:`~openrlhf_shape.weight_sync.choose_transport`; ``auto`` decides there, an
    explicit choice the plan cannot serve is refused with a ``ValueError`` naming the flag and the fix)."""
    return choose_transport(requested, SyncLayout(tuple(sync_group_devices(plan)), on_gpu))


def plan_for(cfg, on_gpu: bool) -> PlacementPlan:
    """The plan for a TrainConfig (``on_gpu``: ``Platform.on_gpu``). CPU: every slot on the local
    node (gpus_per_node = all slots)."""
    m, t, v, world = cfg.megatron, cfg.train, cfg.vllm, cfg.actor.world_size
    ref = cfg.ref.world_size(world) if cfg.algo.kl.enabled else 0  # no KL: no reference ranks at all
    rm = cfg.reward.world_size(world) if cfg.reward.model_name_or_path else 0
    critic = cfg.critic.world_size(world) if cfg.advantage_estimator().needs_critic else 0
    etp = v.tensor_parallel_size
    if on_gpu:
        gpn, nodes = t.gpus_per_node, t.num_nodes
    else:
        gpn, nodes = max(world + ref + rm + critic + v.num_engines * etp, etp, m.tensor_model_parallel_size), None
    return plan_placement(world_size=world, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                          num_engines=v.num_engines, engine_tp=etp, colocate=t.colocate_all, gpus_per_node=gpn,
                          num_nodes=nodes, rollout_gpus=cfg.rollout.num_gpus, ref_world_size=ref,
                          rm_world_size=rm, critic_world_size=critic,
                          critic_on_reward=t.colocate_critic_reward)
