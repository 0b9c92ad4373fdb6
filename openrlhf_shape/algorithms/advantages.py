"""Segment-level advantages: SHAPE (eq. 8-9), MRT (eq. 2), GRPO, and outcome baselines.

Notation (paper section 4): a response has K segments with lengths L_k and K+1 potentials
Phi_0 .. Phi_K, where Phi_0 = Phi(prompt) and Phi_K = R (the outcome; no probe).
"""

from __future__ import annotations

import torch

from openrlhf_shape.algorithms.config import OUTCOME_BASELINES


def _as_float(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN/inf")
    return t


def dynamic_gamma(lengths, gamma_min: float, l_ref: float) -> torch.Tensor:
    """Length-dependent discount (eq. 8): ``max(gamma_min, 1 - (L / L_ref) * (1 - gamma_min))``.

    Args:
        lengths: segment lengths L_k in tokens, any shape.
        gamma_min: floor of the discount, in (0, 1].
        l_ref: reference length L_ref in tokens (> 0).
    Returns: float32 tensor of ``lengths``' shape with values in [gamma_min, 1].
    """
    if not 0.0 < float(gamma_min) <= 1.0:
        raise ValueError(f"gamma_min must lie in (0, 1], got {gamma_min}")
    if not float(l_ref) > 0:
        raise ValueError(f"l_ref must be > 0 tokens, got {l_ref}")
    L = _as_float(lengths, "lengths")
    if (L < 0).any():
        raise ValueError("segment lengths must be >= 0")
    return torch.clamp(1.0 - (L / float(l_ref)) * (1.0 - float(gamma_min)), min=float(gamma_min))


def segment_gamma(lengths, gamma_min: float, l_ref: float, fixed_gamma: float | None = None) -> torch.Tensor:
    """gamma_k per segment: eq. 8 (:func:`dynamic_gamma`), or the constant ``fixed_gamma`` (ablation).

    Args: lengths ``[...]`` segment lengths in tokens. Returns float32 ``[...]``.
    """
    if fixed_gamma is None:
        return dynamic_gamma(lengths, gamma_min, l_ref)
    if not 0.0 < float(fixed_gamma) <= 1.0:
        raise ValueError(f"fixed_gamma must lie in (0, 1], got {fixed_gamma}")
    return torch.full_like(_as_float(lengths, "lengths"), float(fixed_gamma))


def _check_potentials(potentials: torch.Tensor) -> None:
    if potentials.dim() < 1 or potentials.shape[-1] < 2:
        raise ValueError(
            f"potentials must be [..., K+1] with K >= 1 (Phi_0 .. Phi_K), got shape {tuple(potentials.shape)}"
        )
    if ((potentials < 0) | (potentials > 1)).any():
        raise ValueError("potentials must lie in [0, 1] (they are mean verifier scores)")


def shape_segment_advantages(
    potentials,
    lengths,
    outcome,
    alpha: float = 0.3,
    gamma_min: float = 0.9,
    l_ref: float = 1024.0,
    fixed_gamma: float | None = None,
) -> torch.Tensor:
    """SHAPE segment advantages (eq. 9): ``A_k = R + alpha * (gamma_k * Phi_{k+1} - Phi_k)``.

    Args:
        potentials: ``[..., K+1]`` Phi_0..Phi_K in [0, 1].
        lengths: ``[..., K]`` segment lengths in tokens (gamma_k from eq. 8).
        outcome: R, scalar or ``[...]`` (possibly baseline-adjusted, see ``outcome_baseline``).
        fixed_gamma: ablation: a constant gamma_k instead of the dynamic one.
    Returns: ``[..., K]`` float32.
    """
    phi = _as_float(potentials, "potentials")
    _check_potentials(phi)
    L = _as_float(lengths, "lengths")
    if L.shape != phi.shape[:-1] + (phi.shape[-1] - 1,):
        raise ValueError(
            f"lengths shape {tuple(L.shape)} must be potentials' shape with K = {phi.shape[-1] - 1} "
            f"segments, i.e. {tuple(phi.shape[:-1]) + (phi.shape[-1] - 1,)}"
        )
    R = _as_float(outcome, "outcome")
    gamma = segment_gamma(L, gamma_min, l_ref, fixed_gamma)
    shaping = gamma * phi[..., 1:] - phi[..., :-1]
    return R[..., None] + float(alpha) * shaping


def mrt_segment_advantages(potentials, outcome, alpha: float = 0.3, outcome_term=None) -> torch.Tensor:
    """MRT baseline (eq. 2): ``A_k = R + alpha * (R - Phi_k)`` for k = 0..K-1.

    Args: potentials ``[..., K+1]``; outcome R scalar or ``[...]``; ``outcome_term``: the leading R
    after an outcome baseline (default R itself). Returns ``[..., K]``.
    """
    phi = _as_float(potentials, "potentials")
    _check_potentials(phi)
    R = _as_float(outcome, "outcome")
    lead = R if outcome_term is None else _as_float(outcome_term, "outcome_term")
    return lead[..., None] + float(alpha) * (R[..., None] - phi[..., :-1])


def grpo_advantages(rewards, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)`` over the n samples of each prompt.

    Args: rewards ``[prompts, n]`` with n >= 2. std is the unbiased sample std (as in GRPO);
    a group whose rewards are all equal gets advantage 0. Returns ``[prompts, n]`` float32.
    """
    r = _as_float(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(f"rewards must be [prompts, n], got shape {tuple(r.shape)}")
    if r.shape[1] < 2:
        raise ValueError("GRPO needs n_samples_per_prompt >= 2 (set --rollout.n_samples_per_prompt)")
    mean = r.mean(-1, keepdim=True)
    std = r.std(-1, keepdim=True)
    return (r - mean) / (std + eps)


def outcome_baseline(rewards, kind: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """The outcome term R used inside SHAPE/MRT advantages.

    ``none``: R as is (the paper). ``group_mean``: R - group mean. ``group_norm``: GRPO-normalised R.
    ``group_norm_scaled``: R - group mean here; the whole advantage (outcome AND shaping) is then divided
    by the group's reward std, floored (:func:`group_reward_scale`), so the outcome has GRPO's unit spread while
    the shaping keeps its size relative to the outcome (see ``compute_token_advantages``).
    Args: rewards ``[prompts, n]``. Returns ``[prompts, n]``.
    """
    r = _as_float(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(f"rewards must be [prompts, n], got shape {tuple(r.shape)}")
    if kind == "none":
        return r.clone()
    if kind in ("group_mean", "group_norm_scaled"):
        return r - r.mean(-1, keepdim=True)
    if kind == "group_norm":
        return grpo_advantages(r, eps=eps)
    raise ValueError(f"unknown outcome baseline {kind!r}; choose one of {OUTCOME_BASELINES} (--shape.outcome_baseline)")


def group_reward_scale(rewards) -> torch.Tensor:
    """``1 / max(std_group, 1 / sqrt(n))`` per sample (GRPO's divisor, unbiased std over the n samples,
    floored).

    Dividing ``R - mean + alpha * shaping`` by it keeps the paper's task-consistency bound (appendix
    A.1, alpha < 0.5) as written: within a group every return is shifted by the same mean and divided by
    the same positive number, so the order of any two trajectories' returns, hence "every correct return
    exceeds every incorrect one", is that of the unscaled form. (Under ``group_norm`` only the outcome is
    divided, so the shaping weighs 1/std times more than the bound assumes.)
    The floor, 1/sqrt(n), is the smallest spread a group of 0/1 rewards can have (one right of n), so it
    never binds on a mixed 0/1 group; it bounds the scale by sqrt(n) where the spread is 0 or tiny. Without
    it a group whose rewards are all equal (no outcome signal, but moving potentials) had its shaping
    multiplied by 1/eps = 1e6 and outweighed the batch. Such a group's shaping weighs as a one-right group's.
    Args: rewards ``[prompts, n]``. Returns ``[prompts, n]``."""
    r = _as_float(rewards, "rewards")
    floor = r.shape[-1] ** -0.5
    return 1.0 / r.std(-1, keepdim=True).clamp_min(floor).expand_as(r)


def segment_to_token_advantages(segment_advantages: torch.Tensor, segment_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-segment advantages to tokens of a padded batch.

    Args:
        segment_advantages: ``[B, K]``; segment_ids: ``[B, T]`` long in [0, K); mask: ``[B, T]`` bool.
    Returns: ``[B, T]`` float32, 0 at padding.
    """
    if segment_ids.shape != mask.shape or segment_advantages.shape[0] != segment_ids.shape[0]:
        raise ValueError(
            f"shapes disagree: segment_advantages {tuple(segment_advantages.shape)}, "
            f"segment_ids {tuple(segment_ids.shape)}, mask {tuple(mask.shape)}"
        )
    ids = segment_ids.clamp(0, segment_advantages.shape[1] - 1)
    out = segment_advantages.to(torch.float32).gather(1, ids)
    return torch.where(mask.bool(), out, torch.zeros_like(out))
