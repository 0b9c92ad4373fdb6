"""Driver side of the streamed weight sync: who joins which group, and one sync = receivers
started on every engine, then the sender ranks streaming, all awaited together (fail fast).

The trainer's engine group owns one :class:`EngineWeightSync` (see ``EngineGroup.sync_weights``),
so the group that dispatches rollouts is the one that learns about new weights (its
prefix-affinity map is cleared; every engine resets its prefix cache after loading).
"""

from __future__ import annotations

from typing import Any, Callable

from openrlhf_shape.cluster.weight_sync import QUEUE_DEPTH, TRANSPORTS


def get_all_fail_fast(refs: list, timeout_s: float | None = None) -> list:
    """``ray.get`` of all refs, raising the first error as soon as it appears (the other side of
    a collective would otherwise wait for its group timeout)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"weight sync: {len(pending)} calls still running after {timeout_s} s")
        ray.get(done)  # raises the remote error
    return ray.get(list(refs))


class EngineWeightSync:
    """One transport between a sender actor (Megatron rank 0) and every engine worker.

    Args:
        engines: engine actor handles (``VLLMEngine`` in Ray).
        engine_tp: TP workers per engine (every one receives the whole stream).
        transport: ``collective`` | ``object_store`` | ``cuda_ipc``.
        backend: collective only: ``gloo`` (CPU) or ``nccl`` (GPU).
    """

    def __init__(self, engines: list, engine_tp: int, transport: str = "collective", backend: str = "gloo",
                 timeout_s: float = 600.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"--rollout.weight_sync {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        self.engines = list(engines)
        self.engine_tp = int(engine_tp)
        self.transport = transport
        self.backend = backend
        self.timeout_s = timeout_s
        self.connected = False

    @property
    def num_receivers(self) -> int:
        return len(self.engines) * self.engine_tp

    def connect(self, sender) -> None:
        """Collective: form the group (sender = rank 0 on its own node, engine e worker w = rank
        1 + e * engine_tp + w). Needs ``sender.endpoint()`` and ``sender.init_weight_sender(kind, info)``."""
        import ray

        if self.transport == "collective":
            ep = ray.get(sender.endpoint.remote())
            world = 1 + self.num_receivers
            joins = [e.init_weight_sync.remote(ep["ip"], ep["port"], world, 1 + i * self.engine_tp, self.backend,
                                               self.timeout_s) for i, e in enumerate(self.engines)]
            info = {"host": ep["ip"], "port": ep["port"], "world": world, "backend": self.backend,
                    "timeout_s": self.timeout_s}
            get_all_fail_fast([sender.init_weight_sender.remote("collective", info)] + joins, self.timeout_s)
        self._payload = self._payloads()
        self.connected = True

    def _payloads(self) -> tuple[Any, list]:
        """(what the sender gets, what each engine gets); the queues live as long as this object."""
        if self.transport == "collective":
            return None, [None] * len(self.engines)
        from ray.util.queue import Queue

        def q(maxsize: int = 0) -> Queue:
            return Queue(maxsize=maxsize, actor_options={"num_cpus": 0})

        queues = [[q(QUEUE_DEPTH) for _ in range(self.engine_tp)] for _ in self.engines]
        flat = [x for qs in queues for x in qs]
        self._queues = flat
        if self.transport == "object_store":
            return {"queues": flat}, queues
        acks = [[q() for _ in range(self.engine_tp)] for _ in self.engines]
        self._queues += [a for aa in acks for a in aa]
        return {"queues": flat, "acks": [a for aa in acks for a in aa]}, [list(p) for p in zip(queues, acks)]

    def close(self) -> None:
        import ray

        for q in getattr(self, "_queues", []):
            try:
                ray.kill(q.actor)
            except Exception:  # pragma: no cover - best effort on teardown
                pass
        self._queues = []

    def sync(self, start_senders: Callable[[Any], list]) -> dict[str, float]:
        """One sync. ``start_senders(payload)`` starts the sending side (every Megatron rank's
        ``push_weights``; only rank 0 sends) and returns its refs; the first ref's result is the
        sender's stats dict. Returns the sender's metrics plus receiver totals."""
        if not self.connected:
            raise RuntimeError("EngineWeightSync.sync before connect()")
        import ray

        asleep = [i for i, st in enumerate(ray.get([e.state.remote() for e in self.engines])) if not st["weights_awake"]]
        if asleep:  # refuse before any sender starts (it would otherwise wait for the group timeout)
            raise RuntimeError(f"weight sync targets engines {asleep} whose weights are asleep; the colocation "
                               "lifecycle wakes the weights first")
        sender_payload, engine_payloads = self._payload
        recv = [e.receive_weights.remote(self.transport, p) for e, p in zip(self.engines, engine_payloads)]
        send = start_senders(sender_payload)
        out = get_all_fail_fast(list(send) + recv, self.timeout_s)
        metrics = dict(out[0] or {})
        per_worker = [w for r in out[len(send):] for w in r]
        metrics["sync/receivers"] = float(len(per_worker))
        metrics["sync/receiver_seconds_max"] = max((w["seconds"] for w in per_worker), default=0.0)
        if per_worker and len({w["bytes"] for w in per_worker}) != 1:
            raise RuntimeError(f"weight sync: engine workers received different byte counts: {per_worker}")
        return metrics
