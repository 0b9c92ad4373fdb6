"""The sending side as a mixin for the actor that produces full HF-named tensors (Megatron or DeepSpeed
rank 0; in the transport tests a plain tensor holder): one sender per connected sync (made by its transport),
and one streamed sync with the sender's memory high-water mark.

The host actor also offers ``endpoint() -> {"node_id", "ip", "port"}`` (its node and a free port there): the
collective transport's rendezvous. It is the host's (``cluster/rank_group.py:RankActor``, whose rank 0 serves
the torch.distributed rendezvous by it too), so this package asks nothing of ``cluster/``."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from openrlhf_shape.weight_sync.base import RssSampler, transport_class


class WeightSenderMixin:
    """Methods for a Ray actor that sends weights (the actor also offers ``endpoint``: see the module)."""

    def init_weight_sender(self, transport: str, sync_id: str, part: Any, timeout_s: float) -> bool:
        """Make and keep the sender of sync ``sync_id`` from its transport's part (for the collective
        transport this joins the group: it returns when every engine worker joined)."""
        senders = self.__dict__.setdefault("_weight_senders", {})
        senders[sync_id] = transport_class(transport, part).make_sender(part, timeout_s)
        return True

    def drop_weight_sender(self, sync_id: str) -> bool:
        """Forget the sender of sync ``sync_id`` (its group re-formed or closed; ``driver.EngineWeightSync.close``):
        what it holds goes (a collective's sockets close, so members still waiting in it fail at once)."""
        sender = self.__dict__.get("_weight_senders", {}).pop(sync_id, None)
        if sender is not None:
            sender.close()
        return sender is not None

    def stream_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], sync_id: str,
                       model_bytes: int | None = None, bucket_bytes: int | None = None) -> dict[str, float]:
        """Send every bucket as it comes out of ``buckets`` (``bucket_bytes``: their limit, which sizes a host
        staging buffer; None: sized by the buckets); metrics of this sync (bytes, MB/s, peak in-flight bucket
        bytes, peak RSS growth of this process, both relative to the model)."""
        sender = self.__dict__.get("_weight_senders", {}).get(sync_id)
        if sender is None:
            raise RuntimeError(f"weight sync {sync_id!r} before init_weight_sender (connect the sync first)")
        with RssSampler() as rss:
            try:
                sender.begin(bucket_bytes)
                for bucket in buckets:
                    sender.send(bucket)
                stats = sender.finish()
            finally:
                sender.progress.stop()  # a failed sync: no heartbeat past it
        out = stats.as_metrics()
        out["sync/sender_peak_rss_delta_bytes"] = float(rss.peak_delta)
        total = float(model_bytes or stats.bytes or 1)
        out["sync/sender_peak_inflight_over_model"] = stats.peak_inflight_bytes / total
        out["sync/sender_peak_rss_delta_over_model"] = rss.peak_delta / total
        return out
