"""The ``collective`` transport: a torch.distributed group of the sender (rank 0) and every engine worker
(rank ``1 + engine * engine_tp + worker``), a standalone ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
(GPU) over a ``TCPStore`` on the sender's node, formed once and used for every sync. Per bucket: a size
header, the JSON index and ONE flat byte buffer, broadcast from rank 0. Sender memory: the bucket's copies
plus its packed buffer. Never on a colocated GPU plan (two members on one GPU: NCCL refuses; declared by
``one_member_per_gpu``)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Iterator

import torch

from openrlhf_shape.weight_sync.base import (
    DEFAULT_TIMEOUT_S,
    SyncCost,
    SyncSize,
    Transport,
    WeightSender,
    pack_bucket,
    tensor_bytes,
    unpack_bucket,
    worker_device,
    worker_rank,
)


def make_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A standalone process group (it does not touch the process's default group, which Megatron or
    vLLM already own). Rank 0 hosts the TCPStore; its constructor must not wait for the others
    (``wait_for_workers=False``) since every member constructs the group concurrently. ``timeout_s``
    bounds every collective of the group: a member that dies mid-sync makes the others raise."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    elif backend == "nccl":  # GPU only (not in the CPU torch build); unverified here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    else:
        raise ValueError(f"weight-sync backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    return store, pg


def _bcast(pg, t: torch.Tensor) -> None:
    import torch.distributed as dist

    o = dist.BroadcastOptions()
    o.rootRank, o.rootTensor = 0, 0
    pg.broadcast([t], o).wait()


def broadcast_bucket(pg, bucket: list[tuple[str, torch.Tensor]], device) -> int:
    """Sender side of one bucket (empty bucket = end of the sync). Returns bytes sent."""
    if not bucket:
        _bcast(pg, torch.zeros(2, dtype=torch.int64, device=device))
        return 0
    index, flat = pack_bucket(bucket, device)
    _bcast(pg, torch.tensor([len(index), flat.numel()], dtype=torch.int64, device=device))
    _bcast(pg, torch.frombuffer(bytearray(index), dtype=torch.uint8).to(device))
    _bcast(pg, flat)
    return int(flat.numel())


def receive_buckets(pg, device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receiver side: buckets until the sender's end marker."""
    while True:
        sizes = torch.zeros(2, dtype=torch.int64, device=device)
        _bcast(pg, sizes)
        n_index, n_flat = (int(x) for x in sizes.tolist())
        if n_index == 0:
            return
        index = torch.empty(n_index, dtype=torch.uint8, device=device)
        _bcast(pg, index)
        flat = torch.empty(n_flat, dtype=torch.uint8, device=device)
        _bcast(pg, flat)
        yield unpack_bucket(bytes(index.cpu().tolist()), flat)


class CollectiveSender(WeightSender):
    """Rank 0 of the sync group; ``connect`` blocks until every engine worker joined."""

    def __init__(self, host: str, port: int, world: int, backend: str, device: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.store, self.pg = make_group(host, port, 0, world, backend, timeout_s)
        self.device = torch.device(device)
        self.world = world

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        src = sum(tensor_bytes(t) for _, t in bucket)
        n = broadcast_bucket(self.pg, bucket, self.device)
        self._account(n, src + n)  # the bucket's copies + its packed buffer

    def _end(self) -> None:
        broadcast_bucket(self.pg, [], self.device)

    def close(self) -> None:
        self.pg = None
        self.store = None


class Collective(Transport):
    name = "collective"
    summary = "one process group of the sender and every engine worker (gloo on CPU, NCCL on GPU), a broadcast per bucket"
    one_member_per_gpu = True
    auto_rank = 0

    @classmethod
    def cost(cls, size: SyncSize) -> SyncCost:
        """A broadcast at the planner's assumed link rate (not measured)."""
        c = super().cost(size)
        return dataclasses.replace(c, how="NCCL broadcast of " + c.how)

    def parts(self, sender) -> tuple[dict, list[dict]]:
        import ray

        ep = ray.get(sender.endpoint.remote())  # the sender's node IP and a free port there
        world = 1 + len(self.engines) * self.engine_tp
        group = {"host": ep["ip"], "port": ep["port"], "world": world, "backend": self.backend}
        return group, [{**group, "rank_offset": 1 + i * self.engine_tp} for i in range(len(self.engines))]

    @classmethod
    def sender_for(cls, part: dict, timeout_s: float) -> WeightSender:
        device = "cuda" if part["backend"] == "nccl" else "cpu"  # the driver's Platform.collective_backend
        return CollectiveSender(part["host"], int(part["port"]), int(part["world"]), part["backend"], device, timeout_s)

    @classmethod
    def receiver_for(cls, worker, part: dict, timeout_s: float) -> Any:
        """Join the group as rank ``rank_offset + worker rank`` (blocks until every member joined)."""
        rank = int(part["rank_offset"]) + worker_rank(worker)
        return make_group(part["host"], int(part["port"]), rank, int(part["world"]), part["backend"], timeout_s)

    @classmethod
    def buckets(cls, worker, inner: Any, timeout_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
        _store, pg = inner
        yield from receive_buckets(pg, worker_device(worker))
