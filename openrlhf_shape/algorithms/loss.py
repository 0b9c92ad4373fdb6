"""Policy losses (``--actor.policy_loss_type``): PPO's token clip (with DAPO clip-higher and dual clip), GSPO's
sequence clip and CISPO's clipped importance weight; their aggregation over a global count.

Per token, r_t = exp(logp_t - old_t) (``log_probs`` / ``old_log_probs`` ``[B, T]``, nats), A_t the advantage:

* ``ppo``: l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t); with ``dual_clip = c > 1`` tokens with
  A_t < 0 have l_t capped at -c A_t. Token level: sum_t l_t / ``num_global_tokens``.
* ``gspo`` (Zheng et al. 2025, as OpenRLHF 0.11's ``PolicyLoss(policy_loss_type="gspo")``): one ratio per
  sequence, s_i = exp(mean_t (logp - old)) over its valid tokens, in the same clipped surrogate (dual clip
  included) with each token's own A_t. Sequence level: each sample's token mean of l_t, summed over samples, /
  ``num_global_samples`` (the mini-batch's samples with at least one valid token, all ranks).
* ``cispo`` (MiniMax-M1, 2025, eq. 4-5): l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t, sg the stop-
  gradient: the clipped importance weight scales the REINFORCE gradient A_t grad logp_t of every token, none is
  dropped. The paper sets no lower bound (eps_low >= 1 does that here) and tunes eps_high. Token level as ppo.

``num_global_tokens`` / ``num_global_samples``: pass the counts of the whole mini-batch (all data-parallel ranks,
all micro-batches) so that summing micro-batch losses (and averaging gradients across DP with the right factor)
yields the global mean. With ``is_weights`` (rollout-correction weights from :mod:`.rollout_correction`, no
gradient; ppo and cispo) each token's l_t is multiplied by its weight; a weight of 0 removes the token from the
numerator, not from the count, as in OpenRLHF. GSPO takes none: OpenRLHF's GSPO with the correction on takes its
ratio against the rollout log-probs instead (pass them as ``old_log_probs``) and applies no weights.

The critic's loss (:func:`value_loss`, ``--critic.value_clip``), OpenRLHF 0.11.2's ``ValueLoss``: per token,
l_t = 0.5 max((V^clip_t - G_t)^2, (V_t - G_t)^2) with V^clip_t = V^old_t + clip(V_t - V^old_t, -eps, eps) (eps None:
0.5 (V_t - G_t)^2), aggregated as the policy loss: token level (OpenRLHF's critic always is) or sequence level.

The log-ratio is clamped to +-:data:`LOG_RATIO_CLAMP` before ``exp`` (OpenRLHF's PPO clamp): exp(89) overflows
float32, and one such token would make the gradient NaN and the whole optimizer step be skipped. GSPO clamps its
sequence mean (OpenRLHF clamps nothing there; the two agree while |mean| <= 20).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("ppo", "gspo", "cispo")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8; OpenRLHF's PolicyLoss bound


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
    *,
    loss_type: str = "ppo",
    num_global_samples: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of ``loss_type`` (module doc).

    Args:
        log_probs: ``[B, T]`` current policy log-probs (requires grad).
        old_log_probs: ``[B, T]`` behaviour log-probs; advantages: ``[B, T]``; mask: ``[B, T]`` bool.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` of the ratio (ppo, gspo) or of the
            importance weight (cispo).
        dual_clip: None or c > 1 (dual-clip PPO for negative advantages; ppo and gspo).
        num_global_tokens: denominator of the token mean; None = this call's valid tokens.
        is_weights: None or ``[B, T]`` per-token rollout-correction weights (detached; ppo and cispo).
        num_global_samples: denominator of gspo's sample mean; None = this call's samples with a valid token.

    Returns:
        (loss scalar, metrics) where metrics hold detached sums over this call's valid tokens
        (``*_sum`` keys, to be summed across micro-batches and ranks) and ``num_tokens``.
    """
    _check_inputs(log_probs, old_log_probs, advantages, mask, eps_low, eps_high, dual_clip, loss_type)
    if is_weights is not None and loss_type == "gspo":
        raise ValueError("gspo applies no rollout-correction weights (OpenRLHF's GSPO takes its ratio against the "
                         "rollout log-probs instead): pass them as old_log_probs and is_weights=None")
    m = mask.bool()
    mf = m.to(log_probs.dtype)
    adv = advantages.to(log_probs.dtype)
    # Padding may hold anything (even inf); zero it before exp so no NaN leaks into the gradient.
    raw = torch.where(m, log_probs - old_log_probs.to(log_probs.dtype), torch.zeros_like(log_probs))
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if loss_type == "cispo":
        ratio = log_ratio.exp()
        weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
        tok_loss = -weight * adv * torch.where(m, log_probs, torch.zeros_like(log_probs))
    else:
        ratio = log_ratio.exp() if loss_type == "ppo" else _sequence_ratio(raw, mf)
        tok_loss = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip)
    if is_weights is not None:
        if is_weights.shape != tok_loss.shape:
            raise ValueError(f"is_weights must have shape {tuple(tok_loss.shape)}, got {tuple(is_weights.shape)}")
        tok_loss = tok_loss * is_weights.detach().to(tok_loss.dtype)
    tok_loss = torch.where(m, tok_loss, torch.zeros_like(tok_loss))
    loss = _aggregate(tok_loss, mf, loss_type == "gspo", num_global_tokens, num_global_samples)
    metrics = _loss_metrics(ratio, log_ratio, adv, tok_loss, m, mf, eps_low, eps_high, loss_type == "cispo")
    return loss, metrics


