"""Sample packing on the DeepSpeed backend, CPU/gloo (issue 36, items 1 and 4).

A packed micro-batch is one ``[1, T]`` row of several samples whose position ids restart at every sample;
Hugging Face's attention (``sdpa`` here) then masks each sample to itself (transformers' mask builder finds the
samples from the position ids). ZeRO-2 at world 2 (data-parallel sharding, filler micro-batches topped up to
equal counts), on the same weights and tokens as the padded layout (8 sequences of 33..1900 tokens): per-sample
log-probs and entropy within 1e-5, one step's gradients (DeepSpeed's full gradient after the reduction) within
1e-5 relative per parameter, for a tiny Qwen3 and a tiny Qwen3-MoE. Item 4 as on Megatron: the head's largest
logits-shaped tensor has its chunk of rows, forward and backward, and a whole micro-batch's when unchunked.
"""

from __future__ import annotations

import os

import pytest

from mg_helpers import hf_logprobs_entropy, max_abs_diff
from openrlhf_shape.actor.batching import padding_report
from openrlhf_shape.actor.launch import run_ranks
from openrlhf_shape.testing.batches import long_batch
from packing_checks import computed_positions, merged, worst_grad_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_TESTS = os.path.join(os.path.dirname(HERE), "megatron")

PACK_TOL = 1e-5
GRAD_RTOL = 1e-5
HF_TOL = 1e-5  # HF's own attention on both sides (tests/zero's parity tolerance)
CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=2048, max_norm=0.0,
           entropy_chunk_size=256)
ARCHS = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch(seed=0, vocab_size=1024)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    from openrlhf_shape.testing import make_tiny_model

    moe = make_tiny_model(tmp_path_factory.mktemp("zpack_moe") / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2,
                          vocab_size=1024)
    return {"qwen3": tiny_models["qwen3"], "qwen3_moe": str(moe)}


@pytest.fixture(scope="module")
def zero2(models, batch) -> list[dict]:
    return run_ranks("packing_scenarios:zero_packing_run", 2, timeout=900, env={"DS_ACCELERATOR": "cpu"},
                     extra_pythonpath=[MEGATRON_TESTS],
                     kwargs=dict(cfg=CFG, zero={"zero_stage": 2}, model_dirs=models, batch=batch, watch_arch="qwen3"))


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logprobs_entropy_equal_padded_on_cpu(zero2, models, batch, arch):
    n = len(batch["sequences"])
    packed, padded = merged(zero2, arch, "packed", n), merged(zero2, arch, "padded", n)
    assert max_abs_diff(packed.log_probs, padded.log_probs) <= PACK_TOL
    assert max_abs_diff(packed.entropy, padded.entropy) <= PACK_TOL
    ref_lp, ref_ent = hf_logprobs_entropy(models[arch], batch)
    assert max_abs_diff(packed.log_probs, ref_lp) <= HF_TOL and max_abs_diff(packed.entropy, ref_ent) <= HF_TOL
    assert packed.log_probs[6].numel() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_gradients_equal_padded_after_one_step_on_cpu(zero2, arch):
    for rank_res in zero2:  # the full (reduced) gradient, on each rank
        worst, where = worst_grad_rel_diff(rank_res[arch]["packed"]["grads"], rank_res[arch]["padded"]["grads"])
        assert worst <= GRAD_RTOL, where


def test_packed_micro_batches_are_one_row_on_every_rank_on_cpu(zero2, batch):
    real = sum(len(s) for s in batch["sequences"])
    packed = [mb for r in zero2 for mb in r["qwen3"]["packed"]["micro_batches"]]
    padded = [mb for r in zero2 for mb in r["qwen3"]["padded"]["micro_batches"]]
    assert all(mb["packed"] and mb["shape"][0] == 1 for mb in packed)
    counts = {len(r["qwen3"]["packed"]["micro_batches"]) for r in zero2}
    assert len(counts) == 1  # ZeRO's collectives: the same count on both ranks (fillers carry no sample)
    fillers = [mb for mb in packed if not mb["rows"]]
    assert computed_positions(packed) == real + 2 * len(fillers)  # no padding beyond the two-token fillers
    # the padded-token share report plans what the ranks ran (fillers aside)
    report = padding_report([len(s) for s in batch["sequences"]], CFG["micro_batch_max_tokens"], dp_size=2)
    assert computed_positions(padded) == report["padded"]["computed_tokens"] > real
    assert computed_positions(packed) - 2 * len(fillers) == report["packed"]["computed_tokens"] == real
    assert sorted(i for mb in packed for i in mb["rows"]) == list(range(len(batch["sequences"])))


def test_head_never_holds_tokens_x_vocab_on_cpu(zero2):
    watch = zero2[0]["watch"]
    chunk = watch["chunk"]
    assert watch["max_response_tokens"] > 4 * chunk and watch["chunked"]["vocab"] == 1024
    assert 0 < watch["chunked"]["forward"] <= chunk and 0 < watch["chunked"]["train"] <= chunk
    assert watch["unchunked"]["forward"] == watch["max_response_tokens"]
    assert watch["unchunked"]["train"] == watch["max_response_tokens"]
