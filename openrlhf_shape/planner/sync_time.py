"""Weight-sync time of a plan: bytes per sync from the model and the layout, copy rates per transport, and how
close a sync and its slowest bucket come to ``--rollout.weight_sync_timeout``.

Since issue 37 that flag bounds lack of progress (a sync fails when no bucket completed for that long), not the
sync: what can fail is a single bucket that takes close to the bound. A whole sync longer than the bound is
allowed, and reported as a note.

The transport is the trainer's own choice for the layout (``cluster/placement.py:resolve_weight_sync``). Every
engine worker receives the whole stream (it loads its TP shard from it). Per transport, per bucket of B bytes:

* ``object_store`` (colocated, engine workers on other GPUs): the sender copies the bucket GPU -> pinned host
  (staged, ``weight_sync/staging.py``) and ``ray.put``s it (a host copy); Ray ships it once to every other node
  hosting engine workers (over the sender node's link); each worker copies it host -> GPU. The queues let the
  stages overlap across buckets: the sync takes about the slowest stage's time for the whole model plus one
  bucket through the others.
* ``cuda_ipc`` (colocated, every worker on the sender's GPU): end to end at the measured rate.
* ``collective`` (NCCL, disjoint pools): a broadcast at the link between the sender and its farthest receiver
  (``--plan.link_gbs`` across nodes, ``--plan.nvlink_gbs`` within one): NOT measured, the planner's assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import Phase
from openrlhf_shape.planner.model import ModelShape

GIB = 2**30
DTYPE_BYTES = 2  # the sync sends bf16 on GPU (Platform.trainer_dtype)

# Copy rates in GiB/s MEASURED on one NVIDIA H200 (torch 2.11 + CUDA 13.0) on 2026-11-26, median of 7, per
# bucket size in MiB: docs/gpu_results.md, "Host staging" (raw: docs/gpu_results/host_staging_2026-11-26.json,
# made by benchmarks/gpu/host_staging.py). d2h_pinned: GPU -> pinned host (the staged sender);
# d2h_pageable: tensor.cpu() into fresh pageable memory (the sender before issue 37); host_memcpy: a host copy
# into fresh memory (ray.put into the object store); h2d_pageable: host -> GPU from pageable memory (an engine
# worker's copy out of the object store).
HOST_STAGING_GIBS: dict[int, dict[str, float]] = {
    64: {"d2h_pinned": 50.8, "d2h_pageable": 1.13, "host_memcpy": 8.8, "h2d_pageable": 9.1},
    256: {"d2h_pinned": 51.3, "d2h_pageable": 1.30, "host_memcpy": 10.1, "h2d_pageable": 7.2},
    1024: {"d2h_pinned": 51.5, "d2h_pageable": 1.41, "host_memcpy": 11.2, "h2d_pageable": 7.6},
}
# cuda_ipc end to end (our CudaIpcSender -> the worker extension's receive path in a second process on the same
# GPU, 216 MiB in 8 buckets of 32 MiB), MEASURED on the same H200 in the same run: docs/gpu_results.md (kit
# section cuda_ipc; raw docs/gpu_results/gpu_kit_2026-11-26_arch3.json, sections.cuda_ipc.GBps = 4.37 GiB/s).
CUDA_IPC_GIBS = 4.4
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
    pageable_seconds: float | None = None  # object_store staged through pageable memory, as before issue 37

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


def staging_rates(bucket_mb: float) -> dict[str, float]:
    """The measured row nearest ``bucket_mb`` (on a log scale)."""
    size = min(HOST_STAGING_GIBS, key=lambda mb: abs(math.log(mb / max(bucket_mb, 1e-3))))
    return HOST_STAGING_GIBS[size]


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
    common = dict(transport=transport, why=why, sync_bytes=w, receivers=receivers, buckets=buckets,
                  largest_bucket_bytes=largest)
    if transport == "object_store":
        return _object_store(w, largest, remote_nodes, staging_rates(bucket_mb), opt, common)
    if transport == "cuda_ipc":
        rate = CUDA_IPC_GIBS * GIB
        return SyncEstimate(seconds=w / rate, bucket_seconds=largest / rate,
                            how=f"{w / GIB:.1f} GiB at {CUDA_IPC_GIBS:g} GiB/s (CUDA IPC, measured on an H200)", **common)
    link = opt.link_gbs if remote_nodes else opt.nvlink_gbs
    rate = link * 1e9
    where = (f"--plan.link_gbs {opt.link_gbs:g} GB/s (receivers on {remote_nodes} other node(s))" if remote_nodes
             else f"--plan.nvlink_gbs {opt.nvlink_gbs:g} GB/s (every receiver on the sender's node)")
    return SyncEstimate(seconds=w / rate, bucket_seconds=largest / rate,
                        how=f"NCCL broadcast of {w / GIB:.1f} GiB at {where}; not measured", **common)


def _object_store(w: int, largest: int, remote_nodes: int, r: dict[str, float], opt: PlanOptions,
                  common: dict) -> SyncEstimate:
    """The staged object store: sender (stage + put), the network to the other nodes, every worker's upload."""
    def stages(nbytes: float, d2h: float) -> dict[str, float]:
        return {"stage": nbytes / (d2h * GIB), "put": nbytes / (r["host_memcpy"] * GIB),
                "ship": nbytes * remote_nodes / (opt.link_gbs * 1e9),  # one copy per other node, the sender's link
                "load": nbytes / (r["h2d_pageable"] * GIB)}  # every worker at once, each on its own GPU

    def groups(s: dict[str, float]) -> dict[str, float]:
        return {"sender": s["stage"] + s["put"], "ship": s["ship"], "load": s["load"]}  # the sender: one process

    def pipelined(d2h: float) -> float:
        """The slowest group for the whole model + one (largest) bucket through the others."""
        whole, one = groups(stages(w, d2h)), groups(stages(min(largest, w), d2h))
        neck = max(whole, key=whole.get)
        return whole[neck] + sum(one.values()) - one[neck]

    s = stages(w, r["d2h_pinned"])
    how = (f"{w / GIB:.1f} GiB: stage GPU -> pinned host {s['stage']:.1f} s ({r['d2h_pinned']:g} GiB/s) + ray.put "
           f"{s['put']:.1f} s ({r['host_memcpy']:g} GiB/s), to {remote_nodes} other node(s) {s['ship']:.1f} s "
           f"(--plan.link_gbs {opt.link_gbs:g}), each worker host -> GPU {s['load']:.1f} s ({r['h2d_pageable']:g} GiB/s); "
           "overlapped bucket by bucket; copy rates measured on an H200")
    return SyncEstimate(seconds=pipelined(r["d2h_pinned"]), bucket_seconds=sum(stages(largest, r["d2h_pinned"]).values()),
                        how=how, pageable_seconds=pipelined(r["d2h_pageable"]), **common)


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
    if est.pageable_seconds is not None:
        lines.append(f"  staged through pageable memory (tensor.cpu(), before issue 37) it would take {est.pageable_seconds:.0f} s")
    return lines
