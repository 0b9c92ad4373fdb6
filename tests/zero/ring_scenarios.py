"""Rank-side scenario of the DeepSpeed ring-attention tests (tests/zero/test_zero_ring_attention_on_cpu.py).

Each pass builds the DeepSpeed engine from the HF weights, computes the batch's log-probs and entropy, then runs one
step's forward and backward up to the gradient reduction and returns DeepSpeed's full (reduced) gradient of every
parameter, and the micro-batches with this rank's piece of each.
"""

from __future__ import annotations

from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.batches import train_batches
from openrlhf_shape.testing.rank_configs import replaced, zero_config
from rank_sequence import release_zero


def ring_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, zero: dict,
             model_dirs: dict, batch: dict, variants: dict | None = None, keep_group: bool = False) -> dict:
    """For every arch one packed pass (:func:`ring_pass`); then each of ``variants`` (name -> (zero overrides,
    archs)) on the same ranks (the ring size stays: its process groups are the worker's)."""
    from openrlhf_shape.zero.worker import ZeroRankWorker

    worker = ZeroRankWorker(zero_config(cfg, **zero), rank=rank, world_size=world_size, master_addr=master_addr,
                            master_port=master_port, platform=detect_platform())
    res: dict = {arch: ring_pass(worker, path, batch) for arch, path in model_dirs.items()}
    base = worker.cfg
    for vname, (overrides, archs) in (variants or {}).items():
        worker.cfg = replaced(base, **overrides)
        res.setdefault("variants", {})[vname] = {arch: ring_pass(worker, model_dirs[arch], batch) for arch in archs}
    res["ranks"] = {"ring": worker.ring_rank, "dp": worker.dp_rank, "dp_size": worker.dp_size}
    release_zero(worker, keep_group)
    return res


def ring_pass(worker, path: str, batch: dict) -> dict:
    from deepspeed.utils import safe_get_full_grad

    worker.cfg = replaced(worker.cfg, pack_samples=True)
    info = worker.init_model(path)
    out = {"info": info, "logprobs": worker.compute_logprobs_and_entropy(batch)}
    sums = worker._accumulate_gradients(train_batches(batch, 1, seed=1234)[0])
    out["grads"] = {n: safe_get_full_grad(p).detach().float().cpu().clone()
                    for n, p in worker.policy.hf.named_parameters()}
    out["loss_sum"] = float(sums[0])
    _, mbs = worker._plans(SequenceBatch.coerce(batch), forward_only=False)
    out["micro_batches"] = [{"rows": list(mb.rows), "length": int(mb.input_ids.shape[1]),
                             "piece": worker._piece(mb) if worker.cfg.ring_attn_size > 1 else None} for mb in mbs]
    return out
