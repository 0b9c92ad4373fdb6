"""The real placement code on a simulated multi-node GPU cluster (Ray schedules GPUs that nodes
merely declare): one head without GPUs and four nodes of 8 GPUs, one cluster for the module.

Light probes stand in the rank and engine slots, placed with the options the trainer uses
(``RayPlacement.rank_options`` / ``engine_options``); at engine TP > 1 the engine probe does what
vLLM's Ray executor does with the environment it is given (current placement group,
``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``). Probes are tasks, run one at a time: a
slot's GPU is fixed by its bundle when the group is placed, so one at a time reports what all at once
would, while each node needs only a couple of worker processes, kept for the module
(``simulated_cluster.SYSTEM_CONFIG``); concurrent probes started a worker process per probe in flight.
(Actors, a process each, would cost ~8 GB for the 32B preset's 64 slots.) One test holds real actors for
the rendezvous.

The driver's platform decision on this cluster (openrlhf_shape/platform.py) is checked here too: the
profile is the GPU path's, and Megatron rank actors placed on GPU bundles run under the profile they
were handed.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from openrlhf_shape.cluster.placement import plan_placement  # noqa: E402
from openrlhf_shape.cluster.ray_placement import RayPlacement, spawn_rank_actors  # noqa: E402
from support.placement_probes import RankProbe, probe_engine, probe_slot  # noqa: E402
from support.simulated_cluster import simulated_gpu_cluster  # noqa: E402

# A 5-node Ray cluster for the module (~5 s to start); most tests then take well under 2 s, the rank-actor ones
# (Megatron imports in the actors) and the doctor a few seconds.
pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NODES, GPUS = 4, 8
# presets whose layout needs more than the simulated NODES x GPUS (test_too_big_presets_are_refused_naming_flags)
TOO_BIG = {"qwen3-235b-a22b"}  # 128 training + 64 rollout GPUs
# presets a real run refuses until the ranks run context parallelism (--megatron.context_parallel_size > 1: only
# the dry run plans them; tests/planner/test_long_context.py)
PLANNED_ONLY = {"qwen3-4b-thinking-64k", "qwen3-4b-shape-32k"}
PRESETS = sorted(p.stem for p in CONFIGS.glob("*.yaml")
                 if p.stem != "cpu-smoke" and p.stem not in TOO_BIG and p.stem not in PLANNED_ONLY)


def preset_shape(name: str) -> dict:
    """The layout a preset asks for, read through the trainer's own config loader (any flag names)."""
    from openrlhf_shape.config import load_config

    cfg = load_config(str(CONFIGS / f"{name}.yaml"), check_paths=False)
    m = cfg.megatron
    return dict(world_size=cfg.actor.world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                num_engines=cfg.vllm.num_engines, engine_tp=cfg.vllm.tensor_parallel_size,
                colocate=bool(cfg.train.colocate_all))


@pytest.fixture(scope="module")
def cluster(no_ray):
    with simulated_gpu_cluster(NODES, GPUS, cpus_per_node=8) as c:
        yield c


def place_and_probe(shape: dict) -> tuple:
    """Place the preset's groups; probe every rank slot, then every engine, one at a time (module docstring)."""
    plan = plan_placement(**shape, gpus_per_node=GPUS)
    placement = RayPlacement(plan, cpus_per_bundle=1.0, gpus=True, timeout_s=120)
    try:
        ranks = [ray.get(probe_slot.options(**placement.rank_options(r, 0.5)).remote()) for r in range(len(plan.ranks))]
        engines = []
        for e in range(plan.num_engines):
            o = placement.engine_options(e, 0.5)
            engines.append(ray.get(probe_engine.options(**o["options"]).remote(o["env"])))
    finally:
        placement.remove()
    return plan, ranks, engines


