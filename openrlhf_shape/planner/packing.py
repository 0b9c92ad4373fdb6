"""What the ranks compute for one batch: packed micro-batches (what the trainer runs) against padded rows.

The batch's sequences (prompt + a response drawn from :class:`~openrlhf_shape.planner.lengths.ResponseLengths`)
go through the trainer's own micro-batch plan (``actor/batching.py:padding_report``: DP sharding by tokens, the
token budget, first-fit packing), so the tokens the time model charges are the ones the ranks would compute.
Packed attention is document-causal: a token attends within its own sample, so the attention FLOPs per token
follow the token-weighted mean length ``sum s_i^2 / sum s_i``, not the packed row's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=64)
def _report(seq_lengths: tuple[int, ...], budget: int, dp: int) -> dict[str, dict[str, float]]:
    """The trainer's micro-batch plan of one batch, cached: a plan and its split search ask for the same batch
    many times (``planner/split.py``)."""
    from openrlhf_shape.actor.batching import padding_report

    return padding_report(list(seq_lengths), budget, dp_size=dp)


@dataclass(frozen=True)
class Packing:
    """Tokens of one batch as the ranks compute them (all DP ranks together)."""

    real: float  # sum of the sequence lengths
    computed: float  # packed micro-batches: what the trainer computes
    padded: float  # the same batch as padded rows (rows x longest row of each micro-batch)
    micro_batches: float  # packed micro-batches over all DP ranks
    attention_seq: float  # sum s_i^2 / sum s_i: the length the attention term of flops_per_token sees

    @classmethod
    def of(cls, seq_lengths: list[int], budget: int, dp: int) -> "Packing":
        """``seq_lengths``: prompt + response tokens of every sample; ``budget``: tokens of one micro-batch of one
        data-parallel replica (``--train.max_tokens_per_gpu`` x CP, at least the longest sequence)."""
        rep = _report(tuple(seq_lengths), budget, dp)
        real = float(sum(seq_lengths))
        return cls(real=real, computed=rep["packed"]["computed_tokens"], padded=rep["padded"]["computed_tokens"],
                   micro_batches=rep["packed"]["micro_batches"],
                   attention_seq=sum(s * s for s in seq_lengths) / real)

    @classmethod
    def uniform(cls, samples: int, seq: float, budget: int, dp: int) -> "Packing":
        """Every sequence ``seq`` tokens long (no padding either way): the closed form, no plan."""
        per_mb = max(1, int(budget // max(seq, 1)))
        return cls(real=samples * seq, computed=samples * seq, padded=samples * seq,
                   micro_batches=dp * -(-(samples / dp) // per_mb), attention_seq=float(seq))

    @property
    def padded_share(self) -> float:
        """Share of the padded layout's tokens that are padding."""
        return (self.padded - self.real) / self.padded if self.padded else 0.0

    @property
    def packed_share(self) -> float:
        return (self.computed - self.real) / self.computed if self.computed else 0.0

    def describe(self) -> str:
        return (f"packed micro-batches: {self.computed:,.0f} tokens computed ({100 * self.packed_share:.1f}% padding); "
                f"padded rows would compute {self.padded:,.0f} ({100 * self.padded_share:.1f}% padding, "
                f"{self.padded / self.computed:.2f}x); attention at the token-weighted mean length {self.attention_seq:,.0f}")
