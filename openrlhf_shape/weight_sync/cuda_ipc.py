"""The ``cuda_ipc`` transport (GPU, colocated): each bucket's flat buffer stays on the sender's GPU; every
engine worker on that GPU opens it through a CUDA IPC handle, copies it and acknowledges; at most
``QUEUE_DEPTH`` buffers are alive. Only where the sender's GPU hosts every receiver (``same_gpu_only``). The receiver opens the handle on ITS index of the sender's GPU,
found by UUID: processes number GPUs by their own ``CUDA_VISIBLE_DEVICES``. Checked by the GPU kit's
``cuda_ipc`` section (two processes on one GPU, the receiver running this module's worker side)."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from openrlhf_shape.weight_sync.base import (
    DEFAULT_TIMEOUT_S,
    GIB,
    QUEUE_DEPTH,
    SyncCost,
    SyncSize,
    Transport,
    WeightSender,
    get_or_raise,
    pack_bucket,
    put_or_raise,
    unpack_bucket,
    worker_device,
    worker_rank,
)
from openrlhf_shape.weight_sync.object_store import make_queue


# End to end (our CudaIpcSender -> the worker extension's receive path in a second process on the same GPU, 216 MiB
# in 8 buckets of 32 MiB), MEASURED on one NVIDIA H200 (torch 2.11 + CUDA 13.0) on 2026-11-26: docs/gpu_results.md
# (kit section cuda_ipc; raw docs/gpu_results/gpu_kit_2026-11-26_arch3.json, sections.cuda_ipc.GBps = 4.37 GiB/s).
CUDA_IPC_GIBS = 4.4


def gpu_uuid(index: int) -> str:
    """The GPU's UUID (the same in every process, whatever its CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(index).uuid)


# torch.multiprocessing.reductions.rebuild_cuda_tensor's positional arguments: the storage's device
# index is the 7th (tests/contracts hold torch to it).
IPC_STORAGE_DEVICE_ARG = 6


def ipc_args_on_device(args: tuple, device_index: int) -> tuple:
    """``reduce_tensor``'s rebuild arguments with the storage device replaced by ``device_index``.

    The sender writes ITS index of the GPU; a colocated engine worker whose process sees the GPUs in
    another order (Ray and vLLM set CUDA_VISIBLE_DEVICES per process) would open the handle on the
    wrong device. The receiver finds its own index of the sender's GPU by UUID and rebuilds there."""
    out = list(args)
    out[IPC_STORAGE_DEVICE_ARG] = int(device_index)
    return tuple(out)


def local_index_of_gpu(uuid: str, visible: list[str]) -> int:
    """This process's index of the GPU named ``uuid`` among its ``visible`` GPUs' UUIDs; a clear error
    when the sender's GPU is not visible here (the engine is not colocated with the sender)."""
    if uuid not in visible:
        raise RuntimeError(
            f"cuda_ipc weight sync: the sender's GPU {uuid} is not visible to this engine worker (it sees "
            f"{visible}); CUDA IPC needs the engine on the sender's GPU. Use --rollout.weight_sync collective or "
            "object_store for this layout (auto picks the right one).")
    return visible.index(uuid)


