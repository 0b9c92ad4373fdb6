"""Host-staging copy rates on one GPU: what the ``object_store`` weight sync pays per bucket.

That transport moves each bucket GPU -> pageable host memory (``tensor.cpu()``), into Ray's object store (a
host copy), out of it once per engine worker (another host copy) and host -> GPU. This script times the
copies that need a GPU, for the bucket sizes the sync uses, and a host ``memcpy`` for comparison; the planner's
sync-time estimate (``planner/sync_time.py``) takes its default rates from these numbers.

    python benchmarks/gpu/host_staging.py OUT.json [--sizes-mb 64,256,1024] [--repeats 7]

Reports the median of the repeats per copy and size, in GiB/s. Runs on CPU too (host copies only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch


def _median_gibs(copy: Callable[[], None], nbytes: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median rate of ``copy`` in GiB/s over ``repeats`` timed runs, after one untimed warm-up."""
    copy()
    sync()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        sync()
        rates.append(nbytes / (time.perf_counter() - t0) / 2**30)
    return statistics.median(rates)


def measure(size_mb: int, repeats: int) -> dict[str, float]:
    """Rates (GiB/s) of each staging copy for one bf16 bucket of ``size_mb`` MiB."""
    n = size_mb * 2**20 // 2
    host = torch.randn(n).to(torch.bfloat16)
    nbytes = host.numel() * host.element_size()
    out = {"host_memcpy": _median_gibs(lambda: host.clone(), nbytes, repeats, lambda: None)}
    if not torch.cuda.is_available():
        return out
    sync = torch.cuda.synchronize
    dev = host.cuda()
    pinned = torch.empty_like(host).pin_memory()
    out["d2h_pageable"] = _median_gibs(lambda: dev.cpu(), nbytes, repeats, sync)
    out["d2h_pinned"] = _median_gibs(lambda: pinned.copy_(dev, non_blocking=True), nbytes, repeats, sync)
    out["h2d_pageable"] = _median_gibs(lambda: dev.copy_(host), nbytes, repeats, sync)
    out["h2d_pinned"] = _median_gibs(lambda: dev.copy_(pinned, non_blocking=True), nbytes, repeats, sync)
    assert torch.equal(dev.cpu(), pinned), "a staged copy changed the bucket"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sizes-mb", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    res = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "repeats": args.repeats,
        "gib_per_s": {mb: measure(int(mb), args.repeats) for mb in args.sizes_mb.split(",")},
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
