"""Token credit redistribution (TCR, paper section 4.3) inside each segment.

For segment k over its valid tokens: mu, sigma = mean and population std of H;
z_t = (H_t - mu) / (sigma + eps); w_t = clip(1 + beta * z_t, delta_min, delta_max); A_t = A_k * w_t.
Tokens of average entropy keep A_k; a one-token segment has z = 0 and keeps A_k.
"""

from __future__ import annotations

import torch


def tcr_weights(
    entropy: torch.Tensor,
    segment_ids: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    delta_min: float = 0.5,
    delta_max: float = 1.5,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Importance weights w_t, ``[..., T]`` -> ``[..., T]`` float32 (1 at padding).

    Leading dimensions are batch dimensions; segment statistics never mix rows.
    """
    if not (entropy.shape == segment_ids.shape == mask.shape):
        raise ValueError(
            f"entropy {tuple(entropy.shape)}, segment_ids {tuple(segment_ids.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    if delta_min > delta_max:
        raise ValueError(f"delta_min ({delta_min}) must be <= delta_max ({delta_max})")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    mask = mask.bool()
    ent = entropy.to(torch.float32)
    if entropy.numel() == 0:
        return torch.ones_like(ent)
    if not (torch.isfinite(ent) | ~mask).all():
        raise ValueError("entropy has NaN/inf at a valid token")
    seg = torch.where(mask, segment_ids.long(), torch.zeros((), dtype=torch.long))
    if int(seg.min()) < 0:
        raise ValueError("segment_ids must be >= 0 at valid tokens")
    width = ent.shape[-1]
    n_rows = ent.numel() // width
    n_seg = int(seg.max()) + 1
    # One flat bucket per (row, segment); padding tokens carry weight 0 so they never count.
    flat_idx = (seg.reshape(n_rows, width) + n_seg * torch.arange(n_rows)[:, None]).reshape(-1)
    mf = mask.reshape(-1).to(torch.float32)
    x = ent.reshape(-1) * mf
    buckets = n_rows * n_seg
    count = torch.zeros(buckets).scatter_add_(0, flat_idx, mf)
    mu = torch.zeros(buckets).scatter_add_(0, flat_idx, x) / count.clamp(min=1)
    centered = (x - mu.gather(0, flat_idx)) * mf  # two-pass variance: stable for any entropy scale
    var = torch.zeros(buckets).scatter_add_(0, flat_idx, centered * centered) / count.clamp(min=1)
    inv = 1.0 / (var.sqrt() + eps)
    w = torch.clamp(1.0 + float(beta) * centered * inv.gather(0, flat_idx), float(delta_min), float(delta_max))
    w = torch.where(mask.reshape(-1), w, torch.ones((), dtype=w.dtype))
    return w.reshape(ent.shape)


def redistribute_token_credit(
    token_advantages: torch.Tensor,
    entropy: torch.Tensor,
    segment_ids: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    delta_min: float = 0.5,
    delta_max: float = 1.5,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_t = A_k * w_t for tokens of ``[T]`` (or batched ``[..., T]``) responses; 0 at padding.

    Args:
        token_advantages: per-token segment advantages A_k (constant within a segment).
        entropy: H_t (nats); segment_ids: segment index per token; mask: valid tokens.
    """
    if token_advantages.shape != entropy.shape:
        raise ValueError(
            f"token_advantages {tuple(token_advantages.shape)} and entropy {tuple(entropy.shape)} must match"
        )
    w = tcr_weights(entropy, segment_ids, mask, beta=beta, delta_min=delta_min, delta_max=delta_max, eps=eps)
    out = token_advantages.to(torch.float32) * w
    return torch.where(mask.bool(), out, torch.zeros_like(out))
