"""One phase list: the loop runs the experience phases through ``make_experience`` (the code the tests
run), the colocation transitions sit around the update as timed phases of their own, and a phase has
one return type."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from openrlhf_shape.trainer import ppo_trainer
from openrlhf_shape.trainer.phases import PHASES, PhaseOutput, StepLog


def test_steplog_times_phases_and_takes_one_return_type() -> None:
    rec = StepLog()
    assert rec.phase("generate", lambda: PhaseOutput("exp", {"rollout/tokens": 3.0})) == "exp"
    assert rec.phase("to_update", lambda: None) is None  # a transition measures nothing
    assert rec.metrics["rollout/tokens"] == 3.0 and rec.metrics["time/generate"] >= 0 and "time/to_update" in rec.metrics
    with pytest.raises(TypeError, match="phase 'train' returned dict"):
        rec.phase("train", lambda: {"actor/loss": 1.0})  # a bare dict was once taken as metrics
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        rec.phase("warmup", lambda: None)
    assert rec.finish(**{"data/epoch": 1.0})["time/step"] >= 0


def _calls(fn) -> tuple[list[str], dict[str, list[str]]]:
    """(phase names passed to rec.phase, attribute calls per owner name) in ``fn``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    phases, calls = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "phase" and node.args and isinstance(node.args[0], ast.Constant):
                phases.append(node.args[0].value)
            if isinstance(owner, ast.Name):
                calls.setdefault(owner.id, []).append(node.func.attr)
            elif isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                calls.setdefault(owner.attr, []).append(node.func.attr)
    return phases, calls


def test_the_loop_runs_the_experience_phases_through_make_experience() -> None:
    from openrlhf_shape.trainer import schedule
    from openrlhf_shape.trainer.experience import ShapeExperienceMaker

    # the loop: fit's steps (_fit_from, re-entered after a rank-group restart) with each step's update (_update)
    (update_phases, update_calls), (loop_phases, calls) = (_calls(ppo_trainer.ShapeTrainer._update),
                                                           _calls(ppo_trainer.ShapeTrainer._fit_from))
    phases = update_phases + loop_phases
    for owner, names in update_calls.items():
        calls.setdefault(owner, []).extend(names)
    assert "maker" not in calls  # the loop asks the schedule for the step's batch
    assert calls["schedule"] == ["experience", "settle"]
    assert phases == ["to_update", "train", "sync", "to_rollout", "eval", "checkpoint"]
    assert set(phases) <= set(PHASES)
    # the colocation transitions sit symmetrically around the update
    assert phases.index("to_update") + 1 == phases.index("train") and phases.index("sync") + 1 == phases.index("to_rollout")
    # synchronous: one call, the maker's phase list
    assert _calls(schedule.SyncSchedule.experience)[1]["maker"] == ["make_experience"]
    # the phase list is written once: make_experience is its three stages, and the asynchronous schedule runs
    # those stages (in other windows and threads), never a phase function by itself
    mk_phases, mk_calls = _calls(ShapeExperienceMaker.make_experience)
    assert mk_phases == [] and mk_calls["self"] == ["rollout", "credit", "old_policy"]
    stage_phases = [p for stage in ("rollout", "old_policy", "credit") for p in _calls(getattr(ShapeExperienceMaker, stage))[0]]
    # (ref_logprobs: with a reference model only, --algo.kl.init_coef > 0; values: with a critic only, gae)
    assert stage_phases == ["generate", "rewards", "logprobs", "ref_logprobs", "values", "segment", "probes",
                            "advantages"]
    # dynamic filtering's refill rounds (ShapeExperienceMaker.fill) repeat the first stage's two phases
    assert _calls(ShapeExperienceMaker.refill_round)[0] == ["generate", "rewards"]
    async_calls = [c for name, fn in inspect.getmembers(schedule.OneStepOffSchedule, inspect.isfunction)
                   for c in _calls(fn)[1].get("maker", [])]
    assert {"rollout", "old_policy", "credit"} <= set(async_calls), async_calls
    assert not set(async_calls) & {"generate", "rewards", "logprobs", "segment", "probes", "advantages"}, async_calls


def test_the_makers_users_call_its_stages_and_read_nothing_of_it() -> None:
    """The schedules, partial rollouts, set-up and the loop use the maker through its stages (and the two phases a
    partial rollout's window runs itself); what it holds (engines, sampling, tokenizer, the KL) each is handed."""
    from pathlib import Path

    stages = {"make_experience", "rollout", "old_policy", "credit", "rewards", "fill"}
    trainer_dir = Path(ppo_trainer.__file__).parent
    used = {}
    for name in ("schedule.py", "partial.py", "setup.py", "ppo_trainer.py"):
        for node in ast.walk(ast.parse((trainer_dir / name).read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "maker") or (
                        isinstance(owner, ast.Attribute) and owner.attr == "maker"):
                    used.setdefault(node.attr, []).append(name)
    assert set(used) <= stages, {k: v for k, v in used.items() if k not in stages}


def test_a_steps_line_counts_the_engines_replaced_in_its_eval(tmp_path) -> None:
    """An engine replaced during the held-out eval (after the sync, the last phase that read the group's totals)
    counts in that step's line, also the last step's: the loop reads every failure total, the engine group's
    included, after the eval and before the checkpoint keeps the line."""
    from types import SimpleNamespace

    from openrlhf_shape.config import load_config
    from openrlhf_shape.rollout.group import EngineGroup

    tree = ast.parse(textwrap.dedent(inspect.getsource(ppo_trainer.ShapeTrainer._fit_from)))
    lines: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "phase" and node.args and isinstance(node.args[0], ast.Constant):
                lines[node.args[0].value] = node.lineno
            elif node.func.attr == "fault_metrics":
                lines["fault_metrics"] = node.lineno
    assert lines["eval"] < lines["fault_metrics"] < lines["checkpoint"], lines

    trainer = ppo_trainer.ShapeTrainer(load_config(None, ["--ckpt.output_dir", str(tmp_path)], check_paths=False))
    # the group's own totals as a recovery leaves them (EngineGroup._recover; a real one needs Ray and an engine)
    engines = EngineGroup(["engine 0, never called here"])
    engines.restarts, engines.seconds_lost = 1, 21.5
    trainer.run = SimpleNamespace(cluster=SimpleNamespace(engines=engines))
    trainer.rank_restarts, trainer.rank_seconds_lost = 1, 40.0
    assert trainer.fault_metrics() == {"fault/engine_restarts": 1.0, "fault/seconds_lost": 21.5,
                                       "fault/rank_restarts": 1.0, "fault/rank_seconds_lost": 40.0}
