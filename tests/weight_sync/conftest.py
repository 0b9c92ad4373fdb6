"""Shared fixtures of the weight-sync tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local 2-CPU Ray for the module (workers get this PYTHONPATH); one already running is used and left."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    yield
    if started:
        ray.shutdown()
