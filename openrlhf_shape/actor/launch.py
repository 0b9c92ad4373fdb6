"""Launch N ranks of a function as subprocesses on a free port and collect their results (no Ray).

Used by the CPU tests and usable for CPU runs of the trainer:

    results = run_ranks("mypkg.mymod:scenario", world_size=2, kwargs={...}, timeout=300)

The target is ``"module:function"``; each rank calls
``function(rank=r, world_size=n, master_addr=..., master_port=..., **kwargs)`` in a fresh Python
process and its return value (pickled) becomes ``results[r]``. A failing rank raises
:class:`RankFailure` with the tail of every rank's log; a hang is killed after ``timeout``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional


class RankFailure(RuntimeError):
    """A rank exited non-zero or timed out; the message holds the logs' tails."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` ("" = every interface: a rendezvous other
    nodes connect to). The one helper for rendezvous ports (subprocess ranks, Ray rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_ranks(
    target: str,
    world_size: int,
    *,
    kwargs: Optional[dict] = None,
    timeout: float = 600.0,
    env: Optional[dict] = None,
    threads_per_rank: int = 1,
    extra_pythonpath: Optional[list[str]] = None,
) -> list[Any]:
    """Run ``target`` on ``world_size`` ranks; return their results in rank order."""
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="shape_ranks_")
    with open(os.path.join(workdir, "kwargs.pkl"), "wb") as f:
        pickle.dump(kwargs or {}, f)
    rank_env = _rank_env(threads_per_rank, extra_pythonpath, env)
    procs, logs = [], []
    for rank in range(world_size):
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w")
        logs.append(log)
        cmd = [sys.executable, "-m", "openrlhf_shape.actor.launch", target, workdir, str(rank), str(world_size), str(port)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env))
    try:
        failed = _wait_for_ranks(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for log in logs:
            log.close()
    if failed:
        tails = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"rank{rank}.log")) as f:
                tails.append(f"--- rank {rank} ---\n" + f.read()[-4000:])
        raise RankFailure(f"{target} on {world_size} ranks: {failed}\n" + "\n".join(tails))
    results = []
    for rank in range(world_size):
        with open(os.path.join(workdir, f"result{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _rank_env(threads_per_rank: int, extra_pythonpath: Optional[list[str]], env: Optional[dict]) -> dict:
    """This process's environment with the ranks' thread counts, the repository first on PYTHONPATH, then ``env``."""
    base_env = dict(os.environ)
    base_env.update(
        OMP_NUM_THREADS=str(threads_per_rank),
        MKL_NUM_THREADS=str(threads_per_rank),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [repo_root, *(extra_pythonpath or []), base_env.get("PYTHONPATH", "")]
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    base_env.update(env or {})
    return base_env


def _wait_for_ranks(procs: list[subprocess.Popen], timeout: float) -> Optional[str]:
    """None once every rank exited 0; else why not (a rank exited non-zero, or ``timeout`` seconds passed)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            return f"rank(s) {[r for r, c in enumerate(codes) if c not in (None, 0)]} exited non-zero"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f}s"
        time.sleep(0.2)


def _main(argv: list[str]) -> None:
    target, workdir, rank, world_size, port = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    module_name, func_name = target.split(":", 1)
    with open(os.path.join(workdir, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, **kwargs)
    with open(os.path.join(workdir, f"result{rank}.pkl.part"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(workdir, f"result{rank}.pkl.part"), os.path.join(workdir, f"result{rank}.pkl"))


if __name__ == "__main__":
    _main(sys.argv[1:])
