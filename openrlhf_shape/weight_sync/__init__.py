"""Streamed weight sync from the sending rank into every vLLM engine worker: one :class:`Transport`
interface (``base.py``), one module per transport, registered by name in :data:`TRANSPORTS` with what it needs
of the layout and its rough cost (``auto``'s choice: :func:`choose_transport`); the sending actor's side (``sender.py``) and the driver's (``driver.py``).
The receiving side runs inside vLLM's workers: ``openrlhf_shape/rollout/worker_ext.py``. The design:
``openrlhf_shape/weight_sync/README.md``."""

from openrlhf_shape.weight_sync import collective, cuda_ipc, object_store  # noqa: F401  (register)
from openrlhf_shape.weight_sync.base import (
    DEFAULT_TIMEOUT_S,
    FLAG,
    QUEUE_DEPTH,
    TRANSPORTS,
    RssSampler,
    SyncCost,
    SyncLayout,
    SyncSize,
    SyncStats,
    Transport,
    WeightSender,
    choose_transport,
    get_or_raise,
    pack_bucket,
    put_or_raise,
    unpack_bucket,
)

__all__ = ["DEFAULT_TIMEOUT_S", "FLAG", "QUEUE_DEPTH", "TRANSPORTS", "RssSampler", "SyncCost", "SyncLayout", "SyncSize",
           "SyncStats", "Transport", "WeightSender", "choose_transport", "get_or_raise", "pack_bucket", "put_or_raise",
           "unpack_bucket"]