def _sequence_ratio(log_ratio: torch.Tensor, mf: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio ``[B, T]``: exp of each row's mean log-ratio over its valid tokens (``mf`` float mask), clamped
    before exp, on every valid token (0 at padding)."""
    mean = (log_ratio * mf).sum(-1) / mf.sum(-1).clamp(min=1)
    return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().unsqueeze(-1) * mf


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip: float | None) -> torch.Tensor:
    """``[B, T]`` PPO's -min(r A, clip(r) A), capped at -c A where A < 0 under a dual clip c."""
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    tok_loss = -torch.minimum(surr1, surr2)
    if dual_clip is not None:
        capped = torch.minimum(tok_loss, -float(dual_clip) * adv)
        tok_loss = torch.where(adv < 0, capped, tok_loss)
    return tok_loss


def _aggregate(tok_loss: torch.Tensor, mf: torch.Tensor, sequence_level: bool,
               num_global_tokens: float | int | torch.Tensor | None,
               num_global_samples: float | int | torch.Tensor | None) -> torch.Tensor:
    """Token level: sum / tokens. Sequence level: sum over rows of each row's token mean / samples (rows without a
    valid token count for nothing). A count of None is this call's own; a count <= 0 reads as 1."""
    counts = mf.sum(-1)
    if sequence_level:
        numerator = (tok_loss.sum(-1) / counts.clamp(min=1)).sum()
        given = num_global_samples if num_global_samples is not None else (counts > 0).sum()
    else:
        numerator = tok_loss.sum()
        given = num_global_tokens if num_global_tokens is not None else counts.sum()
    denom = torch.as_tensor(given, dtype=tok_loss.dtype)
    return numerator / (denom if float(denom) > 0 else torch.ones_like(denom))


def _check_inputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  eps_low: float, eps_high: float, dual_clip: float | None, loss_type: str) -> None:
    """One ``[B, T]`` shape for all four, a known loss type, a clip range that keeps ratios positive (cispo's weight
    may have no lower bound), a dual clip above 1 and only where there is a PPO surrogate."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"--actor.policy_loss_type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    if not (log_probs.shape == old_log_probs.shape == advantages.shape == mask.shape):
        raise ValueError(
            "log_probs, old_log_probs, advantages and mask must share one shape [B, T]; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    low_ok = eps_low >= 0 if loss_type == "cispo" else 0 <= eps_low < 1
    if not (low_ok and eps_high >= 0):
        bound = "eps_low >= 0" if loss_type == "cispo" else "0 <= eps_low < 1"
        raise ValueError(f"{loss_type}: need {bound} and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if dual_clip is not None and loss_type == "cispo":
        raise ValueError("--actor.dual_clip bounds PPO's clipped surrogate; cispo has none: drop it")


@torch.no_grad()
def _loss_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, tok_loss: torch.Tensor,
                  m: torch.Tensor, mf: torch.Tensor, eps_low: float, eps_high: float,
                  any_sign: bool) -> dict[str, torch.Tensor]:
    """Detached sums over this call's valid tokens (``[B, T]`` inputs; ``ratio`` the one clipped, per token or per
    sequence; ``log_ratio`` per token, clamped; ``m`` bool mask, ``mf`` its float). A clipped token: one whose
    ratio left the band on the side where the clip holds its gradient (ppo, gspo), or left it at all (``any_sign``:
    cispo, whose weight is clipped whatever the advantage)."""
    below, above = (ratio < 1.0 - eps_low) & m, (ratio > 1.0 + eps_high) & m
    if not any_sign:
        below, above = below & (adv < 0), above & (adv > 0)
    clip_low, clip_high = below.to(torch.float32).sum(), above.to(torch.float32).sum()
    approx_kl = (((log_ratio.exp() - 1.0) - log_ratio) * mf).sum()
    return {
        "num_tokens": mf.sum().to(torch.float32),
        "pg_loss_sum": tok_loss.detach().sum().to(torch.float32),
        "clipfrac_low_sum": clip_low,
        "clipfrac_high_sum": clip_high,
        "approx_kl_sum": approx_kl.to(torch.float32),
        "ratio_sum": (ratio.detach() * mf).sum().to(torch.float32),
        "advantage_sum": (adv * mf).sum().detach().to(torch.float32),
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = 0.5,
    *,
    token_level: bool = True,
    num_global_tokens: float | int | torch.Tensor | None = None,
    num_global_samples: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's clipped value loss (module doc; OpenRLHF's ``ValueLoss``).

    Args:
        values: ``[B, T]`` the critic's current values (requires grad); old_values: ``[B, T]`` its values when the
            batch was made; returns: ``[B, T]`` GAE's targets G (:mod:`.gae`); mask: ``[B, T]`` bool.
        clip_eps: ``--critic.value_clip`` (>= 0), how far V may move from V^old before its gradient is held; None:
            no clip.
        token_level: sum / ``num_global_tokens`` (OpenRLHF's critic); else the mean over samples of each sample's
            token mean, / ``num_global_samples``. A count of None is this call's own.

    Returns:
        (loss scalar, metrics): detached sums over this call's valid tokens: ``num_tokens``, ``values_sum``,
        ``value_clipfrac_sum`` (tokens whose clipped term was the larger).
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("values, old_values, returns and mask must share one shape [B, T]; got "
                         f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}")
    if clip_eps is not None and not clip_eps >= 0:
        raise ValueError(f"--critic.value_clip must be >= 0 (or unset: no clip), got {clip_eps}")
    m = mask.bool()
    mf = m.to(values.dtype)
    old, target = old_values.to(values.dtype), returns.to(values.dtype)
    tok_loss = (values - target) ** 2
    clipped = torch.zeros_like(m)
    if clip_eps is not None:
        surr_clip = (old + (values - old).clamp(-float(clip_eps), float(clip_eps)) - target) ** 2
        clipped = (surr_clip > tok_loss) & m
        tok_loss = torch.maximum(surr_clip, tok_loss)
    tok_loss = torch.where(m, 0.5 * tok_loss, torch.zeros_like(tok_loss))
    loss = _aggregate(tok_loss, mf, not token_level, num_global_tokens, num_global_samples)
    metrics = {"num_tokens": mf.sum().detach().to(torch.float32),
               "values_sum": (values.detach() * mf).sum().to(torch.float32),
               "value_clipfrac_sum": clipped.to(torch.float32).sum()}
    return loss, metrics
