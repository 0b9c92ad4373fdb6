"""The object-store sender's host staging (``weight_sync/staging.py``): on a GPU platform every bucket is packed
into ONE reusable pinned buffer before ``ray.put`` (``tensor.cpu()`` into fresh pageable memory ran at 1.1-1.4
GiB/s on an H200, a copy into pinned memory at ~51 GiB/s: docs/gpu_results.md). Here, without CUDA, the same code
runs on an unpinned buffer (pinning is the only GPU step):

* Ray copies a staged view into the object store at ``ray.put``: the buffer may be overwritten by the next
  bucket while receivers have not read the previous one (the invariant buffer reuse rests on);
* the engine workers' receiving code (``ObjectStore.stream``) gets every tensor bit for bit as sent, with two
  buckets queued unread while the buffer was overwritten by later ones;
* one buffer serves every bucket of every sync (allocated once at the bucket limit; a bucket above the limit,
  a single large tensor, grows it once);
* the platform decides: the driver hands ``Platform.pin_memory`` to the sender's part; without it (CPU) the
  tensors are put as before.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from openrlhf_shape.weight_sync import QUEUE_DEPTH  # noqa: E402
from openrlhf_shape.weight_sync.base import Receiver  # noqa: E402
from openrlhf_shape.weight_sync.object_store import ObjectStore, ObjectStoreSender, make_queue  # noqa: E402
from openrlhf_shape.weight_sync.progress import ProgressReporter  # noqa: E402
from openrlhf_shape.weight_sync.staging import HostStaging  # noqa: E402

LIMIT = 64 << 10  # bucket limit of these tests, bytes


def make_bucket(seed: int, n: int = 3, numel: int = 3000) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes as an export carries them (bf16 weights, fp32 norms, an int buffer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = torch.randn(numel // (i + 1), generator=g)
        t = (t.to(torch.bfloat16) if i % 3 == 0 else t if i % 3 == 1 else (t * 1000).to(torch.int64)).reshape(-1, 1)
        out.append((f"s{seed}.t{i}", t))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("nbytes", [1 << 10, 4 << 20])  # inlined by Ray, and in the shared object store
def test_ray_put_copies_a_staged_view_before_it_returns(ray_local, nbytes: int) -> None:
    buf = torch.empty(2 * nbytes, dtype=torch.uint8)
    buf[:nbytes].copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    want = buf[:nbytes].clone()
    ref = ray.put((b"index", buf[:nbytes].numpy()))
    buf.fill_(7)  # the next bucket overwrites the buffer
    index, got = ray.get(ref)
    assert index == b"index" and got.shape == (nbytes,)  # the view, not the whole buffer
    assert torch.equal(torch.from_numpy(got.copy()), want)


class _Collect(threading.Thread):
    """One engine worker's receiving code (``ObjectStore.stream``) on its queue, collecting the tensors; the
    worker is what that code reads of vLLM's (its rank and device)."""

    def __init__(self, queue):
        super().__init__(daemon=True)
        self.state = Receiver(queue, ProgressReporter(None, "engine 0 worker 0"))
        self.got: list[tuple[str, torch.Tensor]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            worker = SimpleNamespace(rank=0, device=torch.device("cpu"))
            self.got = [(n, t.clone()) for n, t in ObjectStore.stream(worker, self.state, 60.0)]
        except BaseException as e:  # surfaced by the test
            self.error = e


def _sync(sender: ObjectStoreSender, queues: list, buckets: list) -> list[list[tuple[str, torch.Tensor]]]:
    """One sync: the first QUEUE_DEPTH buckets are queued before any receiver reads (the buffer is overwritten
    under them), then the receivers start and the rest streams."""
    sender.begin(LIMIT)
    for b in buckets[:QUEUE_DEPTH]:
        sender.send(b)
    readers = [_Collect(q) for q in queues]
    for r in readers:
        r.start()
    for b in buckets[QUEUE_DEPTH:]:
        sender.send(b)
    sender.finish()
    for r in readers:
        r.join(60)
        assert r.error is None, r.error
    return [r.got for r in readers]


def test_staged_buckets_arrive_bit_for_bit_through_one_reused_buffer(ray_local) -> None:
    queues = [make_queue(QUEUE_DEPTH) for _ in range(2)]
    staging = HostStaging(pin=False)
    sender = ObjectStoreSender(queues, 60.0, staging)
    try:
        for sync in range(2):
            buckets = [make_bucket(10 * sync + k) for k in range(5)]
            sent = [(n, t.clone()) for b in buckets for n, t in b]
            for got in _sync(sender, queues, buckets):
                assert [n for n, _ in got] == [n for n, _ in sent]
                for (n, a), (_, b) in zip(sent, got):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b)), n
            if sync == 0:
                ptr = staging.buffer.data_ptr()
            assert staging.allocations == 1 and staging.capacity == LIMIT and staging.buffer.data_ptr() == ptr
            assert sender.stats.extra["sync/staging_allocations"] == 1.0
        # a single tensor above the limit forms its own bucket: the buffer grows once, then serves it again
        big = [[("big", torch.randn(LIMIT // 2))]] + [make_bucket(99)]
        for _ in range(2):
            got = _sync(sender, queues, big + [make_bucket(98)])
            assert torch.equal(bits(got[0][0][1]), bits(big[0][0][1]))
            assert staging.allocations == 2 and staging.capacity == 2 * LIMIT
    finally:
        for q in queues:
            ray.kill(q.actor)


def test_the_platform_decides_whether_buckets_are_staged(ray_local) -> None:
    """``EngineWeightSync(pin_memory=Platform.pin_memory)`` -> the sender's part -> a pinned staging buffer (GPU);
    without it the tensors are put as before (CPU). Pinned memory needs CUDA: only the decision runs here."""
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    for platform, staged in ((gpu_platform(), True), (cpu_platform(), False)):
        transport = ObjectStore([None], engine_tp=1, backend=platform.collective_backend, timeout_s=5.0,
                                pin_memory=platform.pin_memory)
        try:
            sender_part, _ = transport.parts(sender=None)
            sender = ObjectStore.sender_for(sender_part, 5.0)
            assert (sender.staging is not None) == staged
            if staged:
                assert sender.staging.pin and sender.staging.buffer is None  # allocated at the first bucket
        finally:
            transport.close()
