"""The pad token's embedding row gets no gradient from its lookups on Megatron, as on DeepSpeed/Hugging Face
(``megatron/pad_embedding.py``).

A batch whose prompts and responses hold the pad id (0 in the tiny models, whose config names it and whose HF
embedding zeroes and freezes that row through ``padding_idx``) as input tokens, one step with clipping off: the
pad row's gradient is exactly 0 on Megatron world 1 (padded and packed), on TP2 with sequence parallel (the row
lives on TP rank 0; the embedding's output is reduce-scattered over the sequence) and on DeepSpeed; Megatron's
embedding gradient and whole gradient norm equal DeepSpeed's. Before the fix Megatron's pad row held ~all of the
gradient (agent batches: grad norm 3185 against DeepSpeed's 3.06).

The Megatron passes are layouts of long_runs.py's world-1 and world-2 launches (``pad``, ``pad_tp2_sp``: the batch
is ``long_runs.pad_batch``), shared with the packing and context-parallel tests; DeepSpeed's is a layout of its
world-1 launch there (shared with the ring-attention tests).
"""

from __future__ import annotations

import pytest
import torch

from long_runs import PAD, long_models, shared_world1, shared_world2, shared_zero_world1

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(shared_results, tiny_models) -> dict:
    models = long_models(shared_results, tiny_models)
    mg, tp2 = shared_world1(shared_results, models)["pad"], shared_world2(shared_results, models)["pad_tp2_sp"]
    ds = shared_zero_world1(shared_results, models)["pad"]
    return {"megatron": mg[0]["qwen3"], "tp2": [r["qwen3"] for r in tp2], "deepspeed": ds[0]["qwen3"]}


MG_EMB, DS_EMB = "embedding.word_embeddings.weight", "model.embed_tokens.weight"


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_pad_row_has_no_gradient_and_megatron_equals_deepspeed(runs, layout):
    mg, ds = runs["megatron"][layout]["grads"], runs["deepspeed"][layout]["grads"]
    assert float(ds[DS_EMB][PAD].abs().max()) == 0.0  # HF's padding_idx
    assert float(mg[MG_EMB][PAD].abs().max()) == 0.0
    assert float(mg[MG_EMB].abs().sum()) > 0  # the other rows learn
    assert torch.allclose(mg[MG_EMB], ds[DS_EMB], rtol=1e-4, atol=1e-7)
    assert _norm(mg) == pytest.approx(_norm(ds), rel=1e-4)


def test_pad_row_has_no_gradient_under_tp2_sequence_parallel(runs):
    for layout in ("padded", "packed"):
        shard0 = runs["tp2"][0][layout]["grads"][MG_EMB]  # rows [0, V/2): the pad row's shard
        assert shard0.shape[0] == 512 and float(shard0[PAD].abs().max()) == 0.0
        full = torch.cat([r[layout]["grads"][MG_EMB] for r in runs["tp2"]])
        assert torch.allclose(full, runs["megatron"][layout]["grads"][MG_EMB], rtol=1e-4, atol=1e-7)
