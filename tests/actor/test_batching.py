"""Micro-batch layouts and plans (actor/batching.py): the packed layout on a hand example, first-fit packing
against the padded plan, the forward-only token budget, equal micro-batch counts with fillers, and the
padded-token share report."""

from __future__ import annotations

import pytest
import torch

from openrlhf_shape.actor.batching import (build_micro_batch, build_packed_micro_batch, micro_batch_budget,
                                           padding_report, plan_micro_batches, rank_micro_batches)
from openrlhf_shape.actor.optim import OptimConfig
from openrlhf_shape.batch import SequenceBatch

SEQS = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
PLENS = [2, 1, 3]


def test_packed_micro_batch_on_a_hand_example():
    mb = build_packed_micro_batch(SEQS, PLENS, [2, 0], pad_id=0, pad_multiple=4)
    # sample 2 then sample 0, then one pad position (8 = a multiple of 4) as a document of its own
    assert mb.input_ids.tolist() == [[16, 17, 18, 19, 11, 12, 13, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb.cu_seqlens == [0, 4, 7, 8] and mb.max_seqlen == 4 and mb.packed
    # sample 2 (prompt 3): position 2 predicts 19; sample 0 (prompt 2, at offset 4): position 5 predicts 13
    assert mb.resp_rows.tolist() == [0, 0] and mb.resp_pos.tolist() == [2, 5] and mb.resp_targets.tolist() == [19, 13]
    assert mb.resp_offsets == [(0, 1), (1, 2)] and mb.rows == [2, 0] and mb.seq_lens == [4, 3]
    assert mb.padding_mask().tolist() == [[False] * 7 + [True]]
    assert mb.segments() == [(0, 0, 4), (0, 4, 3)]


def test_both_layouts_index_the_same_response_tokens():
    packed = build_packed_micro_batch(SEQS, PLENS, [0, 1, 2])
    padded = build_micro_batch(SEQS, PLENS, [0, 1, 2])
    assert packed.resp_targets.tolist() == padded.resp_targets.tolist() == [13, 15, 19]
    assert packed.resp_offsets == padded.resp_offsets
    flat = packed.input_ids[packed.resp_rows, packed.resp_pos]
    assert flat.tolist() == padded.input_ids[padded.resp_rows, padded.resp_pos].tolist() == [12, 14, 18]
    assert not padded.packed and padded.padding_mask().tolist() == [[False] * 3 + [True], [False] * 2 + [True] * 2,
                                                                    [False] * 4]
    assert padded.segments() == [(0, 0, 3), (1, 0, 2), (2, 0, 4)]


def test_packed_plan_is_first_fit_decreasing_by_total_tokens():
    lengths = [10, 3, 7, 2, 9]  # budget 12
    assert plan_micro_batches(lengths, 12, packed=True) == [[0, 3], [4, 1], [2]]
    assert plan_micro_batches(lengths, 12) == [[0], [4], [2], [1, 3]]  # padded: rows x longest row
    # the tail to a multiple of 4 counts: 10 + 2 = 12 fits, 9 + 3 = 12 fits, 7 + 2 would too but 2 went first
    assert plan_micro_batches(lengths, 12, packed=True, pad_multiple=4) == [[0, 3], [4, 1], [2]]
    # budget 11 with tails to 4: 7 + 3 = 10 pads to 12 and no longer fits; 3 + 2 = 5 pads to 8 and does
    assert plan_micro_batches(lengths, 11, packed=True, pad_multiple=4) == [[0], [4], [2], [1, 3]]
    assert plan_micro_batches([30, 5], 12, packed=True) == [[0], [1]]  # longer than the budget: its own


def test_forward_passes_take_their_own_token_budget():
    train_only = OptimConfig(micro_batch_max_tokens=8)
    both = OptimConfig(micro_batch_max_tokens=8, forward_max_tokens=64)
    assert micro_batch_budget(train_only, forward_only=True) == micro_batch_budget(train_only, forward_only=False) == 8
    assert micro_batch_budget(both, forward_only=True) == 64 and micro_batch_budget(both, forward_only=False) == 8
    batch = SequenceBatch(sequences=[[5] * 6] * 6, prompt_lens=[2] * 6)
    kw = dict(dp_size=1, dp_rank=0, packed=True, pad_id=0)
    assert len(rank_micro_batches(batch, max_tokens=micro_batch_budget(both, forward_only=False), **kw)[1]) == 6
    assert len(rank_micro_batches(batch, max_tokens=micro_batch_budget(both, forward_only=True), **kw)[1]) == 1
    with pytest.raises(ValueError, match="forward_max_tokens"):
        OptimConfig(forward_max_tokens=0)


@pytest.mark.parametrize("packed", [True, False])
def test_every_rank_runs_as_many_micro_batches_as_the_longest_plan(packed):
    batch = SequenceBatch(sequences=[[5] * 9, [6] * 3, [7] * 3], prompt_lens=[1, 1, 1])
    plans = [rank_micro_batches(batch, dp_size=2, dp_rank=r, max_tokens=4, packed=packed, pad_id=0,
                                equal_counts=True) for r in range(2)]
    (shard0, mbs0), (shard1, mbs1) = plans
    assert shard0 == [0] and shard1 == [1, 2]  # balanced by tokens: 9 vs 3 + 3
    assert len(mbs0) == len(mbs1) == 2  # rank 0's one sample is topped up with a filler
    filler = mbs0[1]
    assert filler.rows == [] and filler.input_ids.tolist() == [[0, 0]] and filler.resp_targets.numel() == 0
    assert filler.packed is packed
    assert len(rank_micro_batches(batch, dp_size=2, dp_rank=0, max_tokens=4, packed=packed, pad_id=0)[1]) == 1


def test_padding_report_counts_computed_against_real_tokens():
    lengths = [100, 60, 50, 10]  # one rank, budget 200: padded [100, 60] [50, 10]; packed [100, 60, 10] [50]
    rep = padding_report(lengths, 200)
    assert rep["padded"]["computed_tokens"] == 2 * 100 + 2 * 50 and rep["padded"]["micro_batches"] == 2
    assert rep["packed"]["computed_tokens"] == 220 and rep["packed"]["micro_batches"] == 2
    assert rep["padded"]["padded_share"] == pytest.approx((300 - 220) / 300) and rep["packed"]["padded_share"] == 0
    tail = padding_report(lengths, 200, dp_size=2, pad_multiple=4)  # ranks [100, 10] and [60, 50]
    assert tail["packed"]["computed_tokens"] == 112 + 112 and tail["padded"]["computed_tokens"] == 200 + 120
    assert tail["packed"]["real_tokens"] == 220


def test_packed_rows_of_a_micro_batch_restart_positions():
    mb = build_packed_micro_batch([[1] * 5, [2] * 3], [1, 1], [0, 1])
    starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
    assert starts == mb.cu_seqlens[:-1] == [0, 5]
    assert torch.equal(mb.position_ids, torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))
