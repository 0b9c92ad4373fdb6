"""The pure placement planner: Megatron rank order, TP groups and engine TP groups inside a node,
colocation pairing, disjoint pools, and errors that name the flags."""

from __future__ import annotations

import itertools

import pytest

from openrlhf_shape.cluster.placement import PlacementPlan, megatron_coords, plan_placement


def check_invariants(plan: PlacementPlan, *, world: int, tp: int, pp: int, engines: int, etp: int) -> None:
    dp = world // (tp * pp)
    assert [s.rank for s in plan.ranks] == list(range(world))
    # Megatron's order, checked against an independent enumeration (pp outermost, tp innermost).
    expected = [(t, p, d) for p in range(pp) for d in range(dp) for t in range(tp)]
    assert [(s.tp_rank, s.pp_rank, s.dp_rank) for s in plan.ranks] == expected
    # One rank per GPU, one engine worker per GPU.
    assert len({(s.node, s.gpu) for s in plan.ranks}) == world
    assert len({(s.node, s.gpu) for s in plan.engines}) == engines * etp
    assert len({s.bundle for s in plan.ranks}) == world
    # bundle <-> (node, gpu) consistent with node_bundles
    for s in (*plan.ranks, *plan.engines):
        assert plan.bundle_node(s.bundle) == (s.node, s.gpu)
        assert 0 <= s.gpu < plan.gpus_per_node
    assert sum(plan.node_bundles) == plan.num_bundles
    assert max(plan.node_bundles) <= plan.gpus_per_node
    # TP groups inside one node.
    for p, d in itertools.product(range(pp), range(dp)):
        nodes = {s.node for s in plan.ranks if s.pp_rank == p and s.dp_rank == d}
        assert len(nodes) == 1, (p, d, nodes)
    # Engine TP groups inside one node; workers numbered 0..etp-1.
    for e in range(engines):
        ws = plan.engine_workers(e)
        assert [w.worker for w in ws] == list(range(etp))
        assert len({w.node for w in ws}) == 1
    rank_gpus = {(s.node, s.gpu) for s in plan.ranks}
    engine_gpus = {(s.node, s.gpu) for s in plan.engines}
    if plan.colocate:
        assert engine_gpus <= rank_gpus
        assert plan.num_bundles == world
    else:
        assert not (engine_gpus & rank_gpus)
        assert plan.num_bundles == world + engines * etp
    assert plan.master_rank_node == plan.ranks[0].node == 0


PRESETS = {  # (world, tp, pp, engines, engine_tp, nodes of 8) as in configs/*.yaml
    "qwen3-4b": (8, 2, 1, 4, 2, 1),
    "qwen3-8b": (16, 4, 1, 8, 2, 2),
    "qwen3-14b": (16, 4, 2, 8, 2, 2),
    "qwen3-32b": (32, 8, 2, 8, 4, 4),
    "deepscaler-1.5b": (8, 1, 1, 8, 1, 1),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("colocate", [True, False])
def test_presets(name: str, colocate: bool) -> None:
    world, tp, pp, engines, etp, nodes = PRESETS[name]
    plan = plan_placement(world_size=world, tp=tp, pp=pp, num_engines=engines, engine_tp=etp,
                          colocate=colocate, gpus_per_node=8)
    check_invariants(plan, world=world, tp=tp, pp=pp, engines=engines, etp=etp)
    assert plan.num_nodes == (nodes if colocate else 2 * nodes)
    if colocate:  # every preset fills the ranks' GPUs with engine workers: one of each per GPU
        assert sorted((s.node, s.gpu) for s in plan.engines) == sorted((s.node, s.gpu) for s in plan.ranks)


def test_megatron_readme_example() -> None:
    # TP2 x PP2 x DP2: TP groups {0,1} {2,3} {4,5} {6,7}; DP groups {0,2} {1,3} {4,6} {5,7}; PP {0,4} ...
    coords = [megatron_coords(r, 2, 2, 8) for r in range(8)]
    assert [c[0] for c in coords] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [c[1] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c[2] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_sweep_shapes() -> None:
    n = 0
    for gpn in (1, 2, 4, 8):
        for world in (1, 2, 4, 6, 8, 12, 16):
            for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3)):
                if world % (tp * pp) or gpn % tp:
                    continue
                for engines, etp, colocate in itertools.product((1, 2, 3, 4), (1, 2, 4), (True, False)):
                    if etp > gpn or (colocate and engines * etp > world):
                        continue
                    try:
                        plan = plan_placement(world_size=world, tp=tp, pp=pp, num_engines=engines,
                                              engine_tp=etp, colocate=colocate, gpus_per_node=gpn)
                    except ValueError as e:  # only the straddling case is allowed to refuse
                        assert colocate and "straddling" in str(e)
                        continue
                    check_invariants(plan, world=world, tp=tp, pp=pp, engines=engines, etp=etp)
                    n += 1
    assert n > 300


