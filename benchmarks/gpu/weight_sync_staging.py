"""GPU check of issue 37's weight-sync changes (no Ray, no vLLM needed):

* ``staging``: the object-store sender's pinned staging buffer (``weight_sync/staging.py``) on real GPU buckets:
  the staged bytes equal the tensors', the buffer is pinned and allocated once for every bucket of two syncs,
  and its rate against ``tensor.cpu()`` (the sender before issue 37) on the same buckets;
* ``cuda_ipc_progress``: the cuda_ipc transport's two sides in two processes on one GPU, made through
  ``Transport.make_sender`` / ``open_receiver`` / ``stream`` with a progress board (``weight_sync/progress.py``):
  every tensor arrives equal, and the board shows both sides finished with every bucket counted.

    python benchmarks/gpu/weight_sync_staging.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import torch

N_BUCKETS, BUCKET_MIB = 8, 256


def _bucket(k: int) -> list[tuple[str, torch.Tensor]]:
    """~BUCKET_MIB MiB of bf16 tensors on the GPU, from a seed."""
    g = torch.Generator(device="cuda").manual_seed(k)
    rows = BUCKET_MIB * 2**20 // 2 // 4096 // 4
    return [(f"b{k}.t{i}", torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)) for i in range(4)]


def staging() -> dict:
    from openrlhf_shape.weight_sync.staging import HostStaging

    st = HostStaging(pin=True)
    out: dict = {"equal": True}
    staged_s = cpu_s = 0.0
    nbytes = 0
    for sync in range(2):
        for k in range(N_BUCKETS):
            b = _bucket(10 * sync + k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            index, view = st.stage(b, BUCKET_MIB << 20)
            dt_staged = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = [t.cpu() for _, t in b]  # the old sender's copy, and the reference bytes
            dt_cpu = time.perf_counter() - t0
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ref])
            out["equal"] &= bool(torch.equal(torch.from_numpy(view.copy()), flat))
            if sync == 1:  # timed on the second sync: the buffer exists (its allocation is once per run)
                staged_s, cpu_s, nbytes = staged_s + dt_staged, cpu_s + dt_cpu, nbytes + flat.numel()
    out.update(pinned=bool(st.buffer.is_pinned()), allocations=st.allocations, capacity=st.capacity,
               staged_gibs=nbytes / staged_s / 2**30, cpu_gibs=nbytes / cpu_s / 2**30)
    out["passed"] = out["equal"] and out["pinned"] and out["allocations"] == 1
    return out


def _sender(q, ack, address: dict) -> None:
    from openrlhf_shape.weight_sync.cuda_ipc import CudaIpc

    torch.cuda.set_device(0)
    s = CudaIpc.make_sender({"queues": [q], "acks": [ack], "progress": address, "member": "sender"}, 120.0)
    s.begin(64 << 20)
    for k in range(N_BUCKETS):
        s.send([(n, t[: t.shape[0] // 4]) for n, t in _bucket(k)])  # 64 MiB buckets
    s.finish()


def _receiver(q, ack, address: dict, result) -> None:
    from openrlhf_shape.weight_sync.cuda_ipc import CudaIpc

    torch.cuda.set_device(0)
    worker = SimpleNamespace(rank=0, device=torch.device("cuda", 0))
    state = CudaIpc.open_receiver(worker, {"queues": [q], "acks": [ack], "progress": address, "member": "engine 0"}, 120.0)
    want = {n: t[: t.shape[0] // 4] for k in range(N_BUCKETS) for n, t in _bucket(k)}
    bad, count = [], 0
    for name, t in CudaIpc.stream(worker, state, 120.0):
        count += 1
        if not torch.equal(t, want[name]):
            bad.append(name)
    result.put({"tensors": count, "mismatched": bad})


def cuda_ipc_progress() -> dict:
    import multiprocessing as mp

    from openrlhf_shape.weight_sync.progress import ProgressBoard

    board = ProgressBoard("127.0.0.1", ["sender", "engine 0 worker 0"])
    board.begin()
    ctx = mp.get_context("spawn")
    q, ack, result = ctx.Queue(maxsize=2), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(q, ack, board.address())),
             ctx.Process(target=_receiver, args=(q, ack, board.address(), result))]
    for p in procs:
        p.start()
    out = result.get(timeout=240)
    for p in procs:
        p.join(60)
    lines = {x.member: (x.done, x.doing) for x in board.lines()}
    out.update(lines={k: list(v) for k, v in lines.items()}, ticks=board.ticks(), exit_codes=[p.exitcode for p in procs])
    out["passed"] = (not out["mismatched"] and out["tensors"] == 4 * N_BUCKETS and out["exit_codes"] == [0, 0]
                     and lines == {"sender": (N_BUCKETS, "finished"), "engine 0 worker 0": (N_BUCKETS, "finished")})
    return out


def main() -> None:
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in (("staging", staging), ("cuda_ipc_progress", cuda_ipc_progress)):
        try:
            res[name] = fn()
        except Exception as e:  # reported, the other section still runs
            res[name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(res[name])[:2000], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
