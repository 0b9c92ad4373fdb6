"""Megatron states to host and back (colocation) on real Megatron ranks (gloo, DP2 with the
distributed optimizer): storages are really emptied, every use while offloaded is refused, the
bytes come back bit for bit, and training continues exactly as without the round trip."""

from __future__ import annotations

import os

import pytest
import torch

from openrlhf_shape.actor.launch import run_ranks
from support.preload import spawn_preloaded

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))


def _batches(n_steps: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 1000, (L,), generator=g).tolist() for L in (20, 28, 17, 33)]
    plens = [6, 9, 5, 7]
    out = []
    for _ in range(n_steps):
        resp = [len(s) - p for s, p in zip(seqs, plens)]
        out.append({"sequences": seqs, "prompt_lens": plens, "temperature": 1.0,
                    "old_log_probs": [(-6.9 + 0.3 * torch.randn(t, generator=g)).float() for t in resp],
                    "advantages": [torch.randn(t, generator=g).float() for t in resp]})
    return out


def test_offload_onload_round_trip(tmp_path) -> None:
    from openrlhf_shape.testing import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", arch="qwen3", seed=1, num_layers=2, vocab_size=1024))
    cfg = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_distributed_optimizer=True,
               lr=1e-3, total_steps=10, micro_batch_max_tokens=64)
    both = run_ranks("offload_scenario:run_both", 2, kwargs=dict(cfg=cfg, model_dir=model_dir, batches=_batches()),
                     extra_pythonpath=[HERE], spawner=spawn_preloaded)
    with_rt, plain = [r["offload"] for r in both], [r["plain"] for r in both]
    for r in with_rt:
        assert r["offloaded_bytes"] > 0 and r["empty_after_offload"]
        assert all(e and "offloaded" in e for e in r["errors_while_offloaded"]), r["errors_while_offloaded"]
        assert r["forward_with_params_only"]
        assert "grads" in r["train_with_params_only"] and "offloaded" in r["train_with_params_only"]
        assert r["restored_bitwise"] and r["restored_bitwise_again"]
        first, second = r["host_bytes_first_and_second_round"]
        assert first == second and 0 < first <= 1.01 * r["offloaded_bytes"]  # one host copy of the states, reused
    for a, b in zip(with_rt, plain):
        assert a["metrics"] == b["metrics"]  # exactly the same losses, grad norms, lrs
