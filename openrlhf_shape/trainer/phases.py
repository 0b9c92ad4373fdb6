"""Timing and metrics of one training step: every phase runs through :meth:`StepLog.phase`."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

# The phases of one step, in order (docs/architecture.md); the run report sums their seconds.
PHASES = ("generate", "rewards", "logprobs", "ref_logprobs", "values", "segment", "probes", "advantages", "to_update",
          "train", "sync", "to_rollout", "eval", "checkpoint")


class PhaseOutput(NamedTuple):
    """What a phase function may return: its value and the metrics it measured."""

    value: Any
    metrics: dict[str, Any]


class StepLog:
    """Collects one step's metrics; ``phase(name, fn, *args)`` runs ``fn`` and records ``time/<name>``.

    A phase returns a :class:`PhaseOutput` (its metrics are merged, its value returned) or None (a
    transition that measures nothing, e.g. the colocation lifecycle's); anything else is refused.
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
        if out is None:
            return None
        if not isinstance(out, PhaseOutput):
            raise TypeError(f"phase {name!r} returned {type(out).__name__}; phases return PhaseOutput(value, metrics) or None")
        self.metrics.update(out.metrics)
        return out.value

    def finish(self, **extra: Any) -> dict[str, Any]:
        """The step's metrics with ``time/step`` (seconds since this log was made) and ``extra``."""
        self.metrics.update(extra)
        self.metrics["time/step"] = time.perf_counter() - self._t0
        return self.metrics
