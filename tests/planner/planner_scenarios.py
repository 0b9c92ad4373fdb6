"""Rank-side scenario of the planner's measurement test (run in subprocesses by ``launch.run_ranks``).

What is measured, per rank process, in bytes of resident memory (``/proc/self/status``):

* ``base``: RSS after the worker's construction (gloo, model-parallel groups) and one
  ``init_model`` + training step on a ~0.3M-parameter warm-up model (so the imports and lazy
  initialisations of the model build, the optimizer and the schedule are in the baseline, not in
  the terms; the warm-up model is released when the measured one replaces it);
* ``after_init``: RSS after ``init_model`` (weights + DDP grad buffer);
* ``after_warmup``: RSS after one tiny training step (Adam's state is created by the first step);
* ``peaks[tokens]``: the high-water mark ``VmHWM`` of a training step whose DP shard is one
  micro-batch of ``tokens`` tokens on this rank, reset right before the step (``echo 5 > /proc/self/clear_refs``).

The launcher sets ``MALLOC_MMAP_THRESHOLD_`` so every tensor of 64 KiB or more is its own mmap and
goes back to the OS when freed, and ``malloc_trim(0)`` runs before each RSS reading: RSS then
follows live tensor bytes instead of what glibc keeps cached.

:func:`measure_scenarios` runs several layouts one after another in the same rank processes (each with
a new worker, process group and warm-up, so each has its own ``base``): the layouts share one launch
instead of importing Megatron in fresh processes for each.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Optional

import torch

from openrlhf_shape.actor.launch import free_port
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.batch import TrainBatch
from openrlhf_shape.testing.rank_configs import megatron_config
from openrlhf_shape.megatron.worker import MegatronRankWorker

_LIBC = ctypes.CDLL("libc.so.6")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rss() -> int:
    gc.collect()
    _LIBC.malloc_trim(0)
    return _status("VmRSS")


def _reset_peak() -> None:
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batch(rows: int, seq_len: int, vocab: int, seed: int) -> TrainBatch:
    """``rows`` random sequences of ``seq_len`` tokens (1/8 prompt) with old log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(5, vocab - 1, (seq_len,), generator=g).tolist() for _ in range(rows)]
    plen = max(1, seq_len // 8)
    resp = seq_len - plen
    return TrainBatch.from_ragged(
        seqs, [plen] * rows, [torch.full((resp,), -7.0) for _ in range(rows)],
        [torch.randn(resp, generator=g) for _ in range(rows)], temperature=1.0,
    )


def measure_update_peaks(
    *, rank: int, world_size: int, master_addr: str, master_port: int, model_dir: str, cfg: dict,
    warmup_dir: str, vocab: int, seq_len: int, rows_list: list[int],
) -> dict:
    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size,
                                master_addr=master_addr, master_port=master_port, platform=detect_platform())
    worker.init_model(warmup_dir)
    worker.cfg.optim.micro_batch_max_tokens = 2 * 16
    worker.train_step(_batch(2, 16, 1000, seed=0))
    out: dict = {"base": _rss()}
    worker.init_model(model_dir)
    out["after_init"] = _rss()
    worker.cfg.optim.micro_batch_max_tokens = 2 * 16
    worker.train_step(_batch(2, 16, vocab, seed=1))
    out["after_warmup"] = _rss()
    out["peaks"] = {}
    for k, rows in enumerate(rows_list):
        tokens = rows // worker.state.dp_size * seq_len  # this rank's DP shard is one micro-batch
        worker.cfg.optim.micro_batch_max_tokens = tokens
        batch = _batch(rows, seq_len, vocab, seed=10 + k)
        _reset_peak()
        metrics = worker.train_step(batch)
        out["peaks"][tokens] = _status("VmHWM")
        assert metrics["skipped"] == 0.0
    out["after_steps"] = _rss()
    worker.shutdown()
    return out


def _agree_ports(rank: int, world_size: int, master_addr: str, master_port: int, n: int) -> list[int]:
    """``n`` fresh rendezvous ports picked by rank 0 and told to every rank over a short-lived gloo group on the
    launch's port (a process group made again on the port of a destroyed one finds the old group's addresses)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)
    ports: list = [free_port() for _ in range(n)] if rank == 0 else [None] * n
    dist.broadcast_object_list(ports, src=0)
    dist.destroy_process_group()
    return [int(p) for p in ports]


def measure_scenarios(
    *, rank: int, world_size: int, master_addr: str, master_port: int, model_dir: str, warmup_dir: str, vocab: int,
    seq_len: int, scenarios: list[dict],
) -> list[Optional[dict]]:
    """:func:`measure_update_peaks` for each ``{"world": w, "cfg": {...}, "rows": [...]}`` in turn, in this process,
    each on a process group of its own (its worker makes it, as in a launch of its own).

    A scenario of the launch's world size runs on every rank; a world-1 scenario on rank 0 alone (the other ranks
    return None for it). Run the full-world scenarios first: a rank that skipped one has nobody to wait for it."""
    ports = _agree_ports(rank, world_size, master_addr, master_port, len(scenarios))
    out: list[Optional[dict]] = []
    for sc, port in zip(scenarios, ports):
        world = sc["world"]
        if world not in (1, world_size):
            raise ValueError(f"a scenario of world {world} in a launch of world {world_size}: only {world_size} or 1")
        if rank >= world:
            out.append(None)
            continue
        out.append(measure_update_peaks(rank=rank, world_size=world, master_addr=master_addr, master_port=port,
                                        model_dir=model_dir, cfg=sc["cfg"], warmup_dir=warmup_dir, vocab=vocab,
                                        seq_len=seq_len, rows_list=sc["rows"]))
        gc.collect()  # the scenario's worker (model, optimizer) is gone before the next one reads its base
    return out
