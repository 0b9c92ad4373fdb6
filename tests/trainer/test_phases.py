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


def _fit_calls() -> tuple[list[str], list[str]]:
    """(phase names passed to rec.phase, attribute calls on the maker) in ShapeTrainer.fit's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(ppo_trainer.ShapeTrainer.fit)))
    phases, maker_calls = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "phase" and node.args and isinstance(node.args[0], ast.Constant):
                phases.append(node.args[0].value)
            if isinstance(owner, ast.Name) and owner.id == "maker":
                maker_calls.append(node.func.attr)
    return phases, maker_calls


def test_the_loop_runs_the_experience_phases_through_make_experience() -> None:
    phases, maker_calls = _fit_calls()
    assert maker_calls == ["make_experience"]  # not generate/rewards/... one by one: one phase list
    assert phases == ["to_update", "train", "sync", "to_rollout", "eval", "checkpoint"]
    assert set(phases) <= set(PHASES)
    # the colocation transitions sit symmetrically around the update
    assert phases.index("to_update") + 1 == phases.index("train") and phases.index("sync") + 1 == phases.index("to_rollout")
