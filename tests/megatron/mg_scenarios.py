"""Rank-side scenarios for the Megatron tests (run in subprocesses by ``launch.run_ranks``).

Each function drives the real :class:`MegatronRankWorker` on CPU/gloo and returns plain data
(lists of tensors, floats) that the pytest side compares against Hugging Face or other layouts.
"""

from __future__ import annotations

import dataclasses
import os
import time

import psutil
import torch

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.testing.rank_configs import megatron_config, replaced
from openrlhf_shape.megatron.worker import MegatronRankWorker
from openrlhf_shape.testing.batches import train_batches
from openrlhf_shape.testing.negative_controls import flat_qkv_conversion
from support.reference import reference_run
from rank_sequence import release_megatron


def layout_run(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    cfg: dict,
    model_dirs: dict,
    batch: dict,
    train_dir: str | None = None,
    train_steps: int = 0,
    save_at: int | None = None,
    ckpt_root: str | None = None,
    resume_from: str | None = None,
    export_dir: str | None = None,
    bucket_bytes: int | None = None,
    wrong_qkv_arch: str | None = None,
    nan_step: bool = False,
    variants: dict | None = None,
    single_sequence_check: bool = False,
    reference_dir: str | None = None,
    keep_group: bool = False,
) -> dict:
    """Parity forward for every arch in ``model_dirs``, then optional training/ckpt/export of ``train_dir``."""
    t0 = time.time()
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, platform=detect_platform())
    res: dict = {"logprobs": {}, "timing": {}}
    for arch, path in model_dirs.items():
        worker.init_model(path)
        res["logprobs"][arch] = worker.compute_logprobs_and_entropy(batch)
        if arch == wrong_qkv_arch:
            res["wrong_qkv"] = _wrong_qkv_logprobs(worker, path, batch)
    res["timing"]["parity_s"] = time.time() - t0
    if train_dir is not None:
        t1 = time.time()
        info = worker.init_model(train_dir)
        res["info"] = info
        start = 0
        if resume_from is not None:
            extra = worker.load_checkpoint(resume_from)
            res["extra"] = extra
            start = int(extra["step"])
        batches = train_batches(batch, train_steps, seed=1234)
        metrics = []
        for step in range(start, train_steps):
            metrics.append(worker.train_step(batches[step]))
            if save_at is not None and step + 1 == save_at:
                worker.save_checkpoint(os.path.join(ckpt_root, f"step_{step + 1}"), extra={"step": step + 1, "data_pos": 7})
                # what the save left running under this rank (megatron's writer forks and joins its own)
                res["children_after_save"] = [" ".join(c.cmdline()[:3]) for c in psutil.Process().children(recursive=True)]
        res["metrics"] = metrics
        res["after_train"] = worker.compute_logprobs_and_entropy(batch)
        if nan_step:
            bad = dataclasses.replace(batches[0], advantages=batches[0].advantages.clone())
            bad.advantages[0, 0] = float("nan")
            res["nan_metrics"] = worker.train_step(bad)
            res["after_nan"] = worker.compute_logprobs_and_entropy(batch)
        res["timing"]["train_s"] = time.time() - t1
        if export_dir is not None:
            t2 = time.time()
            worker.export_hf(export_dir)
            res["timing"]["export_s"] = time.time() - t2
        if bucket_bytes is not None:
            buckets = list(worker.iter_hf_weights(bucket_bytes))
            res["buckets"] = [[(n, t.shape, t.dtype, float(t.double().sum())) for n, t in b] for b in buckets]
    if reference_dir is not None:  # after the updates: the reference comes from the HF weights, not the trained ones
        res["reference"] = reference_run(worker, reference_dir, batch)
    if single_sequence_check:
        # fewer sequences than DP ranks: the rank without data runs a fully masked filler
        one = {"sequences": batch["sequences"][:1], "prompt_lens": batch["prompt_lens"][:1], "temperature": batch["temperature"]}
        res["single_logprobs"] = worker.compute_logprobs_and_entropy(one)
        res["single_metrics"] = worker.train_step(train_batches(one, 1, seed=5)[0])
    for vname, overrides in (variants or {}).items():
        # Sequence parallel and activation recompute are TransformerConfig switches, not process
        # groups: the same ranks rebuild the models with the switch on (saves process launches).
        t3 = time.time()
        worker.cfg = replaced(worker.cfg, **overrides)
        var: dict = {"logprobs": {}}
        for arch, path in model_dirs.items():
            worker.init_model(path)
            var["logprobs"][arch] = worker.compute_logprobs_and_entropy(batch)
        var["info"] = worker.init_model(train_dir)
        batches = train_batches(batch, train_steps, seed=1234)
        var["metrics"] = [worker.train_step(b) for b in batches]
        res.setdefault("variants", {})[vname] = var
        res["timing"][f"{vname}_s"] = time.time() - t3
    release_megatron(worker, keep_group)
    return res


def _wrong_qkv_logprobs(worker: MegatronRankWorker, path: str, batch: dict) -> dict:
    """Negative control: load q/k/v concatenated flat (no per-KV-group interleave) and re-run."""
    if worker.cfg.use_distributed_optimizer:
        raise RuntimeError("negative control expects the plain optimizer")
    with flat_qkv_conversion(worker.state.bridge):
        worker.state.bridge.load_weights([worker.state.gpt], path)
    return worker.compute_logprobs_and_entropy(batch)
