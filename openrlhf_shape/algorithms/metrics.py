"""The paper's analyses as batch metrics (pure functions over potentials and segments).

Start regimes (appendix B.3, m = 8 grid): Low {0, 1/8}, Mid-Low {2/8, 3/8}, Mid-High {4/8, 5/8},
High {6/8, 7/8}; for other m the same quarter intervals [0, .25), [.25, .5), [.5, .75), [.75, 1).
A start potential of exactly 1 cannot gain and is excluded.
"""

from __future__ import annotations

import torch

REGIMES = ("low", "mid_low", "mid_high", "high")


def _transitions(potentials: torch.Tensor, num_segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``potentials`` [B, Kmax+1] padded, ``num_segments`` [B] -> (start, end, valid) all [B, Kmax]."""
    if potentials.dim() != 2:
        raise ValueError(f"potentials must be [B, K+1], got {tuple(potentials.shape)}")
    kmax = potentials.shape[1] - 1
    k = torch.arange(kmax, device=potentials.device)
    valid = k[None, :] < num_segments.to(potentials.device)[:, None]
    return potentials[:, :-1].float(), potentials[:, 1:].float(), valid


def potential_drop_rate(potentials: torch.Tensor, num_segments: torch.Tensor) -> float:
    """Share of transitions Phi_k -> Phi_{k+1} (including the last, into R) with Phi_{k+1} < Phi_k."""
    start, end, valid = _transitions(potentials, num_segments)
    n = int(valid.sum())
    return float(((end < start) & valid).sum()) / n if n else 0.0


def start_regime(phi: torch.Tensor) -> torch.Tensor:
    """Regime index 0..3 for start potentials ``phi`` (any shape); -1 for phi >= 1."""
    idx = torch.clamp((phi * 4.0 + 1e-6).floor().long(), max=3)
    return torch.where(phi >= 1.0 - 1e-6, torch.full_like(idx, -1), idx)


def gain_by_start_regime(potentials: torch.Tensor, num_segments: torch.Tensor) -> dict[str, tuple[float, int]]:
    """Raw gains Delta_k = Phi_{k+1} - Phi_k summed by start regime: ``{regime: (sum, count)}``."""
    start, end, valid = _transitions(potentials, num_segments)
    reg = start_regime(start)
    gain = end - start
    out = {}
    for i, name in enumerate(REGIMES):
        sel = valid & (reg == i)
        out[name] = (float(gain[sel].sum()), int(sel.sum()))
    return out


def gain_contribution_percent(avg_gains: dict[str, dict[str, float]], eps: float = 0.03) -> dict[str, dict[str, float]]:
    """Appendix B.3 normalisation across methods.

    Args: ``avg_gains[method][regime]`` = average raw gain of that regime.
    Shift by the global minimum ``G_min - eps`` so all are positive, then each method's regimes
    as percentages of that method's total shifted gain.
    """
    values = [v for per in avg_gains.values() for v in per.values()]
    if not values:
        return {}
    g_min = min(values)
    out = {}
    for method, per in avg_gains.items():
        shifted = {r: v - (g_min - eps) for r, v in per.items()}
        total = sum(shifted.values())
        out[method] = {r: 100.0 * s / total for r, s in shifted.items()}
    return out


def describe(values: torch.Tensor, prefix: str) -> dict[str, float]:
    """mean / std / min / max of a 1-D tensor as ``{prefix/mean: ...}`` (empty -> zeros)."""
    v = values.detach().float().reshape(-1)
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/std": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/std": float(v.std(unbiased=False)),
        f"{prefix}/min": float(v.min()),
        f"{prefix}/max": float(v.max()),
    }


def advantage_by_outcome(token_advantages: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Each response's mean token advantage, described separately for correct (R > 0.5) and wrong
    responses: ``adv/correct/{mean,std,min,max}``, ``adv/wrong/...`` and the counts. A wrong answer whose
    advantage sits at ~0 gets no push away (the length-collapse mechanism seen with the paper's raw R).

    Args: token_advantages ``[B, T]``; mask ``[B, T]`` bool; rewards ``[B]``."""
    m = mask.bool()
    per = (token_advantages * m).sum(-1) / m.sum(-1).clamp(min=1)
    correct = torch.as_tensor(rewards, dtype=torch.float32) > 0.5
    out = {**describe(per[correct], "adv/correct"), **describe(per[~correct], "adv/wrong")}
    out["adv/correct/count"], out["adv/wrong/count"] = float(correct.sum()), float((~correct).sum())
    return out


def shaping_to_outcome(segment_advantages: torch.Tensor, outcome_term: torch.Tensor,
                       valid: torch.Tensor) -> dict[str, float]:
    """``shape/shaping_to_outcome``: mean |shaping part of A_k| over valid segments divided by mean
    |outcome term| over responses (the shaping part is A_k minus the response's outcome term, i.e.
    alpha * (gamma_k Phi_{k+1} - Phi_k), scaled as the advantage is). Omitted when every outcome term is 0.

    Args: segment_advantages ``[B, K]``; outcome_term ``[B]``; valid ``[B, K]`` bool."""
    shaping = (segment_advantages - outcome_term[:, None])[valid.bool()].abs()
    denom = float(outcome_term.abs().mean()) if outcome_term.numel() else 0.0
    out = {"shape/shaping_abs/mean": float(shaping.mean()) if shaping.numel() else 0.0,
           "shape/outcome_abs/mean": denom}
    if denom > 0:
        out["shape/shaping_to_outcome"] = out["shape/shaping_abs/mean"] / denom
    return out


def discount_instruments(potentials: torch.Tensor, gamma: torch.Tensor, num_segments: torch.Tensor,
                         alpha: float) -> dict[str, float]:
    """What the length discount gamma_k does to the shaping F_k = gamma_k Phi_{k+1} - Phi_k (the mechanism
    of the paper's gamma_min = 0.7 collapse, section 5 and appendix A.2).

    ``shape/length_tax/{mean,max}``: alpha * (1 - gamma_k) * Phi_{k+1} over valid segments, in units of R
    (before any outcome scaling): what a segment loses for its length, since
    alpha * F_k = alpha * (Phi_{k+1} - Phi_k) - length tax.
    ``shape/sign_reversal_rate``: among improving transitions (Phi_{k+1} > Phi_k, the last one into R
    included), the share whose shaping is <= 0 (appendix A.2's reward-sign consistency broken: progress
    penalised); 0 when no transition improves. It stays 0 whenever gamma_min > (m - 1) / m.
    ``shape/improving_transitions``: how many transitions that rate is over.

    Args: potentials ``[B, K+1]``; gamma ``[B, K]``; num_segments ``[B]``; alpha: the shaping weight."""
    start, end, valid = _transitions(potentials, num_segments)
    g = gamma.float()
    out = describe((alpha * (1.0 - g) * end)[valid], "shape/length_tax")
    del out["shape/length_tax/std"], out["shape/length_tax/min"]
    improving = valid & (end > start)
    n = int(improving.sum())
    out["shape/improving_transitions"] = float(n)
    out["shape/sign_reversal_rate"] = float((improving & (g * end - start <= 0)).sum()) / n if n else 0.0
    return out
