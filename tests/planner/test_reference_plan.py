"""The reference model in ``--dry_run`` (openrlhf_shape/planner/reference.py): its GPUs in the placement, its memory
in every phase, its host memory and its time per step; nothing of it without KL."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.memory import GiB
from openrlhf_shape.planner.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
KL = ["--algo.kl.init_coef", "0.01"]


def _plan(preset: str, flags: list[str]):
    cfg = load_config(str(REPO / "configs" / preset), flags, check_paths=False)
    return build_plan(cfg, PlanOptions(), f"configs/{preset}")


def _phase(plan, name: str):
    return next(ph for ph in plan.gpu_phases if ph.name == name)


def _term(ph, name: str) -> int:
    return next(t.bytes for t in ph.terms if t.name == name)


def test_colocated_reference_memory_and_time():
    """qwen3-8b (colocated, TP4 x DP4 on 2 nodes): reference rank r on actor rank r's GPU; its weights are the actor's
    shard; the rank GPU gains the reference process in every phase and a ``reference log-probs`` phase after the
    log-probs one that holds the rollout phase's memory plus the reference's forward peak; host RAM holds the
    reference weights of the node's ranks; the step gains the forward over the same GPUs plus the weights' trip."""
    base, plan = _plan("qwen3-8b.yaml", []), _plan("qwen3-8b.yaml", KL)
    assert plan.ref_world == plan.world == 16 and base.ref_world == 0 and base.reference is None
    assert [s.bundle for s in plan.placement.refs] == [s.bundle for s in plan.placement.ranks]
    assert plan.placement.num_bundles == base.placement.num_bundles
    names = [ph.name for ph in plan.gpu_phases]
    assert names == ["rollout", "log-probs", "reference log-probs", "update"], names
    assert [ph.name for ph in base.gpu_phases] == ["rollout", "log-probs", "update"]
    ref_w = _term(_phase(plan, "reference log-probs"), "reference weights")
    assert ref_w == _term(_phase(plan, "update"), "weights") > 0  # the actor's TP shard, in bf16
    ctx = int(plan.options.cuda_context_gib * GiB) + int(plan.options.nccl_gib * GiB)
    for name in ("rollout", "log-probs", "update"):  # the reference's process everywhere, its weights on host
        assert _phase(plan, name).total == _phase(base, name).total + ctx, name
        assert _term(_phase(plan, name), "reference weights (on host: the colocation lifecycle)") == 0
    assert _phase(plan, "reference log-probs").total == _phase(plan, "rollout").total + plan.reference.peak
    assert plan.reference.peak > ref_w  # + the forward's activations and the log-prob scratch
    host = {t.name: t.bytes for t in plan.host}
    assert host["reference weights offloaded"] == ref_w * 8  # 8 reference ranks on rank 0's node
    phases = {p.name: p.seconds for p in plan.phases}
    moved = 2 * plan.reference.static_bytes / (plan.options.pcie_gbs * 1e9)
    assert phases["reference log-probs"] == pytest.approx(phases["log-probs + entropy"] + moved, rel=1e-9)
    assert plan.step_seconds == pytest.approx(base.step_seconds + phases["reference log-probs"], rel=1e-9)
    assert "reference log-probs" not in {p.name for p in base.phases}


def test_disaggregated_reference_gets_its_own_gpus():
    """qwen3-4b disaggregated (TP2 x DP4, 8 GPUs) with a 4-GPU reference (TP2 x DP2): 4 more bundles before the
    engines; the reference GPUs hold its forward only (a phase of their own); the rank GPUs are unchanged; its
    forward runs over 4 GPUs (twice the actor's log-prob time), no weights move."""
    flags = ["--train.colocate_all", "false"]
    base = _plan("qwen3-4b.yaml", flags)
    plan = _plan("qwen3-4b.yaml", flags + KL + ["--ref.num_gpus_per_node", "4"])
    assert plan.placement.num_bundles == base.placement.num_bundles + 4
    assert [s.bundle for s in plan.placement.refs] == [8, 9, 10, 11]
    assert min(s.bundle for s in plan.placement.engines) == 12
    assert [ph.total for ph in plan.gpu_phases] == [ph.total for ph in base.gpu_phases]
    (ref_ph,) = plan.ref_phases
    assert ref_ph.name == "reference log-probs (reference GPU)"
    assert ref_ph.total == plan.reference.peak + int(plan.options.cuda_context_gib * GiB) + int(plan.options.nccl_gib * GiB)
    assert not [t for t in ref_ph.terms if "grads" in t.name or "optimizer" in t.name]
    phases = {p.name: p.seconds for p in plan.phases}
    assert phases["reference log-probs"] == pytest.approx(phases["log-probs + entropy"] * 8 / 4, rel=1e-9)


def test_deepspeed_zero3_reference_is_partitioned_and_dry_run_prints_it(capsys):
    """DeepSpeed ZeRO-3: the reference's weights are partitioned over its ranks as the actor's; the dry run shows
    the reference phase and its step time."""
    from openrlhf_shape.cli.main import main

    flags = ["--actor.backend", "deepspeed", "--ds.zero_stage", "3", "--megatron.tensor_model_parallel_size", "1",
             "--megatron.sequence_parallel", "false"]
    plan = _plan("qwen3-4b.yaml", flags + KL)
    assert _term(_phase(plan, "reference log-probs"), "reference weights") == _term(_phase(plan, "update"), "weights")
    assert main(["train", "--config", "configs/qwen3-4b.yaml", *flags, *KL, "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "[reference log-probs]" in out and "reference log-probs:" in out and "FITS" in out


def test_cpu_config_counts_the_reference_ranks_in_host_ram():
    base, plan = _plan("cpu-smoke.yaml", []), _plan("cpu-smoke.yaml", KL)
    (ph0,), (ph,) = base.gpu_phases, plan.gpu_phases
    extra = {t.name: t.bytes for t in ph.terms if "reference" in t.name}
    assert extra and ph.total - ph0.total == sum(extra.values()) and plan.ref_world == plan.world
