"""The planner's model of probes hidden in the rollout's tail (issue 49, item 3): each response's first probe round
is sent as it finishes (``--shape.entropy_source engine``) and folds into the tail's decode steps, which share the
step's weight read but read the probes' own context KV on top. Checked against hand arithmetic on small inputs and
on the Qwen3-4B preset, whose SHAPE/GRPO with the overlap the dry run prints."""

from __future__ import annotations

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import tail_overlap
from openrlhf_shape.planner.plan import build_plan


def test_hidden_is_the_shared_weight_reads_plus_the_prefill_in_the_tail() -> None:
    kw = dict(probe_seconds=20.0, prefill_seconds=4.0, decode_steps=600, weight_read_seconds=0.002)
    # a long tail: every probe step shares a tail step (600 x 2 ms) and the whole prefill fits (4 s)
    assert tail_overlap(tail_seconds=10.0, tail_steps=1000, first_round_share=1.0, **kw)[0] == pytest.approx(5.2)
    # a tail of 300 steps: 300 of the 600 share a weight read
    assert tail_overlap(tail_seconds=10.0, tail_steps=300, first_round_share=1.0, **kw)[0] == pytest.approx(4.6)
    # a 2 s tail: 2 s of the prefill in its idle compute
    assert tail_overlap(tail_seconds=2.0, tail_steps=1000, first_round_share=1.0, **kw)[0] == pytest.approx(3.2)
    # an adaptive first round of half the probes: half the steps and half the prefill
    hidden, how = tail_overlap(tail_seconds=10.0, tail_steps=1000, first_round_share=0.5, **kw)
    assert hidden == pytest.approx(300 * 0.002 + 2.0) and "first round 50%" in how and "KV reads stay exposed" in how
    # never more than the probes cost; no tail hides nothing
    assert tail_overlap(tail_seconds=1e6, tail_steps=1e9, first_round_share=1.0,
                        **{**kw, "probe_seconds": 3.0})[0] == pytest.approx(3.0)
    assert tail_overlap(tail_seconds=0.0, tail_steps=0.0, first_round_share=1.0, **kw)[0] == 0.0


def _plan(*flags: str):
    cfg = load_config("configs/qwen3-4b.yaml", list(flags), check_paths=False)
    return build_plan(cfg, PlanOptions(), "configs/qwen3-4b.yaml")


def test_qwen3_4b_overlap_from_the_rollout_tail_and_the_probe_roofline() -> None:
    plan = _plan("--shape.entropy_source", "engine")
    rollout, probes = (next(p for p in plan.phases if p.name == n) for n in ("rollout decode", "SHAPE probes"))
    # the tail: the decode past the bulk's throughput time, at one sequence's step (2.8 ms, module doc of cost.py)
    assert rollout.tail_seconds > 0 and rollout.tail_steps == pytest.approx(16_384 * (1 - 1 / 75), rel=0.01)
    # 128 waves x 16 steps share a weight read each: bf16 weights / TP 2 at HBM 3350 GB/s x 0.5; + the 12 s prefill
    weights = plan.model.total_params() * 2 / 2 / (3350e9 * 0.5)
    assert 10 < probes.hidden_seconds - 2048 * weights < 15
    base = plan.step_seconds - plan.probe_seconds
    assert plan.shape_over_grpo_overlapped == pytest.approx((plan.step_seconds - probes.hidden_seconds) / base)
    # the probes' decode reads each probe's own context KV (95% of the bytes): the tail hides little of it
    assert 1.10 < plan.shape_over_grpo_overlapped < plan.shape_over_grpo
    assert plan.engine_entropy and not _plan().engine_entropy
    adaptive = _plan("--shape.entropy_source", "engine", "--probe.adaptive", "true", "--probe.max_probes", "8")
    assert 0 < adaptive.probe_hidden_seconds < plan.probe_hidden_seconds  # a first round of 4 of 8


def test_dry_run_prints_the_overlap_and_its_inputs(capsys) -> None:
    assert main(["train", "--config", "configs/qwen3-4b.yaml", "--shape.entropy_source", "engine", "--dry_run"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "with the probes in the rollout's tail" in ln)
    ratio = float(line.split("SHAPE/GRPO ")[1].split()[0])
    assert 1.0 < ratio < 1.17 and "configured)" in line and "tail " in line and "steps share the tail" in line
    print(line)
