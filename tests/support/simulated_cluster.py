"""A Ray cluster whose nodes declare GPUs they do not have (``ray.cluster_utils.Cluster``): Ray
schedules the declared ``GPU`` resources, so placement, colocation pairing and the driver's platform
decision run here as on a GPU cluster (docs/architecture.md, "The cluster path without a cluster")."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

BOOTSTRAP_FILE = "/tmp/ray/ray_current_cluster"
# Ray ends a worker process idle for 1 s when its node holds more workers than a soft limit; here that
# restarted nearly every probe's process (measured: a second pass over the 32-GPU preset started 24 new
# worker processes, ~1 s of CPU each). Idle workers live as long as the simulated cluster instead.
SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 3_600_000}


def system_config() -> dict:
    """``SYSTEM_CONFIG``, except while coverage is measured in this process: a worker kept alive is killed at the
    cluster's shutdown before it writes its coverage data, so there Ray's default lets idle workers exit (and
    write it) as before, at the cost of the restarts."""
    try:
        import coverage
    except ImportError:
        return SYSTEM_CONFIG
    return {} if coverage.Coverage.current() is not None else SYSTEM_CONFIG


def forget_bootstrap_address(address: str) -> None:
    """The simulated head writes its address to /tmp/ray/ray_current_cluster, where any later plain
    ``ray.init()`` on this machine (other test modules, other jobs) would join it: remove it."""
    try:
        with open(BOOTSTRAP_FILE) as f:
            if f.read().strip() == address:
                os.remove(BOOTSTRAP_FILE)
    except OSError:
        pass


@contextlib.contextmanager
def simulated_gpu_cluster(nodes: int, gpus_per_node: int, cpus_per_node: int) -> Iterator[object]:
    """A head without GPUs and ``nodes`` nodes declaring ``gpus_per_node`` GPUs; this process joins
    it (workers get this PYTHONPATH) and leaves, shutting it down, on exit. Idle worker processes are
    kept for the cluster's life (``SYSTEM_CONFIG``). Yields the Cluster."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, num_gpus=0, include_dashboard=False,
                                                          _system_config=system_config()))
    forget_bootstrap_address(c.address)
    for _ in range(nodes):
        c.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
