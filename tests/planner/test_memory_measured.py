"""The planner's Megatron terms against the memory real CPU ranks reach (world 1 and TP2+SP world 2).

A tiny random Qwen3 (hidden 512, 4 layers, vocab 8192, 21M parameters, fp32 on CPU) runs through
the real :class:`MegatronRankWorker` (local spec, gloo) in rank subprocesses (world 1; world 2 as
TP2 + sequence parallel and as DP2 with the distributed optimizer; all three in one launch of two
processes, one layout after another, each from its own warmed-up baseline); each rank reports
its resident memory above a warmed-up baseline (see ``planner_scenarios.py`` for exactly what is
read and when). The planner's terms, computed from the model's config.json alone, must be within
25% of: weights + grads (after init), the optimizer state (created by the first step), the
activation + scratch part of a step, and the step's peak, at micro-batches of 512 and 1536 tokens.
"""

from __future__ import annotations

import json
import os

import pytest

from openrlhf_shape.actor.launch import run_ranks
from openrlhf_shape.planner.memory import megatron_update_peak_bytes

pytestmark = pytest.mark.slow  # one launch of two Megatron ranks (~25 s)
HERE = os.path.dirname(os.path.abspath(__file__))
SEQ_LEN = 256
ROWS = [2, 6]  # micro-batches of 512 and 1536 tokens
TOL = 0.25
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str, dict]:
    from openrlhf_shape.testing import make_tiny_model

    root = tmp_path_factory.mktemp("planner_models")
    measured = make_tiny_model(root / "measured", arch="qwen3", num_layers=4, vocab_size=8192, hidden_size=512,
                               intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    warmup = make_tiny_model(root / "warmup", arch="qwen3", num_layers=1, vocab_size=1000)
    with open(measured / "config.json") as f:
        cfg = json.load(f)
    return str(measured), str(warmup), cfg


def _close(pred: float, meas: float, what: str) -> None:
    rel = (pred - meas) / meas
    assert abs(rel) <= TOL, f"{what}: planner {pred / 2**20:.1f} MiB vs measured {meas / 2**20:.1f} MiB ({rel:+.0%})"


SCENARIOS = {
    "world1": (1, {"entropy_chunk_size": 512}, ROWS),
    "tp2-sp": (2, {"entropy_chunk_size": 512, "tensor_model_parallel_size": 2, "sequence_parallel": True}, ROWS),
    # DP2: Adam state sharded by the distributed optimizer; one size (each rank trains on 3 rows).
    "dp2-distopt": (2, {"entropy_chunk_size": 512, "use_distributed_optimizer": True}, [6]),
}
# The world-2 layouts first, then world 1 on rank 0 (planner_scenarios.measure_scenarios).
LAUNCH_ORDER = ["tp2-sp", "dp2-distopt", "world1"]


@pytest.fixture(scope="module")
def measured(models) -> dict[str, list[dict]]:
    """Every scenario measured in ONE launch of two rank processes (each scenario with its own worker, process
    group, warm-up and baseline): scenario id -> the results of the ranks that ran it."""
    model_dir, warmup_dir, _ = models
    scenarios = [dict(zip(("world", "cfg", "rows"), SCENARIOS[name])) for name in LAUNCH_ORDER]
    results = run_ranks(
        "planner_scenarios:measure_scenarios", 2,
        kwargs=dict(model_dir=model_dir, warmup_dir=warmup_dir, vocab=8192, seq_len=SEQ_LEN, scenarios=scenarios),
        timeout=600, env=MALLOC_ENV, extra_pythonpath=[HERE],
    )
    return {name: [r[i] for r in results if r[i] is not None] for i, name in enumerate(LAUNCH_ORDER)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_planner_terms_match_measured_rank_memory(models, measured, scenario):
    _, _, hf_cfg = models
    world, cfg, rows = SCENARIOS[scenario]
    results = measured[scenario]
    tp = cfg.get("tensor_model_parallel_size", 1)
    distopt = cfg.get("use_distributed_optimizer", False)
    assert len(results) == world, "every rank of the layout reports"
    for r in results:  # a peak for each micro-batch size (this rank's DP shard of the rows, one micro-batch)
        assert sorted(r["peaks"]) == [n // (world // tp) * SEQ_LEN for n in rows], r["peaks"]
    for rank, r in enumerate(results):
        base = r["base"]
        for tokens, peak in r["peaks"].items():
            pred = megatron_update_peak_bytes(
                hf_cfg, tp=tp, pp=1, dp=world // tp, micro_batch_tokens=tokens, seq_len=SEQ_LEN, recompute="none",
                sequence_parallel=cfg.get("sequence_parallel", False), dtype="fp32", distributed_optimizer=distopt,
                logprob_chunk=cfg["entropy_chunk_size"], spec="local",
            )
            states = pred["weights"] + pred["grads"]
            print(f"world {world} {cfg} rank {rank} {tokens} tokens: planner vs measured MiB: "
                  f"weights+grads {states / 2**20:.0f} vs {(r['after_init'] - base) / 2**20:.0f}, "
                  f"Adam {pred['optimizer'] / 2**20:.0f} vs {(r['after_warmup'] - r['after_init']) / 2**20:.0f}, "
                  f"peak {pred['total'] / 2**20:.0f} vs {(peak - base) / 2**20:.0f}")
            _close(states, r["after_init"] - base, f"rank {rank}: weights + grads")
            _close(pred["optimizer"], r["after_warmup"] - r["after_init"], f"rank {rank}: Adam state")
            dyn = pred["total"] - states - pred["optimizer"]
            _close(dyn, peak - r["after_warmup"], f"rank {rank}, {tokens} tokens: activations + scratch")
            _close(pred["total"], peak - base, f"rank {rank}, {tokens} tokens: peak")
        if len(r["peaks"]) < 2:
            continue
        # The larger micro-batch must cost more, by about what the planner says.
        (t1, p1), (t2, p2) = sorted(r["peaks"].items())
        d_pred = [megatron_update_peak_bytes(hf_cfg, tp=tp, dp=world // tp, micro_batch_tokens=t, seq_len=SEQ_LEN,
                                             recompute="none", sequence_parallel=cfg.get("sequence_parallel", False),
                                             dtype="fp32", distributed_optimizer=distopt, logprob_chunk=512,
                                             spec="local")["total"] for t in (t1, t2)]
        _close(d_pred[1] - d_pred[0], p2 - p1, f"rank {rank}: peak growth {t1} -> {t2} tokens")
