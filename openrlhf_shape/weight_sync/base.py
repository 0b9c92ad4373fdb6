"""The weight sync's shared parts: the bucket wire format, the sender interface, bounded queue waits,
and :class:`Transport`, the one interface every transport implements in its own module.

A transport has three sides, each running in a different process:

* the **driver** (``driver.EngineWeightSync`` owns one instance): :meth:`Transport.connect` makes
  what the sync needs (a process group, queues) and hands each side its part;
* the **sender** (Megatron rank 0's actor, ``sender.WeightSenderMixin``): :meth:`Transport.make_sender`
  turns its part into a :class:`WeightSender` (``begin() / send(bucket) / finish()``), kept for every sync;
* each **engine worker** (inside vLLM, ``rollout/worker_ext.py:WeightSyncExtension``): :meth:`Transport.open_receiver`
  keeps its part, :meth:`Transport.stream` yields one sync's ``(hf_name, tensor)`` pairs, which the worker
  loads in ONE ``reload_weights`` call (fused q/k/v and gate/up load layer-wise: they arrive together).

Transports register by name (:data:`TRANSPORTS`) when their module is imported, and declare what they need of the
layout and what a sync costs (:class:`Transport`'s class attributes and :meth:`Transport.cost`): ``auto``'s choice
(:func:`choose_transport`), the config checks and the dry-run planner read those, and nothing switches on a
transport's name. The driver hands every side the transport's module with its part, so a transport defined outside
this package reaches the sender's and the engine workers' processes by being importable there. Buckets are
``list[(hf_name, tensor)]`` as the bridge export produces them; each leaves the sender as soon as it is
produced (no full-model gather). Every side reports its progress per bucket (``progress.py``): the driver fails a
sync in which no bucket completed for ``--rollout.weight_sync_timeout``, naming who holds it up and at which bucket;
every wait on either side is bounded too (a little longer: the driver's verdict comes first while it lives).
"""

from __future__ import annotations

import importlib
import json
import queue as stdlib_queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch

from openrlhf_shape.weight_sync.progress import SENDER, ProgressReporter, worker_member

FLAG = "--rollout.weight_sync"
GIB = 2**30
QUEUE_DEPTH = 2  # buckets a sender may be ahead of the slowest receiver
DEFAULT_TIMEOUT_S = 600.0  # --rollout.weight_sync_timeout: the longest a sync may go without a bucket completing
Bucket = list[tuple[str, torch.Tensor]]


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

# Wire format: a JSON index (name, dtype, shape, offset, bytes) + one flat byte buffer per bucket
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool)}


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_index(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list, int]:
    """([[name, dtype, shape, offset, bytes], ...], total bytes) of a bucket packed tensor after tensor."""
    index, off = [], 0
    for name, t in bucket:
        nb = tensor_bytes(t)
        index.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off, nb])
        off += nb
    return index, off


def copy_into(bucket: list[tuple[str, torch.Tensor]], index: list, flat: torch.Tensor, non_blocking: bool = False) -> None:
    """Each tensor's bytes into ``flat`` (uint8, at least the bucket's bytes) at its index offset."""
    for (_name, t), (_, _, _, o, nb) in zip(bucket, index):
        if nb:
            flat[o : o + nb].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=non_blocking)


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device | str) -> tuple[bytes, torch.Tensor]:
    """(JSON index, flat uint8 buffer [total bytes]) of a bucket; tensors keep their dtype bits."""
    index, total = bucket_index(bucket)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    copy_into(bucket, index, flat)
    return json.dumps(index).encode(), flat


