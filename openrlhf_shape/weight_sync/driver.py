"""Driver side of the streamed weight sync: the transport's parts handed out once (``connect``), and one
sync = receivers started on every engine, then the sender ranks streaming, all awaited together under one
deadline, failing fast with a :class:`WeightSyncError` that names the engine and the step.

The colocation lifecycle (``cluster/lifecycle.py``) calls :meth:`EngineWeightSync.sync` with the rank group as
the :class:`SendingRanks`; every engine resets its prefix cache after loading, and the lifecycle has the engine
group forget its prefix affinity.
"""

from __future__ import annotations

import uuid
from typing import Protocol

from openrlhf_shape.weight_sync import DEFAULT_TIMEOUT_S, TRANSPORTS


class SendingRanks(Protocol):
    """The sending side as the driver sees it: ``cluster/rank_group.py:RankGroup`` (every rank walks the
    export, rank 0 sends); in the transport tests ``testing/weight_holder.py:HolderRanks``."""

    def start_weight_stream(self, sync_id: str, bucket_bytes: int) -> list:
        """Start every rank's part of sync ``sync_id`` (buckets of ``bucket_bytes`` bytes); their Ray refs,
        the sender's first: its result is the sender's metrics dict."""
        ...


class WeightSyncError(RuntimeError):
    """A sync that failed or timed out: names the side that failed (``who``) and the step."""

    def __init__(self, message: str, who: str, step: int | None):
        super().__init__(message)
        self.who, self.step = who, step


GRACE_S = 5.0  # after a first failure: how long the others may take to fail too (to find the root cause)


def get_all_fail_fast(refs: list, timeout_s: float | None = None, labels: list[str] | None = None,
                      step: int | None = None) -> list:
    """``ray.get`` of all refs, raising the first error as soon as it appears (the other side of
    a collective would otherwise wait for its group timeout), and a timeout once ``timeout_s`` has
    passed since the call (not per wait). Errors are :class:`WeightSyncError` naming the call's
    label (``labels[i]`` for ``refs[i]``, e.g. ``"engine 1"``) and ``step``.

    When one member of a group dies, its peers fail too (a broken connection) and either may be
    seen first: after the first failure the others get :data:`GRACE_S` to fail, and a call whose
    actor DIED is named as the cause before the calls that failed because of it."""
    import time

    import ray

    labels = labels or [f"call {i}" for i in range(len(refs))]
    where = f"weight sync after step {step}" if step is not None else "weight sync"
    resume = ("The run stops here; re-run the same command to resume from the newest complete checkpoint "
              "(--ckpt.output_dir).")
    label_of = {r.hex(): lab for r, lab in zip(refs, labels)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            late = ", ".join(label_of[r.hex()] for r in pending)
            raise WeightSyncError(f"{where}: {late} still running after {timeout_s:.0f} s "
                                  f"(--rollout.weight_sync_timeout). {resume}", late, step)
        first = _error_of(done[0])
        if first is None:
            continue
        failed = [(label_of[done[0].hex()], first)]
        more, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S) if pending else ([], [])
        failed += [(label_of[r.hex()], e) for r in more if (e := _error_of(r)) is not None]
        failed.sort(key=lambda le: not isinstance(le[1], ray.exceptions.ActorDiedError))
        who, cause = failed[0]
        also = "".join(f"; then {lab}: {type(e).__name__}" for lab, e in failed[1:])
        verb = "died" if isinstance(cause, ray.exceptions.ActorDiedError) else "failed"
        raise WeightSyncError(f"{where}: {who} {verb} ({type(cause).__name__}: {_first_line(cause)}){also}. "
                              f"{resume}", who, step) from cause
    return ray.get(list(refs))


def _error_of(ref) -> BaseException | None:
    """The exception a finished ref raises, or None."""
    import ray

    try:
        ray.get(ref)
    except Exception as e:  # ActorDiedError, a receiver's TimeoutError, a coverage error...
        return e
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if "Traceback" in text else lines[0]) if lines else repr(e)


class EngineWeightSync:
    """One transport between a sender actor (rank 0 of the actor) and every engine worker.

    Args:
        engines: engine actor handles (``VLLMEngine`` in Ray).
        engine_tp: TP workers per engine (every one receives the whole stream).
        transport: a registered transport name (``weight_sync.TRANSPORTS``: collective, object_store,
            cuda_ipc); ``auto`` is decided before, per placement plan (``cluster/placement.py:resolve_weight_sync``).
        backend: the collective backend of the platform: ``gloo`` (CPU) or ``nccl`` (GPU).
        timeout_s: ``--rollout.weight_sync_timeout``: the longest any one sync (or the connection) may
            take, and every wait inside it on either side; past it the trainer raises naming the engine,
            instead of hanging.
    """

    def __init__(self, engines: list, engine_tp: int, transport: str = "collective", backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if transport not in TRANSPORTS:
            raise ValueError(f"--rollout.weight_sync {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        self.engines = list(engines)
        self.transport = transport
        self.timeout_s = timeout_s
        self._impl = TRANSPORTS[transport](engines, engine_tp, backend, timeout_s)
        self.sync_id = f"{transport}-{uuid.uuid4().hex[:8]}"  # the sender and workers keep their part under it
        self.connected = False

    def connect(self, sender) -> None:
        """Hand the sender (``init_weight_sender``) and every engine (``init_weight_receiver``) their part of
        the transport, awaited together (a collective group forms only when every member joined)."""
        refs = self._impl.connect(sender, self.sync_id)
        get_all_fail_fast(refs, self.timeout_s, ["the sender (rank 0)"] + [f"engine {i}" for i in range(len(refs) - 1)])
        self.connected = True

    def close(self) -> None:
        self._impl.close()

    def sync(self, ranks: SendingRanks, bucket_bytes: int, step: int | None = None) -> dict[str, float]:
        """One sync (after training step ``step``, named in errors): receivers started on every engine, then
        ``ranks.start_weight_stream`` (buckets of ``bucket_bytes`` bytes). Returns the sender's metrics plus
        receiver totals. Raises :class:`WeightSyncError` naming the engine (or rank) that failed or
        outlived ``timeout_s``."""
        if not self.connected:
            raise RuntimeError("EngineWeightSync.sync before connect()")
        states = get_all_fail_fast([e.state.remote() for e in self.engines], self.timeout_s,
                                   [f"engine {i}" for i in range(len(self.engines))], step)
        asleep = [i for i, st in enumerate(states) if not st["weights_awake"]]
        if asleep:  # refuse before any sender starts (it would otherwise wait for the group timeout)
            raise RuntimeError(f"weight sync targets engines {asleep} whose weights are asleep; the colocation "
                               "lifecycle wakes the weights first")
        recv = [e.receive_weights.remote(self.sync_id) for e in self.engines]
        send = list(ranks.start_weight_stream(self.sync_id, bucket_bytes))
        labels = [f"actor rank {i}" + (" (the sender)" if i == 0 else "") for i in range(len(send))]
        labels += [f"engine {i}" for i in range(len(recv))]
        out = get_all_fail_fast(send + recv, self.timeout_s, labels, step)
        metrics = dict(out[0] or {})
        per_worker = [w for r in out[len(send):] for w in r]
        metrics["sync/receivers"] = float(len(per_worker))
        metrics["sync/receiver_seconds_max"] = max((w["seconds"] for w in per_worker), default=0.0)
        if per_worker and len({w["bytes"] for w in per_worker}) != 1:
            raise RuntimeError(f"weight sync: engine workers received different byte counts: {per_worker}")
        return metrics
