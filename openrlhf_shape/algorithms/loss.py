"""PPO policy loss with DAPO clip-higher and optional dual clip; token-mean over a global count.

Token loss l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) with r_t = exp(logp - old).
With ``dual_clip = c > 1``, tokens with A_t < 0 have l_t capped at -c A_t. The loss is
sum_t l_t over valid tokens divided by ``num_global_tokens``: pass the number of valid tokens of
the whole mini-batch (all data-parallel ranks, all micro-batches) so that summing micro-batch
losses (and averaging gradients across DP with the right factor) yields the global token mean.
With ``is_weights`` (rollout-correction weights from :mod:`.rollout_correction`, no gradient) each
token's l_t is multiplied by its weight before the sum; a weight of 0 removes the token from the
numerator (the denominator, the token count, stays the same, as in OpenRLHF).
"""

from __future__ import annotations

import torch


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    num_global_tokens: float | int | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO/DAPO policy loss.

    Args:
        log_probs: ``[B, T]`` current policy log-probs (requires grad).
        old_log_probs: ``[B, T]`` behaviour log-probs; advantages: ``[B, T]``; mask: ``[B, T]`` bool.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher).
        dual_clip: None or c > 1 (dual-clip PPO for negative advantages).
        num_global_tokens: denominator of the token mean; None = this call's valid tokens.
        is_weights: None or ``[B, T]`` per-token rollout-correction weights (detached).

    Returns:
        (loss scalar, metrics) where metrics hold detached sums over this call's valid tokens
        (``*_sum`` keys, to be summed across micro-batches and ranks) and ``num_tokens``.
    """
    _check_inputs(log_probs, old_log_probs, advantages, mask, eps_low, eps_high, dual_clip)
    m = mask.bool()
    mf = m.to(log_probs.dtype)
    n_local = mf.sum()
    denom = n_local if num_global_tokens is None else torch.as_tensor(num_global_tokens, dtype=log_probs.dtype)
    if float(denom) <= 0:
        denom = torch.ones((), dtype=log_probs.dtype)
    adv = advantages.to(log_probs.dtype)
    # Padding may hold anything (even inf); zero it before exp so no NaN leaks into the gradient.
    log_ratio = torch.where(m, log_probs - old_log_probs.to(log_probs.dtype), torch.zeros_like(log_probs))
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    tok_loss = -torch.minimum(surr1, surr2)
    if dual_clip is not None:
        capped = torch.minimum(tok_loss, -float(dual_clip) * adv)
        tok_loss = torch.where(adv < 0, capped, tok_loss)
    if is_weights is not None:
        if is_weights.shape != tok_loss.shape:
            raise ValueError(f"is_weights must have shape {tuple(tok_loss.shape)}, got {tuple(is_weights.shape)}")
        tok_loss = tok_loss * is_weights.detach().to(tok_loss.dtype)
    tok_loss = torch.where(m, tok_loss, torch.zeros_like(tok_loss))
    loss = tok_loss.sum() / denom
    metrics = _loss_metrics(ratio, log_ratio, adv, tok_loss, m, mf, n_local, eps_low, eps_high)
    return loss, metrics


def _check_inputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    """One ``[B, T]`` shape for all four, a clip range that keeps ratios positive, a dual clip above 1."""
    if not (log_probs.shape == old_log_probs.shape == advantages.shape == mask.shape):
        raise ValueError(
            "log_probs, old_log_probs, advantages and mask must share one shape [B, T]; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")


@torch.no_grad()
def _loss_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, tok_loss: torch.Tensor,
                  m: torch.Tensor, mf: torch.Tensor, n_local: torch.Tensor, eps_low: float,
                  eps_high: float) -> dict[str, torch.Tensor]:
    """Detached sums over this call's valid tokens (``[B, T]`` inputs; ``m`` bool mask, ``mf`` its float)."""
    clip_low = ((ratio < 1.0 - eps_low) & (adv < 0) & m).to(torch.float32).sum()
    clip_high = ((ratio > 1.0 + eps_high) & (adv > 0) & m).to(torch.float32).sum()
    approx_kl = (((ratio - 1.0) - log_ratio) * mf).sum()
    metrics = {
        "num_tokens": n_local.detach().to(torch.float32),
        "pg_loss_sum": tok_loss.detach().sum().to(torch.float32),
        "clipfrac_low_sum": clip_low,
        "clipfrac_high_sum": clip_high,
        "approx_kl_sum": approx_kl.to(torch.float32),
        "ratio_sum": (ratio.detach() * mf).sum().to(torch.float32),
        "advantage_sum": (adv * mf).sum().detach().to(torch.float32),
    }
    return metrics
