"""Weight-sync time of a plan: bytes per sync from the model and the layout, copy rates per transport, and how
close a sync and its slowest bucket come to ``--rollout.weight_sync_timeout``.

Since issue 37 that flag bounds lack of progress (a sync fails when no bucket completed for that long), not the
sync: what can fail is a single bucket that takes close to the bound. A whole sync longer than the bound is
allowed, and reported as a note.

The transport is the trainer's own choice for the layout (``weight_sync.choose_transport``, through
``cluster/placement.py:resolve_weight_sync``); its rough cost is its own (``Transport.cost``: measured copy rates
where there are some, else the planner's assumed links, each saying which). Every engine worker receives the whole
stream (it loads its TP shard from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import Phase
from openrlhf_shape.planner.model import ModelShape
from openrlhf_shape.weight_sync import TRANSPORTS, SyncSize

GIB = 2**30
DTYPE_BYTES = 2  # the sync sends bf16 on GPU (Platform.trainer_dtype)
WARN_SHARE = 0.5  # a bucket (or a sync) taking this share of the bound or more is reported


@dataclass(frozen=True)
class SyncEstimate:
    transport: str
    why: str  # why the trainer picks it on this layout
    sync_bytes: int  # what the sender sends per sync (the whole model, bf16)
    receivers: int  # engine workers, each receiving the whole stream
    buckets: int
    largest_bucket_bytes: int
    seconds: float  # one sync
    bucket_seconds: float  # the largest bucket through every stage (the longest a healthy sync goes without progress)
    how: str
    note: str = ""  # the transport's extra line for the dry run

    def warnings(self, timeout_s: float) -> list[str]:
        """What the dry run says about ``--rollout.weight_sync_timeout`` ``timeout_s``."""
        out = []
        if self.bucket_seconds >= WARN_SHARE * timeout_s:
            out.append(f"weight sync: the largest bucket ({self.largest_bucket_bytes / GIB:.2f} GiB) takes ~"
                       f"{self.bucket_seconds:.1f} s, {self.bucket_seconds / timeout_s:.0%} of --rollout.weight_sync_timeout "
                       f"{timeout_s:g} s (the longest a sync may go without a bucket completing): raise "
                       "--rollout.weight_sync_timeout, or lower --vllm.weight_sync_bucket_mb (a single tensor larger "
                       "than the limit still forms a bucket of its own)")
        if self.seconds >= WARN_SHARE * timeout_s:
            out.append(f"weight sync: one sync takes ~{self.seconds:.0f} s, {self.seconds / timeout_s:.1f}x "
                       f"--rollout.weight_sync_timeout {timeout_s:g} s; allowed, since the flag bounds the time "
                       f"without progress (a bucket completes every ~{self.seconds / max(self.buckets, 1):.1f} s), "
                       "not the sync")
        return out


def largest_tensor_bytes(model: ModelShape) -> int:
    """The largest single HF tensor (it forms a bucket of its own when above the limit): the embedding or LM
    head, a dense MLP matrix, or the attention's q projection."""
    mats = [model.vocab * model.hidden, model.intermediate * model.hidden, model.q_dim * model.hidden]
    if model.is_moe:
        mats.append(model.moe_intermediate * model.hidden)
    return max(mats) * DTYPE_BYTES


def estimate_sync(model: ModelShape, placement, transport: str, why: str, bucket_mb: float,
                  opt: PlanOptions) -> SyncEstimate:
    """One sync of ``model`` on ``placement`` (a ``cluster.placement.PlacementPlan``) over ``transport``."""
    w = model.total_params() * DTYPE_BYTES
    limit = int(bucket_mb * 2**20)
    largest = max(limit, largest_tensor_bytes(model))
    buckets = max(1, math.ceil(w / limit))
    receivers = len(placement.engines)
    sender_node = placement.ranks[0].node
    remote_nodes = len({s.node for s in placement.engines} - {sender_node})
    cost = TRANSPORTS[transport].cost(SyncSize(w, largest, bucket_mb, remote_nodes, opt.link_gbs, opt.nvlink_gbs))
    return SyncEstimate(transport=transport, why=why, sync_bytes=w, receivers=receivers, buckets=buckets,
                        largest_bucket_bytes=largest, seconds=cost.seconds, bucket_seconds=cost.bucket_seconds,
                        how=cost.how, note=cost.note)


def weight_sync_phase(est: SyncEstimate, wake_s: float = 0.0) -> Phase:
    """The step's weight-sync phase from ``est``, plus ``wake_s`` of the engines' wake-up copy (sleep level 1,
    colocated)."""
    how = f"{est.transport}: {est.how}" + (f"; + engine wake-up {wake_s:.1f} s at --plan.pcie_gbs" if wake_s else "")
    return Phase("weight sync", est.seconds + wake_s, how)


def sync_lines(est: SyncEstimate | None, timeout_s: float) -> list[str]:
    """The dry run's weight-sync section."""
    if est is None:
        return ["weight sync estimate: n/a (CPU config: the measured copy rates describe a GPU node)"]
    lines = [f"weight sync estimate: {est.seconds:.1f} s per sync over {est.transport} ({est.why}); "
             f"{est.sync_bytes / GIB:.1f} GiB (params x {DTYPE_BYTES} B) to each of {est.receivers} engine worker(s), "
             f"~{est.buckets} buckets, the largest {est.largest_bucket_bytes / GIB:.2f} GiB ~{est.bucket_seconds:.1f} s; "
             f"--rollout.weight_sync_timeout {timeout_s:g} s bounds the time without a completed bucket",
             f"  {est.how}"]
    if est.note:
        lines.append(f"  {est.note}")
    return lines
