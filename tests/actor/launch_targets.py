"""Rank functions for tests/actor/test_launch.py (imported by the rank subprocesses)."""
from __future__ import annotations

import torch.distributed as dist


def rank_sum(rank: int, world_size: int, master_addr: str, master_port: int) -> int:
    """Join a gloo group on the given port and all-reduce the ranks: every rank returns sum(range(world))."""
    import torch

    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)
    t = torch.tensor([rank])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def whoami(rank: int, world_size: int, master_addr: str, master_port: int) -> dict:
    """What a rank process sees of its launch: parent, environment, path, working directory, argv, threads, open
    file descriptors; and a line on stdout (into its log)."""
    import os
    import sys

    import torch

    print(f"rank {rank} of {world_size} reporting", flush=True)
    return {"pid": os.getpid(), "ppid": os.getppid(), "env": dict(os.environ), "path": list(sys.path),
            "cwd": os.getcwd(), "argv0": sys.argv[0], "target": sys.argv[1], "threads": torch.get_num_threads(),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")), "modules": sorted(sys.modules)}


def fail_on_rank_one(rank: int, world_size: int, master_addr: str, master_port: int) -> int:
    """Rank 1 prints a line and raises; the others return their rank."""
    if rank == 1:
        print("rank 1 is about to fail", flush=True)
        raise ValueError("boom from rank 1")
    return rank


def hang(rank: int, world_size: int, master_addr: str, master_port: int, pid_dir: str) -> None:
    """Write this rank's pid and parent's pid to ``pid_dir/rank<r>``, then sleep for an hour."""
    import os
    import time

    with open(os.path.join(pid_dir, f"rank{rank}.part"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(os.path.join(pid_dir, f"rank{rank}.part"), os.path.join(pid_dir, f"rank{rank}"))
    time.sleep(3600)


def kill_my_parent(rank: int, world_size: int, master_addr: str, master_port: int, pid_dir: str) -> None:
    """Write this rank's pid to ``pid_dir/rank<r>``, kill the process that started it (for a forked rank: the
    zygote), then sleep for an hour."""
    import os
    import signal
    import time

    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)


def start_a_manager(rank: int, world_size: int, master_addr: str, master_port: int, pid_dir: str) -> int:
    """Start a multiprocessing ``Manager`` (a child process, as a Megatron checkpoint save does) and return without
    shutting it down: the rank's exit must. Its pid goes to ``pid_dir/manager<r>``."""
    import multiprocessing
    import os

    manager = multiprocessing.get_context("spawn").Manager()
    pid = manager._process.pid
    with open(os.path.join(pid_dir, f"manager{rank}"), "w") as f:
        f.write(str(pid))
    globals()["_KEPT"] = manager  # alive until the process ends
    return os.getppid()
