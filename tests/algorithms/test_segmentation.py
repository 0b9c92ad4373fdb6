"""Cutpoint properties (hypothesis) and the w/o-EBS ablations."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_shape.algorithms import (
    ShapeConfig,
    boundaries_to_segment_ids,
    delimiter_cutpoints,
    entropy_cutpoints,
    segment_batch,
    segment_lengths,
    uniform_cutpoints,
)


@st.composite
def responses(draw):
    t = draw(st.integers(1, 120))
    pad = draw(st.integers(0, 10))
    ent = draw(st.lists(st.floats(0, 5, allow_nan=False, width=32), min_size=t, max_size=t))
    k = draw(st.integers(1, 10))
    min_len = draw(st.integers(1, 12))
    q = draw(st.sampled_from([0.0, 0.5, 0.8, 0.95]))
    return t, pad, ent, k, min_len, q


@settings(max_examples=300, deadline=None)
@given(responses())
def test_entropy_cutpoint_properties(case):
    t, pad, ent, k, min_len, q = case
    entropy = torch.tensor(ent + [9.0] * pad)  # padding holds junk that must be ignored
    mask = torch.tensor([True] * t + [False] * pad)
    b = entropy_cutpoints(entropy, mask, k, quantile=q, min_segment_len=min_len)
    tau = torch.quantile(torch.tensor(ent), q)
    assert b.dtype == torch.long
    assert b.numel() <= k - 1
    assert torch.equal(b, torch.unique(b))  # sorted, unique
    assert ((b > 0) & (b < t)).all()  # inside
    assert (entropy[b] > tau).all()  # only above-threshold tokens
    edges = torch.cat([torch.tensor([0]), b, torch.tensor([t])])
    if b.numel():
        assert (edges[1:] - edges[:-1] >= min_len).all()  # minimum segment length
    # count: as many as possible up to K-1 - if a further candidate fits the spacing rule, we took K-1.
    cand = [i for i in range(1, t) if ent[i] > float(tau) and min_len <= i <= t - min_len]
    fits = [c for c in cand if all(abs(c - x) >= min_len for x in b.tolist())]
    assert b.numel() == k - 1 or not fits


def test_downsampling_takes_nearest_candidate_to_targets():
    ent = torch.zeros(100)
    ent[[10, 24, 26, 49, 52, 77, 90]] = 5.0
    b = entropy_cutpoints(ent, torch.ones(100, dtype=torch.bool), num_segments=4, threshold=1.0, min_segment_len=1)
    assert b.tolist() == [24, 49, 77]  # targets 25, 50, 75; 24 beats 26 on the tie


def test_absolute_threshold_and_no_invented_boundaries():
    ent = torch.zeros(50)
    mask = torch.ones(50, dtype=torch.bool)
    assert entropy_cutpoints(ent, mask, 8, threshold=0.5).numel() == 0  # flat entropy: one segment
    ent[30] = 1.0
    assert entropy_cutpoints(ent, mask, 8, threshold=0.5).tolist() == [30]


@pytest.mark.parametrize(
    "entropy, mask, match",
    [
        (torch.tensor([0.1, float("nan"), 0.3]), torch.ones(3, dtype=torch.bool), "NaN"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.bool), "empty"),
        (torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool), "1-D"),
        (torch.zeros(3), torch.ones(4, dtype=torch.bool), "shape"),
        (torch.zeros(3), torch.tensor([True, False, True]), "right-padded"),
    ],
)
def test_bad_inputs(entropy, mask, match):
    with pytest.raises(ValueError, match=match):
        entropy_cutpoints(entropy, mask, 4)


def test_nan_in_padding_is_ignored():
    ent = torch.tensor([0.1, 2.0, 0.1, 0.1, float("nan")])
    b = entropy_cutpoints(ent, torch.tensor([True] * 4 + [False]), 2, threshold=1.0, min_segment_len=1)
    assert b.tolist() == [1]


def test_uniform_and_delimiter_ablations():
    assert uniform_cutpoints(100, 4).tolist() == [25, 50, 75]
    assert uniform_cutpoints(3, 8).tolist() == [1, 2]
    assert uniform_cutpoints(10, 4, min_segment_len=5).tolist() == [5]
    ids = torch.tensor([5, 7, 99, 5, 5, 99, 5, 5, 5, 99, 5, 5])
    b = delimiter_cutpoints(ids, torch.ones(12, dtype=torch.bool), {99}, num_segments=8, min_segment_len=1)
    assert b.tolist() == [3, 6, 10]  # right after each delimiter token


def test_batched_segmentation_matches_single():
    torch.manual_seed(0)
    ent = torch.rand(6, 40)
    lengths = torch.tensor([40, 1, 17, 33, 5, 22])
    mask = torch.arange(40)[None, :] < lengths[:, None]
    cfg = ShapeConfig(num_segments=5, min_segment_len=3)
    bb = segment_batch(ent, mask, cfg)
    for i in range(6):
        single = entropy_cutpoints(ent[i], mask[i], 5, quantile=0.8, min_segment_len=3)
        row = bb[i][bb[i] >= 0]
        assert torch.equal(row, single)
    seg_len, n = segment_lengths(bb, lengths)
    assert torch.equal(seg_len.sum(-1), lengths)
    assert torch.equal(n, (bb >= 0).sum(-1) + 1)
    ids = boundaries_to_segment_ids(bb, 40)
    for i in range(6):
        single = boundaries_to_segment_ids(bb[i][bb[i] >= 0], 40)
        assert torch.equal(ids[i], single)
        assert ids[i, : lengths[i]].max() == n[i] - 1


def test_batched_modes_match_single(tiny_tokenizer):
    """Every mode through its registered class (as the maker binds it: once, with the tokenizer) equals the
    single-response functions row by row; the delimiter mode's ids are the tokens whose text holds the delimiter."""
    from openrlhf_shape.algorithms import get_segmentation

    text = "First we add.\n\nThen we carry the one.\n\nSo 12 + 9 = 21.\n\nDone, that is all there is to it."
    row = tiny_tokenizer(text)["input_ids"]
    ids = torch.tensor([row, row[3:] + [row[0]] * 3])
    lengths = torch.tensor([len(row), len(row) - 6])
    mask = torch.arange(len(row))[None, :] < lengths[:, None]
    ent = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    cfg = ShapeConfig(segmentation="delimiter", delimiter=".", num_segments=4, min_segment_len=2)
    delimiter = get_segmentation(cfg, tiny_tokenizer)  # the tiny vocabulary splits "\n\n": cut after "."
    assert delimiter.needs_token_ids
    assert delimiter.delimiter_ids == {i for i in range(len(tiny_tokenizer)) if "." in tiny_tokenizer.decode([i])}
    uniform = get_segmentation(ShapeConfig(segmentation="uniform", num_segments=4, min_segment_len=2))
    bd, bu = delimiter(ent, mask, ids), uniform(ent, mask)
    for i in range(2):
        want = delimiter_cutpoints(ids[i], mask[i], delimiter.delimiter_ids, num_segments=4, min_segment_len=2)
        assert torch.equal(bd[i][bd[i] >= 0], want) and len(want) == 3  # right after each "." but the last
        t = int(lengths[i])  # the downsampling rule: the position nearest j*T/K, ties to the earlier one
        assert bu[i].tolist() == [min(range(1, t), key=lambda b: (abs(b - j * t / 4), b)) for j in (1, 2, 3)]
    with pytest.raises(ValueError, match="--shape.segmentation delimiter needs the responses' token ids"):
        delimiter(ent, mask)
    with pytest.raises(ValueError, match="--shape.segmentation delimiter needs the policy's tokenizer"):
        segment_batch(ent, mask, ShapeConfig(segmentation="delimiter"))
