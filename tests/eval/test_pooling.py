"""Pooling the held-out evals of several seeds of one arm, per problem: the point estimate is the mean
over seeds and problems, the interval widens when the seeds disagree, and runs on different problem
sets are refused."""

from __future__ import annotations

import numpy as np
import pytest

from openrlhf_shape.eval.metrics import ProblemResult
from openrlhf_shape.eval.pooling import eval_steps, paired_difference, pool_runs, pooled_table, read_problem_results, write_problem_results


def _run(tmp_path, name: str, rates: np.ndarray, tokens: np.ndarray, step: int = 12, n: int = 8) -> str:
    """A run directory whose eval at ``step`` has these per-problem pass rates ([problems])."""
    d = str(tmp_path / name)
    problems = [ProblemResult(problem_id=str(i), scores=[1.0] * int(round(r * n)) + [0.0] * (n - int(round(r * n))),
                              num_tokens=[int(t)] * n) for i, (r, t) in enumerate(zip(rates, tokens))]
    write_problem_results(d, step, problems)
    return d


def test_pooled_mean_and_an_interval_that_sees_the_seeds(tmp_path) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 9, 100) / 8  # per-problem pass rates in eighths
    tokens = rng.integers(20, 60, 100)
    same = [_run(tmp_path, f"same{i}", base, tokens) for i in range(3)]
    # three seeds with the same mean over seeds as `same`, but one learned and two did not
    up, down = np.clip(base + 0.25, 0, 1), np.clip(base - 0.125, 0, 1)
    spread = [_run(tmp_path, "up", up, tokens), _run(tmp_path, "down1", down, tokens), _run(tmp_path, "down2", down, tokens)]

    p = pool_runs(same, 12)
    assert p.runs == 3 and p.problems == 100
    assert p.accuracy == pytest.approx(base.mean()) and p.length == pytest.approx(tokens.mean())
    assert p.accuracy_ci[0] < p.accuracy < p.accuracy_ci[1]
    assert p.per_run_accuracy == pytest.approx([base.mean()] * 3)

    q = pool_runs(spread, 12)
    want = np.mean([up.mean(), down.mean(), down.mean()])
    assert q.accuracy == pytest.approx(want)
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(q.accuracy_ci) > 1.5 * width(p.accuracy_ci)  # seed disagreement widens it
    assert pool_runs(same, 12, seed=3).accuracy_ci == pool_runs(same, 12, seed=3).accuracy_ci  # deterministic

    table = pooled_table({"GRPO": same, "SHAPE": spread})
    assert "| GRPO | 12 | 3 |" in table and "| SHAPE | 12 | 3 |" in table


def test_pooling_refuses_what_does_not_pool(tmp_path) -> None:
    a = _run(tmp_path, "a", np.full(10, 0.5), np.full(10, 30))
    b = _run(tmp_path, "b", np.full(12, 0.5), np.full(12, 30))
    with pytest.raises(ValueError, match="other problems at step 12"):
        pool_runs([a, b], 12)
    with pytest.raises(FileNotFoundError, match=r"no held-out eval at step 6 .*evals ran at \[12\]"):
        read_problem_results(a, 6)
    assert eval_steps(a) == [12] and eval_steps(str(tmp_path / "none")) == []


def test_paired_difference_sees_a_small_shift_that_side_by_side_intervals_hide(tmp_path) -> None:
    """B = A + 1/8 on a quarter of the problems (+3.1 points) with 0.8x the tokens: per-problem pairing
    puts the difference's interval above 0 although the two arms' own intervals overlap widely."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 7, 100) / 8
    tokens = rng.integers(20, 60, 100).astype(float)
    lift = np.where(np.arange(100) % 4 == 0, 0.125, 0.0)
    a = [_run(tmp_path, f"a{i}", base, tokens) for i in range(3)]
    b = [_run(tmp_path, f"b{i}", base + lift, tokens * 0.8) for i in range(3)]
    d = paired_difference(a, b, 12)
    assert d.runs == 3 and d.problems == 100
    assert d.accuracy == pytest.approx(lift.mean())
    assert 0.0 < d.accuracy_ci[0] < d.accuracy < d.accuracy_ci[1]
    pa, pb = pool_runs(a, 12), pool_runs(b, 12)
    assert pb.accuracy_ci[0] < pa.accuracy_ci[1]  # the arms' intervals overlap
    assert d.length_ratio == pytest.approx(0.8, abs=0.02) and d.length_ratio_ci[1] < 1.0
    with pytest.raises(ValueError, match="same number of runs"):
        paired_difference(a, b[:2], 12)
