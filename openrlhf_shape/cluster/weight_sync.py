"""Streamed weight sync from the Megatron sender rank into every vLLM engine worker.

One interface, :class:`WeightSender` (``begin() / send(bucket) / finish()``), on the sending rank;
the receiving side runs inside each vLLM worker (``worker_ext.WeightSyncExtension``), which feeds
what arrives to the worker's own ``reload_weights(weights_iterator=...)`` in ONE call per sync (vLLM
loads fused q/k/v and gate/up parameters layer-wise: they must arrive within one call).

Buckets are ``list[(hf_name, tensor)]`` as the bridge export produces them; each leaves the sender
as soon as it is produced (no full-model gather). Transports:

* ``collective``: a torch.distributed group of the sender (rank 0) and every engine worker (rank
  ``1 + engine * engine_tp + tp_rank``), a standalone ``ProcessGroupGloo`` (CPU) or
  ``ProcessGroupNCCL`` (GPU) over a ``TCPStore`` on the sender's node: the same code on both. Per
  bucket: a size header, a JSON index (name, dtype, shape, offset) and ONE flat byte buffer.
* ``object_store``: each bucket is ``ray.put`` once and its ref goes into one bounded queue per
  engine worker (``maxsize=2``: the sender is never more than two buckets ahead of the slowest
  worker); the worker ``ray.get``s it. The fallback; needs workers that are Ray processes (TP 1
  in-process engines, or vLLM's Ray executor on GPU).
* ``cuda_ipc`` (GPU, colocated only; NOT verified on this CPU machine): the bucket's flat buffer
  stays on the sender's GPU; the engine worker on the same GPU opens it through a CUDA IPC handle,
  copies and acknowledges; at most two buffers alive.

Sender memory: one bucket of copies (the export) plus one flat buffer (collective) or the
two queued object-store objects; never the model.
"""

from __future__ import annotations

import json
import queue as stdlib_queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch

TRANSPORTS = ("collective", "object_store", "cuda_ipc")
QUEUE_DEPTH = 2  # buckets a sender may be ahead of the slowest receiver
DEFAULT_TIMEOUT_S = 600.0  # --rollout.weight_sync_timeout: any one wait of a sync, either side


def put_or_raise(queue, item: Any, timeout_s: float, what: str) -> None:
    """``queue.put`` that raises :class:`TimeoutError` naming ``what`` after ``timeout_s`` instead of
    blocking forever on a full queue whose reader died (a bounded queue is how a sender waits). Any
    queue with ``put(item, block, timeout)``: Ray's (whose Full is the stdlib's) or multiprocessing's."""
    try:
        queue.put(item, block=True, timeout=timeout_s)
    except stdlib_queue.Full:
        raise TimeoutError(f"weight sync: {what} took nothing for {timeout_s:g} s (its reader died or hangs; "
                           "--rollout.weight_sync_timeout sets the wait)") from None


def get_or_raise(queue, timeout_s: float, what: str) -> Any:
    """``queue.get`` that raises :class:`TimeoutError` naming ``what`` after ``timeout_s``."""
    try:
        return queue.get(block=True, timeout=timeout_s)
    except stdlib_queue.Empty:
        raise TimeoutError(f"weight sync: nothing arrived on {what} for {timeout_s:g} s (the sender died or "
                           "hangs; --rollout.weight_sync_timeout sets the wait)") from None

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------------
# Wire format: index (JSON) + one flat byte buffer per bucket
# ---------------------------------------------------------------------------------------------------


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device | str) -> tuple[bytes, torch.Tensor]:
    """(JSON index, flat uint8 buffer [total bytes]) of a bucket; tensors keep their dtype bits."""
    index = []
    off = 0
    for name, t in bucket:
        nb = _nbytes(t)
        index.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off, nb])
        off += nb
    flat = torch.empty(off, dtype=torch.uint8, device=device)
    for (_name, t), (_, _, _, o, nb) in zip(bucket, index):
        if nb:
            flat[o : o + nb].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return json.dumps(index).encode(), flat


