"""Rank-side scenario of the long-batch Megatron tests: context parallelism (test_context_parallel*_on_cpu.py) and
packing (test_packing_on_cpu.py), launched by long_runs.py.

Each pass builds the model from the HF weights, computes the batch's log-probs and entropy, takes one optimizer step
and returns that step's gradients under their Hugging Face names (the bridge's export run on the gradient buffers:
every layout's gradients then compare with world 1's, whatever TP shards or fuses) and as this rank's own shards
(Megatron's names: packed against padded on the same ranks), for packed and for padded micro-batches. Each pass also
records the micro-batches the step ran and how they were split over the CP ranks, and checks the padded split
against megatron-core's own ``get_batch_on_this_cp_rank``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from openrlhf_shape.actor.cp_split import cp_shard
from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.megatron.export import iter_hf_tensors
from openrlhf_shape.megatron.step import plan
from openrlhf_shape.megatron.worker import MegatronRankWorker
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.batches import train_batches
from openrlhf_shape.testing.rank_configs import megatron_config, replaced
from packing_scenarios import watch_head
from rank_sequence import release_megatron

LAYOUTS = (("packed", True), ("padded", False))


def cp_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model_dirs: dict,
           batch: dict, variants: dict | None = None, watch_arch: str | None = None,
           keep_group: bool = False) -> dict:
    """For every arch: packed and padded passes (:func:`cp_pass`); the logits watch on ``watch_arch``
    (packing_scenarios.watch_head); then each of ``variants`` (name -> (config overrides of ``cfg``, archs)) on the
    same ranks."""
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())
    base = worker.cfg
    res: dict = {arch: {name: cp_pass(worker, path, batch, pack) for name, pack in LAYOUTS}
                 for arch, path in model_dirs.items()}
    if watch_arch is not None:
        res["watch"] = watch_head(worker, model_dirs[watch_arch], batch)
    for vname, (overrides, archs) in (variants or {}).items():
        worker.cfg = replaced(base, **overrides)
        res.setdefault("variants", {})[vname] = {
            arch: {name: cp_pass(worker, model_dirs[arch], batch, pack) for name, pack in LAYOUTS} for arch in archs}
    from megatron.core import parallel_state as mpu

    res["ranks"] = {"cp": mpu.get_context_parallel_rank(), "tp": mpu.get_tensor_model_parallel_rank(),
                    "pp": mpu.get_pipeline_model_parallel_rank(), "dp_size": worker.state.dp_size,
                    "cp_group": sorted(dist.get_process_group_ranks(mpu.get_context_parallel_group())),
                    "ep_group": sorted(dist.get_process_group_ranks(mpu.get_expert_model_parallel_group()))}
    release_megatron(worker, keep_group)
    return res


def cp_pass(worker, path: str, batch: dict, pack: bool) -> dict:
    """Log-probs + entropy (results on the rank that holds them), one step's metrics, its HF-named gradients
    (``grads``) and this rank's gradient shards (``shard_grads``), the step's micro-batches and their CP split."""
    t0 = time.time()
    worker.cfg = replaced(worker.cfg, pack_samples=pack)
    info = worker.init_model(path)
    out = {"info": info, "logprobs": worker.compute_logprobs_and_entropy(batch)}
    out["metrics"] = worker.train_step(train_batches(batch, 1, seed=1234)[0])
    # the reduced gradients stay in the grad buffers after the step
    out["shard_grads"] = {n: p.main_grad.detach().float().cpu().clone() for n, p in worker.state.gpt.named_parameters()}
    out["grads"] = hf_named_grads(worker)
    _, mbs = plan(worker.state, SequenceBatch.coerce(batch), forward_only=False)
    out["micro_batches"] = [{"rows": list(mb.rows), "shape": tuple(mb.input_ids.shape), "packed": mb.packed}
                            for mb in mbs]
    out["split"] = split_record(worker, mbs)
    out["seconds"] = time.time() - t0  # the record (where a launch's time goes)
    return out


def hf_named_grads(worker) -> dict[str, torch.Tensor]:
    """This step's reduced gradients (Megatron's ``main_grad`` buffers) as full HF-named tensors: the bridge's
    export run with every parameter's data swapped for its gradient (all ranks iterate in lockstep)."""
    params = [p for p in worker.state.gpt.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad.detach().to(p.dtype)
        with worker._mode():
            return {name: t.detach().float().cpu().clone() for name, t in iter_hf_tensors(worker.state)}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def split_record(worker, mbs) -> dict:
    """Per micro-batch: its global length, the positions this rank holds, and (padded micro-batches) whether
    megatron-core's ``get_batch_on_this_cp_rank`` gives this rank the same tokens."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron.core import parallel_state as mpu

    cp = worker.cfg.context_parallel_size
    rec: dict = {"global": [], "positions": [], "megatron_agrees": []}
    for mb in mbs:
        rec["global"].append(int(mb.input_ids.shape[1]))
        if cp == 1:
            continue
        view = cp_shard(mb, cp, mpu.get_context_parallel_rank())
        rec["positions"].append(view.index.tolist())
        if not mb.packed:
            theirs = get_batch_on_this_cp_rank({"tokens": mb.input_ids.clone()})["tokens"]
            rec["megatron_agrees"].append(bool(torch.equal(theirs, mb.input_ids[:, view.index])))
    return rec
