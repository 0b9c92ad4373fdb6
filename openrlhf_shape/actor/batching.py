"""Data-parallel sharding and token-budget micro-batching (pure Python/torch, no Megatron).

Every rank receives the whole batch and computes the same plan, so no data moves between ranks.

Two layouts of a micro-batch (:class:`MicroBatch`):

* **packed** (the default wherever the attention supports it): the rows are concatenated into one
  row ``[1, T]`` with no padding between them; ``cu_seqlens`` marks where each sample starts, position
  ids restart at 0 for every sample, and the attention is document-causal (a token sees the earlier
  tokens of its own sample only). Megatron runs it as THD with ``PackedSeqParams``, the DeepSpeed
  backend's Hugging Face model as position-id packing. A micro-batch costs the sum of its lengths.
* **padded**: ``[rows, max_len]``, right padding, plain causal attention; a micro-batch costs
  ``rows x max_len``.

Both index the positions that predict response tokens the same way (``resp_rows``/``resp_pos``), so
the log-prob head, the loss and the per-sample outputs never look at the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from openrlhf_shape.batch import SequenceBatch


def shard_for_dp(lengths: list[int], dp_size: int) -> list[list[int]]:
    """Split sample indices over ``dp_size`` ranks, balanced by tokens; deterministic.

    Longest first, each to the rank with the fewest tokens so far (ties: fewest samples, then
    lowest rank). Returns per-rank index lists, each sorted ascending.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for idx in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda k: (loads[k], len(shards[k]), k))
        shards[r].append(idx)
        loads[r] += lengths[idx]
    return [sorted(s) for s in shards]


def plan_micro_batches(
    lengths: list[int], max_tokens: int, *, pad_multiple: int = 1, packed: bool = False
) -> list[list[int]]:
    """Group positions ``0..len(lengths)-1`` into micro-batches under a token budget (tokens computed).

    Padded (``packed=False``): sorted by length (longest first), filled in order, so rows of one
    micro-batch have similar lengths; a micro-batch costs ``rows x padded_max_len``.
    Packed: first-fit decreasing; a micro-batch costs the sum of its lengths, rounded up to
    ``pad_multiple``. Either way a single sequence longer than the budget gets a micro-batch of its
    own. Deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"micro_batch_max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if packed:
        return _first_fit(order, lengths, max_tokens, pad_multiple)
    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        padded = _round_up(lengths[i], pad_multiple)
        new_max = max(current_max, padded)
        if current and new_max * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, current_max = [], 0
            new_max = padded
        current.append(i)
        current_max = new_max
    if current:
        batches.append(current)
    return batches


def _first_fit(order: list[int], lengths: list[int], max_tokens: int, pad_multiple: int) -> list[list[int]]:
    """Bins of positions (in ``order``): each to the first bin whose padded total stays within budget."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if _round_up(load + lengths[i], pad_multiple) <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass
class MicroBatch:
    """One micro-batch, packed (``cu_seqlens`` set) or padded (``cu_seqlens`` None).

    ``input_ids``/``position_ids``: [rows, seq] int64 (packed: [1, T], positions restart at 0 at every
    sample). ``rows``: batch indices of the samples. ``resp_rows``/``resp_pos``: [N] flat index of each
    response-predicting position: the row and the position whose output predicts response token j
    (``prompt_len + j - 1`` of the sample; packed: plus the sample's offset). ``resp_targets``: [N] the
    predicted token ids. ``resp_offsets``: per sample, its slice of the flat arrays. ``seq_lens``: per
    sample, its length in tokens. ``cu_seqlens``: packed only, ``[0, l_0, l_0 + l_1, ..., T]``: the
    document boundaries; a tail of padding (to a multiple of the TP size under sequence parallel) is a
    document of its own, after the samples.
    """

    rows: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    resp_rows: torch.Tensor
    resp_pos: torch.Tensor
    resp_targets: torch.Tensor
    resp_offsets: list[tuple[int, int]]
    seq_lens: list[int] = field(default_factory=list)
    cu_seqlens: Optional[list[int]] = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_seqlen(self) -> int:
        """The longest document of a packed micro-batch (the row length of a padded one)."""
        if self.cu_seqlens is None:
            return int(self.input_ids.shape[1])
        return max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    @property
    def real_tokens(self) -> int:
        return sum(self.seq_lens)

    def padding_mask(self) -> torch.Tensor:
        """[rows, seq] bool, True at padding: after each row's ``seq_lens`` (padded), the tail (packed)."""
        if self.packed:
            return torch.arange(self.input_ids.shape[1])[None, :] >= self.real_tokens
        return torch.arange(self.input_ids.shape[1])[None, :] >= torch.tensor(self.seq_lens, dtype=torch.long)[:, None]

    def segments(self) -> list[tuple[int, int, int]]:
        """Per sample ``(row, start, length)``: where its tokens sit in ``input_ids``."""
        if self.packed:
            return [(0, a, n) for a, n in zip(self.cu_seqlens, self.seq_lens)]
        return [(k, 0, n) for k, n in enumerate(self.seq_lens)]


