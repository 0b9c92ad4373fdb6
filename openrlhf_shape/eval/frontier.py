"""The "frontier" of a training set for a given policy: the problems whose measured pass rate lies in a
band, where outcome and potentials both carry signal (a problem the policy always fails gives potentials of
0 and no GRPO signal; one it always solves gives nothing to learn).

``openrlhf-shape frontier`` samples the policy n times per training problem with the eval runner
(resumable, Math-Verify scored), then :func:`select_frontier` keeps the rows whose pass rate lies in
[low, high] and writes them, each with its measured ``pass_rate`` and ``frontier_samples``, to a new file
(atomically). The held-out set is never touched by it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass
class FrontierSelection:
    rows: list[dict[str, Any]]  # kept source rows, each with pass_rate and frontier_samples added
    pass_rates: list[float]  # every problem's, in source order
    band: tuple[float, float]

    def summary(self) -> str:
        n, kept = len(self.pass_rates), len(self.rows)
        bins = [0] * 5
        for p in self.pass_rates:
            bins[min(int(p * 5), 4)] += 1
        hist = ", ".join(f"[{i / 5:.1f}, {(i + 1) / 5:.1f}{']' if i == 4 else ')'}: {c}" for i, c in enumerate(bins))
        mean = sum(self.pass_rates) / n if n else 0.0
        return (f"kept {kept} of {n} problems with pass rate in [{self.band[0]:g}, {self.band[1]:g}] "
                f"(mean pass rate {mean:.3f}; problems by pass rate: {hist})")


def select_frontier(rows: list[dict[str, Any]], records: Iterable[dict[str, Any]],
                    band: tuple[float, float]) -> FrontierSelection:
    """``rows``: the source file's rows; ``records``: the eval runner's per-problem records (``index`` =
    row number, ``scores`` = one 0/1 score per sample). Every row must have a record."""
    low, high = band
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"--band {low} {high}: need 0 <= LOW <= HIGH <= 1 (pass rates)")
    by_index = {int(r["index"]): r for r in records}
    missing = [i for i in range(len(rows)) if i not in by_index]
    if missing:
        raise ValueError(f"{len(missing)} problems have no sampled result (first rows: {missing[:5]}); run again to resume")
    kept, rates = [], []
    for i, row in enumerate(rows):
        scores = [float(s) for s in by_index[i]["scores"]]
        rate = sum(scores) / len(scores) if scores else 0.0
        rates.append(rate)
        if low <= rate <= high:
            kept.append({**row, "pass_rate": rate, "frontier_samples": len(scores)})
    return FrontierSelection(kept, rates, (low, high))


def write_jsonl_atomic(rows: list[dict[str, Any]], path: str) -> None:
    """``rows`` as JSON lines at ``path``, via a temporary file and a rename (never half-written)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
