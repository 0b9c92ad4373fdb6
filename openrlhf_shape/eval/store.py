"""Resumable per-benchmark results: ``<out_dir>/samples/<benchmark>.jsonl``, one line per finished problem.

A problem is written only when all its N samples are generated and scored, so a crash loses at
most the chunk in flight; on restart, problems already in the file are not generated again. A
sidecar ``<benchmark>.meta.json`` holds the settings fingerprint: resuming with other settings
(model, N, sampling, prompt) would mix incomparable samples, so it is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable


class ResultStore:
    def __init__(self, out_dir: str | os.PathLike, benchmark: str, fingerprint: dict[str, Any], overwrite: bool = False):
        self.dir = Path(out_dir) / "samples"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{benchmark}.jsonl"
        self.meta_path = self.dir / f"{benchmark}.meta.json"
        self.benchmark = benchmark
        fp = json.loads(json.dumps(fingerprint))  # normalise (tuples -> lists) for comparison
        if overwrite:
            self.path.unlink(missing_ok=True)
            self.meta_path.unlink(missing_ok=True)
        if self.meta_path.exists():
            old = json.loads(self.meta_path.read_text())
            if old != fp:
                diff = {k: (old.get(k), fp.get(k)) for k in set(old) | set(fp) if old.get(k) != fp.get(k)}
                raise ValueError(
                    f"{self.path} holds results made with other settings {diff} (old, new); "
                    "pass --overwrite to start again or choose another --out_dir"
                )
        else:
            self.meta_path.write_text(json.dumps(fp, indent=1, sort_keys=True))
        self._records = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        records: dict[str, dict[str, Any]] = {}
        if not self.path.exists():
            return records
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        good: list[str] = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # A line cut by a crash can only be the last one; anything else is corruption.
                if line is not lines[-1]:
                    raise ValueError(f"{self.path}: corrupt line in the middle of the file") from None
                continue
            records[str(rec["problem_id"])] = rec
            good.append(line if line.endswith("\n") else line + "\n")
        if len(good) != len(lines):  # drop the torn tail so appends start on a clean line
            self.path.write_text("".join(good), encoding="utf-8")
        return records

    @property
    def done(self) -> dict[str, dict[str, Any]]:
        """problem_id -> saved record of every finished problem."""
        return self._records

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Save finished problems (flushed and fsynced before returning)."""
        records = list(records)
        if not records:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for rec in records:
            self._records[str(rec["problem_id"])] = rec