def _response_index(sequences: list[list[int]], prompt_lens: list[int], rows: list[int],
                    starts: list[tuple[int, int]]) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """Flat (row, position, target) of every response-predicting position, and each sample's slice."""
    resp_rows, resp_pos, resp_targets, offsets = [], [], [], []
    n = 0
    for r, (row, start) in zip(rows, starts):
        seq, p = sequences[r], prompt_lens[r]
        t = len(seq) - p
        resp_rows.extend([row] * t)
        resp_pos.extend(range(start + p - 1, start + p - 1 + t))
        resp_targets.extend(seq[p:])
        offsets.append((n, n + t))
        n += t
    return resp_rows, resp_pos, resp_targets, offsets


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def build_micro_batch(
    sequences: list[list[int]], prompt_lens: list[int], rows: list[int], *, pad_id: int = 0, pad_multiple: int = 1
) -> MicroBatch:
    """Pad ``sequences[rows]`` to one [rows, seq] tensor and index their response positions."""
    seq_len = _round_up(max(len(sequences[r]) for r in rows), pad_multiple)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, : len(sequences[r])] = _long(sequences[r])
    resp_rows, resp_pos, resp_targets, offsets = _response_index(sequences, prompt_lens, rows,
                                                                 [(k, 0) for k in range(len(rows))])
    pos = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(len(rows), -1).contiguous()
    return MicroBatch(rows=list(rows), input_ids=ids, position_ids=pos, resp_rows=_long(resp_rows),
                      resp_pos=_long(resp_pos), resp_targets=_long(resp_targets), resp_offsets=offsets,
                      seq_lens=[len(sequences[r]) for r in rows])


def build_packed_micro_batch(
    sequences: list[list[int]], prompt_lens: list[int], rows: list[int], *, pad_id: int = 0, pad_multiple: int = 1
) -> MicroBatch:
    """Concatenate ``sequences[rows]`` into one ``[1, T]`` row (no padding between samples; a tail of
    ``pad_id`` up to a multiple of ``pad_multiple``, as its own document) and index their response positions."""
    lens = [len(sequences[r]) for r in rows]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tail = _round_up(cu[-1], pad_multiple) - cu[-1]
    ids = [t for r in rows for t in sequences[r]] + [pad_id] * tail
    pos = [j for n in lens for j in range(n)] + list(range(tail))
    if tail:
        cu.append(cu[-1] + tail)
    resp_rows, resp_pos, resp_targets, offsets = _response_index(sequences, prompt_lens, rows,
                                                                 [(0, a) for a in cu[:len(rows)]])
    return MicroBatch(rows=list(rows), input_ids=_long(ids)[None], position_ids=_long(pos)[None],
                      resp_rows=_long(resp_rows), resp_pos=_long(resp_pos), resp_targets=_long(resp_targets),
                      resp_offsets=offsets, seq_lens=lens, cu_seqlens=cu)


