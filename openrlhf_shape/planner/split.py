"""The engine : trainer GPU split of an asynchronous (one-step-off) layout that costs the fewest GPU-seconds per step.

A candidate is ``R`` rank GPUs (a multiple of TP x PP x CP whose DP divides ``--train.batch_size``) and ``E``
engines of ``--vllm.tensor_parallel_size`` GPUs each, disaggregated, ``R + E x engine TP <= max GPUs``
(``--plan.split_max_gpus``; default: the GPUs of the disaggregated variant the async estimate is on). Its cost is
the one-step-off step (:func:`~openrlhf_shape.planner.async_cost.async_step` at the run's
``--train.max_staleness``) times its GPUs: GPU-seconds per step, i.e. the split that buys the most steps per
GPU-second. Ties: fewer GPUs, then fewer rank GPUs. The search runs on top of a built plan (the dry run, the sizing
doc): it builds plans, so ``plan.py`` does not call it.

The search needs one plan per rank size and one per engine count, not one per pair: the ranks' phases (log-probs,
update, CP and MoE exchanges) and memory depend on ``R`` only, the engines' (decode, probes) and their memory on
``E`` only; a pair adds its placement and the weight sync over the nodes it spans.
``tests/planner/test_long_context.py`` holds it to the brute force (a whole plan per pair).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from openrlhf_shape.planner.async_cost import AsyncStep, async_step
from openrlhf_shape.planner.cost import Phase
from openrlhf_shape.planner.plan import Plan, build_plan

RANK_PHASES = ("log-probs + entropy", "update", "CP K/V exchange", "MoE all-to-all")
ENGINE_PHASES = ("rollout decode", "SHAPE probes", "rewards")


@dataclass(frozen=True)
class Split:
    rank_gpus: int
    engines: int
    engine_tp: int
    step: AsyncStep

    @property
    def gpus(self) -> int:
        return self.rank_gpus + self.engines * self.engine_tp

    @property
    def gpu_seconds(self) -> float:
        return self.step.seconds * self.gpus

    def key(self) -> tuple[float, int, int]:
        return (self.gpu_seconds, self.gpus, self.rank_gpus)


@dataclass
class SplitSearch:
    staleness: int
    max_gpus: int
    best: Split | None = None
    configured: Split | None = None  # the split the async estimate is on (the config's ranks and engines)
    candidates: list[Split] = field(default_factory=list)


def variant(cfg: Any, rank_gpus: int, engines: int) -> Any:
    """``cfg`` disaggregated with ``rank_gpus`` Megatron ranks and ``engines`` vLLM engines."""
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, colocate_all=False),
        actor=dataclasses.replace(cfg.actor, num_nodes=1, num_gpus_per_node=rank_gpus),
        vllm=dataclasses.replace(cfg.vllm, num_engines=engines))


def rank_sizes(cfg: Any, max_gpus: int) -> list[int]:
    """Rank GPU counts a split may use: multiples of TP x PP x CP whose DP divides ``--train.batch_size``."""
    m = cfg.megatron
    block = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    room = max_gpus - cfg.vllm.tensor_parallel_size
    return [r for r in range(block, room + 1, block) if cfg.train.batch_size % (r // block) == 0]


def _fits(plan: Any, side: str) -> bool:
    """The rank GPUs (``side='ranks'``) or the engine GPUs (``'engines'``) of ``plan`` fit, and its layout is valid."""
    if any(r.startswith("layout:") for r in plan.refusals):
        return False
    if side == "ranks":
        return all(ph.free >= plan.options.min_free_gib * 1024**3 for ph in plan.gpu_phases)
    return not any(r.startswith("rollout") for r in plan.refusals)


def _pair(plan_r: Any, plan_e: Any, cfg: Any, rank_gpus: int, engines: int, staleness: int) -> Split | None:
    """The split (rank side of ``plan_r``, engine side of ``plan_e``) with its own placement and weight sync."""
    from openrlhf_shape.cluster.placement import plan_placement, resolve_weight_sync
    from openrlhf_shape.planner.sync_time import estimate_sync, weight_sync_phase

    o = plan_r.options
    try:
        placement = plan_placement(world_size=rank_gpus, tp=plan_r.tp * plan_r.cp, pp=plan_r.pp, num_engines=engines,
                                   engine_tp=cfg.vllm.tensor_parallel_size, colocate=False,
                                   gpus_per_node=o.gpus_per_node, num_nodes=o.num_nodes)
        transport, why = resolve_weight_sync(cfg.rollout.weight_sync, placement, on_gpu=True)
    except ValueError:
        return None
    phases: list[Phase] = [p for p in plan_r.phases if p.name in RANK_PHASES]
    phases += [p for p in plan_e.phases if p.name in ENGINE_PHASES]
    est = estimate_sync(plan_r.model, placement, transport, why, cfg.vllm.weight_sync_bucket_mb, o)
    phases.append(weight_sync_phase(est))
    return Split(rank_gpus, engines, cfg.vllm.tensor_parallel_size, async_step(phases, staleness))


def search_split(plan: Plan, cfg: Any) -> SplitSearch | None:
    """Every split of ``plan``'s run that fits in at most ``--plan.split_max_gpus`` GPUs (default: those of the
    disaggregated variant its async estimate is on); the cheapest in GPU-seconds per step (module doc). None when
    the plan has no async estimate (a CPU config, or no placement)."""
    if plan.async_plan is None:
        return None
    options, config_path = plan.options, plan.config_path
    max_gpus = options.split_max_gpus or plan.async_plan.gpus or plan.placement.num_bundles
    staleness = int(cfg.train.max_staleness)
    out = SplitSearch(staleness, max_gpus)
    etp = cfg.vllm.tensor_parallel_size
    sizes = rank_sizes(cfg, max_gpus)
    if not sizes:
        return out
    by_rank = {r: build_plan(variant(cfg, r, 1), options, config_path) for r in sizes}
    by_engine = {e: build_plan(variant(cfg, sizes[0], e), options, config_path)
                 for e in range(1, (max_gpus - sizes[0]) // etp + 1)}
    for r, plan_r in by_rank.items():
        if not _fits(plan_r, "ranks"):
            continue
        for e in range(1, (max_gpus - r) // etp + 1):
            if _fits(by_engine[e], "engines"):
                split = _pair(plan_r, by_engine[e], cfg, r, e, staleness)
                if split is not None:
                    out.candidates.append(split)
    out.best = min(out.candidates, key=Split.key, default=None)
    out.configured = next((c for c in out.candidates
                           if c.rank_gpus == cfg.actor.world_size and c.engines == cfg.vllm.num_engines), None)
    return out