def test_disaggregated_engine_skips_to_next_node() -> None:
    # 6 rank GPUs on node 0 leave 2; an engine of TP 4 must start on node 1.
    plan = plan_placement(world_size=6, tp=2, pp=1, num_engines=2, engine_tp=4, colocate=False, gpus_per_node=8)
    assert [s.node for s in plan.engines] == [1] * 8
    assert plan.node_bundles == (6, 8)
    assert plan.num_bundles == 14


@pytest.mark.parametrize("kwargs, flags", [
    (dict(world_size=8, tp=3, pp=1), ["--megatron.tensor_model_parallel_size", "--actor.num_gpus_per_node"]),
    (dict(world_size=16, tp=16, pp=1), ["--megatron.tensor_model_parallel_size", "--train.gpus_per_node"]),
    (dict(world_size=8, tp=2, pp=1, engine_tp=16), ["--vllm.tensor_parallel_size"]),
    (dict(world_size=8, tp=2, pp=1, num_engines=8, engine_tp=2), ["--train.colocate_all", "--vllm.num_engines"]),
    (dict(world_size=16, tp=4, pp=1, num_nodes=1), ["--train.num_nodes"]),
    (dict(world_size=8, tp=2, pp=1, colocate=False, num_nodes=1), ["--train.num_nodes", "--vllm.num_engines"]),
    (dict(world_size=8, tp=2, pp=1, colocate=False, rollout_gpus=3), ["--rollout.num_gpus"]),
    (dict(world_size=8, tp=2, pp=1, rollout_gpus=4), ["--rollout.num_gpus", "--train.colocate_all"]),
])
def test_errors_name_flags(kwargs: dict, flags: list[str]) -> None:
    args = dict(num_engines=4, engine_tp=2, colocate=True, gpus_per_node=8)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan_placement(**args)
    for f in flags:
        assert f in str(e.value), (f, str(e.value))


@pytest.mark.parametrize("preset", ["qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "deepscaler-1.5b",
                                    "deepseek-r1-distill-qwen-1.5b"])
def test_trainer_config_to_plan(preset: str) -> None:
    import os

    from openrlhf_shape.cluster.placement import plan_for
    from openrlhf_shape.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the presets point at /models and /data, which this machine does not have
    cfg = load_config(os.path.join(root, "configs", f"{preset}.yaml"), check_paths=False)
    plan = plan_for(cfg, on_gpu=True)
    m = cfg.megatron
    check_invariants(plan, world=cfg.actor.world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                     engines=cfg.vllm.num_engines, etp=cfg.vllm.tensor_parallel_size)
    cpu = plan_for(cfg, on_gpu=False)  # CPU slots: one node holds every slot
    assert cpu.num_nodes == 1


