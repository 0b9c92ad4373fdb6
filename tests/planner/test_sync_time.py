"""The dry run's weight-sync estimate (``planner/sync_time.py``) on the presets in ``configs/``: bytes per sync from
the model, the transport the trainer picks for each layout, the time from the rates measured on an H200 (worked
by hand for one preset per transport), and the warnings about ``--rollout.weight_sync_timeout`` (a bucket that
nears the progress bound; a sync longer than it, which is allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.cluster.placement import resolve_weight_sync
from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import PlanOptions, parse_plan_options
from openrlhf_shape.planner.plan import build_plan
from openrlhf_shape.weight_sync import SyncSize
from openrlhf_shape.weight_sync.cuda_ipc import CUDA_IPC_GIBS
from openrlhf_shape.weight_sync.object_store import HOST_STAGING_GIBS, staged_seconds, staging_rates

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
GPU_PRESETS = [p for p in PRESETS if not p.startswith("cpu-")]
GIB = 2**30


def plan_of(preset: str, *flags: str, plan_flags: tuple[str, ...] = ()):
    cfg = load_config(str(REPO / "configs" / preset), list(flags), check_paths=False)  # as the dry run loads it
    return cfg, build_plan(cfg, parse_plan_options(list(plan_flags)), f"configs/{preset}")


def dry_run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["train", *argv, "--dry_run"])
    except SystemExit as exc:
        return (exc.code if isinstance(exc.code, int) else 1), capsys.readouterr().out + str(exc.code)
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_has_a_sync_estimate_on_the_trainers_transport(preset: str) -> None:
    cfg, plan = plan_of(preset)
    est = plan.sync
    assert est is not None
    assert (est.transport, est.why) == resolve_weight_sync(cfg.rollout.weight_sync, plan.placement, on_gpu=True)
    assert est.sync_bytes == plan.model.total_params() * 2  # bf16, the whole model once per sync
    assert est.receivers == cfg.vllm.num_engines * cfg.vllm.tensor_parallel_size
    assert est.largest_bucket_bytes >= cfg.vllm.weight_sync_bucket_mb << 20
    assert est.largest_bucket_bytes >= plan.model.vocab * plan.model.hidden * 2  # the embedding is one tensor
    assert 0 < est.bucket_seconds < est.seconds < plan.sync_timeout_s
    assert plan.sync_warnings == []  # no preset's bucket nears the 600 s bound


def test_object_store_worked_by_hand_on_the_32b_preset() -> None:
    """Qwen3-32B, 4 nodes, colocated, 8 engines x TP 4 -> object_store; 256 MB buckets -> the 256 MiB row."""
    cfg, plan = plan_of("qwen3-32b.yaml")
    est = plan.sync
    assert est.transport == "object_store" and est.receivers == 32
    w = plan.model.total_params() * 2
    assert 61.0 < w / GIB < 61.1
    r = HOST_STAGING_GIBS[256]
    assert staging_rates(256) is r and staging_rates(100) is HOST_STAGING_GIBS[64] and staging_rates(700) is HOST_STAGING_GIBS[1024]
    emb = plan.model.vocab * plan.model.hidden * 2  # 151936 x 5120 x 2 B: the largest bucket
    assert est.largest_bucket_bytes == emb
    link = PlanOptions().link_gbs * 1e9
    sender, ship, load = w / (51.3 * GIB) + w / (10.1 * GIB), 3 * w / link, w / (7.2 * GIB)  # 3 other nodes
    assert load > sender and load > ship  # every worker's host -> GPU copy is the bottleneck
    one = dict(sender=emb / (51.3 * GIB) + emb / (10.1 * GIB), ship=3 * emb / link, load=emb / (7.2 * GIB))
    assert est.seconds == pytest.approx(load + one["sender"] + one["ship"], rel=1e-9)
    assert est.bucket_seconds == pytest.approx(sum(one.values()), rel=1e-9)
    # the same sync staged through pageable memory: the sender (1.30 GiB/s) becomes the bottleneck, 6x slower
    pageable = staged_seconds(SyncSize(w, emb, 256, 3, PlanOptions().link_gbs, PlanOptions().nvlink_gbs), "d2h_pageable")
    assert pageable == pytest.approx(w / (1.30 * GIB) + w / (10.1 * GIB) + one["ship"] + one["load"], rel=1e-9)
    assert pageable > 6 * est.seconds and f"before issue 37) it would take {pageable:.0f} s" in est.note


def test_cuda_ipc_and_collective_worked_by_hand() -> None:
    # one GPU: rank 0 and the one engine worker on it -> cuda_ipc at the measured 4.4 GiB/s
    flags = ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
             "--vllm.tensor_parallel_size", "1", "--megatron.tensor_model_parallel_size", "1",
             "--megatron.pipeline_model_parallel_size", "1", "--train.batch_size", "8", "--rollout.batch_size", "1"]
    _, plan = plan_of("deepscaler-1.5b.yaml", *flags)
    w = plan.model.total_params() * 2
    assert plan.sync.transport == "cuda_ipc" and plan.sync.seconds == pytest.approx(w / (CUDA_IPC_GIBS * GIB))
    # the 235B MoE preset is disaggregated: an NCCL broadcast to engines on other nodes at --plan.link_gbs
    _, plan = plan_of("qwen3-235b-a22b.yaml", plan_flags=("--plan.link_gbs", "25"))
    w = plan.model.total_params() * 2
    assert plan.sync.transport == "collective" and plan.sync.seconds == pytest.approx(w / 25e9)
    assert "not measured" in plan.sync.how


def test_dry_run_shows_the_estimate_and_warns_near_the_bound(capsys) -> None:
    rc, out = dry_run(capsys, "--config", "configs/qwen3-32b.yaml")
    assert rc == 0 and "weight sync estimate: 8.7 s per sync over object_store" in out, out
    assert "copy rates measured on an H200" in out and "warning: weight sync" not in out
    # a 0.8 s bound: the 1.45 GiB embedding bucket (~0.47 s) nears it; the 8.7 s sync is longer (allowed)
    rc, out = dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--rollout.weight_sync_timeout", "0.8")
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: weight sync")]
    assert len(warnings) == 2, out
    assert "the largest bucket (1.45 GiB) takes ~0.5 s, 58% of --rollout.weight_sync_timeout 0.8 s" in warnings[0]
    assert "raise --rollout.weight_sync_timeout, or lower --vllm.weight_sync_bucket_mb" in warnings[0]
    assert "one sync takes ~9 s, 10.9x --rollout.weight_sync_timeout 0.8 s; allowed" in warnings[1]
    # a 1 s bound: the bucket takes 47% of it, below the warning share; the sync is still reported
    rc, out = dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--rollout.weight_sync_timeout", "1")
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: weight sync")]
    assert len(warnings) == 1 and "one sync takes" in warnings[0], out
    rc, out = dry_run(capsys, "--config", "configs/cpu-smoke.yaml")
    assert "weight sync estimate: n/a (CPU config" in out


def test_a_transport_the_layout_cannot_serve_is_refused(capsys) -> None:
    rc, out = dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--rollout.weight_sync", "cuda_ipc")
    assert rc == 2 and "weight sync: --rollout.weight_sync cuda_ipc" in out and "use --rollout.weight_sync auto" in out, out
