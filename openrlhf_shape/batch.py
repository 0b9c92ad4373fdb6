"""Typed batches between the experience maker and the actor (the policy loss).

Rows are samples in prompt-major order (the n samples of one prompt are contiguous). Token ids stay
ragged (``list[list[int]]``) because the actor re-packs them into micro-batches by a token budget;
every per-token float travels as a right-padded ``[B, T]`` tensor, T = the longest response, where
response token j of row i sits at column j (``sequences[i][prompt_lens[i] + j]``). Padding is 0
(False for masks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def pad_rows(rows: Sequence[torch.Tensor], width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stack 1-D tensors ``[T_i]`` into ``[B, width]`` (0-padded; width defaults to max T_i)."""
    width = max((int(r.numel()) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width, dtype=dtype)
    if rows:
        lengths = torch.tensor([int(r.numel()) for r in rows])
        mask = torch.arange(width)[None, :] < lengths[:, None]
        if int(lengths.sum()):
            out[mask] = torch.cat([r.reshape(-1).to(dtype) for r in rows])
    return out


def length_mask(lengths: Sequence[int] | torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True at the first ``lengths[i]`` columns of row i."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return torch.arange(width)[None, :] < lengths[:, None]


@dataclass(kw_only=True)
class SequenceBatch:
    """Input of a forward pass: B prompt+response sequences and the sampling temperature.

    ``sequences``: B lists of token ids; ``prompt_lens``: B prompt lengths in tokens (>= 1);
    ``temperature``: log-probs and entropy are taken of ``logits / temperature``.
    ``routed_experts``: MoE routing replay (``megatron/routing_replay.py``, ``--megatron.routing_replay``):
    per sample an integer tensor ``[L_i, layers, top_k]``, the experts each token (prompt and response, in
    order; ``L_i`` = len(sequence) or one less) is routed to; None without replay.
    """

    sequences: list[list[int]]
    prompt_lens: list[int]
    temperature: float = 1.0
    routed_experts: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    @property
    def response_width(self) -> int:
        """T: the longest response in tokens (the width of the ``[B, T]`` tensors)."""
        return max(self.response_lens, default=0)

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, True at real response tokens."""
        return length_mask(self.response_lens, self.response_width)

    @classmethod
    def coerce(cls, batch: "SequenceBatch | dict[str, Any]") -> "SequenceBatch":
        """Accept a typed batch, or a mapping with sequences / prompt_lens / temperature (tests, tools)."""
        if isinstance(batch, SequenceBatch):
            return batch
        for key in ("sequences", "prompt_lens"):
            if key not in batch:
                raise KeyError(f"batch is missing {key!r}; expected keys sequences, prompt_lens, temperature")
        return SequenceBatch(sequences=batch["sequences"], prompt_lens=batch["prompt_lens"],
                             temperature=float(batch.get("temperature", 1.0)), routed_experts=batch.get("routed_experts"))

    def validate(self) -> None:
        """Check the shapes; errors name the field and the fix."""
        seqs, plens = self.sequences, self.prompt_lens
        if len(seqs) != len(plens):
            raise ValueError(f"batch.sequences has {len(seqs)} rows but batch.prompt_lens has {len(plens)}")
        if len(seqs) == 0:
            raise ValueError("batch.sequences is empty")
        for i, (s, p) in enumerate(zip(seqs, plens)):
            if not 1 <= p <= len(s):
                raise ValueError(
                    f"batch.prompt_lens[{i}]={p} must be in [1, len(sequences[{i}])={len(s)}] "
                    "(at least one prompt token; the response may be empty)"
                )
        if float(self.temperature) <= 0:
            raise ValueError(f"batch.temperature must be > 0, got {self.temperature}")
        if self.routed_experts is not None and len(self.routed_experts) != len(seqs):
            raise ValueError(f"batch.routed_experts has {len(self.routed_experts)} entries for {len(seqs)} sequences "
                             "(one [L_i, layers, top_k] tensor per sample)")


@dataclass(kw_only=True)
class TrainBatch(SequenceBatch):
    """Input of one optimizer step: a :class:`SequenceBatch` plus ``[B, T]`` per-token tensors.

    ``old_log_probs``: float32 log-probs of the policy that sampled (at ``temperature``);
    ``advantages``: float32 per-token advantages; ``loss_mask``: bool, tokens that enter the loss
    (False at padding).
    """

    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    is_weights: torch.Tensor | None = None  # float32 rollout-correction weights (algorithms/rollout_correction.py)

    @classmethod
    def from_ragged(cls, sequences: list[list[int]], prompt_lens: list[int], old_log_probs: Sequence[torch.Tensor],
                    advantages: Sequence[torch.Tensor], loss_mask: Sequence[torch.Tensor] | None = None,
                    temperature: float = 1.0) -> "TrainBatch":
        """Build from per-sample ``[T_i]`` tensors (tests and tools)."""
        seq = SequenceBatch(sequences=sequences, prompt_lens=prompt_lens, temperature=temperature)
        width = seq.response_width
        valid = seq.response_mask()
        mask = valid if loss_mask is None else pad_rows(loss_mask, width, torch.bool) & valid
        return cls(sequences=sequences, prompt_lens=prompt_lens, temperature=temperature,
                   old_log_probs=pad_rows(old_log_probs, width), advantages=pad_rows(advantages, width), loss_mask=mask)

    def validate(self) -> None:
        super().validate()
        shape = (len(self), self.response_width)
        for name in ("old_log_probs", "advantages", "loss_mask") + (("is_weights",) if self.is_weights is not None else ()):
            t = getattr(self, name)
            if tuple(t.shape[:1]) != shape[:1] or t.dim() != 2 or t.shape[1] < shape[1]:
                raise ValueError(f"batch.{name} must be [B, T] = [{shape[0]}, >= {shape[1]}], got {tuple(t.shape)}")
