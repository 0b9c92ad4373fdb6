"""Driver side of the streamed weight sync: the transport's parts handed out once (``connect``), and one
sync = receivers started on every engine, then the sender ranks streaming, all awaited together, failing fast
with a :class:`WeightSyncError` that names the engine and the step.

A sync is bounded by its progress, not its total time: it fails when no bucket has completed on any side for
``--rollout.weight_sync_timeout`` seconds (``progress.py``: every side reports per bucket to a board in this
process), naming who holds it up (an engine, the sender, or the transport), the bucket and the step. A slow but
progressing sync of a large model runs as long as it needs. Every wait on the sides is bounded a little longer
(:func:`side_wait_s`), so the driver's verdict, which can name the culprit, comes first.

The colocation lifecycle (``cluster/lifecycle.py``) calls :meth:`EngineWeightSync.sync` with the rank group as
the :class:`SendingRanks`; every engine resets its prefix cache after loading, and the lifecycle has the engine
group forget its prefix affinity.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Protocol

from openrlhf_shape.weight_sync import DEFAULT_TIMEOUT_S, TRANSPORTS
from openrlhf_shape.weight_sync.progress import (
    SENDER,
    ProgressBoard,
    progress_summary,
    stall_verdict,
    worker_member,
)


class SendingRanks(Protocol):
    """The sending side as the driver sees it: ``cluster/rank_group.py:RankGroup`` (every rank walks the
    export, rank 0 sends); in the transport tests ``tests/support/weight_holder.py:HolderRanks``."""

    def start_weight_stream(self, sync_id: str, bucket_bytes: int) -> list:
        """Start every rank's part of sync ``sync_id`` (buckets of ``bucket_bytes`` bytes); their Ray refs,
        the sender's first: its result is the sender's metrics dict."""
        ...


class WeightSyncError(RuntimeError):
    """A sync that failed or stalled: names the side that failed (``who``), the step and, for a stall, the
    bucket (0-based) it is stuck on."""

    def __init__(self, message: str, who: str, step: int | None, bucket: int | None = None,
                 idle_s: float | None = None):
        super().__init__(message)
        self.who, self.step, self.bucket, self.idle_s = who, step, bucket, idle_s


GRACE_S = 5.0  # after a first failure: how long the others may take to fail too (to find the root cause)
POLL_S = 1.0  # how often the driver reads the progress board while a sync runs
RESUME = ("The run stops here; re-run the same command to resume from the newest complete checkpoint "
          "(--ckpt.output_dir).")


def side_wait_s(timeout_s: float) -> float:
    """Every single wait of the sender and the engine workers (queues, the collective's operations): longer than
    the driver's progress bound, so that the driver, which sees every side, reports a stall first."""
    return timeout_s + max(GRACE_S, 0.25 * timeout_s)


class _Watch:
    """When to give up waiting: ``timeout_s`` after the start (no board), or after the last progress (a board's
    ticks changed, or a call finished)."""

    def __init__(self, timeout_s: float | None, board: ProgressBoard | None):
        self.timeout_s, self.board = timeout_s, board
        self.last = time.monotonic()
        self.ticks = board.ticks() if board is not None else None

    def wait_s(self) -> float | None:
        if self.timeout_s is None:
            return None
        left = max(0.0, self.last + self.timeout_s - time.monotonic())
        return min(left, POLL_S) if self.board is not None else left

    def moved(self) -> None:
        self.last = time.monotonic()

    def expired(self) -> bool:
        if self.board is not None:
            self.board.sample()  # heartbeats: who still runs, for the verdict
            if (t := self.board.ticks()) != self.ticks:
                self.ticks = t
                self.moved()
        return self.timeout_s is not None and time.monotonic() - self.last >= self.timeout_s


def get_all_fail_fast(refs: list, timeout_s: float | None = None, labels: list[str] | None = None,
                      step: int | None = None, progress: ProgressBoard | None = None) -> list:
    """``ray.get`` of all refs, raising the first error as soon as it appears (the other side of
    a collective would otherwise wait for its group timeout). Without ``progress``: a timeout once
    ``timeout_s`` has passed since the call (not per wait). With ``progress`` (a sync's board): a
    timeout once nothing progressed for ``timeout_s`` (no bucket completed, no call finished), naming
    who holds the sync up and at which bucket (:func:`progress.stall_verdict`). Errors are
    :class:`WeightSyncError` naming the call's label (``labels[i]`` for ``refs[i]``, e.g. ``"engine 1"``) and ``step``.

    When one member of a group dies, its peers fail too (a broken connection) and either may be
    seen first: after the first failure the others get :data:`GRACE_S` to fail, and a call whose
    actor DIED is named as the cause before the calls that failed because of it."""
    import ray

    labels = labels or [f"call {i}" for i in range(len(refs))]
    where = f"weight sync after step {step}" if step is not None else "weight sync"
    label_of = {r.hex(): lab for r, lab in zip(refs, labels)}
    watch = _Watch(timeout_s, progress)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=watch.wait_s())
        if not done:
            if watch.expired():
                raise _timeout_error(where, [label_of[r.hex()] for r in pending], watch, step)
            continue
        watch.moved()
        first = _error_of(done[0])
        if first is not None:
            raise _failure(where, (label_of[done[0].hex()], first), pending, label_of, step)
    return ray.get(list(refs))


