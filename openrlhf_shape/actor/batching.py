"""Data-parallel sharding and token-budget micro-batching (pure Python/torch, no Megatron).

Every rank receives the whole batch and computes the same plan, so no data moves between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    lengths: list[int], max_tokens: int, *, pad_multiple: int = 1
) -> list[list[int]]:
    """Group positions ``0..len(lengths)-1`` into micro-batches under a padded-token budget.

    Sorted by length (longest first) so rows of one micro-batch have similar lengths and padding
    stays small; a micro-batch's cost is ``rows x padded_max_len``. A single sequence longer than
    the budget gets a micro-batch of its own. Deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"micro_batch_max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
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


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass
class MicroBatch:
    """One padded micro-batch (right padding; causal attention never sees the pads).

    ``input_ids``/``position_ids``: [rows, seq] int64. ``rows``: batch indices of the rows.
    ``resp_rows``/``resp_pos``: [N] flat index of each response-predicting position: row and the
    position whose output predicts response token j (``prompt_len + j - 1``). ``resp_targets``:
    [N] the predicted token ids. ``resp_offsets``: per row, the slice of the flat arrays.
    """

    rows: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    resp_rows: torch.Tensor
    resp_pos: torch.Tensor
    resp_targets: torch.Tensor
    resp_offsets: list[tuple[int, int]]
    seq_lens: list[int] = field(default_factory=list)  # unpadded length of each row (tokens)

    def padding_mask(self) -> torch.Tensor:
        """[rows, seq] bool, True at the right-padding positions (after each row's ``seq_lens``)."""
        return torch.arange(self.input_ids.shape[1])[None, :] >= torch.tensor(self.seq_lens, dtype=torch.long)[:, None]


def build_micro_batch(
    sequences: list[list[int]], prompt_lens: list[int], rows: list[int], *, pad_id: int = 0, pad_multiple: int = 1
) -> MicroBatch:
    """Pad ``sequences[rows]`` to one [rows, seq] tensor and index their response positions."""
    seq_len = _round_up(max(len(sequences[r]) for r in rows), pad_multiple)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    resp_rows, resp_pos, resp_targets, offsets = [], [], [], []
    n = 0
    for k, r in enumerate(rows):
        seq, p = sequences[r], prompt_lens[r]
        ids[k, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        t = len(seq) - p
        resp_rows.extend([k] * t)
        resp_pos.extend(range(p - 1, p - 1 + t))
        resp_targets.extend(seq[p:])
        offsets.append((n, n + t))
        n += t
    pos = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(len(rows), -1).contiguous()
    return MicroBatch(
        rows=list(rows),
        input_ids=ids,
        position_ids=pos,
        resp_rows=torch.tensor(resp_rows, dtype=torch.long),
        resp_pos=torch.tensor(resp_pos, dtype=torch.long),
        resp_targets=torch.tensor(resp_targets, dtype=torch.long),
        resp_offsets=offsets,
        seq_lens=[len(sequences[r]) for r in rows],
    )


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