def check(plan, ranks: list[dict], engines: list[list[dict]], shape: dict) -> None:
    tp, etp, world = shape["tp"], shape["engine_tp"], shape["world_size"]
    for rep in ranks + [w for e in engines for w in e]:
        assert len(rep["gpu_ids"]) == 1, rep
        assert rep["cvd"] == rep["gpu_ids"][0], rep  # Ray sets CUDA_VISIBLE_DEVICES to the slot's GPU
    rank_gpu = [(r["node_id"], r["gpu_ids"][0]) for r in ranks]
    eng_gpu = [(w["node_id"], w["gpu_ids"][0]) for e in engines for w in e]
    assert max(Counter(rank_gpu).values()) == 1, "two Megatron ranks on one GPU"
    assert max(Counter(eng_gpu).values()) == 1, "two engine workers on one GPU"
    assert len(engines) == shape["num_engines"] and all(len(e) == etp for e in engines)
    # TP groups (consecutive ranks, Megatron's order) inside one node; plan's node ids map 1:1 to Ray nodes.
    for g in range(world // tp):
        assert len({ranks[r]["node_id"] for r in range(g * tp, (g + 1) * tp)}) == 1, f"TP group {g} spans nodes"
    for e in engines:
        assert len({w["node_id"] for w in e}) == 1, "an engine's TP workers span nodes"
    node_map = {}
    for slot, rep in zip(plan.ranks, ranks):
        assert node_map.setdefault(slot.node, rep["node_id"]) == rep["node_id"]
    assert len(set(node_map.values())) == len(node_map), "two plan nodes landed on one Ray node"
    if shape["colocate"]:
        assert set(eng_gpu) <= set(rank_gpu), "colocated engine worker on a GPU without a rank"
        # the same bundle gives the same GPU to its rank and its engine worker
        by_bundle = {s.bundle: rank_gpu[s.rank] for s in plan.ranks}
        for s, rep in zip(plan.engines, [w for e in engines for w in e]):
            assert by_bundle[s.bundle] == (rep["node_id"], rep["gpu_ids"][0])
    else:
        assert not set(eng_gpu) & set(rank_gpu), "engine pool overlaps the ranks' GPUs"


def expert_layout(name: str) -> tuple[int, int, str]:
    """(EP, expert TP, model name) of a preset: megatron-core's expert TP is the TP size (the worker sets no other)."""
    from openrlhf_shape.config import load_config

    cfg = load_config(str(CONFIGS / f"{name}.yaml"), check_paths=False)
    m = cfg.megatron
    etp = getattr(m, "expert_tensor_parallel_size", None) or m.tensor_model_parallel_size
    return m.expert_model_parallel_size, etp, cfg.actor.model_name_or_path


@pytest.mark.parametrize("name", PRESETS)
def test_preset_as_configured(cluster, name: str) -> None:
    shape = preset_shape(name)
    plan, ranks, engines = place_and_probe(shape)
    check(plan, ranks, engines, shape)
    ep, etp, pretrain = expert_layout(name)
    if ep > 1:
        # MoE: an EP group is ETP x EP consecutive ranks (Megatron's expert order); the planner's all-to-all term
        # assumes it spans ceil(ETP x EP / GPUS) nodes. The ranks Ray actually placed say the same.
        from openrlhf_shape.planner.assumptions import PlanOptions
        from openrlhf_shape.planner.cost import moe_alltoall
        from openrlhf_shape.planner.model import ModelShape, resolve_model_config

        span = etp * ep
        nodes = [len({ranks[r]["node_id"] for r in range(g, g + span)}) for g in range(0, shape["world_size"], span)]
        expected = -(-span // GPUS)
        assert nodes == [expected] * len(nodes), nodes
        model = ModelShape.from_file(resolve_model_config(pretrain))
        assert model.is_moe
        _, how = moe_alltoall(model, tokens_per_dp=1, passes=1, tp=shape["tp"], pp=shape["pp"], sp=True, ep=ep, etp=etp,
                              gpus_per_node=GPUS, opt=PlanOptions())
        assert (f"over {expected} nodes" in how) if expected > 1 else ("inside a node" in how), how


def test_too_big_presets_are_refused_naming_flags(cluster) -> None:
    for name in sorted(TOO_BIG):
        plan = plan_placement(**preset_shape(name), gpus_per_node=GPUS)
        assert plan.num_nodes > NODES
        with pytest.raises(ValueError, match=r"cannot host this layout.*--actor.num_gpus_per_node"):
            RayPlacement(plan, gpus=True)


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-14b"])
def test_preset_disaggregated(cluster, name: str) -> None:
    shape = {**preset_shape(name), "colocate": False}
    plan, ranks, engines = place_and_probe(shape)
    check(plan, ranks, engines, shape)


def test_too_few_gpus_names_flags(cluster) -> None:
    # 32B disaggregated needs 8 nodes of 8 GPUs; the cluster has 4.
    plan = plan_placement(**{**preset_shape("qwen3-32b"), "colocate": False}, gpus_per_node=GPUS)
    with pytest.raises(ValueError, match=r"--actor\.num_nodes x --actor\.num_gpus_per_node .*--vllm\.num_engines"):
        RayPlacement(plan, gpus=True)
    # Enough GPUs in total (32) but not of the right shape: a 16-GPU TP group needs a 16-GPU node.
    plan = plan_placement(world_size=16, tp=16, pp=1, num_engines=1, engine_tp=1, colocate=True, gpus_per_node=16)
    with pytest.raises(ValueError, match=r"--train.gpus_per_node"):
        RayPlacement(plan, gpus=True)


def test_rendezvous_on_rank0_node(cluster) -> None:
    shape = preset_shape("qwen3-4b")
    plan = plan_placement(**shape, gpus_per_node=GPUS)
    placement = RayPlacement(plan, cpus_per_bundle=1.0, gpus=True)
    try:
        actors, endpoint = spawn_rank_actors(placement, RankProbe, num_cpus=0.5, args_for_rank=lambda r: (r,))
        reps = ray.get([a.report.remote() for a in actors])
        driver_node = ray.get_runtime_context().get_node_id()
        assert reps[0]["node_id"] != driver_node  # the driver (head) has no GPU: a driver-address bug would show
        assert endpoint["node_id"] == reps[0]["node_id"]
        assert endpoint["port"] > 0
        assert max(Counter((r["node_id"], r["gpu_ids"][0]) for r in reps).values()) == 1
        for a in actors:
            ray.kill(a)
    finally:
        placement.remove()


def _doctor_cfg(name: str, out_dir: str, model_dir: str, *extra: str):
    from openrlhf_shape.config import load_config

    return load_config(str(CONFIGS / f"{name}.yaml"), ["--ckpt.output_dir", out_dir, "--actor.model_name_or_path",
                                                       model_dir, *extra], check_paths=False)


def test_doctor_on_the_simulated_cluster(cluster, tmp_path) -> None:
    """Every check passes for a preset that fits (nodes, its placement groups made and released, the
    rendezvous on rank 0's node reached from all 5 nodes, the output directory shared, the model read
    everywhere); a path no node can write and a layout the cluster cannot host fail, naming the flag."""
    from openrlhf_shape.cluster.doctor import run_doctor

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    checks = {c.name: c for c in run_doctor(_doctor_cfg("qwen3-4b", str(tmp_path / "out"), str(model)), on_gpu=True)}
    for name in ("nodes", "placement", "rendezvous", "shared path --ckpt.output_dir", "model directory",
                 "placement released"):
        assert checks[name].ok, checks[name].line()
    assert "reached from every node" in checks["rendezvous"].detail
    assert len([n for n in checks if n.startswith("env ")]) == NODES + 1  # the head too
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".doctor")]  # it cleans up
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]

    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    bad = {c.name: c for c in run_doctor(_doctor_cfg("qwen3-4b", str(blocked / "out"), str(model)), on_gpu=True)}
    assert not bad["shared path --ckpt.output_dir"].ok and "cannot write" in bad["shared path --ckpt.output_dir"].detail

    huge = {c.name: c for c in run_doctor(_doctor_cfg(
        "qwen3-4b", str(tmp_path / "out"), str(model), "--actor.num_nodes", "8", "--actor.num_gpus_per_node", "8"),
        on_gpu=True, timeout_s=10)}
    assert not huge["placement"].ok and "cannot host this layout" in huge["placement"].detail, huge["placement"].line()


