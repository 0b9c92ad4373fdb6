"""The per-step guard on the rollout/trainer log-prob gap (the pure parts of the receiving worker's load it
stands behind, tied head re-emitted and coverage of the checkpoint: tests/rollout/test_worker_ext.py)."""

import logging

import pytest

from openrlhf_shape.trainer.logprob_guard import GAP_METRIC, LogprobGapGuard


def test_float32_gap_of_a_stale_head_warns_and_a_kernel_rounding_gap_does_not(caplog):
    guard = LogprobGapGuard("float32", "float32")
    ok = {GAP_METRIC: 9.0e-6}  # the demo's step 1: same weights on both sides
    assert guard.check(1, ok) is None and ok["rollout/mismatch/over_expected"] == 0.0
    stale = {GAP_METRIC: 4.2e-4}  # the demo's step 2 with the engines' head left at its start
    with caplog.at_level(logging.WARNING):
        msg = guard.check(2, stale)
    assert stale["rollout/mismatch/over_expected"] == 1.0
    assert msg and "step 2" in msg and "4.2e-04" in msg and "tied LM head" in msg and "--rollout.max_logprob_gap" in msg
    assert msg in caplog.text


def test_the_less_precise_side_sets_the_expectation():
    assert LogprobGapGuard("bfloat16", "float32").check(3, {GAP_METRIC: 4.2e-4}) is None  # bf16 rounding alone
    assert LogprobGapGuard("float32", "bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        LogprobGapGuard("int8", "float32")


def test_max_gap_stops_the_run_with_the_same_message():
    guard = LogprobGapGuard("float32", "float32", max_gap=1e-4)
    assert guard.check(1, {GAP_METRIC: 5e-5 + 1e-6}) is not None  # over the expectation, under the stop: warns
    with pytest.raises(RuntimeError, match=r"step 4: .*8\.7e-04 is over 1\.0e-04.*not running the policy"):
        guard.check(4, {GAP_METRIC: 8.7e-4})
    with pytest.raises(ValueError, match="--rollout.max_logprob_gap"):
        LogprobGapGuard("float32", "float32", max_gap=-1)


def test_steps_without_comparable_logprobs_pass():
    assert LogprobGapGuard("float32", "float32", max_gap=1e-6).check(1, {}) is None  # truncated sampling


def test_guard_for_run_reads_each_sides_dtype():
    from openrlhf_shape.config import load_config
    from openrlhf_shape.platform import detect_platform, gpu_platform
    from openrlhf_shape.trainer.logprob_guard import guard_for_run

    class Model:  # an HF config's dtype attribute
        dtype = "bfloat16"

    cpu = detect_platform()
    cfg = load_config(None, [])
    assert guard_for_run(cfg, cpu, Model(), "float32").dtype == "float32"  # CPU: float32 both sides
    assert guard_for_run(cfg, cpu, Model(), "auto").dtype == "bfloat16"  # engine at the checkpoint's bf16
    assert guard_for_run(cfg, gpu_platform(), Model(), "float32").dtype == "bfloat16"  # Megatron auto on a GPU: bf16
    bf16 = load_config(None, ["--megatron.bf16", "true"])
    assert guard_for_run(bf16, gpu_platform(), Model(), "float32").dtype == "bfloat16"
    with pytest.raises(ValueError, match="--megatron.bf16 true: Megatron trains in bf16 on GPUs only"):
        guard_for_run(bf16, cpu, Model(), "float32")  # refused at start-up before (check_dtypes)
    ds = load_config(None, ["--actor.backend", "deepspeed", "--ds.param_dtype", "bf16"])
    assert guard_for_run(ds, cpu, Model(), "float32").dtype == "bfloat16"
