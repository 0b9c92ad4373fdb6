"""Sample packing on the Megatron backend, CPU/gloo (issue 36, items 1 and 4).

A packed micro-batch is one THD row of several samples with ``PackedSeqParams`` (``actor/batching.py``,
``megatron/attention.py``); a padded one is ``[rows, max_len]``. On the same weights and tokens (8 sequences of
33..1900 tokens, one with an empty response) both give the same per-sample log-probs and entropy within 1e-5 and
the same gradients after one step within 1e-5 relative (each parameter), for a tiny Qwen3 and a tiny Qwen3-MoE,
at world 1 and at TP2 with sequence parallel (vocab-parallel head; the pack padded to a multiple of TP as a
document of its own), on Megatron's own local attention run per document, and (Qwen3, world 1) on the SDPA core
attention. Item 4: the log-prob / entropy head
never holds a micro-batch's ``[tokens, vocab shard]`` logits: the largest logits-shaped tensor of a forward-only
pass and of a training step has the head's chunk of rows, and the watch sees the whole micro-batch when the chunk
is larger than it (the negative control).

The launches are long_runs.py's (world 1 and world 2), shared with the context-parallel and pad-token tests.
"""

from __future__ import annotations

import pytest

from long_runs import ARCHS, LONG_CFG as CFG, batch as long_batch, long_models, shared_world1, shared_world2, variant
from mg_helpers import hf_logprobs_entropy, max_abs_diff
from openrlhf_shape.actor.batching import padding_report
from packing_checks import computed_positions, merged, worst_grad_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PACK_TOL = 1e-5  # log-probs / entropy, packed vs padded
GRAD_RTOL = 1e-5  # per parameter, packed vs padded
HF_TOL = 1e-4  # vs a Hugging Face forward of each sequence alone (the layout tests' parity tolerance)


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def models(shared_results, tiny_models) -> dict[str, str]:
    return long_models(shared_results, tiny_models)


@pytest.fixture(scope="module")
def runs(shared_results, models) -> dict[str, list[dict]]:
    """Per layout, every rank's results (one step from the HF weights, no clipping: the gradients compared are the
    step's own). ``world1_sdpa``: the world-1 ranks again with the SDPA core attention (``--megatron.local_attention
    sdpa``: torch SDPA per document), on the dense model."""
    world1 = shared_world1(shared_results, models)["world1"]
    return {"world1": world1, "world1_sdpa": variant(world1, "sdpa"),
            "tp2_sp": shared_world2(shared_results, models)["tp2_sp"]}


@pytest.fixture(scope="module")
def hf_refs(models, batch):
    return {arch: hf_logprobs_entropy(path, batch) for arch, path in models.items()}


CASES = [(layout, arch) for layout in ("world1", "tp2_sp") for arch in ARCHS] + [("world1_sdpa", "qwen3")]


@pytest.mark.parametrize("layout, arch", CASES)
def test_packed_logprobs_entropy_equal_padded_on_cpu(runs, hf_refs, batch, layout, arch):
    n = len(batch["sequences"])
    packed, padded = merged(runs[layout], arch, "packed", n), merged(runs[layout], arch, "padded", n)
    assert max_abs_diff(packed.log_probs, padded.log_probs) <= PACK_TOL
    assert max_abs_diff(packed.entropy, padded.entropy) <= PACK_TOL
    ref_lp, ref_ent = hf_refs[arch]
    assert max_abs_diff(packed.log_probs, ref_lp) <= HF_TOL and max_abs_diff(packed.entropy, ref_ent) <= HF_TOL
    assert packed.log_probs[6].numel() == 0  # the empty response stays empty, in batch order


@pytest.mark.parametrize("layout, arch", CASES)
def test_packed_gradients_equal_padded_after_one_step_on_cpu(runs, layout, arch):
    for rank_res in runs[layout]:  # each TP rank compares its own shard
        packed, padded = rank_res[arch]["packed"], rank_res[arch]["padded"]
        worst, where = worst_grad_rel_diff(packed["shard_grads"], padded["shard_grads"])
        assert worst <= GRAD_RTOL, where
        assert packed["metrics"]["loss"] == pytest.approx(padded["metrics"]["loss"], abs=1e-6)
        assert packed["metrics"]["num_tokens"] == padded["metrics"]["num_tokens"]
        assert packed["metrics"]["grad_norm"] > 0


@pytest.mark.parametrize("layout", ["world1", "tp2_sp"])
def test_packed_micro_batches_are_one_row_without_padding_on_cpu(runs, batch, layout):
    res = runs[layout][0]["qwen3"]
    packed, padded = res["packed"]["micro_batches"], res["padded"]["micro_batches"]
    assert all(mb["packed"] and mb["shape"][0] == 1 for mb in packed)
    assert not any(mb["packed"] for mb in padded)
    real = sum(len(s) for s in batch["sequences"])
    # packed: the samples plus at most TP-1 positions of tail padding per micro-batch (sequence parallel)
    assert real <= computed_positions(packed) <= real + len(packed)
    # the padded-token share report plans what the ranks ran
    report = padding_report([len(s) for s in batch["sequences"]], CFG["micro_batch_max_tokens"],
                            pad_multiple=2 if layout == "tp2_sp" else 1)
    assert computed_positions(packed) == report["packed"]["computed_tokens"]
    assert computed_positions(padded) == report["padded"]["computed_tokens"] > 1.2 * real
    assert len(packed) == report["packed"]["micro_batches"] < len(padded) == report["padded"]["micro_batches"]
    assert sorted(r for mb in packed for r in mb["rows"]) == list(range(len(batch["sequences"])))


@pytest.mark.parametrize("layout", ["world1", "tp2_sp"])
def test_head_never_holds_tokens_x_vocab_on_cpu(runs, layout):
    watch = runs[layout][0]["watch"]
    chunk = watch["chunk"]
    assert watch["max_response_tokens"] > 4 * chunk  # a micro-batch long enough for the chunking to matter
    assert watch["chunked"]["vocab"] == (1024 if layout == "world1" else 512)  # the vocab shard under TP2
    assert 0 < watch["chunked"]["forward"] <= chunk and 0 < watch["chunked"]["train"] <= chunk
    # the negative control: a chunk larger than any micro-batch puts a micro-batch's [N, V/tp] in the head
    assert watch["unchunked"]["forward"] == watch["max_response_tokens"]
    assert watch["unchunked"]["train"] == watch["max_response_tokens"]
