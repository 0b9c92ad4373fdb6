"""Benchmark problems from local files (.jsonl / .json / .parquet) or a Hugging Face dataset id.

Nothing is bundled: a benchmark is whatever file the user points at. An HF dataset id (``org/name``
or ``org/name@split``) is downloaded with ``huggingface_hub`` when the machine is online; its
parquet/jsonl/json files whose path mentions the split are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_shape.eval.config import BenchmarkSpec

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class Problem:
    """One benchmark problem. ``index`` is its row number in the source."""

    problem_id: str
    index: int
    question: str
    answer: str
    difficulty: Any = None


def _read_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: take the one list value
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: a JSON object must hold exactly one list of rows")
            data = lists[0]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {LOCAL_SUFFIXES}")


def _hf_dataset_files(repo_id: str, split: str) -> list[Path]:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers always brings it
        raise RuntimeError("reading an HF dataset id needs huggingface_hub; pass a local file instead") from exc
    try:
        root = Path(
            snapshot_download(
                repo_id, repo_type="dataset", allow_patterns=["*.parquet", "*.jsonl", "*.json"]
            )
        )
    except Exception as exc:
        raise RuntimeError(
            f"could not download HF dataset {repo_id!r} ({type(exc).__name__}: {exc}). Offline? "
            "Download it elsewhere and pass the local .jsonl/.json/.parquet file instead."
        ) from exc
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in LOCAL_SUFFIXES and p.is_file())
    files = [p for p in files if not p.name.startswith(".") and p.name != "dataset_infos.json"]
    chosen = [p for p in files if split in p.relative_to(root).as_posix()]
    if not chosen and len(files) == 1:
        chosen = files
    if not chosen:
        names = [p.relative_to(root).as_posix() for p in files]
        raise ValueError(f"HF dataset {repo_id!r} has no file for split {split!r}; files: {names}")
    return chosen


def read_rows(source: str) -> list[dict[str, Any]]:
    """All rows of a local file, or of an HF dataset id ``org/name[@split]`` (default split 'test')."""
    path = Path(os.path.expanduser(source))
    if path.exists():
        if path.is_dir():
            raise ValueError(f"{source}: is a directory; pass a .jsonl/.json/.parquet file")
        return _read_file(path)
    if path.suffix.lower() in LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"benchmark file {source!r} does not exist")
    repo_id, _, split = source.partition("@")
    if repo_id.count("/") != 1:
        raise ValueError(f"{source!r}: neither an existing file nor an HF dataset id 'org/name[@split]'")
    rows: list[dict[str, Any]] = []
    for f in _hf_dataset_files(repo_id, split or "test"):
        rows.extend(_read_file(f))
    return rows


def load_problems(spec: BenchmarkSpec, limit: int | None = None) -> list[Problem]:
    """Problems of one benchmark, with clear errors for missing keys or duplicate ids."""
    rows = read_rows(spec.source)
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"benchmark {spec.name!r}: {spec.source} has no rows")
    problems: list[Problem] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        for key, flag in ((spec.input_key, "input_key"), (spec.label_key, "label_key")):
            if key not in row:
                raise KeyError(
                    f"benchmark {spec.name!r} row {i}: no field {key!r} (its fields: {sorted(row)}); "
                    f"set {flag} (--benchmark_keys {spec.name}=INPUT_KEY,LABEL_KEY)"
                )
        pid = str(row[spec.id_key]) if spec.id_key and spec.id_key in row else str(i)
        if spec.id_key and spec.id_key not in row:
            raise KeyError(f"benchmark {spec.name!r} row {i}: no id field {spec.id_key!r}")
        if pid in seen:
            raise ValueError(f"benchmark {spec.name!r}: duplicate problem id {pid!r}")
        seen.add(pid)
        difficulty = row.get(spec.difficulty_key) if spec.difficulty_key else None
        problems.append(Problem(pid, i, str(row[spec.input_key]), str(row[spec.label_key]), difficulty))
    return problems
