"""A Ray actor that holds HF-named tensors and sends them through the real weight-sync senders:
the transport tests' stand-in for Megatron rank 0 (which sends through the same mixin and offers the
same ``endpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from openrlhf_shape.cluster.ray_placement import local_endpoint
from openrlhf_shape.weight_sync.sender import WeightSenderMixin


class TensorHolder(WeightSenderMixin):
    """``hf_dir``'s safetensors weights; ``perturb(seed)`` adds seeded noise (a "training step")."""

    def __init__(self, hf_dir: str):
        import glob

        from safetensors.torch import load_file

        self.weights: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
            self.weights.update(load_file(f))

    def endpoint(self) -> dict[str, Any]:
        """The holder's node id, IP and a free port (the collective transport's rendezvous), as rank 0's."""
        return local_endpoint()

    def perturb(self, seed: int, scale: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        for k, v in self.weights.items():
            v.add_(scale * torch.randn(v.shape, generator=gen, dtype=v.dtype))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.weights.items()}

    def model_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.weights.values())

    def _buckets(self, bucket_bytes: int, pause_s: float = 0.0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Copies made bucket by bucket, as the Megatron export makes them (``pause_s`` between
        buckets: a slow stream, for killing a receiver mid-sync)."""
        import time

        bucket, size = [], 0
        for name, t in self.weights.items():
            nb = t.numel() * t.element_size()
            if bucket and size + nb > bucket_bytes:
                yield bucket
                time.sleep(pause_s)
                bucket, size = [], 0
            bucket.append((name, t.detach().clone()))
            size += nb
        if bucket:
            yield bucket

    def push(self, payload, bucket_bytes: int, pause_s: float = 0.0) -> dict[str, float]:
        return self.stream_weights(self._buckets(bucket_bytes, pause_s), payload, model_bytes=self.model_bytes(),
                                   bucket_bytes=bucket_bytes)


@dataclass
class HolderRanks:
    """A :class:`TensorHolder` actor as the sync driver's sending ranks (``weight_sync.driver.SendingRanks``):
    one rank, the holder, ``pause_s`` seconds between buckets (a slow stream)."""

    holder: Any  # a Ray handle of TensorHolder
    pause_s: float = 0.0

    def start_weight_stream(self, sync_id: str, bucket_bytes: int) -> list:
        return [self.holder.push.remote(sync_id, bucket_bytes, self.pause_s)]
