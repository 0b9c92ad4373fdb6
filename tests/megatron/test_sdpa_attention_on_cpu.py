"""The local spec's SDPA core attention (``local_attention='sdpa'``) against Megatron's own
DotProductAttention and Hugging Face, on CPU/gloo: same log-probs, entropies and training steps.

SDPA is what lets 8k/16k-token micro-batches fit without transformer-engine (Megatron's local
attention keeps [batch*heads, s, s] scores); on GPU the GPU kit (scripts/gpu_check.sh) measures
the memory. Here the arithmetic is checked: same model, same batch, both attentions.
"""

from __future__ import annotations

import pytest

from mg_helpers import hf_logprobs_entropy, max_abs_diff, run_layout
from openrlhf_shape.cluster.rank_group import merge_rank_outputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARITY_TOL = 1e-4
STEPS = 3
CFG = dict(lr=2e-3, lr_decay_style="constant", total_steps=STEPS, micro_batch_max_tokens=96, clip_grad=1.0,
           entropy_chunk_size=16)


@pytest.fixture(scope="module")
def runs(tiny_models, ragged_batch):
    world1 = run_layout(1, cfg=CFG, model_dirs=tiny_models, batch=ragged_batch, train_dir=tiny_models["qwen3"],
                        train_steps=STEPS, variants={"sdpa": {"local_attention": "sdpa"}})
    # TP2: 2 query heads and 1 KV group per rank (GQA inside SDPA), plus sequence parallel
    tp2 = run_layout(2, cfg={**CFG, "tensor_model_parallel_size": 2, "local_attention": "sdpa"},
                     model_dirs={"qwen3": tiny_models["qwen3"]}, batch=ragged_batch,
                     train_dir=tiny_models["qwen3"], train_steps=STEPS,
                     variants={"sp": {"sequence_parallel": True}})
    return {"world1": world1, "tp2": tp2}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_sdpa_matches_megatron_attention_and_hf_on_cpu(runs, tiny_models, ragged_batch, arch):
    n = len(ragged_batch["sequences"])
    res = runs["world1"][0]
    base = merge_rank_outputs([res["logprobs"][arch]], n)
    sdpa = merge_rank_outputs([res["variants"]["sdpa"]["logprobs"][arch]], n)
    ref_lp, ref_ent = hf_logprobs_entropy(tiny_models[arch], ragged_batch)
    assert max_abs_diff(sdpa["log_probs"], base["log_probs"]) <= 1e-5
    assert max_abs_diff(sdpa["entropy"], base["entropy"]) <= 1e-5
    assert max_abs_diff(sdpa["log_probs"], ref_lp) <= PARITY_TOL
    assert max_abs_diff(sdpa["entropy"], ref_ent) <= PARITY_TOL


def test_sdpa_training_steps_match_megatron_attention_on_cpu(runs):
    res = runs["world1"][0]
    ref = [m["loss"] for m in res["metrics"]]
    assert max(ref) - min(ref) > 1e-3  # the model moves, so equal trajectories mean something
    for name, metrics in [("world1_sdpa", res["variants"]["sdpa"]["metrics"])] + [
        (f"tp2_rank{r}", rr["metrics"]) for r, rr in enumerate(runs["tp2"])
    ] + [(f"tp2_sp_rank{r}", rr["variants"]["sp"]["metrics"]) for r, rr in enumerate(runs["tp2"])]:
        assert [m["loss"] for m in metrics] == pytest.approx(ref, abs=2e-5), name
        assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in res["metrics"]], rel=1e-4), name


def test_sdpa_tp2_parity_with_hf_on_cpu(runs, tiny_models, ragged_batch):
    n = len(ragged_batch["sequences"])
    got = merge_rank_outputs([r["logprobs"]["qwen3"] for r in runs["tp2"]], n)
    ref_lp, ref_ent = hf_logprobs_entropy(tiny_models["qwen3"], ragged_batch)
    assert max_abs_diff(got["log_probs"], ref_lp) <= PARITY_TOL
    assert max_abs_diff(got["entropy"], ref_ent) <= PARITY_TOL
