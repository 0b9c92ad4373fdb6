"""Rank-side scenarios for the DeepSpeed backend tests (run in subprocesses by ``launch.run_ranks``).

Each function drives the real :class:`~openrlhf_shape.zero.worker.ZeroRankWorker` on CPU/gloo and
returns plain data (tensors, floats) that the pytest side compares against Hugging Face, against
the Megatron backend and against itself (resume).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.batches import train_batches
from openrlhf_shape.testing.rank_configs import zero_config
from support.reference import reference_run


def _one(worker, *, model_dirs: dict, batch: dict, train_dir: str | None, train_steps: int, save_at: int | None,
         ckpt_root: str | None, resume_from: str | None, export_dir: str | None, bucket_bytes: int | None,
         nan_step: bool, offload_check: bool, reference_dir: str | None = None) -> dict:
    res: dict = {"logprobs": {}, "timing": {}}
    t0 = time.time()
    for arch, path in model_dirs.items():
        worker.init_model(path)
        res["logprobs"][arch] = worker.compute_logprobs_and_entropy(batch)
    res["timing"]["parity_s"] = time.time() - t0
    if train_dir is None:
        return res
    t1 = time.time()
    res["info"] = worker.init_model(train_dir)
    start = 0
    if resume_from is not None:  # a checkpoint root: the newest complete checkpoint under it
        from openrlhf_shape.checkpoint_dir import latest_checkpoint

        res["resumed_from"] = latest_checkpoint(resume_from)
        res["extra"] = worker.load_checkpoint(res["resumed_from"])
        start = int(res["extra"]["step"])
    batches = train_batches(batch, train_steps, seed=1234)
    metrics = []
    for step in range(start, train_steps):
        metrics.append(worker.train_step(batches[step]))
        if save_at is not None and step + 1 == save_at:
            worker.save_checkpoint(os.path.join(ckpt_root, f"step_{step + 1}"), extra={"step": step + 1, "data_pos": 7})
    res["metrics"] = metrics
    res["after_train"] = worker.compute_logprobs_and_entropy(batch)
    res["timing"]["train_s"] = time.time() - t1
    if offload_check:
        before = worker.compute_logprobs_and_entropy(batch)
        off = worker.offload_states()
        try:
            worker.compute_logprobs_and_entropy(batch)
            res["offload_refused"] = False
        except RuntimeError:
            res["offload_refused"] = True
        on = worker.onload_states()
        res["offload"] = {"off": off, "on": on, "before": before, "after": worker.compute_logprobs_and_entropy(batch)}
    if nan_step:
        bad = dataclasses.replace(batches[0], advantages=batches[0].advantages.clone())
        bad.advantages[0, 0] = float("nan")
        res["nan_metrics"] = worker.train_step(bad)
        res["after_nan"] = worker.compute_logprobs_and_entropy(batch)
    if export_dir is not None:
        worker.export_hf(export_dir)
    if bucket_bytes is not None:
        buckets = list(worker.iter_hf_weights(bucket_bytes))
        res["buckets"] = [[(n, tuple(t.shape), t.dtype, float(t.double().sum())) for n, t in b] for b in buckets]
    if reference_dir is not None:  # after the updates: the reference comes from the HF weights, not the trained ones
        res["reference"] = reference_run(worker, reference_dir, batch)
    return res


def zero_run(*, rank: int, world_size: int, master_addr: str, master_port: int, train_cfg: dict, stages: dict,
             model_dirs: dict, batch: dict, train_dir: str | None = None, train_steps: int = 0,
             save_at: int | None = None, ckpt_root: str | None = None, resume_from: str | None = None,
             export_dir: str | None = None, bucket_bytes: int | None = None, nan_step: bool = False,
             offload_check: bool = False, reference_dir: str | None = None) -> dict:
    """For each named ZeRO variant in ``stages`` (ZeroConfig overrides), in this one process group:
    parity forward for every arch, then optional training / checkpoint / export of ``train_dir``.
    Checkpoint, export and buckets go to ``<path>/<variant>``."""
    from openrlhf_shape.zero.worker import ZeroRankWorker

    out = {}
    worker = None
    for name, overrides in stages.items():
        zcfg = zero_config(train_cfg, **overrides)
        if worker is None:
            worker = ZeroRankWorker(zcfg, rank=rank, world_size=world_size, master_addr=master_addr,
                                    master_port=master_port, platform=detect_platform())
        worker.cfg = zcfg
        sub = lambda p: None if p is None else os.path.join(p, name)  # noqa: E731
        out[name] = _one(worker, model_dirs=model_dirs, batch=batch, train_dir=train_dir, train_steps=train_steps,
                         save_at=save_at, ckpt_root=sub(ckpt_root), resume_from=sub(resume_from),
                         export_dir=sub(export_dir), bucket_bytes=bucket_bytes, nan_step=nan_step,
                         offload_check=offload_check, reference_dir=reference_dir)
    from deepspeed.comm import comm as ds_comm

    # the training process group never compiled DeepSpeed's shared-memory op (zero/worker.py: skip_cpu_shm_comm_op)
    out["shm_comm_op_built"] = ds_comm.cdb.shm_comm_op is not None
    worker.shutdown()
    return out
