"""What the ranks' ``compute_logprobs_and_entropy`` return, merged back into batch order.

Kept free of Ray so the rank side (and the GPU kit, on a machine with torch only) can import it.
"""

from __future__ import annotations

from typing import Optional

import torch


def merge_rank_outputs(outputs: list[dict], n: int) -> dict:
    """Merge per-rank ``compute_logprobs_and_entropy`` outputs into batch order.

    ``outputs``: one dict per rank (``{}`` for ranks without results). Returns
    ``{"log_probs": [Tensor[T_i]] * n, "entropy": [...]}`` (and ``"routed_experts"``: [Tensor[L_i, layers,
    top_k]] * n under MoE routing replay); raises if a sample is missing.
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
    merged = {"log_probs": log_probs, "entropy": entropy}
    if any("routed_experts" in out for out in outputs if out):  # MoE routing replay (megatron/routing_replay.py)
        routed: list[Optional[torch.Tensor]] = [None] * n
        for out in outputs:
            for idx, r in zip(out.get("indices", []), out.get("routed_experts", [])):
                routed[idx] = r
        merged["routed_experts"] = routed
    return merged
