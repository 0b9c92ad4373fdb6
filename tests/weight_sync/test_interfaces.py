"""What the weight sync needs of its hosts and what it runs without: the worker extension and the transports import
where Ray and vLLM cannot (the GPU kit runs the extension's code on a machine without them), and the driver starts
the senders through one typed interface. (Its floor, below ``cluster/`` and ``rollout/`` which import it, never the
reverse: ``tests/test_layers.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "openrlhf_shape"
STANDIN = REPO / "tests" / "gpu_kit" / "gpu_machine_standin"


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
