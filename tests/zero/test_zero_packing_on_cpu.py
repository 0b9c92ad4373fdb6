"""Sample packing on the DeepSpeed backend, CPU/gloo (issue 36, items 1 and 4).

A packed micro-batch is one ``[1, T]`` row of several samples whose position ids restart at every sample;
Hugging Face's attention (``sdpa`` here) then masks each sample to itself (transformers' mask builder finds the
samples from the position ids). ZeRO-2 at world 2 (data-parallel sharding, filler micro-batches topped up to
equal counts), on the same weights and tokens as the padded layout (8 sequences of 33..1900 tokens): per-sample
log-probs and entropy within 1e-5, one step's gradients (DeepSpeed's full gradient after the reduction) within
1e-5 relative per parameter, for a tiny Qwen3 and a tiny Qwen3-MoE. Item 4 as on Megatron: the head's largest
logits-shaped tensor has its chunk of rows, forward and backward, and a whole micro-batch's when unchunked.

The ranks are tests/megatron/long_runs.py's DeepSpeed world-2 launch (shared with the ring-attention tests).
"""

from __future__ import annotations

import pytest

from long_runs import ARCHS, LONG_CFG as CFG, batch as long_batch, long_models, shared_zero_world2
from mg_helpers import hf_logprobs_entropy, max_abs_diff
from openrlhf_shape.actor.batching import padding_report
from packing_checks import computed_positions, merged, worst_grad_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PACK_TOL = 1e-5
GRAD_RTOL = 1e-5
HF_TOL = 1e-5  # HF's own attention on both sides (tests/zero's parity tolerance)


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def models(shared_results, tiny_models) -> dict[str, str]:
    return long_models(shared_results, tiny_models)


@pytest.fixture(scope="module")
def zero2(shared_results, models) -> list[dict]:
    return shared_zero_world2(shared_results, models)["zero2"]


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
