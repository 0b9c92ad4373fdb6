"""The pure parts of benchmarks/bench_async.py (medians, ratios, CI inclusion, the final line), no Ray."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.modules import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_async.py"


@pytest.fixture(scope="module")
def bench():
    return load_file(SCRIPT)


def _row(step, t, tokens, eng, rank, **more):
    return {"step": step, "time/step": t, "rollout/tokens": tokens, "time/engine_idle_share": eng,
            "time/rank_idle_share": rank, **more}


def test_summary_drops_warmup_and_last_step(bench):
    rows = [
        _row(1, 100.0, 999, 0.9, 0.9),  # warm-up: left out
        _row(2, 40.0, 800, 0.10, 0.30, **{"async/overlap_seconds": 20.0, "async/wait_seconds": 1.0,
                                          "async/staleness": 1.0}),
        _row(4, 44.0, 1000, 0.20, 0.40, **{"async/overlap_seconds": 22.0, "async/wait_seconds": 3.0,
                                           "async/staleness": 1.0}),
        _row(3, 42.0, 1200, 0.90, 0.00, **{"async/overlap_seconds": 24.0, "async/wait_seconds": 2.0,
                                           "async/staleness": 1.0}),
        # the last step (nothing generated beside it in async, the final checkpoint, the eval): left out
        _row(5, 20.0, 5000, 0.5, 0.5, **{"time/eval": 8.0, "time/checkpoint": 3.0}),
    ]
    s = bench.summarize(rows)
    assert s["steps_measured"] == [2, 3, 4]  # sorted by step
    assert s["step_seconds_each"] == [40.0, 42.0, 44.0]
    assert s["step_seconds"] == 42.0
    assert s["rollout_tokens"] == 1000.0  # median of 800, 1200, 1000
    assert s["tokens_per_second"] == pytest.approx(1000.0 / 42.0)
    assert s["engine_idle_share"] == pytest.approx(0.20) and s["rank_idle_share"] == pytest.approx(0.30)
    assert s["overlap_seconds"] == 22.0 and s["wait_seconds"] == 2.0 and s["staleness"] == 1.0


def test_summary_of_two_steps_and_of_one(bench):
    rows = [_row(1, 30.0, 500, 0.5, 0.5), _row(2, 20.0, 600, 0.6, 0.4)]
    s = bench.summarize(rows)
    assert s["steps_measured"] == [2]
    assert s["step_seconds"] == 20.0 and s["tokens_per_second"] == 30.0
    assert s["overlap_seconds"] is None and s["staleness"] is None  # sync: no async metrics
    # two steps: step 2 without its eval and checkpoint seconds (27 - 5 - 2); its shares are all there is
    s = bench.summarize([_row(1, 30.0, 500, 0.5, 0.5),
                         _row(2, 27.0, 600, 0.6, 0.4, **{"time/eval": 5.0, "time/checkpoint": 2.0})])
    assert s["step_seconds"] == 20.0 and s["engine_idle_share"] == 0.6 and s["rollout_tokens"] == 600.0
    # one step: it is measured (nothing else ran)
    assert bench.summarize([_row(1, 30.0, 600, 0.5, 0.5)])["step_seconds"] == 30.0


def test_idle_shares_skip_eval_and_checkpoint_steps(bench):
    # a 5-step run whose eval ran at step 3 (--eval.steps 3): its step seconds lose the eval, its shares are left out
    rows = [_row(1, 9.0, 1, 0.9, 0.9), _row(2, 10.0, 1, 0.2, 0.6), _row(3, 16.0, 1, 0.0, 0.9, **{"time/eval": 4.0}),
            _row(4, 14.0, 1, 0.4, 0.8), _row(5, 1.0, 1, 0.0, 0.0)]
    s = bench.summarize(rows)
    assert s["step_seconds_each"] == [10.0, 12.0, 14.0] and s["step_seconds"] == 12.0
    assert s["engine_idle_share"] == pytest.approx(0.3) and s["rank_idle_share"] == pytest.approx(0.7)


def test_ratios_and_final_line(bench):
    assert bench.ratio(34.0, 40.0) == pytest.approx(0.85)
    assert math.isnan(bench.ratio(1.0, 0.0))
    line = bench.final_line(34.0 / 40.0, 34.0 / 48.0)
    assert line == "async: shape_async_over_grpo_sync=0.85 shape_async_over_shape_sync=0.71"


def test_learning_check(bench):
    assert bench.inside_ci(0.25, 0.2, 0.3) and bench.inside_ci(0.2, 0.2, 0.3) and bench.inside_ci(0.3, 0.2, 0.3)
    assert not bench.inside_ci(0.31, 0.2, 0.3) and not bench.inside_ci(0.19, 0.2, 0.3)
    sync_rows = [{"step": 1}, {"step": 5, "eval/accuracy": 0.25, "eval/accuracy_ci_low": 0.18,
                               "eval/accuracy_ci_high": 0.32, "eval/response_length/mean": 90.0}]
    async_rows = [{"step": 5, "eval/accuracy": 0.33, "eval/accuracy_ci_low": 0.25, "eval/accuracy_ci_high": 0.41}]
    sy, asy = bench.eval_result(sync_rows), bench.eval_result(async_rows)
    assert sy == {"step": 5, "accuracy": 0.25, "ci_low": 0.18, "ci_high": 0.32, "response_length": 90.0}
    check = bench.learning_check(sy, asy)
    assert check["async_inside_sync_ci"] is False and check["difference"] == pytest.approx(0.08)
    asy["accuracy"] = 0.30
    assert bench.learning_check(sy, asy)["async_inside_sync_ci"] is True
    assert bench.eval_result([{"step": 1}]) is None and bench.learning_check(None, asy) is None


def test_plan_and_staleness(bench):
    assert bench.parse_staleness("1") == [1] and bench.parse_staleness("2, 1,2") == [2, 1]
    with pytest.raises(ValueError):
        bench.parse_staleness("3")
    plan = bench.run_plan([1, 2], learning=True)
    assert [p["name"] for p in plan] == ["grpo_sync", "grpo_async_s1", "shape_sync", "shape_async_s1",
                                         "shape_async_s2"]
    assert [p["eval"] for p in plan] == [False, False, True, True, False]  # the learning check: first staleness
    assert [p["staleness"] for p in plan] == [None, 1, None, 1, 2]
    assert not any(p["eval"] for p in bench.run_plan([2], learning=False))