def _timeout_error(where: str, late: list[str], watch: _Watch, step: int | None) -> WeightSyncError:
    """The whole call outlived its timeout (no board), or nothing progressed for it (a board: who, which bucket)."""
    if watch.board is None:
        late_s = ", ".join(late)
        return WeightSyncError(f"{where}: {late_s} still running after {watch.timeout_s:.0f} s "
                               f"(--rollout.weight_sync_timeout). {RESUME}", late_s, step)
    idle = time.monotonic() - watch.last
    lines = watch.board.lines()
    v = stall_verdict(lines)
    return WeightSyncError(
        f"{where}: stalled at bucket {v.bucket}: no bucket completed for {idle:.1f} s "
        f"(--rollout.weight_sync_timeout {watch.timeout_s:g} s bounds the time without progress, not the sync): "
        f"{v.who}: {v.detail}. Buckets done per side: {progress_summary(lines)}; still running: {', '.join(late)}. "
        f"{RESUME}", v.who, step, v.bucket, idle)


def _failure(where: str, first: tuple[str, BaseException], pending: list, label_of: dict,
             step: int | None) -> WeightSyncError:
    """The first failed call, or the call whose actor died among those that fail within :data:`GRACE_S`."""
    import ray

    failed = [first]
    more, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S) if pending else ([], [])
    failed += [(label_of[r.hex()], e) for r in more if (e := _error_of(r)) is not None]
    failed.sort(key=lambda le: not isinstance(le[1], ray.exceptions.ActorDiedError))
    who, cause = failed[0]
    also = "".join(f"; then {lab}: {type(e).__name__}" for lab, e in failed[1:])
    verb = "died" if isinstance(cause, ray.exceptions.ActorDiedError) else "failed"
    text = str(cause).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    msg = (lines[-1] if "Traceback" in text else lines[0]) if lines else repr(cause)  # a traceback ends with the error
    err = WeightSyncError(f"{where}: {who} {verb} ({type(cause).__name__}: {msg}){also}. "
                          f"{RESUME}", who, step)
    err.__cause__ = cause
    return err


def lost_engine(err: WeightSyncError) -> int | None:
    """The engine (its index in the group) a failed sync lost: one engine whose actor died or that held the sync up
    past the bound (a stall verdict); None when the failure lies elsewhere (the sender, the transport, an engine's
    own error, which a replacement would repeat)."""
    import ray

    m = re.fullmatch(r"engine (\d+)", err.who or "")
    died = isinstance(err.__cause__, ray.exceptions.ActorDiedError)
    return int(m.group(1)) if m is not None and (died or err.bucket is not None) else None