def micro_batch_budget(optim, *, forward_only: bool) -> int:
    """Tokens of one micro-batch on one data-parallel rank (``optim``: an ``actor.optim.OptimConfig``):
    ``forward_budget`` for a forward-only pass (``--rollout.max_tokens_per_gpu``, unset: the training budget),
    else ``micro_batch_max_tokens`` (``--train.max_tokens_per_gpu``). A forward keeps no activations for a
    backward, so it can take more tokens at once."""
    return int(optim.forward_budget if forward_only else optim.micro_batch_max_tokens)


def rank_micro_batches(batch: SequenceBatch, *, dp_size: int, dp_rank: int, max_tokens: int, packed: bool,
                       pad_id: int, pad_multiple: int = 1, equal_counts: bool = False) -> tuple[list[int], list[MicroBatch]]:
    """This data-parallel rank's sample indices and its micro-batches (the same on its TP/PP peers).

    At least one micro-batch (a rank without samples runs a filler, so collectives stay in step); with
    ``equal_counts`` as many as the longest plan of any rank (every rank computes every rank's plan, no
    communication): ZeRO-3's parameter gathers and expert parallelism's all-to-alls are collectives of every
    micro-batch. A filler is a two-token micro-batch of ``pad_id`` that carries no sample (``rows`` empty: the
    shared loss masks it out entirely).
    """
    lengths = [len(s) for s in batch.sequences]
    shards = shard_for_dp(lengths, dp_size)
    shard = shards[dp_rank]
    build = build_packed_micro_batch if packed else build_micro_batch

    def plan(s: list[int]) -> list[list[int]]:
        return plan_micro_batches([lengths[i] for i in s], max_tokens, pad_multiple=pad_multiple, packed=packed) if s else []

    mbs = [build(batch.sequences, batch.prompt_lens, [shard[k] for k in g], pad_id=pad_id, pad_multiple=pad_multiple)
           for g in plan(shard)]
    target = max([1] + [len(plan(s)) for s in shards]) if equal_counts else 1
    while len(mbs) < target:
        filler = build([[pad_id, pad_id]], [2], [0], pad_id=pad_id, pad_multiple=pad_multiple)
        filler.rows = []
        mbs.append(filler)
    return shard, mbs


def padding_report(lengths: list[int], max_tokens: int, *, dp_size: int = 1,
                   pad_multiple: int = 1) -> dict[str, dict[str, float]]:
    """What one batch of sequences (``lengths``, prompt + response tokens) costs in each layout.

    For ``padded`` and ``packed``: ``micro_batches`` (over all DP ranks), ``computed_tokens`` (positions the
    model runs: rows x padded length, or the packed lengths with their tail), ``real_tokens`` and
    ``padded_share`` = (computed - real) / computed. The trainer's micro-batches are this plan (the same
    sharding and budget), so a run's logged sequence lengths give its padded-token share before/after packing.
    """
    real = sum(lengths)
    out: dict[str, dict[str, float]] = {}
    for name, packed in (("padded", False), ("packed", True)):
        computed, count = 0, 0
        for shard in shard_for_dp(lengths, dp_size):
            groups = plan_micro_batches([lengths[i] for i in shard], max_tokens, pad_multiple=pad_multiple,
                                        packed=packed) if shard else []
            count += len(groups)
            for g in groups:
                ls = [lengths[shard[k]] for k in g]
                computed += _round_up(sum(ls), pad_multiple) if packed else len(ls) * _round_up(max(ls), pad_multiple)
        out[name] = {"micro_batches": float(count), "computed_tokens": float(computed), "real_tokens": float(real),
                     "padded_share": (computed - real) / computed if computed else 0.0}
    return out


def validate_batch(batch: "SequenceBatch | dict") -> SequenceBatch:
    """The batch as a validated :class:`~openrlhf_shape.batch.SequenceBatch` (errors name the field)."""
    seq = SequenceBatch.coerce(batch)
    SequenceBatch.validate(seq)
    return seq


def take_rows(t: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """``t[rows, :width]`` (``[B, T]`` -> ``[len(rows), width]``), zero-padded on the right when ``t``
    is narrower than ``width`` (a micro-batch's per-token training tensors at its padded width)."""
    out = t[rows, :width]
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]))
    return out
