"""Context parallelism's load-balanced split (openrlhf_shape/actor/cp_split.py) on worked examples, and the packed
micro-batch it needs (each document padded to a multiple of 2 x CP inside its own document)."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch, build_packed_micro_batch, rank_micro_batches
from openrlhf_shape.actor.cp_split import chunk_positions, cp_shard
from openrlhf_shape.batch import SequenceBatch


def test_chunk_positions_pair_an_early_with_a_late_chunk():
    # 8 tokens, CP2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(0, 8, 2, 0) == [0, 1, 6, 7]
    assert chunk_positions(0, 8, 2, 1) == [2, 3, 4, 5]
    # CP4 over 16 tokens from offset 10: rank 1 holds chunks 1 and 6
    assert chunk_positions(10, 16, 4, 1) == [12, 13, 22, 23]
    with pytest.raises(ValueError, match="multiple of 2 x 2"):
        chunk_positions(0, 6, 2, 0)


def test_packed_documents_padded_to_two_cp_and_split_per_document():
    seqs, plens = [[5, 6, 7], [8, 9, 10, 11, 12, 13]], [1, 2]
    mb = build_packed_micro_batch(seqs, plens, [0, 1], pad_id=0, doc_multiple=4)
    assert mb.cu_seqlens == [0, 4, 12]  # 3 -> 4, 6 -> 8
    assert mb.input_ids[0].tolist() == [5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 0, 0]
    assert mb.padding_mask()[0].tolist() == [False] * 3 + [True] + [False] * 6 + [True] * 2
    # response positions: sample 0 predicts tokens 1..2 from positions 0..1; sample 1 tokens 2..5 from 5..8
    assert mb.resp_pos.tolist() == [0, 1, 5, 6, 7, 8]
    r0, r1 = cp_shard(mb, 2, 0), cp_shard(mb, 2, 1)
    assert r0.index.tolist() == [0, 3, 4, 5, 10, 11] and r1.index.tolist() == [1, 2, 6, 7, 8, 9]
    assert r0.local_bounds == r1.local_bounds == [(0, 2), (2, 6)]
    # every response position is held by exactly one rank, at the local position of its global one
    assert (r0.resp_local ^ r1.resp_local).all()
    for view in (r0, r1):
        assert view.index[view.resp_pos].tolist() == mb.resp_pos[view.resp_local].tolist()


def test_padded_rows_split_like_one_sequence():
    mb = build_micro_batch([[1] * 5, [2] * 8], [1, 1], [0, 1], pad_multiple=8)
    view = cp_shard(mb, 2, 1)
    assert view.index.tolist() == [2, 3, 4, 5] and view.local_bounds == [(0, 4)]
    # row 0 predicts from positions 0..3, of which 2..3 are here; row 1 from 0..6, of which 2..5
    assert view.resp_rows.tolist() == [0, 0, 1, 1, 1, 1]
    assert view.resp_pos.tolist() == [0, 1, 0, 1, 2, 3]


def test_rank_micro_batches_plan_with_padded_document_costs():
    batch = SequenceBatch.coerce({"sequences": [[3] * 5, [4] * 5, [5] * 2], "prompt_lens": [1, 1, 1],
                                  "temperature": 1.0})
    # documents cost 8, 8 and 4 tokens with doc_multiple 4: a budget of 12 holds 8 + 4, not 8 + 8
    _, mbs = rank_micro_batches(batch, dp_size=1, dp_rank=0, max_tokens=12, packed=True, pad_id=0, doc_multiple=4)
    assert [mb.cu_seqlens for mb in mbs] == [[0, 8, 12], [0, 8]]
    assert sorted(r for mb in mbs for r in mb.rows) == [0, 1, 2]
    assert all(torch.equal(mb.padding_mask()[0], mb.input_ids[0] == 0) for mb in mbs)