def _error_of(ref) -> BaseException | None:
    """The exception a finished ref raises, or None."""
    import ray

    try:
        ray.get(ref)
    except Exception as e:  # ActorDiedError, a receiver's TimeoutError, a coverage error...
        return e
    return None


class EngineWeightSync:
    """One transport between a sender actor (rank 0 of the actor) and every engine worker.

    Args:
        engines: engine actor handles (``VLLMEngine`` in Ray).
        engine_tp: TP workers per engine (every one receives the whole stream).
        transport: a registered transport's name (``weight_sync.TRANSPORTS``); ``auto`` is decided before, per
            placement plan (``base.choose_transport``).
        backend: the collective backend of the platform: ``gloo`` (CPU) or ``nccl`` (GPU).
        timeout_s: ``--rollout.weight_sync_timeout``: the longest a sync may go without a bucket completing on
            any side (the connection and the engines' state check: the longest they may take). Past it the
            trainer raises naming who holds the sync up and the bucket, instead of hanging; a slow sync that
            keeps completing buckets never times out. The sides' own waits: :func:`side_wait_s`.
        pin_memory: the platform's ``Platform.pin_memory`` (GPU): the object-store sender stages each bucket
            through one reusable pinned host buffer (``staging.py``).
        indices: the engines' indices in the trainer's group, which errors and the progress board name them by
            (default ``0..len(engines) - 1``; a replacement's own sync: ``[e]``).
    """

    def __init__(self, engines: list, engine_tp: int, transport: str = "collective", backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S, pin_memory: bool = False, indices: list[int] | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"--rollout.weight_sync {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        self.transport, self.timeout_s, self.engine_tp = transport, timeout_s, int(engine_tp)
        self.backend, self.pin_memory = backend, pin_memory
        self.sender = None  # what connect() was handed: a reconnect forms the sync again with it
        self.labels = [f"engine {i}" for i in (range(len(engines)) if indices is None else indices)]
        self._inflight: list = []  # the last sync's calls (a failed one's are awaited by abort())
        self._over(engines)

    def _over(self, engines: list) -> None:
        """This sync over ``engines``, not connected: a fresh transport instance and sync id."""
        self.engines = list(engines)
        self._impl = TRANSPORTS[self.transport](self.engines, self.engine_tp, self.backend, side_wait_s(self.timeout_s),
                                                self.pin_memory)
        self._impl.labels = self.labels
        self.members = [SENDER] + [worker_member(label, r) for label in self.labels for r in range(self.engine_tp)]
        self.sync_id = f"{self.transport}-{uuid.uuid4().hex[:8]}"  # the sender and workers keep their part under it
        self.connected = False
        self.board: ProgressBoard | None = None

    def for_engines(self, engines: list, indices: list[int]) -> "EngineWeightSync":
        """A sync of the same transport and settings over ``engines`` only, named by their ``indices`` in the group
        (not connected): a replacement engine's own sync (``cluster/lifecycle.py:Lifecycle.restore_engine``)."""
        return EngineWeightSync(engines, self.engine_tp, self.transport, self.backend, self.timeout_s, self.pin_memory,
                                indices)

    def reconnect(self, engines: list, sender: Any = None) -> None:
        """Form the sync again over ``engines`` with ``sender`` (default: the one :meth:`connect` was handed): an
        engine of the old group died and was replaced (``rollout/group.py:EngineGroup.recover``), or the ranks were
        restarted (``cluster/runtime.py:restart_ranks``: the new rank 0). The old group's parts are freed on the old
        sender and the engines still alive (:meth:`close`; a dead side's call fails unread)."""
        if self.sender is None:
            raise RuntimeError("EngineWeightSync.reconnect before connect()")
        self.close()
        self._over(engines)
        self.connect(self.sender if sender is None else sender)

    def abort(self, e: int) -> None:
        """After a sync that lost engine ``e`` (:func:`lost_engine`): kill its actor, free the group (the sides still
        waiting in it then fail at once) and wait, at most :func:`side_wait_s`, for the sync's other calls to end, so
        that a sync over a re-formed group finds the sender and the engines idle. :class:`WeightSyncError` if one
        still runs then."""
        import ray

        ray.kill(self.engines[e], no_restart=True)
        self.close()
        refs, self._inflight = self._inflight, []
        _, left = ray.wait(refs, num_returns=len(refs), timeout=side_wait_s(self.timeout_s)) if refs else ([], [])
        if left:
            raise WeightSyncError(f"weight sync: {len(left)} call(s) of the sync that lost engine {e} still run "
                                  f"{side_wait_s(self.timeout_s):.0f} s after it was killed; the sync cannot start "
                                  f"again under them. {RESUME}", self.labels[e], None)

    def connect(self, sender) -> None:
        """Hand the sender (``init_weight_sender``) and every engine (``init_weight_receiver``) their part of
        the transport and the progress board's address, awaited together (a collective group forms only when
        every member joined)."""
        import ray

        self.sender = sender
        self.board = ProgressBoard(ray.util.get_node_ip_address(), self.members)
        refs = self._impl.connect(sender, self.sync_id, self.board.address())
        self._inflight = refs  # a member lost while the group forms: abort() waits for the others to give up
        get_all_fail_fast(refs, self.timeout_s, ["the sender (rank 0)"] + self.labels)
        self._inflight = []
        self.connected = True

    def close(self) -> None:
        """Free this sync: the transport's driver side, the board, and (not awaited) the sender's and every engine
        worker's part, so a group re-formed after a replacement leaves no sockets, buffers or threads behind."""
        self._impl.close()
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.connected:
            self.connected = False
            self.sender.drop_weight_sender.remote(self.sync_id)
            for engine in self.engines:
                engine.drop_weight_receiver.remote(self.sync_id)  # a dead one's call fails, unread

    def sync(self, ranks: SendingRanks, bucket_bytes: int, step: int | None = None) -> dict[str, float]:
        """One sync (after training step ``step``, named in errors): receivers started on every engine, then
        ``ranks.start_weight_stream`` (buckets of ``bucket_bytes`` bytes). Returns the sender's metrics plus
        receiver totals. Raises :class:`WeightSyncError` naming the engine (or rank) that failed, or who held
        the sync up when no bucket completed for ``timeout_s``."""
        if not self.connected:
            raise RuntimeError("EngineWeightSync.sync before connect()")
        states = get_all_fail_fast([e.state.remote() for e in self.engines], self.timeout_s, self.labels, step)
        asleep = [i for i, st in enumerate(states) if not st["weights_awake"]]
        if asleep:  # refuse before any sender starts (it would otherwise wait for the group timeout)
            raise RuntimeError(f"weight sync targets engines {asleep} whose weights are asleep; the colocation "
                               "lifecycle wakes the weights first")
        self.board.begin()
        recv = [e.receive_weights.remote(self.sync_id) for e in self.engines]
        send = list(ranks.start_weight_stream(self.sync_id, bucket_bytes))
        labels = [f"actor rank {i}" + (" (the sender)" if i == 0 else "") for i in range(len(send))]
        labels += self.labels
        self._inflight = send + recv
        out = get_all_fail_fast(send + recv, self.timeout_s, labels, step, progress=self.board)
        self._inflight = []
        metrics = dict(out[0] or {})
        per_worker = [w for r in out[len(send):] for w in r]
        metrics["sync/receivers"] = float(len(per_worker))
        metrics["sync/receiver_seconds_max"] = max((w["seconds"] for w in per_worker), default=0.0)
        if per_worker and len({w["bytes"] for w in per_worker}) != 1:
            raise RuntimeError(f"weight sync: engine workers received different byte counts: {per_worker}")
        return metrics