def test_startup_checks_the_output_is_shared_with_the_rank_nodes(cluster, tmp_path) -> None:
    """The trainer's start-up guard (cluster/runtime.py): the nodes hosting the preset's ranks (not the
    driver's: the head has no GPU) see what the driver writes in --ckpt.output_dir and the other way
    round; an output directory the run cannot create stops the start naming the flag."""
    from openrlhf_shape.cluster.doctor import check_shared_output

    cfg = _doctor_cfg("qwen3-4b", str(tmp_path / "out"), str(tmp_path))
    plan = plan_placement(**preset_shape("qwen3-4b"), gpus_per_node=GPUS)
    placement = RayPlacement(plan, cpus_per_bundle=0.01, gpus=True)
    try:
        nodes = placement.rank_node_ids()
        assert len(nodes) == len(plan.ranks) and ray.get_runtime_context().get_node_id() not in nodes
        check_shared_output(cfg, nodes)  # one machine: shared
        assert not os.listdir(tmp_path / "out")
        (tmp_path / "f").write_text("x")
        with pytest.raises(RuntimeError, match="--ckpt.output_dir must be on a filesystem every node shares|"
                                               "the driver cannot write it"):
            check_shared_output(_doctor_cfg("qwen3-4b", str(tmp_path / "f" / "out"), str(tmp_path)), nodes)
    finally:
        placement.remove()


# ---- the platform profile on this cluster (openrlhf_shape/platform.py; moved from test_platform.py, which ran
# a second simulated cluster for them)
def _platform_cfg(**flags: str):
    """A trainer config from the defaults plus ``--key value`` flags (the demo model; no preset)."""
    from openrlhf_shape.config import load_config

    args: list[str] = []
    for k, v in flags.items():
        args += [f"--{k}", v]
    return load_config(None, ["--actor.model_name_or_path", "demo", *args], check_paths=False)


