"""The sending side as a mixin for the actor that produces full HF-named tensors (Megatron rank 0;
in the transport tests a plain tensor holder): rendezvous endpoint, transport set-up, and one
streamed sync with the sender's memory high-water mark."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from openrlhf_shape.cluster.weight_sync import (
    CollectiveSender,
    CudaIpcSender,
    ObjectStoreSender,
    RssSampler,
    WeightSender,
)


class WeightSenderMixin:
    """Methods for a Ray actor that sends weights (``endpoint`` also serves the Megatron rendezvous)."""

    def endpoint(self) -> dict[str, Any]:
        """This actor's node id, node IP and a free port there."""
        from openrlhf_shape.cluster.ray_placement import local_endpoint

        return local_endpoint()

    def init_weight_sender(self, kind: str, info: dict) -> bool:
        """Collective: become rank 0 of the sync group (returns when every engine worker joined)."""
        if kind != "collective":
            raise ValueError(f"init_weight_sender is for the collective transport, got {kind!r}")
        device = "cuda" if info["backend"] == "nccl" else "cpu"  # the driver's Platform.collective_backend
        self._collective_sender = CollectiveSender(info["host"], int(info["port"]), int(info["world"]),
                                                   info["backend"], device, float(info.get("timeout_s", 600.0)))
        return True

    def _weight_sender(self, payload: Any) -> WeightSender:
        if payload is None:
            sender = getattr(self, "_collective_sender", None)
            if sender is None:
                raise RuntimeError("collective weight sync before init_weight_sender")
            return sender
        if "acks" in payload:
            return CudaIpcSender(payload["queues"], payload["acks"])
        return ObjectStoreSender(payload["queues"])

    def stream_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], payload: Any,
                       model_bytes: int | None = None) -> dict[str, float]:
        """Send every bucket as it comes out of ``buckets``; metrics of this sync (bytes, MB/s,
        peak in-flight bucket bytes, peak RSS growth of this process, both relative to the model)."""
        sender = self._weight_sender(payload)
        with RssSampler() as rss:
            sender.begin()
            for bucket in buckets:
                sender.send(bucket)
            stats = sender.finish()
        out = stats.as_metrics()
        out["sync/sender_peak_rss_delta_bytes"] = float(rss.peak_delta)
        total = float(model_bytes or stats.bytes or 1)
        out["sync/sender_peak_inflight_over_model"] = stats.peak_inflight_bytes / total
        out["sync/sender_peak_rss_delta_over_model"] = rss.peak_delta / total
        return out
