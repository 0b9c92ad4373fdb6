"""Correction of the rollout/trainer mismatch (TIS, ICEPOP, sequence-mask TIS), and its metrics.

The rollout engine (vLLM) samples with pi_rollout; the trainer recomputes the behaviour log-probs
with pi_old (Megatron, other kernels and precision). The two differ, so the PPO update is slightly
off-policy. Per token the importance weight is

    w_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_probs_t - rollout_log_probs_t).

A *gate* reads a statistic per unit and treats units outside the band ``[low, high]``:

* ``level``: ``"token"`` (each token is a unit) or ``"seq"`` (one statistic per response: the
  geometric mean of w over its valid tokens for the ratio gate, the plain mean for a divergence);
  ``"off"`` disables the correction (weights are all 1).
* ``gating``: ``"ratio"`` (w itself), ``"binary_kl"`` or ``"tv"`` (a divergence between the
  sampled token's probabilities p = pi_rollout(y_t), q = pi_old(y_t): p log(p/q) + (1-p) log((1-p)/(1-q)),
  or |p - q|; upper bound only, so ``low`` must be 0).
* ``mode``: ``"clip"`` clamps w into the band (truncated IS, "TIS": token level and ratio gate only);
  ``"mask"`` drops out-of-band units (weight 0) and survivors keep their own w ("ICEPOP" at token
  level, "sequence-mask TIS" at sequence level).

The flag names and defaults follow OpenRLHF 0.11 (``--algo.advantage.is_correction_level|mode|
gating|threshold``; threshold ``[0.5, 5.0]``; a single value means ``[0, value]``). The weight
multiplies each token's clipped PPO loss (or CISPO's; GSPO takes none, algorithms/loss.py); it carries no
gradient. Log-ratios are clamped to +-20 before ``exp`` (the sequence gate: its mean of the raw log-ratios), so a
wild mismatch gives a finite weight; OpenRLHF clamps none, and the two agree within the clamp.

Sampling with top-p < 1 or top-k > 0: the rollout log-probs then come from the truncated,
renormalised distribution that vLLM actually sampled from, so every w_t is below 1 by the kept
mass even with identical weights. The trainer refuses the correction in that case (see
``docs/openrlhf_compat.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = ("off", "token", "seq")
MODES = ("mask", "clip")
GATINGS = ("ratio", "binary_kl", "tv")

_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: keeps w finite for wildly mismatched tokens (OpenRLHF: no clamp; equal within it)
_P_EPS = 1e-6  # keeps the binary-KL logs finite


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``--algo.advantage.is_correction_*``. ``threshold``: (low, high) band on the gated statistic."""

    level: str = "off"
    mode: str = "mask"
    gating: str = "ratio"
    threshold: tuple[float, float] = (0.5, 5.0)

    @staticmethod
    def band(values: float | list[float] | tuple[float, ...]) -> tuple[float, float]:
        """One value HIGH -> (0, HIGH); two values -> (LOW, HIGH)."""
        vals = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
        if len(vals) == 1:
            return (0.0, vals[0])
        if len(vals) != 2:
            raise ValueError(f"--algo.advantage.is_correction_threshold takes HIGH or LOW HIGH, got {len(vals)} values")
        return (vals[0], vals[1])

    def validate(self) -> "RolloutCorrectionConfig":
        f = "--algo.advantage.is_correction_"
        if self.level not in LEVELS:
            raise ValueError(f"{f}level {self.level!r}: choose one of {', '.join(LEVELS)}")
        if self.mode not in MODES:
            raise ValueError(f"{f}mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.gating not in GATINGS:
            raise ValueError(f"{f}gating {self.gating!r}: choose one of {', '.join(GATINGS)}")
        low, high = self.threshold
        if not (0.0 <= low < high):
            raise ValueError(f"{f}threshold {low} {high}: need 0 <= LOW < HIGH")
        if self.level == "off":
            return self
        if self.mode == "clip" and (self.level != "token" or self.gating != "ratio"):
            raise ValueError(
                f"{f}mode clip clamps a per-token weight: it needs {f}level token and {f}gating ratio "
                f"(got level {self.level}, gating {self.gating}); use {f}mode mask to filter sequences or divergences"
            )
        if self.gating != "ratio" and low > 0:
            raise ValueError(
                f"{f}gating {self.gating} is a divergence, bounded from above only: give one value, "
                f"e.g. {f}threshold {high}"
            )
        if self.gating == "ratio" and not (low < 1.0 < high):
            raise ValueError(f"{f}threshold {low} {high}: the ratio band must contain 1 (identical policies)")
        return self


def _masked_row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: mean over each row's valid tokens (0 for an empty row)."""
    m = mask.to(x.dtype)
    return ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def rollout_mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs are from the rollout engine's on the sampled tokens.

    Args: ``[B, T]`` float log-probs (nats) of the sampled tokens and a ``[B, T]`` bool mask.
    Returns floats: ``abs_log_ratio/mean`` and ``/max`` (|old - rollout| over valid tokens, nats),
    ``kl`` (mean of rollout - old: the k1 estimate of KL(pi_rollout || pi_old) on these samples),
    ``seq_abs_log_ratio/max`` (the largest |mean log-ratio| of one response) and ``tokens``.
    """
    m = mask.bool()
    if not m.any():
        return {"abs_log_ratio/mean": 0.0, "abs_log_ratio/max": 0.0, "kl": 0.0, "seq_abs_log_ratio/max": 0.0, "tokens": 0.0}
    d = (old_log_probs.float() - rollout_log_probs.float())
    valid = d[m]
    rows = m.any(-1)
    seq = _masked_row_mean(d, m).squeeze(-1)[rows]
    return {
        "abs_log_ratio/mean": float(valid.abs().mean()),
        "abs_log_ratio/max": float(valid.abs().max()),
        "kl": float((-valid).mean()),
        "seq_abs_log_ratio/max": float(seq.abs().max()),
        "tokens": float(m.sum()),
    }


def rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss weights that correct for the rollout/trainer mismatch.

    Args:
        old_log_probs: ``[B, T]`` trainer log-probs of the sampled tokens (nats).
        rollout_log_probs: ``[B, T]`` the rollout engine's log-probs of the same tokens (nats).
        mask: ``[B, T]`` bool, valid response tokens.
        cfg: level / mode / gating / threshold (validated here).

    Returns:
        (weights ``[B, T]`` float32, 0 on padding and on masked units; metrics) where metrics hold
        ``filtered_frac`` (share of units outside the band: tokens at token level, responses at
        sequence level) and ``weight/mean`` over valid tokens.
    """
    cfg.validate()
    if not (old_log_probs.shape == rollout_log_probs.shape == mask.shape):
        raise ValueError(
            f"old_log_probs, rollout_log_probs and mask must share one shape [B, T]; got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    mf = m.float()
    if cfg.level == "off":
        return mf.clone(), {"filtered_frac": 0.0, "weight/mean": 1.0 if m.any() else 0.0}
    old = old_log_probs.float().detach()
    roll = rollout_log_probs.float().detach()
    raw_log_w = torch.where(m, old - roll, torch.zeros_like(old))
    token_w = raw_log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
    seq_level = cfg.level == "seq"
    if cfg.gating == "ratio":  # the sequence's mean of the raw log-ratios (OpenRLHF's), clamped only before exp
        seq_w = _masked_row_mean(raw_log_w, m).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
        stat = seq_w.expand_as(token_w) if seq_level else token_w
    else:
        p = roll.exp().clamp(_P_EPS, 1 - _P_EPS)
        q = old.exp().clamp(_P_EPS, 1 - _P_EPS)
        if cfg.gating == "binary_kl":
            div = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            div = (p - q).abs()
        div = torch.where(m, div, torch.zeros_like(div))
        stat = _masked_row_mean(div, m).expand_as(div) if seq_level else div
    low, high = cfg.threshold
    inside = (stat >= low) & (stat <= high)
    if cfg.mode == "clip":
        weights = stat.clamp(min=low, max=high)
    else:
        weights = torch.where(inside, token_w, torch.zeros_like(token_w))
    weights = torch.where(m, weights, torch.zeros_like(weights))
    if seq_level:
        rows = m.any(-1)
        filtered = float((~inside[:, 0])[rows].float().mean()) if rows.any() else 0.0
    else:
        filtered = float((~inside & m).float().sum() / mf.sum().clamp(min=1.0))
    mean_w = float((weights * mf).sum() / mf.sum().clamp(min=1.0))
    return weights, {"filtered_frac": filtered, "weight/mean": mean_w}