def test_gpu_profile_from_declared_gpu_cluster_reaches_the_ranks(cluster) -> None:
    import torch

    from openrlhf_shape.cluster.rank_group import RankActor
    from openrlhf_shape.platform import Platform, detect_platform

    cfg = _platform_cfg(**{"actor.num_gpus_per_node": "2", "vllm.tensor_parallel_size": "2"})
    p = detect_platform(cfg)
    assert not torch.cuda.is_available()  # the driver itself has no GPU: the cluster decides
    assert (p.device, p.source, p.cluster_gpus) == ("cuda", "ray", float(NODES * GPUS))
    assert (p.trainer_dtype, p.collective_backend, p.layer_spec) == ("bfloat16", "nccl", "te")
    assert (p.engine_dtype, p.engine_block_size, p.engine_enforce_eager, p.engine_sleep_mode) == ("auto", None, False, True)
    assert p.engine_tp_executor == "ray" and p.pin_memory and p.threads_per_rank is None and p.threads_per_engine is None
    assert (p.gpus_per_bundle, p.gpus_per_engine) == (1.0, 0.0)  # engine TP 2: vLLM's Ray workers hold the GPUs
    assert detect_platform(_platform_cfg()).gpus_per_engine == 1.0  # engine TP 1: the engine actor is the worker

    plan = plan_placement(world_size=2, tp=1, pp=1, num_engines=1, engine_tp=2, colocate=False, gpus_per_node=8)
    placement = RayPlacement(plan, cpus_per_bundle=0.5, gpus=p.gpus_per_bundle > 0, timeout_s=120)
    try:
        backend = cfg.backend()
        actors, _ = spawn_rank_actors(placement, ray.remote(RankActor), num_cpus=0.25,
                                      args_for_rank=lambda r: (backend.worker, backend.rank_config(cfg), r, 2, p.to_dict()))
        got = ray.get([a.platform_profile.remote() for a in actors])
        for g in got:
            g.pop("torch_threads")
            assert Platform.from_dict(g) == p  # handed, not re-detected (torch sees no CUDA in the actor)

        @ray.remote(num_cpus=0)
        def cuda_in_actor_process() -> bool:
            import torch

            return torch.cuda.is_available()

        assert ray.get(cuda_in_actor_process.remote()) is False
        for a in actors:
            ray.kill(a)
    finally:
        placement.remove()


def test_cpu_rank_actor_sets_the_handed_threads(cluster) -> None:
    """A CPU profile handed to a rank: its torch threads come from the profile."""
    from openrlhf_shape.cluster.rank_group import RankActor
    from openrlhf_shape.megatron.backend import MEGATRON
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.platform import Platform, cpu_platform

    handed = cpu_platform(threads_per_rank=2)
    a = ray.remote(RankActor).options(num_cpus=0.25).remote(MEGATRON.worker, MegatronConfig(), 0, 1, handed.to_dict())
    got = ray.get(a.platform_profile.remote())
    assert got.pop("torch_threads") == 2 and Platform.from_dict(got) == handed
    ray.kill(a)


def test_colocated_reference_ranks_share_the_actor_gpus(cluster) -> None:
    """--train.colocate_all with a reference model: three processes per GPU (actor rank, reference rank, engine
    worker), each with a third of it; Ray admits all three at once on one bundle and they see one GPU."""
    plan = plan_placement(world_size=2, tp=1, pp=1, num_engines=2, engine_tp=1, colocate=True, gpus_per_node=GPUS,
                          ref_world_size=2)
    placement = RayPlacement(plan, cpus_per_bundle=1.5, gpus=True, timeout_s=120)
    try:
        assert placement.rank_gpu_share() == placement.engine_gpu_share() == 0.3333
        actors = [RankProbe.options(**placement.rank_options(r, 0.5, role=role)).remote(r)
                  for role in ("actor", "reference") for r in range(2)]
        actors += [RankProbe.options(**placement.engine_options(e, 0.5)["options"]).remote(e) for e in range(2)]
        reps = ray.get([a.report.remote() for a in actors], timeout=120)  # all six alive at once
        for r in range(2):  # actor rank r, reference rank r and engine r on one GPU of one node
            same = {(reps[k]["node_id"], tuple(reps[k]["gpu_ids"])) for k in (r, 2 + r, 4 + r)}
            assert len(same) == 1 and len(next(iter(same))[1]) == 1, same
        assert reps[0]["gpu_ids"] != reps[1]["gpu_ids"] or reps[0]["node_id"] != reps[1]["node_id"]
        for a in actors:
            ray.kill(a)
    finally:
        placement.remove()
