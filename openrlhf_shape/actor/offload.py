"""Move a training rank's parameters, gradients and optimizer states to host memory and back
(colocation: vLLM needs the GPU memory while the rank does not train). Backend-neutral: each backend
says which tensors belong to which group (``megatron/offload.py``, ``zero/offload.py``: ``state_tensors``).

Works on storages, not tensors: parameters are views into contiguous buffers (Megatron DDP's, ZeRO's
flat groups; optimizer shards are views into those), so each distinct storage is copied to host
once and then resized to zero bytes; every view keeps pointing at its storage and sees the data
again after :meth:`StateOffloader.onload` resizes it back and copies the bytes in. On GPU the
host copies are pinned and the freed blocks go back to the driver (``torch.cuda.empty_cache``) so
vLLM can take them; on CPU the same code runs (host and "device" are one memory, so nothing is
saved, but the storages really are emptied: any use while offloaded fails loudly).

Host buffers are allocated once and reused by every later offload of the same storage (matched by
group, position and size): pinned memory is slow to allocate, and torch's pinned-host cache rounds
each request up and keeps the blocks, so fresh buffers every step held up to ~2x the states in pinned
RAM per rank. ``host_bytes_allocated`` counts what was ever allocated (it stops growing after the
first round trip).

Groups (offloaded/onloaded independently; a storage belongs to the first group that reaches it):
``params``, ``grads``, ``optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

GROUPS = ("params", "grads", "optimizer")


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor


@dataclass
class StateOffloader:
    """Per-group host copies of a rank's storages. ``offloaded`` lists the groups now on host."""

    on_gpu: bool = False  # the rank's Platform.on_gpu: pinned host copies, freed blocks back to the driver
    saved: dict[str, list[_Saved]] = field(default_factory=dict)
    host_bytes_allocated: int = 0  # host buffer bytes ever allocated (reuse keeps it at one copy of the states)
    _host: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (group, position) -> buffer

    @property
    def pin_memory(self) -> bool:
        return self.on_gpu

    @property
    def offloaded(self) -> set[str]:
        return set(self.saved)

    def offload(self, tensors: dict[str, list[torch.Tensor]], groups: Iterable[str] = GROUPS) -> int:
        """Copy each not yet offloaded group's storages to host and free them; returns bytes freed.

        ``tensors``: group -> the rank's tensors of that group (the backend's ``state_tensors``)."""
        groups = [g for g in groups if g not in self.saved]
        for g in groups:
            if g not in GROUPS:
                raise ValueError(f"unknown offload group {g!r}; choose from {GROUPS}")
        # A storage belongs to the first group (in GROUPS order) that reaches it, offloaded or not.
        owner: dict[int, str] = {}
        storages: dict[int, torch.UntypedStorage] = {}
        for g in GROUPS:
            for t in tensors[g]:
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() == 0 or key in owner:
                    continue
                owner[key] = g
                storages[key] = st
        freed = 0
        for g in groups:
            saved = []
            for key, st in storages.items():
                if owner[key] != g:
                    continue
                n = st.nbytes()
                host = self._host.get((g, len(saved)))  # kept for the next offload; allocated on first use
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
                    self._host[(g, len(saved))] = host
                    self.host_bytes_allocated += n
                host.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st), non_blocking=self.pin_memory)
                saved.append(_Saved(st, n, host))
            if self.pin_memory:
                torch.cuda.synchronize()
            for s in saved:
                s.storage.resize_(0)
                freed += s.nbytes
            self.saved[g] = saved
        if self.on_gpu:
            torch.cuda.empty_cache()
        return freed

    def onload(self, groups: Iterable[str] = GROUPS) -> int:
        """Restore offloaded groups (bit for bit); returns bytes restored."""
        restored = 0
        for g in list(groups):
            for s in self.saved.pop(g, []):
                s.storage.resize_(s.nbytes)
                torch.empty(0, dtype=torch.uint8, device=s.storage.device).set_(s.storage).copy_(
                    s.host, non_blocking=self.pin_memory)
                restored += s.nbytes
        if self.pin_memory:
            torch.cuda.synchronize()
        return restored
