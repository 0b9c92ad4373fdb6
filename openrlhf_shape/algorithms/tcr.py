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
    if not torch.isfinite(ent[mask]).all():
        raise ValueError("entropy has NaN/inf at a valid token")
    if entropy.numel() == 0:
        return torch.ones_like(ent)
    seg = segment_ids.long()
    if (seg[mask] < 0).any():
        raise ValueError("segment_ids must be >= 0 at valid tokens")
    width = ent.shape[-1]
    rows = ent.reshape(-1, width)
    segs = seg.reshape(-1, width)
    m = mask.reshape(-1, width)
    n_rows = rows.shape[0]
    n_seg = int(segs[m].max()) + 1 if m.any() else 1
    flat_idx = (torch.arange(n_rows, device=ent.device)[:, None] * n_seg + segs.clamp(0, n_seg - 1)).reshape(-1)
    mf = m.reshape(-1).to(torch.float32)
    x = rows.reshape(-1)
    count = torch.zeros(n_rows * n_seg, dtype=torch.float32, device=ent.device).index_add_(0, flat_idx, mf)
    total = torch.zeros_like(count).index_add_(0, flat_idx, x * mf)
    mu = total / count.clamp(min=1)
    centered = (x - mu[flat_idx]) * mf
    var = torch.zeros_like(count).index_add_(0, flat_idx, centered * centered) / count.clamp(min=1)
    sigma = var.sqrt()
    z = centered / (sigma[flat_idx] + eps)
    w = torch.clamp(1.0 + float(beta) * z, float(delta_min), float(delta_max))
    w = torch.where(m.reshape(-1), w, torch.ones_like(w))
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
