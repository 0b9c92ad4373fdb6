"""Context parallelism on the Megatron backend, CPU/gloo (issue 36, item 2).

``--megatron.context_parallel_size 2`` splits every sequence (a padded micro-batch's rows; each document of a packed
one, padded to a multiple of 2 x CP) into 4 chunks, rank r holding chunks r and 3 - r (megatron-core's split; the
padded split is checked against its ``get_batch_on_this_cp_rank``); the local attentions all-gather K/V over the CP
group. On the same weights and tokens (8 sequences of 33..1900 tokens, 3853 in all, one with an empty response),
for a tiny Qwen3 and a tiny Qwen3-MoE, packed and padded: CP2 (world 2), CP2 x DP2 (world 4, Qwen3) and CP2 x TP2
with sequence parallel (world 4) give the world-1 log-probs and entropy within 1e-5 and the world-1 gradients after
one step within 1e-5 relative per parameter (full HF-named gradients: the bridge's export run on the gradient
buffers), on Megatron's own local attention and (Qwen3, CP2) on the SDPA core attention with full activation
recompute.
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

CP_TOL = 1e-5  # log-probs / entropy vs world 1
GRAD_RTOL = 1e-5  # per parameter vs world 1
CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=2048, max_norm=0.0,
           entropy_chunk_size=256)
ARCHS = ("qwen3", "qwen3_moe")
CP2 = {"context_parallel_size": 2}
LAYOUTS = {  # name -> (world size, config, archs)
    "cp2": (2, CP2, ARCHS),
    "cp2_dp2": (4, CP2, ("qwen3",)),
    "cp2_tp2_sp": (4, {**CP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, ARCHS),
}
CASES = [(name, arch, layout) for name, (_, _, archs) in LAYOUTS.items() for arch in archs
         for layout in ("packed", "padded")] + [("cp2_sdpa", "qwen3", layout) for layout in ("packed", "padded")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch(seed=0, vocab_size=1024)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    from openrlhf_shape.testing import make_tiny_model

    moe = make_tiny_model(tmp_path_factory.mktemp("cp_moe") / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2,
                          vocab_size=1024)
    return {"qwen3": tiny_models["qwen3"], "qwen3_moe": str(moe)}


def _run(world: int, cfg: dict, models: dict, batch: dict, variants: dict | None = None) -> list[dict]:
    return run_ranks("cp_scenarios:cp_run", world, timeout=900, extra_pythonpath=[HERE],
                     kwargs=dict(cfg=cfg, model_dirs=models, batch=batch, variants=variants))


@pytest.fixture(scope="module")
def runs(models, batch) -> dict[str, list[dict]]:
    """Per layout, every rank's results; ``cp2_sdpa``: the CP2 ranks again with ``--megatron.local_attention sdpa``
    and ``--actor.gradient_checkpointing_enable`` (Megatron's full recompute)."""
    out = {"world1": _run(1, CFG, models, batch)}
    for name, (world, extra, archs) in LAYOUTS.items():
        # SDPA core attention, with Megatron's full activation recompute (the backward reruns the all-gathers)
        variants = ({"sdpa": ({"local_attention": "sdpa", "gradient_checkpointing_enable": True}, ["qwen3"])}
                    if name == "cp2" else None)
        out[name] = _run(world, {**CFG, **extra}, {a: models[a] for a in archs}, batch, variants)
    out["cp2_sdpa"] = [{**r["variants"]["sdpa"], "ranks": r["ranks"]} for r in out["cp2"]]
    return out


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_logprobs_entropy_equal_world1_on_cpu(runs, batch, name, arch, layout):
    n = len(batch["sequences"])
    ours, ref = merged(runs[name], arch, layout, n), merged(runs["world1"], arch, layout, n)
    assert max_abs_diff(ours.log_probs, ref.log_probs) <= CP_TOL
    assert max_abs_diff(ours.entropy, ref.entropy) <= CP_TOL
    assert ours.log_probs[6].numel() == 0  # the empty response stays empty, in batch order
    holders = [r for r in runs[name] if r[arch][layout]["logprobs"]]
    assert holders and all(r["ranks"]["cp"] == 0 and r["ranks"]["tp"] == 0 for r in holders)


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_gradients_equal_world1_after_one_step_on_cpu(runs, name, arch, layout):
    ref = runs["world1"][0][arch][layout]
    for rank_res in runs[name]:
        res = rank_res[arch][layout]
        worst, where = worst_grad_rel_diff(res["grads"], ref["grads"])
        assert worst <= GRAD_RTOL, where
        assert res["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
        assert res["metrics"]["num_tokens"] == ref["metrics"]["num_tokens"]
        assert res["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert res["info"]["num_parameters"] == ref["info"]["num_parameters"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_ranks_hold_balanced_halves_of_every_sequence_on_cpu(runs, batch, name):
    world, extra, archs = LAYOUTS[name]
    tp = extra.get("tensor_model_parallel_size", 1)
    assert all(r["ranks"]["dp_size"] == world // (2 * tp) for r in runs[name])
    for layout in ("packed", "padded"):
        by_cp = {}
        for r in runs[name]:
            if r["ranks"]["tp"] == 0:
                by_cp.setdefault(r["ranks"]["cp"], []).append(r[archs[0]][layout]["split"])
        assert sorted(by_cp) == [0, 1]
        for dp_slot in range(len(by_cp[0])):  # the CP peers of one DP rank
            s0, s1 = by_cp[0][dp_slot], by_cp[1][dp_slot]
            assert s0["global"] == s1["global"] and all(g % (4 * tp) == 0 for g in s0["global"])
            for g, p0, p1 in zip(s0["global"], s0["positions"], s1["positions"]):
                assert len(p0) == len(p1) == g // 2 and sorted(p0 + p1) == list(range(g))
            if layout == "padded":  # megatron-core's get_batch_on_this_cp_rank hands each rank the same tokens
                assert s0["megatron_agrees"] and all(s0["megatron_agrees"] + s1["megatron_agrees"])