class CudaIpcSender(WeightSender):
    """GPU only, colocated engines (NOT verified on CPU: needs CUDA). Per bucket the packed flat
    buffer stays on this GPU; its IPC handle goes to every engine worker on the same GPU (one queue
    each), which rebuilds the tensor, copies what it needs and acknowledges on ``acks``. At most
    QUEUE_DEPTH buffers are alive. Every put and acknowledgement waits at most ``timeout_s``."""

    def __init__(self, queues: list, acks: list, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not torch.cuda.is_available():
            raise RuntimeError("transport 'cuda_ipc' needs CUDA (colocated GPU engines); use --rollout.weight_sync "
                               "auto on CPU")
        self.queues, self.acks = queues, acks
        self.timeout_s = float(timeout_s)
        self._alive: list[torch.Tensor] = []

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.cuda.current_device()
        index, flat = pack_bucket(bucket, torch.device("cuda", device))
        torch.cuda.synchronize()
        handle = reduce_tensor(flat)
        uuid = gpu_uuid(device)  # receivers number GPUs their own way (their CUDA_VISIBLE_DEVICES)
        for i, q in enumerate(self.queues):
            put_or_raise(q, (index, handle, uuid), self.timeout_s, f"engine worker {i}'s queue")
        self._alive.append(flat)
        if len(self._alive) > QUEUE_DEPTH:
            self._await_acks()  # the oldest buffer was consumed by every receiver
            self._alive.pop(0)
        self._account(int(flat.numel()), int(flat.numel()) * len(self._alive))

    def _await_acks(self) -> None:
        for i, a in enumerate(self.acks):
            get_or_raise(a, self.timeout_s, f"engine worker {i}'s acknowledgements")

    def _end(self) -> None:
        for i, q in enumerate(self.queues):
            put_or_raise(q, None, self.timeout_s, f"engine worker {i}'s queue")
        for _ in self._alive:
            self._await_acks()
        self._alive.clear()


class CudaIpc(Transport):
    name = "cuda_ipc"
    summary = "CUDA IPC: every engine worker, on the sender's GPU, copies each bucket out of the sender's buffer"
    platforms = ("gpu",)
    same_gpu_only = True
    auto_rank = 1

    @classmethod
    def cost(cls, size: SyncSize) -> SyncCost:
        """End to end at the measured rate."""
        rate = CUDA_IPC_GIBS * GIB
        return SyncCost(size.sync_bytes / rate, size.largest_bucket_bytes / rate,
                        f"{size.sync_bytes / GIB:.1f} GiB at {CUDA_IPC_GIBS:g} GiB/s (CUDA IPC, measured on an H200)")

    def parts(self, sender) -> tuple[dict, list[dict]]:
        self.queues = [[make_queue(QUEUE_DEPTH) for _ in range(self.engine_tp)] for _ in self.engines]
        self.acks = [[make_queue() for _ in range(self.engine_tp)] for _ in self.engines]
        flat = lambda xs: [q for qs in xs for q in qs]  # noqa: E731
        return ({"queues": flat(self.queues), "acks": flat(self.acks)},
                [{"queues": qs, "acks": acks} for qs, acks in zip(self.queues, self.acks)])

    def close(self) -> None:
        import ray

        for qs in getattr(self, "queues", []) + getattr(self, "acks", []):
            for q in qs:
                try:
                    ray.kill(q.actor)
                except Exception:  # pragma: no cover - best effort on teardown
                    pass
        self.queues, self.acks = [], []

    @classmethod
    def sender_for(cls, part: dict, timeout_s: float) -> WeightSender:
        return CudaIpcSender(part["queues"], part["acks"], timeout_s)

    @classmethod
    def receiver_for(cls, worker, part: dict, timeout_s: float) -> Any:
        rank = worker_rank(worker)
        return part["queues"][rank], part["acks"][rank]

    @classmethod
    def buckets(cls, worker, inner: Any, timeout_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Per bucket ``(index_json, (rebuild, args), sender GPU uuid)``, then None: opened on this
        process's index of the sender's GPU, copied out (the sender may free it after the ack)."""
        q, ack = inner
        rank = worker_rank(worker)
        visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
        while True:
            item = get_or_raise(q, timeout_s, f"engine worker {rank}'s queue")
            if item is None:
                return
            index, (rebuild, args), uuid = item
            device = local_index_of_gpu(uuid, visible)
            flat = rebuild(*ipc_args_on_device(args, device)).clone()
            torch.cuda.synchronize(device)
            put_or_raise(ack, True, timeout_s, f"engine worker {rank}'s acknowledgements")
            yield unpack_bucket(index, flat.to(worker_device(worker)))
