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
"""

from __future__ import annotations

import os

import pytest

from mg_helpers import max_abs_diff
from openrlhf_shape.actor.launch import run_ranks
from openrlhf_shape.testing.batches import long_batch
from packing_checks import merged, worst_grad_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")

RING_TOL = 1e-5
GRAD_RTOL = 1e-5
CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=2048, max_norm=0.0,
           entropy_chunk_size=256)
ARCHS = ("qwen3", "qwen3_moe")
RING2 = {"zero_stage": 2, "ring_attn_size": 2}
LAYOUTS = {"ring2": (2, ARCHS), "ring2_dp2": (4, ("qwen3",))}  # name -> (world size, archs)
# also with HF gradient checkpointing: the backward recomputes the attention (its all-gathers) inside the layout
STRIDE2_ZERO3 = {"ring_attn_head_stride": 2, "zero_stage": 3, "zero3_param_persistence_threshold": 0,
                 "gradient_checkpointing_enable": True}
CASES = [(name, arch) for name, (_, archs) in LAYOUTS.items() for arch in archs] + [("ring2_stride2_zero3", "qwen3")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch(seed=0, vocab_size=1024)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    from openrlhf_shape.testing import make_tiny_model

    moe = make_tiny_model(tmp_path_factory.mktemp("ring_moe") / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2,
                          vocab_size=1024)
    return {"qwen3": tiny_models["qwen3"], "qwen3_moe": str(moe)}


def _run(world: int, zero: dict, models: dict, batch: dict, variants: dict | None = None) -> list[dict]:
    return run_ranks("ring_scenarios:ring_run", world, timeout=900, env={"DS_ACCELERATOR": "cpu"},
                     extra_pythonpath=[HERE, MEGATRON_TESTS],
                     kwargs=dict(cfg=CFG, zero=zero, model_dirs=models, batch=batch, variants=variants))


@pytest.fixture(scope="module")
def runs(models, batch) -> dict[str, list[dict]]:
    out = {"world1": _run(1, {"zero_stage": 2}, models, batch)}
    for name, (world, archs) in LAYOUTS.items():
        variants = {"stride2_zero3": (STRIDE2_ZERO3, ["qwen3"])} if name == "ring2" else None
        out[name] = _run(world, RING2, {a: models[a] for a in archs}, batch, variants)
    out["ring2_stride2_zero3"] = [{**r["variants"]["stride2_zero3"], "ranks": r["ranks"]} for r in out["ring2"]]
    return out


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
