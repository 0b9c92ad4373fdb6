"""Which engine stopped making progress during a call (``--rollout.engine_stall_timeout``): the driver's side.

Every engine actor counts the steps of vLLM's engine loop (``VLLMEngine.engine_steps``: one per scheduler step,
milliseconds to seconds apart while it works) and a thread of its process writes the count to a store in the
driver's process every :data:`REPORT_S` (``VLLMEngine.report_progress``). A store and not a second actor call: a
Ray actor runs one call at a time, and the call being watched is the one running. :class:`StallWatch` reads the
counts while calls are in flight: an engine whose count has not moved for the bound since its call was sent is
stalled, whether its process was stopped, hangs holding the interpreter, or its engine loop hangs inside a step
(a collective, a driver fault). The bound applies to calls only, never to an engine's start (a GPU engine
compiles for minutes; ``EngineGroup.start_timeout_s`` bounds that).

Costs: one store write per engine per :data:`REPORT_S`; one read per in-flight engine per driver poll.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

STALL_FLAG = "--rollout.engine_stall_timeout"
REPORT_S = 1.0  # how often an engine writes its step count
STORE_OP_S = 60.0  # one store operation's limit


class EngineStalled(RuntimeError):
    """Engine ``engine`` made no step for ``idle_s`` seconds during a call (the cause handed to
    ``EngineGroup.recover``, which kills the actor and replaces it)."""

    def __init__(self, engine: int, idle_s: float, bound_s: float):
        super().__init__(f"no engine step for {idle_s:.0f} s ({STALL_FLAG} {bound_s:g} s)")
        self.engine, self.idle_s = engine, idle_s


class StallWatch:
    """The driver's store (a ``torch.distributed.TCPStore`` server on ``host``, a free port) and, per engine index,
    its last count and when it last changed. ``timeout_s``: the bound in seconds (> 0)."""

    def __init__(self, host: str, timeout_s: float):
        import torch.distributed as dist

        if timeout_s <= 0:
            raise ValueError(f"{STALL_FLAG} {timeout_s}: a positive number of seconds (0 turns the watch off)")
        self.timeout_s = float(timeout_s)
        self.store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=STORE_OP_S), wait_for_workers=False)
        self.host, self.port = host, int(self.store.port)
        self._seen: dict[int, tuple[str, float]] = {}  # engine -> (last count, monotonic seconds it last changed)

    @staticmethod
    def key(e: int) -> str:
        return f"engine/{e}"

    def watch(self, e: int, handle: Any) -> None:
        """Have engine ``e``'s actor (``handle``: a new one too) report to this store; not awaited (it runs after
        the actor's start, before any later call of it)."""
        handle.report_progress.remote({"host": self.host, "port": self.port}, self.key(e), REPORT_S)

    def poll_s(self) -> float:
        """How long the driver waits for a result between two reads (a tenth of the bound, 0.5 s to 5 s)."""
        return min(5.0, max(0.5, self.timeout_s / 10))

    def sent(self, e: int) -> None:
        """A call went to engine ``e`` now: its time without progress counts from here."""
        self._seen[e] = (self._read(e), time.monotonic())

    def stalled(self, engines: set[int]) -> dict[int, float]:
        """Of ``engines`` (those with a call in flight), the ones whose count stood still for the bound:
        ``{engine: seconds since it last moved}``."""
        now, out = time.monotonic(), {}
        for e in engines:
            count = self._read(e)
            last, since = self._seen.get(e, (count, now))
            if count != last:
                self._seen[e] = (count, now)
            elif now - since >= self.timeout_s:
                out[e] = now - since
        return out

    def _read(self, e: int) -> str:
        return self.store.get(self.key(e)).decode() if self.store.check([self.key(e)]) else ""
