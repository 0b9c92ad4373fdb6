"""Launch N ranks of a function as subprocesses on a free port and collect their results (no Ray).

Used by the CPU tests and usable for CPU runs of the trainer:

    results = run_ranks("mypkg.mymod:scenario", world_size=2, kwargs={...}, timeout=300)

The target is ``"module:function"``; each rank calls
``function(rank=r, world_size=n, master_addr=..., master_port=..., **kwargs)`` in a fresh Python
process and its return value (pickled) becomes ``results[r]``. A failing rank raises
:class:`RankFailure` with the tail of every rank's log; a hang is killed after ``timeout``.

``spawner`` starts each rank process; the product's is :func:`spawn_subprocess` (a fresh interpreter). The test
suite passes one that forks ranks from a process that imported torch, Megatron and DeepSpeed once
(``tests/support/preload.py``): the same rank body, files and failures, 4-6 s of imports less per rank.
"""

from __future__ import annotations

import importlib
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional


class RankFailure(RuntimeError):
    """A rank exited non-zero, timed out or could not be started; the message says which and why."""


def spawn_subprocess(argv: list[str], env: dict, log_path: str) -> subprocess.Popen:
    """Start one rank as a fresh interpreter running :func:`run_rank` on ``argv`` with ``env``, its stdout and stderr
    into ``log_path``."""
    with open(log_path, "w") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "openrlhf_shape.actor.launch", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env)


# (argv, env, log path) -> a started rank answering Popen's poll(), kill() and wait()
Spawner = Callable[[list[str], dict, str], Any]


# Ports below Linux's ephemeral range (32768-60999, where the kernel draws the source ports of
# outgoing connections: Ray opens hundreds) and above Ray's worker ports (10002-19999).
_PORT_RANGE = (20000, 32767)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` ("" = every interface: a rendezvous other
    nodes connect to). The one helper for rendezvous ports (subprocess ranks, Ray rank 0).

    Drawn at random from ``_PORT_RANGE`` so that neither outgoing connections nor Ray's workers take
    it between this check and the rendezvous; another process can still win the race, which
    ``run_ranks`` answers by retrying on a new port."""
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randint(*_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is crowded: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PORT_ATTEMPTS = 3


def run_ranks(
    target: str,
    world_size: int,
    *,
    kwargs: Optional[dict] = None,
    timeout: float = 600.0,
    env: Optional[dict] = None,
    threads_per_rank: int = 1,
    extra_pythonpath: Optional[list[str]] = None,
    spawner: Spawner = spawn_subprocess,
) -> list[Any]:
    """Run ``target`` on ``world_size`` ranks, each started by ``spawner``; return their results in rank order.

    A launch whose rendezvous port was taken by another process in the meantime (rank 0 fails
    with EADDRINUSE before any work) is retried on a new port, ``_PORT_ATTEMPTS`` times in all."""
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    rank_env = _rank_env(threads_per_rank, extra_pythonpath, env)
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        workdir = tempfile.mkdtemp(prefix="shape_ranks_")
        failed = _launch_once(target, world_size, workdir, free_port(), kwargs or {}, rank_env, timeout, spawner)
        if not failed:
            break
        tails = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"rank{rank}.log")) as f:
                tails.append(f"--- rank {rank} ---\n" + f.read()[-4000:])
        if "EADDRINUSE" in tails[0] and attempt < _PORT_ATTEMPTS:
            print(f"[launch] {target}: the rendezvous port was taken meanwhile; retrying on a new one", file=sys.stderr)
            continue
        raise RankFailure(f"{target} on {world_size} ranks: {failed}\n" + "\n".join(tails))
    results = []
    for rank in range(world_size):
        with open(os.path.join(workdir, f"result{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _launch_once(target: str, world_size: int, workdir: str, port: int, kwargs: dict, rank_env: dict,
                 timeout: float, spawner: Spawner) -> Optional[str]:
    """Start every rank on ``port`` with ``spawner``, wait for them; None once every rank exited 0, else why not (a
    rank exited non-zero, or ``timeout`` seconds passed; logs in ``workdir``)."""
    with open(os.path.join(workdir, "kwargs.pkl"), "wb") as f:
        pickle.dump(kwargs, f)
    procs: list = []
    try:
        for rank in range(world_size):
            argv = [target, workdir, str(rank), str(world_size), str(port)]
            procs.append(spawner(argv, rank_env, os.path.join(workdir, f"rank{rank}.log")))
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
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


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


def run_rank(argv: list[str]) -> None:
    """One rank's body (``argv``: target, workdir, rank, world size, port): call the target with the pickled
    kwargs and pickle its result beside them. Run by a subprocess rank (``__main__``) and a forked one alike."""
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
    run_rank(sys.argv[1:])