def unpack_bucket(index_json: bytes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (one per tensor), the inverse of :func:`pack_bucket`."""
    out = []
    for name, dtype, shape, off, nb in json.loads(index_json.decode()):
        out.append((name, flat[off : off + nb].view(_DTYPES[dtype]).reshape(shape)))
    return out

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
    ``finish()`` -> :class:`SyncStats`. Each transport implements ``_send`` (one bucket, calling
    ``_account``) and ``_end`` (the end marker); this class reports the progress around them (``progress``:
    set by :meth:`Transport.make_sender`; a sender made by hand reports nothing)."""

    progress: ProgressReporter = ProgressReporter(None, SENDER)

    def begin(self, bucket_bytes: int | None = None) -> None:
        """Start a sync; ``bucket_bytes``: its bucket limit (a staging buffer is sized to it), None if unknown."""
        self.stats = SyncStats()
        self._t0 = time.perf_counter()
        self.bucket_bytes = bucket_bytes
        self.progress.report(0, "producing")
        self.progress.start()

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not bucket:
            return
        done = self.stats.buckets
        self.progress.report(done, "sending")
        self._send(bucket)
        self.progress.completed(done + 1, "producing")

    def finish(self) -> SyncStats:
        self.progress.report(self.stats.buckets, "finishing")
        self._end()
        self.stats.seconds = time.perf_counter() - self._t0
        self.progress.completed(self.stats.buckets, "finished")
        self.progress.stop()
        return self.stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _end(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _account(self, bucket_bytes: int, held: int) -> None:
        self.stats.bytes += bucket_bytes
        self.stats.buckets += 1
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, held)

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


# ---------------------------------------------------------------------------------------------------
# The transport interface
# ---------------------------------------------------------------------------------------------------

TRANSPORTS: dict[str, type["Transport"]] = {}  # name -> class, filled by each transport module


@dataclass(frozen=True)
class SyncLayout:
    """Where the sync group's members sit, as plain values (``cluster/placement.py`` makes it from a plan):
    ``devices``: (node, GPU) of the sender (actor rank 0) first, then every engine worker; ``on_gpu``: the
    platform's (CPU: ranks and engines share no device)."""

    devices: tuple[tuple[int, int], ...]
    on_gpu: bool

    def shared_gpu(self) -> tuple[int, int] | None:
        """A device that holds two members of the group (colocation: the sender and engine 0's worker 0), or None."""
        return next((d for d in self.devices if self.devices.count(d) > 1), None)

    def receivers_off_sender_gpu(self) -> bool:
        return any(d != self.devices[0] for d in self.devices[1:])


@dataclass(frozen=True)
class SyncSize:
    """One sync as the dry-run planner sizes it: ``sync_bytes`` sent to every engine worker, its largest bucket
    (``largest_bucket_bytes``), the bucket limit ``bucket_mb`` (``--vllm.weight_sync_bucket_mb``), the nodes other
    than the sender's that host engine workers (``remote_nodes``) and the planner's assumed links in GB/s
    (``--plan.link_gbs`` across nodes, ``--plan.nvlink_gbs`` within one)."""

    sync_bytes: int
    largest_bucket_bytes: int
    bucket_mb: float
    remote_nodes: int
    link_gbs: float
    nvlink_gbs: float


@dataclass(frozen=True)
class SyncCost:
    """A transport's rough cost of one :class:`SyncSize`: ``seconds`` per sync, ``bucket_seconds`` for the largest
    bucket through every stage (the longest a healthy sync goes without progress), ``how`` the model in words (and
    whether its rates were measured), ``note`` one more line for the dry run ("" for none)."""

    seconds: float
    bucket_seconds: float
    how: str
    note: str = ""


def choose_transport(requested: str, layout: SyncLayout) -> tuple[str, str]:
    """(transport, why) for ``--rollout.weight_sync requested`` on ``layout``. ``auto`` takes the transport of lowest
    ``auto_rank`` among those whose declared constraints the layout meets; a named one it does not meet is refused
    (``ValueError`` naming the flag, the reason and what auto would take)."""
    if requested != "auto" and requested not in TRANSPORTS:
        raise ValueError(f"{FLAG} {requested!r}: use auto or a registered transport ({', '.join(TRANSPORTS)})")
    refused = {name: why for name, cls in TRANSPORTS.items() if (why := cls.refusal(layout))}
    usable = sorted((cls.auto_rank, name) for name, cls in TRANSPORTS.items() if name not in refused)
    if requested != "auto":
        if requested in refused:
            instead = f" (here: {usable[0][1]})" if usable else ""
            raise ValueError(f"{FLAG} {requested}: {refused[requested]}; use {FLAG} auto{instead}")
        return requested, "as requested"
    if not usable:
        raise ValueError(f"{FLAG} auto: no registered transport serves this layout: "
                         + "; ".join(f"{n}: {why}" for n, why in refused.items()))
    rank, name = usable[0]
    passed = "".join(f"; not {n}: {why}" for n, why in refused.items() if TRANSPORTS[n].auto_rank < rank)
    return name, f"{'GPU' if layout.on_gpu else 'CPU'}: {TRANSPORTS[name].summary}{passed}"


def transport_class(name: str, part: dict) -> type["Transport"]:
    """The transport ``name`` in a sender's or engine worker's process: the module the driver named in ``part`` is
    imported first, which registers a transport defined outside this package (it must be importable there)."""
    importlib.import_module(part.get("module", __name__))
    return TRANSPORTS[name]


class Transport:
    """One way of moving buckets from the sender to every engine worker (see the module docstring).

    Driver side (an instance per ``EngineWeightSync``): ``engines`` are the engine actors, each with
    ``engine_tp`` workers that all receive the whole stream; ``backend`` is the collective backend the
    platform chose (gloo on CPU, NCCL on GPU); ``pin_memory``: the platform's (host staging through pinned
    memory, GPU). Sender and worker sides are classmethods: they run in other processes, with only the plain
    parts :meth:`connect` handed them. A transport implements :meth:`parts`, :meth:`sender_for`,
    :meth:`receiver_for` and :meth:`buckets`; the public :meth:`make_sender`, :meth:`open_receiver` and
    :meth:`stream` wrap those with the progress reports (``progress.py``), the same for every transport.

    What it needs of the layout, declared once here and read by :func:`choose_transport`, ``config/checks.py`` and
    the docs: ``platforms`` it runs on (``cpu``, ``gpu``); ``same_gpu_only``: it reaches only engine workers on the
    sender's GPU (so it needs ``--train.colocate_all``); ``one_member_per_gpu``: on GPU its group cannot hold two
    members on one GPU (an NCCL communicator). ``auto_rank``: auto's preference among the transports a layout
    allows (lowest first); ``summary``: one line saying what it does. :meth:`cost`: its rough cost for the planner."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu")
    same_gpu_only: ClassVar[bool] = False
    one_member_per_gpu: ClassVar[bool] = False
    auto_rank: ClassVar[int] = 100

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        TRANSPORTS[cls.name] = cls

    def __init__(self, engines: list, engine_tp: int, backend: str, timeout_s: float, pin_memory: bool = False):
        self.engines, self.engine_tp, self.backend, self.timeout_s = list(engines), int(engine_tp), backend, timeout_s
        self.pin_memory = bool(pin_memory)
        self.labels = [f"engine {i}" for i in range(len(self.engines))]  # the driver names them (their group index)

    @classmethod
    def refusal(cls, layout: SyncLayout) -> str | None:
        """Why this transport cannot serve ``layout``, from its declared constraints (None: it can)."""
        if ("gpu" if layout.on_gpu else "cpu") not in cls.platforms:
            return "needs CUDA" if not layout.on_gpu else "runs on CPU only"
        if cls.same_gpu_only and layout.receivers_off_sender_gpu():
            return "the sending rank's GPU does not host every engine worker"
        if cls.one_member_per_gpu and layout.on_gpu and (shared := layout.shared_gpu()) is not None:
            return (f"its group would hold two ranks on node {shared[0]} GPU {shared[1]} (colocation puts actor rank 0 "
                    "and engine 0's worker 0 there), which NCCL refuses at the first sync")
        return None

    @classmethod
    def cost(cls, size: SyncSize) -> SyncCost:
        """A rough cost of one sync for the dry run (``planner/sync_time.py``). This default: the whole stream at the
        link between the sender and its farthest receiver, the planner's assumed rates (not measured); a transport
        with measured rates overrides it."""
        remote = size.remote_nodes
        gbs = size.link_gbs if remote else size.nvlink_gbs
        where = (f"--plan.link_gbs {size.link_gbs:g} GB/s (receivers on {remote} other node(s))" if remote
                 else f"--plan.nvlink_gbs {size.nvlink_gbs:g} GB/s (every receiver on the sender's node)")
        return SyncCost(size.sync_bytes / (gbs * 1e9), size.largest_bucket_bytes / (gbs * 1e9),
                        f"{size.sync_bytes / GIB:.1f} GiB at {where}; not measured")

    # ---- driver ---------------------------------------------------------------------------------
    def connect(self, sender, sync_id: str, progress: dict | None = None) -> list:
        """Start handing out the parts: returns the refs of the sender's ``init_weight_sender`` and every
        engine's ``init_weight_receiver`` (awaited together by the driver: a group forms only when all
        members join). ``progress``: the driver's board (``ProgressBoard.address``), handed to every side, as is
        this transport's module (:func:`transport_class`)."""
        sender_part, engine_parts = self.parts(sender)
        common = {"progress": progress, "module": type(self).__module__}
        sender_part = {**sender_part, **common, "member": SENDER}
        engine_parts = [{**part, **common, "member": label} for label, part in zip(self.labels, engine_parts)]
        return ([sender.init_weight_sender.remote(self.name, sync_id, sender_part, self.timeout_s)]
                + [e.init_weight_receiver.remote(self.name, sync_id, part, self.timeout_s)
                   for e, part in zip(self.engines, engine_parts)])

    def parts(self, sender) -> tuple[dict, list[dict]]:  # pragma: no cover - interface
        """(the sender's part, one part per engine): plain dicts."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what :meth:`connect` made (queues)."""

    # ---- sender -----------------------------------------------------------------------------------
    @classmethod
    def make_sender(cls, part: dict, timeout_s: float) -> "WeightSender":
        sender = cls.sender_for(part, timeout_s)
        sender.progress = ProgressReporter(part.get("progress"), part.get("member", SENDER), timeout_s)
        return sender

    @classmethod
    def sender_for(cls, part: dict, timeout_s: float) -> "WeightSender":  # pragma: no cover - interface
        raise NotImplementedError

    # ---- engine worker ------------------------------------------------------------------------------
    @classmethod
    def open_receiver(cls, worker, part: dict, timeout_s: float) -> "Receiver":
        """What this worker keeps between syncs (``worker``: the vLLM worker, rank and device)."""
        member = worker_member(part.get("member", "engine ?"), worker_rank(worker))
        return Receiver(cls.receiver_for(worker, part, timeout_s), ProgressReporter(part.get("progress"), member, timeout_s))

    @classmethod
    def stream(cls, worker, state: "Receiver", timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """One sync's tensors, as they arrive. A bucket counts as completed when the loader asks for the
        tensor after its last one (it has taken the whole bucket)."""
        report, done = state.progress, 0
        report.report(done, "waiting")
        report.start()
        try:
            for bucket in cls.buckets(worker, state.inner, timeout_s):
                report.report(done, "loading")
                yield from bucket
                done += 1
                report.completed(done, "waiting")
            report.completed(done, "finished")
        finally:
            report.stop()

    @classmethod
    def receiver_for(cls, worker, part: dict, timeout_s: float) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    @classmethod
    def buckets(cls, worker, inner: Any, timeout_s: float) -> Iterator[Bucket]:  # pragma: no cover - interface
        """One sync's buckets, as they arrive, until the sender's end marker."""
        raise NotImplementedError


@dataclass
class Receiver:
    """An engine worker's side of a connected sync: the transport's own state and the progress reporter."""

    inner: Any
    progress: ProgressReporter


def worker_rank(worker) -> int:
    return int(getattr(worker, "rank", 0))


def worker_device(worker) -> torch.device:
    dev = getattr(worker, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")
