"""Timing and metrics of one training step: every phase runs through :meth:`StepLog.phase`."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

# The phases of one step, in order (docs/architecture.md); the run report sums their seconds.
PHASES = ("generate", "rewards", "logprobs", "segment", "probes", "advantages", "train", "sync", "eval", "checkpoint")


class PhaseOutput(NamedTuple):
    """What a phase function may return: its value and the metrics it measured."""

    value: Any
    metrics: dict[str, Any]


class StepLog:
    """Collects one step's metrics; ``phase(name, fn, *args)`` runs ``fn`` and records ``time/<name>``.

    A phase returning a :class:`PhaseOutput` has its metrics merged and its value returned; a phase
    returning a plain ``dict`` is taken as metrics (and returned); anything else is returned as is.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def phase(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.metrics[f"time/{name}"] = time.perf_counter() - t0
        if isinstance(out, PhaseOutput):
            self.metrics.update(out.metrics)
            return out.value
        if isinstance(out, dict):
            self.metrics.update(out)
        return out

    def finish(self, **extra: Any) -> dict[str, Any]:
        """The step's metrics with ``time/step`` (seconds since this log was made) and ``extra``."""
        self.metrics.update(extra)
        self.metrics["time/step"] = time.perf_counter() - self._t0
        return self.metrics