@pytest.mark.parametrize("flags, flag", [
    (["--rollout.weight_sync", "nccl"], "rollout.weight_sync"),
    (["--rollout.weight_sync", "cuda_ipc"], "rollout.weight_sync"),
    (["--train.gpus_per_node", "0"], "train.gpus_per_node"),
])
def test_cluster_flags_are_validated(flags: list[str], flag: str) -> None:
    from openrlhf_shape.config import load_config

    with pytest.raises(ValueError, match=flag):
        load_config(None, flags)


PRESET_NAMES = ["qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "deepscaler-1.5b", "deepseek-r1-distill-qwen-1.5b"]


def _preset_plan(preset: str, colocate: bool, on_gpu: bool = True):
    import os

    from openrlhf_shape.cluster.placement import plan_for
    from openrlhf_shape.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", f"{preset}.yaml"), check_paths=False)
    cfg.train.colocate_all = colocate
    return plan_for(cfg, on_gpu=on_gpu)


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("colocate", [True, False])
def test_no_nccl_sync_group_holds_two_ranks_on_one_gpu(preset: str, colocate: bool) -> None:
    """NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected"), at the first
    sync, after minutes of start-up. Every preset is colocated, and the colocated plan puts the sender
    (Megatron rank 0) on engine 0 worker 0's GPU: whatever ``auto`` picks must not be an NCCL group then.
    (Before this check, ``auto`` always meant the collective: every colocated preset failed on GPU.)"""
    from openrlhf_shape.cluster.placement import resolve_weight_sync, sync_group_devices

    plan = _preset_plan(preset, colocate)
    devices = sync_group_devices(plan)
    assert len(devices) == 1 + len(plan.engines)
    transport, why = resolve_weight_sync("auto", plan, on_gpu=True)
    if transport == "collective":
        assert len(set(devices)) == len(devices), f"{preset}: NCCL group with two members on one GPU ({why})"
    if transport == "cuda_ipc":  # one sender: every receiver must be on its GPU
        assert all(d == devices[0] for d in devices)
    assert (transport == "collective") == (not colocate)
    if colocate:
        with pytest.raises(ValueError, match=r"--rollout.weight_sync collective: .* two ranks on node 0 GPU 0"):
            resolve_weight_sync("collective", plan, on_gpu=True)
    assert resolve_weight_sync("auto", _preset_plan(preset, colocate, on_gpu=False), on_gpu=False)[0] == "collective"


def test_cuda_ipc_only_where_the_sender_gpu_hosts_every_receiver() -> None:
    from openrlhf_shape.cluster.placement import resolve_weight_sync

    one_gpu = plan_placement(world_size=1, tp=1, pp=1, num_engines=1, engine_tp=1, colocate=True, gpus_per_node=1)
    assert resolve_weight_sync("auto", one_gpu, on_gpu=True)[0] == "cuda_ipc"
    eight = plan_placement(world_size=8, tp=2, pp=1, num_engines=4, engine_tp=2, colocate=True, gpus_per_node=8)
    assert resolve_weight_sync("auto", eight, on_gpu=True)[0] == "object_store"
    with pytest.raises(ValueError, match="cuda_ipc: the sending rank's GPU does not host every engine worker"):
        resolve_weight_sync("cuda_ipc", eight, on_gpu=True)
    with pytest.raises(ValueError, match="cuda_ipc: needs CUDA"):
        resolve_weight_sync("cuda_ipc", one_gpu, on_gpu=False)
    assert resolve_weight_sync("object_store", eight, on_gpu=True)[0] == "object_store"


def test_reference_ranks_colocated_pair_with_the_actor_ranks() -> None:
    """--train.colocate_all with KL: reference rank r on actor rank r's GPU, in the actor's layout; no GPU added."""
    plan = plan_placement(world_size=8, tp=2, pp=2, num_engines=4, engine_tp=2, colocate=True, gpus_per_node=8,
                          ref_world_size=8)
    check_invariants(plan, world=8, tp=2, pp=2, engines=4, etp=2)
    assert [(s.rank, s.node, s.gpu, s.bundle, s.tp_rank, s.pp_rank, s.dp_rank) for s in plan.refs] == \
           [(s.rank, s.node, s.gpu, s.bundle, s.tp_rank, s.pp_rank, s.dp_rank) for s in plan.ranks]
    assert plan.num_bundles == 8
    assert not plan_placement(world_size=8, tp=2, pp=2, num_engines=4, engine_tp=2, colocate=True,
                              gpus_per_node=8).refs  # no KL: no reference ranks


def test_reference_ranks_disaggregated_get_their_own_gpus_before_the_engines() -> None:
    """Separate pools: 6 actor GPUs (TP2), 4 reference GPUs (TP2, DP2: its own data-parallel size), then 2 engines of
    TP 4; every TP group and engine inside one node of 8 (the second engine skips to node 2)."""
    plan = plan_placement(world_size=6, tp=2, pp=1, num_engines=2, engine_tp=4, colocate=False, gpus_per_node=8,
                          ref_world_size=4)
    assert [(s.node, s.gpu) for s in plan.ranks] == [(0, g) for g in range(6)]
    assert [(s.node, s.gpu) for s in plan.refs] == [(0, 6), (0, 7), (1, 0), (1, 1)]
    assert [(s.tp_rank, s.dp_rank) for s in plan.refs] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(s.engine, s.node) for s in plan.engines] == [(0, 1)] * 4 + [(1, 2)] * 4
    taken = [(s.node, s.gpu) for s in (*plan.ranks, *plan.refs, *plan.engines)]
    assert len(set(taken)) == len(taken) == 6 + 4 + 8  # disjoint
    for s in (*plan.ranks, *plan.refs, *plan.engines):
        assert plan.bundle_node(s.bundle) == (s.node, s.gpu)
    assert plan.node_bundles == (8, 6, 4) and plan.num_bundles == 18


