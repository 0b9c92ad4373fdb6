"""What the ranks' ``compute_logprobs_and_entropy`` return, merged back into batch order.

Kept free of Ray so the rank side (and the GPU kit, on a machine with torch only) can import it.
"""

from __future__ import annotations

from typing import Optional

import torch

from openrlhf_shape.batch import LogProbs


def merge_rank_outputs(outputs: list[dict], n: int) -> LogProbs:
    """Merge per-rank ``compute_logprobs_and_entropy`` outputs into batch order.

    ``outputs``: one dict per rank (``{}`` for ranks without results), each ``{"indices": [i], "log_probs":
    [Tensor[T_i]], "entropy": [...]}`` (and ``"routed_experts"``: [Tensor[L_i, layers, top_k]] under MoE
    routing replay). Returns the n samples' :class:`~openrlhf_shape.batch.LogProbs`; raises if one is missing.
    """
    log_probs: list[Optional[torch.Tensor]] = [None] * n
    entropy: list[Optional[torch.Tensor]] = [None] * n
    for out in outputs:
        if not out:
            continue
        for idx, lp, en in zip(out["indices"], out["log_probs"], out["entropy"]):
            if not 0 <= idx < n:
                raise ValueError(f"rank output holds index {idx} outside the batch of {n}")
            log_probs[idx], entropy[idx] = lp, en
    missing = [i for i in range(n) if log_probs[i] is None]
    if missing:
        raise ValueError(f"no rank returned results for batch indices {missing[:10]} (of {len(missing)})")
    routed: Optional[list[Optional[torch.Tensor]]] = None
    if any("routed_experts" in out for out in outputs if out):  # MoE routing replay (megatron/routing_replay.py)
        routed = [None] * n
        for out in outputs:
            for idx, r in zip(out.get("indices", []), out.get("routed_experts", [])):
                routed[idx] = r
    return LogProbs(log_probs=log_probs, entropy=entropy, routed_experts=routed)


def merge_value_outputs(outputs: list[dict], n: int) -> list[torch.Tensor]:
    """Merge per-rank ``compute_values`` outputs (``{"indices": [i], "values": [Tensor[R_i + 1]]}``, ``{}`` for ranks
    without results) into batch order: the n samples' values; raises if one is missing."""
    values: list[Optional[torch.Tensor]] = [None] * n
    for out in outputs:
        for idx, v in zip(out.get("indices", []), out.get("values", [])):
            if not 0 <= idx < n:
                raise ValueError(f"rank output holds index {idx} outside the batch of {n}")
            values[idx] = v
    missing = [i for i in range(n) if values[i] is None]
    if missing:
        raise ValueError(f"no rank returned values for batch indices {missing[:10]} (of {len(missing)})")
    return values  # type: ignore[return-value]
