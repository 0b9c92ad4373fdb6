"""The pad token's embedding row gets no gradient from its lookups on Megatron, as on DeepSpeed/Hugging Face
(``megatron/pad_embedding.py``).

A batch whose prompts and responses hold the pad id (0 in the tiny models, whose config names it and whose HF
embedding zeroes and freezes that row through ``padding_idx``) as input tokens, one step with clipping off: the
pad row's gradient is exactly 0 on Megatron world 1 (padded and packed), on TP2 with sequence parallel (the row
lives on TP rank 0; the embedding's output is reduce-scattered over the sequence) and on DeepSpeed; Megatron's
embedding gradient and whole gradient norm equal DeepSpeed's. Before the fix Megatron's pad row held ~all of the
gradient (agent batches: grad norm 3185 against DeepSpeed's 3.06).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from openrlhf_shape.actor.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
PAD = 0
CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=256, max_norm=0.0,
           entropy_chunk_size=64)


def _batch() -> dict:
    rng = random.Random(3)
    seqs, plens = [], []
    for n in (120, 90, 64, 41):
        seq = [rng.randint(5, 1023) for _ in range(n)]
        p = rng.randint(8, 20)
        for pos in (p // 2, p + 5, p + 17, n - 10):  # once in the prompt, three times in the response (never last)
            seq[pos] = PAD
        seqs.append(seq)
        plens.append(p)
    return {"sequences": seqs, "prompt_lens": plens, "temperature": 1.0}


@pytest.fixture(scope="module")
def runs(tiny_models) -> dict:
    models, batch = {"qwen3": tiny_models["qwen3"]}, _batch()
    mg = run_ranks("packing_scenarios:megatron_packing_run", 1, timeout=600, extra_pythonpath=[HERE],
                   kwargs=dict(cfg=CFG, model_dirs=models, batch=batch))
    tp2 = run_ranks("packing_scenarios:megatron_packing_run", 2, timeout=600, extra_pythonpath=[HERE],
                    kwargs=dict(cfg={**CFG, "tensor_model_parallel_size": 2, "sequence_parallel": True},
                                model_dirs=models, batch=batch))
    ds = run_ranks("packing_scenarios:zero_packing_run", 1, timeout=600, env={"DS_ACCELERATOR": "cpu"},
                   extra_pythonpath=[HERE], kwargs=dict(cfg=CFG, zero={"zero_stage": 2}, model_dirs=models, batch=batch))
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