def unpack_bucket(index_json: bytes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (one per tensor), the inverse of :func:`pack_bucket`."""
    out = []
    for name, dtype, shape, off, nb in json.loads(index_json.decode()):
        out.append((name, flat[off : off + nb].view(_DTYPES[dtype]).reshape(shape)))
    return out


# ---------------------------------------------------------------------------------------------------
# Collective group (gloo on CPU, NCCL on GPU)
# ---------------------------------------------------------------------------------------------------


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
    pg.broadcast([t], _bcast_opts()).wait()


def _bcast_opts():
    import torch.distributed as dist

    o = dist.BroadcastOptions()
    o.rootRank = 0
    o.rootTensor = 0
    return o


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


# ---------------------------------------------------------------------------------------------------
# Sender interface
# ---------------------------------------------------------------------------------------------------


@dataclass
class SyncStats:
    """What one sync cost the sender. ``peak_inflight_bytes``: most bucket bytes the sender held at
    once (its copies + packed buffers + queued objects it still owns)."""

    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_inflight_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        mb = self.bytes / 2**20
        return {"sync/bytes": float(self.bytes), "sync/buckets": float(self.buckets),
                "sync/seconds": self.seconds, "sync/MBps": mb / self.seconds if self.seconds > 0 else 0.0,
                "sync/peak_inflight_bytes": float(self.peak_inflight_bytes), **self.extra}


class WeightSender:
    """Sender side of one transport: ``begin()``, ``send(bucket)`` per bucket as it is produced,
    ``finish()`` -> :class:`SyncStats`."""

    def begin(self) -> None:
        self.stats = SyncStats()
        self._t0 = time.perf_counter()

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self) -> SyncStats:
        self.stats.seconds = time.perf_counter() - self._t0
        return self.stats

    def close(self) -> None:
        pass

    def _account(self, bucket_bytes: int, held: int) -> None:
        self.stats.bytes += bucket_bytes
        self.stats.buckets += 1
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, held)


class CollectiveSender(WeightSender):
    """Rank 0 of the sync group; ``connect`` blocks until every engine worker joined."""

    def __init__(self, host: str, port: int, world: int, backend: str, device: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.store, self.pg = make_group(host, port, 0, world, backend, timeout_s)
        self.device = torch.device(device)
        self.world = world

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not bucket:
            return
        src = sum(_nbytes(t) for _, t in bucket)
        n = broadcast_bucket(self.pg, bucket, self.device)
        self._account(n, src + n)  # the bucket's copies + its packed buffer

    def finish(self) -> SyncStats:
        broadcast_bucket(self.pg, [], self.device)
        return super().finish()

    def close(self) -> None:
        self.pg = None
        self.store = None


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
        nb = sum(_nbytes(t) for _, t in bucket)
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


class CudaIpcSender(WeightSender):
    """GPU only, colocated engines (NOT verified on CPU: needs CUDA). Per bucket the packed flat
    buffer stays on this GPU; its IPC handle goes to every engine worker on the same GPU (one queue
    each), which rebuilds the tensor, copies what it needs and acknowledges on ``acks``. At most
    QUEUE_DEPTH buffers are alive. Every put and acknowledgement waits at most ``timeout_s``."""

    def __init__(self, queues: list, acks: list, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not torch.cuda.is_available():
            raise RuntimeError("transport 'cuda_ipc' needs CUDA (colocated GPU engines); use 'collective' "
                               "or 'object_store' on CPU")
        self.queues, self.acks = queues, acks
        self.timeout_s = float(timeout_s)
        self._alive: list[torch.Tensor] = []

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not bucket:
            return
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

    def finish(self) -> SyncStats:
        for i, q in enumerate(self.queues):
            put_or_raise(q, None, self.timeout_s, f"engine worker {i}'s queue")
        for _ in self._alive:
            self._await_acks()
        self._alive.clear()
        return super().finish()


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


# ---------------------------------------------------------------------------------------------------
# Measuring the sender's memory
# ---------------------------------------------------------------------------------------------------


class RssSampler:
    """High-water mark of this process's resident memory over a block (sampled every 2 ms), in
    bytes above the RSS at entry. Coarse (allocator caching counts), but it sees every copy."""

    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        self.peak_delta = 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self) -> "RssSampler":
        self.base = self.rss()
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                self.peak_delta = max(self.peak_delta, self.rss() - self.base)
                time.sleep(self.period_s)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_delta = max(self.peak_delta, self.rss() - self.base)
