"""Ring attention (context parallelism) on the DeepSpeed backend, CPU/gloo (issue 36, item 2).

``--ds.ring_attn_size 2``: ranks in groups of two consecutive ranks share a data-parallel shard; each packed
micro-batch is padded to an even length and cut into two contiguous pieces, one per ring rank (OpenRLHF's split: a
sample may straddle the pieces); the HF model's attention is ours (``zero/ring_attention.py``), all-gathering K/V
over the group ``--ds.ring_attn_head_stride`` KV heads at a time. On the same weights and tokens (8 sequences of
33..1900 tokens, 3853 in all, one with an empty response) as world 1 with HF's own SDPA attention: ring 2 (world 2,
ZeRO-2, Qwen3 and Qwen3-MoE), ring 2 with head stride 2 under ZeRO-3 with gradient checkpointing (Qwen3), and
ring 2 x DP 2 (world 4, ZeRO-2,
Qwen3) give the world-1 log-probs and entropy within 1e-5 and DeepSpeed's reduced gradients after one step's
backward within 1e-5 relative per parameter.

World 1 and ring 2 are layouts of tests/megatron/long_runs.py's DeepSpeed launches (shared with the packing and
pad-token tests); ring 2 x DP 2 launches here.
"""

from __future__ import annotations

import os

import pytest

from long_runs import (ARCHS, LONG_CFG as CFG, RING2, batch as long_batch, long_models, shared_zero_world1,
                       shared_zero_world2, variant)
from mg_helpers import max_abs_diff
from openrlhf_shape.actor.launch import run_ranks
from packing_checks import merged, worst_grad_rel_diff
from support.preload import spawn_preloaded

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")

RING_TOL = 1e-5
GRAD_RTOL = 1e-5
LAYOUTS = {"ring2": (2, ARCHS), "ring2_dp2": (4, ("qwen3",))}  # name -> (world size, archs)
CASES = [(name, arch) for name, (_, archs) in LAYOUTS.items() for arch in archs] + [("ring2_stride2_zero3", "qwen3")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def runs(shared_results, tiny_models, batch) -> dict[str, list[dict]]:
    """Per layout, every rank's results; ``ring2_stride2_zero3``: the ring-2 ranks again with head stride 2 under
    ZeRO-3 with gradient checkpointing (the backward recomputes the attention, its all-gathers, inside the layout)."""
    models = long_models(shared_results, tiny_models)
    ring2 = shared_zero_world2(shared_results, models)["ring2"]
    dp2 = run_ranks("ring_scenarios:ring_run", 4, timeout=900, env={"DS_ACCELERATOR": "cpu"},
                    extra_pythonpath=[HERE, MEGATRON_TESTS], spawner=spawn_preloaded,
                    kwargs=dict(cfg=CFG, zero=RING2, model_dirs={"qwen3": models["qwen3"]}, batch=batch))
    return {"world1": shared_zero_world1(shared_results, models)["ring_world1"], "ring2": ring2, "ring2_dp2": dp2,
            "ring2_stride2_zero3": variant(ring2, "stride2_zero3")}


def _as_layout(results: list[dict], arch: str) -> list[dict]:
    return [{arch: {"packed": r[arch]}} for r in results]  # the shape packing_checks.merged reads


@pytest.mark.parametrize("name, arch", CASES)
def test_ring_logprobs_entropy_equal_world1_on_cpu(runs, batch, name, arch):
    n = len(batch["sequences"])
    ours = merged(_as_layout(runs[name], arch), arch, "packed", n)
    ref = merged(_as_layout(runs["world1"], arch), arch, "packed", n)
    assert max_abs_diff(ours.log_probs, ref.log_probs) <= RING_TOL
    assert max_abs_diff(ours.entropy, ref.entropy) <= RING_TOL
    assert ours.log_probs[6].numel() == 0
    assert all(r["ranks"]["ring"] == 0 for r in runs[name] if r[arch]["logprobs"])  # one ring rank reports


@pytest.mark.parametrize("name, arch", CASES)
def test_ring_gradients_equal_world1_after_one_step_on_cpu(runs, name, arch):
    ref = runs["world1"][0][arch]
    for rank_res in runs[name]:  # DeepSpeed's full (reduced) gradient, on each rank
        worst, where = worst_grad_rel_diff(rank_res[arch]["grads"], ref["grads"])
        assert worst <= GRAD_RTOL, where
    # the policy-loss sum is counted once per data-parallel shard (ring rank 0), and adds up to world 1's
    total = sum(r[arch]["loss_sum"] for r in runs[name])
    assert total == pytest.approx(ref["loss_sum"], rel=1e-5)
    assert all(r[arch]["loss_sum"] == 0.0 for r in runs[name] if r["ranks"]["ring"] == 1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ring_ranks_hold_contiguous_halves_of_each_pack_on_cpu(runs, batch, name):
    world, archs = LAYOUTS[name]
    by_dp: dict = {}
    for r in runs[name]:
        assert r["ranks"]["dp_size"] == world // 2 and r[archs[0]]["info"]["ring_attn_size"] == 2
        by_dp.setdefault(r["ranks"]["dp"], {})[r["ranks"]["ring"]] = r[archs[0]]["micro_batches"]
    rows = []
    for peers in by_dp.values():
        assert sorted(peers) == [0, 1]
        for mb0, mb1 in zip(peers[0], peers[1]):
            assert mb0["rows"] == mb1["rows"] and mb0["length"] == mb1["length"] and mb0["length"] % 2 == 0
            half = mb0["length"] // 2
            assert tuple(mb0["piece"]) == (0, half) and tuple(mb1["piece"]) == (half, 2 * half)
            rows += mb0["rows"]
    assert sorted(rows) == list(range(len(batch["sequences"])))
