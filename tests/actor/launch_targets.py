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
