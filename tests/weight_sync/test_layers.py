"""The weight sync's place in the import layers. ``weight_sync/`` imports no other ``openrlhf_shape`` package:
the rank group (``cluster/``) and the engines' worker extension (``rollout/worker_ext.py``) import it, never the
reverse (its sending mixin once asked ``cluster/`` for the rendezvous endpoint; the host actor offers that now).
``rollout/`` does not import ``cluster/``. The worker extension and the transports import where Ray and vLLM
cannot (the GPU kit runs the extension's code on a machine without them)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "openrlhf_shape"
STANDIN = REPO / "tests" / "gpu_kit" / "gpu_machine_standin"


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _imports_of(folder: str) -> dict[str, set[str]]:
    """``openrlhf_shape`` modules imported by each file under ``openrlhf_shape/<folder>``."""
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, folder
    return {f.relative_to(PKG).as_posix(): {m for m in _imported_modules(f) if m.startswith("openrlhf_shape")}
            for f in files}


def test_weight_sync_imports_no_other_package() -> None:
    upward = {f: sorted(m for m in mods if not m.startswith("openrlhf_shape.weight_sync"))
              for f, mods in _imports_of("weight_sync").items()}
    upward = {f: m for f, m in upward.items() if m}
    assert not upward, f"weight_sync/ imports upward: {upward}"


def test_rollout_does_not_import_cluster() -> None:
    up = {f: sorted(m for m in mods if m.startswith("openrlhf_shape.cluster")) for f, mods in _imports_of("rollout").items()}
    up = {f: m for f, m in up.items() if m}
    assert not up, f"rollout/ imports cluster/: {up}"


@pytest.mark.parametrize("module", ["openrlhf_shape.rollout.worker_ext", "openrlhf_shape.weight_sync",
                                    "openrlhf_shape.weight_sync.sender"])
def test_imports_without_ray_or_vllm(module: str) -> None:
    """As on the lent GPU machine (``tests/gpu_kit/gpu_machine_standin``): Ray and vLLM cannot be imported."""
    path = os.pathsep.join(p for p in (str(STANDIN), str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_rank_group_and_the_holder_are_the_drivers_sending_ranks() -> None:
    """The driver starts the senders through one typed interface (``SendingRanks``), not a callback: the
    lifecycle hands it the rank group, the transport tests a tensor holder."""
    import inspect

    from openrlhf_shape.cluster.rank_group import RankGroup
    from openrlhf_shape.weight_sync.driver import EngineWeightSync, SendingRanks
    from support.weight_holder import HolderRanks

    want = inspect.signature(SendingRanks.start_weight_stream)
    for cls in (RankGroup, HolderRanks):
        assert inspect.signature(cls.start_weight_stream) == want, cls.__name__
    assert list(inspect.signature(EngineWeightSync.sync).parameters) == ["self", "ranks", "bucket_bytes", "step"]
    lifecycle = (PKG / "cluster" / "lifecycle.py").read_text()
    assert "lambda" not in lifecycle, "cluster/lifecycle.py hands the driver a callback again"
