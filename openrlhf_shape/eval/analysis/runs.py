"""Reading training runs: ``run.json`` + ``metrics.jsonl`` (one JSON object per step), plus an
optional evaluation report of the run's final model.

Run directory layout (written by the trainer)::

    run.json        {"estimator": "shape"|"mrt"|"grpo", "name": str, "config": {...},
                     "code": [{"from_step": int, "commit": sha, "dirty": bool}, ...] (one per resumed segment)}
    metrics.jsonl   {"step": int, "time": float, "rollout/accuracy": float, ...} per step
    eval/report.json  (optional) ``openrlhf-shape eval --out_dir <run>/eval`` of the final model

A torn last line (a run still writing) is skipped; a step logged twice (resume) keeps its last record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EVAL_REPORT_CANDIDATES = ("eval/report.json", "report.json")


def saved_value(config: dict[str, Any], *paths: str, default: Any = None) -> Any:
    """The first of the dotted ``paths`` present in a saved config (``run.json``'s ``config``).

    Name the flag = path location first (``train.num_steps``), then where older run directories keep it
    (``trainer.num_steps``), so one reader serves run directories of every layout."""
    for path in paths:
        node: Any = config
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            return node
    return default


@dataclass
class Run:
    """One run. ``records``: per-step metric dicts sorted by step."""

    path: str
    label: str
    estimator: str
    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    eval_report: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> np.ndarray:
        return np.asarray([r["step"] for r in self.records], dtype=np.int64)

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the steps that logged ``key`` as a number (others skipped)."""
        pts = [(r["step"], float(r[key])) for r in self.records if isinstance(r.get(key), (int, float))]
        if not pts:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        s, v = zip(*pts)
        return np.asarray(s, np.int64), np.asarray(v, np.float64)

    def window(self, which: str, size: int) -> list[dict[str, Any]]:
        """The first or last ``size`` step records."""
        if which == "first":
            return self.records[:size]
        if which == "last":
            return self.records[-size:] if size > 0 else []
        raise ValueError(f"window must be 'first' or 'last', got {which!r}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, sorted by step, one per step (the last one logged wins)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # torn tail of a run that is still writing
            raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
        if "step" not in rec:
            raise ValueError(f"{path}:{i + 1}: record without 'step'")
        by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def load_run(run_dir: str | Path, label: str | None = None, eval_report: str | Path | None = None) -> Run:
    """Load one run directory (see module docstring)."""
    d = Path(run_dir)
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{d}: no metrics.jsonl (is this a training run directory?)")
    meta: dict[str, Any] = {}
    if (d / "run.json").is_file():
        meta = json.loads((d / "run.json").read_text())
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics}: no step records")
    estimator = str(meta.get("estimator", "unknown")).lower()
    name = str(meta.get("name") or d.name)
    report = None
    if eval_report is not None:
        p = Path(eval_report)
        report = json.loads((p / "report.json" if p.is_dir() else p).read_text())
    else:
        for cand in EVAL_REPORT_CANDIDATES:
            if (d / cand).is_file():
                report = json.loads((d / cand).read_text())
                break
    return Run(str(d), label or name, estimator, name, dict(meta.get("config", {})), records, report)


def load_eval_report(path: str | Path) -> dict[str, Any]:
    """An ``EvalReport`` JSON (a report.json or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no eval report.json (run `openrlhf-shape eval --out_dir ...` first)")
    return json.loads(p.read_text())


def unique_labels(labels: list[str]) -> list[str]:
    """Make labels unique by suffixing repeats with #2, #3, ..."""
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
    return out
