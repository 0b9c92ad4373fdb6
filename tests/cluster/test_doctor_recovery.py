"""``openrlhf-shape doctor`` says what recovery costs on the job's layout: the planner's numbers for the same config
(``planner/recovery.py``), under the same ``--plan.*`` assumptions as ``train --dry_run``. No Ray here: the lines come
from the config alone (test_doctor_cli.py runs the whole command)."""

from __future__ import annotations

from pathlib import Path

from openrlhf_shape.cli.doctor import recovery_report
from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import parse_plan_options
from openrlhf_shape.planner.plan import build_plan

REPO = Path(__file__).resolve().parents[2]


def _cfg(preset: str, *flags: str):
    return load_config(str(REPO / "configs" / preset), list(flags), check_paths=False)


def test_the_doctor_prints_the_planners_recovery_cost_of_the_layout() -> None:
    cfg = _cfg("qwen3-8b.yaml")
    rc = build_plan(cfg, parse_plan_options([])).recovery
    engine, rank = recovery_report(cfg, [])
    assert engine.startswith(f"recovery per engine failure (--rollout.max_engine_restarts): ~{rc.engine_failure_s:.1f} s")
    assert f"one weight sync to it {rc.engine_sync_s:.1f} s" in engine
    assert rank.startswith(f"recovery per rank failure (--train.max_restarts): ~{rc.rank_failure_s:.1f} s")
    assert f"--ckpt.save_steps 20 / 2 x {rc.step_s:.0f} s" in rank


def test_the_doctors_lines_follow_the_plan_flags_and_the_checkpoint_interval() -> None:
    engine, rank = recovery_report(_cfg("qwen3-8b.yaml", "--ckpt.save_steps", "5"), ["--plan.engine_start_s", "30"])
    assert "engine start 30 s (--plan.engine_start_s)" in engine
    assert "--ckpt.save_steps 5 / 2 x" in rank
    cpu_engine, cpu_rank = recovery_report(_cfg("cpu-smoke.yaml"), [])
    assert "engine start 15 s" in cpu_engine and "(no step-time estimate on CPU)" in cpu_rank


def test_without_a_model_shape_the_doctor_says_why_there_is_no_estimate() -> None:
    (line,) = recovery_report(_cfg("cpu-smoke.yaml", "--actor.model_name_or_path", "/nowhere/NoSuchModel"), [])
    assert line.startswith("recovery cost: no estimate (--actor.model_name_or_path: /nowhere/NoSuchModel")
