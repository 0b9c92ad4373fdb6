"""One reusable host buffer that the object-store sender packs each bucket into before ``ray.put``.

Why: on a GPU, ``tensor.cpu()`` copies into fresh pageable memory at 1.1-1.4 GiB/s, a copy into pinned memory at
~51 GiB/s (H200, ``docs/gpu_results.md``, "Host staging"). The buffer is allocated once, pinned where the
platform says so (``Platform.pin_memory``, handed by the driver), sized to the sync's bucket limit; it grows only
for a bucket above every earlier one (a single tensor larger than the limit forms its own bucket: the embedding
of a large vocabulary), and is then reused.

Reuse is safe because ``ray.put`` copies: it serialises the staged bytes (a numpy view, pickled out of band)
into the object store before it returns, so the next bucket may overwrite the buffer while receivers still hold
the previous object (``tests/weight_sync/test_host_staging.py`` holds Ray to it).
"""

from __future__ import annotations

import json

import torch

from openrlhf_shape.weight_sync.base import Bucket, bucket_index, copy_into


class HostStaging:
    """The sender's staging buffer. ``pin``: page-locked (GPU platforms; needs CUDA). ``allocations`` counts the
    buffers ever made (1 once the largest bucket has been seen)."""

    def __init__(self, pin: bool):
        self.pin = bool(pin)
        self.buffer: torch.Tensor | None = None  # uint8 [capacity bytes]
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else int(self.buffer.numel())

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least ``nbytes`` (a new allocation only when it does not)."""
        if nbytes > self.capacity:
            self.buffer = None  # free the old one first: the two would otherwise coexist
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1

    def stage(self, bucket: Bucket, bucket_limit: int | None = None):
        """(JSON index, numpy uint8 view [bucket bytes] of the buffer) with the bucket packed in (the wire format of
        ``base.pack_bucket``). The view is valid until the next ``stage``: put it into the object store first."""
        index, total = bucket_index(bucket)
        self.reserve(max(total, int(bucket_limit or 0)))
        flat = self.buffer[:total]
        on_gpu = any(t.is_cuda for _, t in bucket)
        copy_into(bucket, index, flat, non_blocking=self.pin and on_gpu)
        if self.pin and on_gpu:
            torch.cuda.synchronize()  # the device-to-host copies were queued asynchronously
        return json.dumps(index).encode(), flat.numpy()