@pytest.mark.parametrize("kwargs, match", [
    (dict(colocate=True, ref_world_size=4), r"--train\.colocate_all: .*--ref\.num_nodes x --ref\.num_gpus_per_node = 4 must equal"),
    (dict(colocate=False, ref_world_size=3), r"--ref\.num_nodes x --ref\.num_gpus_per_node = 3: .*TP x PP = 2"),
])
def test_reference_layout_errors_name_the_flags(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_placement(world_size=8, tp=2, pp=1, num_engines=4, engine_tp=2, gpus_per_node=8, **kwargs)


def test_trainer_config_places_the_reference_only_with_kl() -> None:
    from openrlhf_shape.cluster.placement import plan_for
    from openrlhf_shape.config import load_config

    base = ["--actor.num_gpus_per_node", "4", "--train.batch_size", "128", "--vllm.num_engines", "2"]
    assert plan_for(load_config(None, base), on_gpu=True).refs == ()
    plan = plan_for(load_config(None, base + ["--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "2"]), on_gpu=True)
    assert [s.bundle for s in plan.refs] == [4, 5] and [s.bundle for s in plan.engines] == [6, 7]
    coloc = plan_for(load_config(None, base + ["--algo.kl.init_coef", "0.01", "--train.colocate_all"]), on_gpu=True)
    assert [s.bundle for s in coloc.refs] == [0, 1, 2, 3] and coloc.num_bundles == 4


def test_reward_model_ranks_colocated_and_disaggregated() -> None:
    """--reward.model_name_or_path: colocated, reward rank r on actor rank r's GPU (with the reference's, no GPU added);
    separate, GPUs of its own after the reference's and before the engines', its TP groups whole inside a node."""
    plan = plan_placement(world_size=4, tp=2, pp=1, num_engines=2, engine_tp=2, colocate=True, gpus_per_node=8,
                          ref_world_size=4, rm_world_size=4)
    assert [(s.node, s.gpu, s.bundle, s.tp_rank) for s in plan.rms] == \
           [(s.node, s.gpu, s.bundle, s.tp_rank) for s in plan.ranks] and plan.num_bundles == 4
    plan = plan_placement(world_size=2, tp=2, pp=1, num_engines=2, engine_tp=2, colocate=False, gpus_per_node=4,
                          ref_world_size=2, rm_world_size=4)
    assert [(s.node, s.gpu) for s in plan.refs] == [(0, 2), (0, 3)]
    assert [(s.node, s.gpu, s.tp_rank, s.dp_rank) for s in plan.rms] == \
           [(1, 0, 0, 0), (1, 1, 1, 0), (1, 2, 0, 1), (1, 3, 1, 1)]
    assert [(s.engine, s.node) for s in plan.engines] == [(0, 2)] * 2 + [(1, 2)] * 2
    taken = [(s.node, s.gpu) for s in (*plan.ranks, *plan.refs, *plan.rms, *plan.engines)]
    assert len(set(taken)) == len(taken) == 2 + 2 + 4 + 4
    with pytest.raises(ValueError, match=r"--reward.num_nodes x --reward.num_gpus_per_node = 2 must equal"):
        plan_placement(world_size=4, tp=1, pp=1, num_engines=1, engine_tp=1, colocate=True, gpus_per_node=8,
                       rm_world_size=2)


def test_critic_ranks_colocated_disaggregated_and_on_the_reward_models_gpus() -> None:
    """gae's critic: colocated, critic rank r on actor rank r's GPU; separate, GPUs of its own after the reward
    model's and before the engines'; --train.colocate_critic_reward, critic rank r on reward rank r's GPU (OpenRLHF's
    shared group), no GPU added; without a reward model that flag leaves the critic its own GPUs."""
    coloc = plan_placement(world_size=4, tp=2, pp=1, num_engines=2, engine_tp=2, colocate=True, gpus_per_node=8,
                           rm_world_size=4, critic_world_size=4)
    assert [(s.bundle, s.tp_rank, s.dp_rank) for s in coloc.critics] == \
           [(s.bundle, s.tp_rank, s.dp_rank) for s in coloc.ranks] and coloc.num_bundles == 4
    apart = plan_placement(world_size=2, tp=2, pp=1, num_engines=1, engine_tp=2, colocate=False, gpus_per_node=8,
                           rm_world_size=2, critic_world_size=4)
    assert [s.gpu for s in apart.rms] == [2, 3] and [s.gpu for s in apart.critics] == [4, 5, 6, 7]
    assert [(s.tp_rank, s.dp_rank) for s in apart.critics] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [s.node for s in apart.engines] == [1, 1]
    paired = plan_placement(world_size=2, tp=1, pp=1, num_engines=1, engine_tp=1, colocate=False, gpus_per_node=8,
                            rm_world_size=2, critic_world_size=2, critic_on_reward=True)
    assert [s.bundle for s in paired.critics] == [s.bundle for s in paired.rms] == [2, 3]
    assert paired.num_bundles == 5 and [s.bundle for s in paired.engines] == [4]
    alone = plan_placement(world_size=2, tp=1, pp=1, num_engines=1, engine_tp=1, colocate=False, gpus_per_node=8,
                           critic_world_size=2, critic_on_reward=True)
    assert [s.bundle for s in alone.critics] == [2, 3] and alone.num_bundles == 5


@pytest.mark.parametrize("kwargs, match", [
    (dict(colocate=True, critic_world_size=2), r"--critic\.num_nodes x --critic\.num_gpus_per_node = 2 must equal"),
    (dict(colocate=False, critic_world_size=3), r"--critic\.num_nodes .* = 3: the critic runs the actor.s layout"),
    (dict(colocate=False, rm_world_size=4, critic_world_size=2, critic_on_reward=True),
     r"--train\.colocate_critic_reward: .*--critic\.num_nodes x --critic\.num_gpus_per_node = 2 must equal "
     r"--reward\.num_nodes x --reward\.num_gpus_per_node = 4"),
])
def test_critic_layout_errors_name_the_flags(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_placement(world_size=4, tp=2, pp=1, num_engines=1, engine_tp=1, gpus_per_node=8, **kwargs)
