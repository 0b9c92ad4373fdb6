"""Rank-side scenario of the MoE routing replay tests (run by ``launch.run_ranks``; see
test_moe_routing_replay_on_cpu.py): the real MegatronRankWorker on CPU/gloo with ``routing_replay`` set."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from openrlhf_shape.batch import LogProbs
from openrlhf_shape.testing.rank_configs import megatron_config
from openrlhf_shape.megatron.routing_replay import moe_routers
from openrlhf_shape.megatron.worker import MegatronRankWorker
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.batches import train_batches


def _shared(worker, out: dict, n: int) -> LogProbs:
    """The merged per-sample outputs, the same on every rank (the driver's role: gather, then send to all)."""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, out)
    return merge_rank_outputs(objs, n)


@contextlib.contextmanager
def _routing_seen(worker, store: list):
    """Capture what every router of the model actually routed each token to (its routing_map output)."""
    handles = []
    routers = moe_routers(worker.state.gpt)

    def hook(module, args, output):
        _, routing_map = output  # [tokens, experts] bool
        store.append((routers.index(module), routing_map.detach().cpu().clone()))

    for r in routers:
        handles.append(r.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replay_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, moe_dir: str,
               perturbed_dir: str, batch: dict, layer0_drop: int = 7) -> dict:
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())
    n, seqs = len(batch["sequences"]), batch["sequences"]
    res: dict = {}
    # 1. R2's old-log-prob pass: free routing, recorded
    worker.init_model(moe_dir)
    rec = _shared(worker, worker.compute_logprobs_and_entropy(batch), n)
    routed = rec.routed_experts
    res["recorded"] = rec
    # 2. the same weights, the recorded routing replayed: the recorded log-probs (token alignment of the replay)
    res["replay_same"] = _shared(worker, worker.compute_logprobs_and_entropy({**batch, "routed_experts": routed}), n)
    # ... and another valid routing replayed: other log-probs (the replay is what routes)
    other = [(r.long() + 1) % 8 for r in routed]
    res["replay_other"] = _shared(worker, worker.compute_logprobs_and_entropy({**batch, "routed_experts": other}), n)
    # 3. perturbed router: free routing flips some tokens; the replayed pass routes as recorded
    worker.init_model(perturbed_dir)
    res["free_perturbed"] = _shared(worker, worker.compute_logprobs_and_entropy(batch), n)
    res["replay_perturbed"] = _shared(worker, worker.compute_logprobs_and_entropy({**batch, "routed_experts": routed}), n)
    # 4. update passes: R2 refuses a batch without the recorded routing; with it, the train forward routes as
    # recorded and only replayed experts' gate rows (and experts) receive gradients
    tb = train_batches(batch, 1, seed=7)[0]
    try:
        worker.train_step(tb)
        res["train_without_routing"] = "ran"
    except ValueError as e:
        res["train_without_routing"] = str(e)
    dropped = []
    for r in routed:  # layer 0: no token goes to expert `layer0_drop`
        r = r.long().clone()
        l0 = r[:, 0]
        for t in range(l0.shape[0]):
            for j in range(l0.shape[1]):
                if int(l0[t, j]) == layer0_drop:
                    l0[t, j] = next(e for e in range(8) if e != layer0_drop and e not in l0[t].tolist())
        dropped.append(r)
    res["trained"] = {}
    for name, routing in (("dropped", dropped), ("free", res["free_perturbed"].routed_experts)):
        worker.init_model(perturbed_dir)
        gpt = worker.state.gpt
        router0 = moe_routers(gpt)[0]
        fc1 = dict(gpt.named_parameters())
        fc1_name = next(k for k in fc1 if f"local_experts.{layer0_drop}.linear_fc1" in k and ".layers.0." in k)
        before_router, before_fc1 = router0.weight.detach().clone(), fc1[fc1_name].detach().clone()
        seen = []
        with _routing_seen(worker, seen):
            metrics = worker.train_step(dataclasses.replace(tb, routed_experts=routing))
        moved = (router0.weight.detach() - before_router).abs().amax(dim=1)  # per expert row
        res["trained"][name] = {
            "metrics": metrics,
            "router_row_moved": moved,
            "expert_fc1_moved": float((fc1[fc1_name].detach() - before_fc1).abs().max()),
            "seen_routing": seen,
        }
    worker.shutdown()
    return res if rank == 0 else {}


def r3_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, moe_dir: str, batch: dict,
           engine_routed: list) -> dict:
    """The trainer's passes on an engine's samples: free (R2 records it; R3 refuses without the engine's routing)
    and with the engine's routing replayed, with what the routers actually routed each token to."""
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())
    n = len(batch["sequences"])
    worker.init_model(moe_dir)
    res: dict = {}
    try:
        res["free"] = _shared(worker, worker.compute_logprobs_and_entropy(batch), n)
    except ValueError as e:
        res["free"] = str(e)
    seen: list = []
    with _routing_seen(worker, seen):
        res["replayed"] = _shared(worker, worker.compute_logprobs_and_entropy({**batch, "routed_experts": engine_routed}), n)
    res["seen_routing"] = seen
    tb = train_batches(batch, 1, seed=7)[0]
    seen_train: list = []
    with _routing_seen(worker, seen_train):
        res["train_metrics"] = worker.train_step(dataclasses.replace(tb, routed_experts=engine_routed))
    res["seen_train"] = seen_train
    worker.shutdown()
    return res if rank == 0 else {}
