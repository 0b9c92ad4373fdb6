"""How long a side of the cluster (the engines, the ranks) has been working: wall seconds during which at
least one call was in flight, from any thread. The trainer reads it once per step for each side's idle share."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class BusyClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    @contextmanager
    def working(self):
        """Count the wall time of the ``with`` block (nested or concurrent blocks count once)."""
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._total += time.perf_counter() - self._since

    @property
    def busy(self) -> bool:
        return self._in_flight > 0

    def seconds(self) -> float:
        """Busy wall seconds since the clock was made (the running interval included)."""
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._in_flight else 0.0)
