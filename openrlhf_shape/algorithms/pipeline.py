"""Batched advantages (SHAPE, MRT, and OpenRLHF's outcome estimators) for a padded batch of responses.

Two stages, because potentials come from probes sampled at the boundaries:

1. :func:`segment_batch` (after the old-policy pass gives entropy): boundaries ``[B, K-1]``.
2. :func:`compute_token_advantages` (after probes give potentials): token advantages ``[B, T]``.

All tensors are right-padded: ``mask[i, :T_i]`` is True. Potentials are ``[B, K+1]`` padded per row:
``potentials[i, :n_i + 1]`` = Phi_0 .. Phi_{n_i} with ``n_i`` segments and Phi_{n_i} = R_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from openrlhf_shape.algorithms.advantages import group_reward_scale, outcome_baseline, segment_to_token_advantages
from openrlhf_shape.algorithms.config import ShapeConfig
from openrlhf_shape.algorithms.estimators import AdvantageEstimator, SegmentInputs, SequenceInputs, names_with
from openrlhf_shape.algorithms.metrics import (
    advantage_by_outcome,
    describe,
    gain_by_start_regime,
    potential_drop_rate,
    shaping_to_outcome,
)
from openrlhf_shape.algorithms.segmentation import (
    PAD_BOUNDARY,
    _valid_lengths,
    boundaries_to_segment_ids,
    get_segmentation,
    segment_lengths,
)
from openrlhf_shape.algorithms.tcr import tcr_weights


def segment_batch(entropy: torch.Tensor, mask: torch.Tensor, cfg: ShapeConfig, token_ids: torch.Tensor | None = None,
                  tokenizer: Any = None) -> torch.Tensor:
    """Boundaries for every response, ``[B, T]`` -> ``[B, K-1]`` (sorted, -1 padded), by the mode
    ``cfg.segmentation`` (:data:`~openrlhf_shape.algorithms.segmentation.SEGMENTATIONS`); ``token_ids`` ``[B, T]``
    and the ``tokenizer`` for modes that read them. A run binds its mode once (:func:`get_segmentation`); outcome
    estimators need no segments: callers skip this for them."""
    return get_segmentation(cfg, tokenizer)(entropy, mask, token_ids)


@dataclass
class AdvantageResult:
    """Output of :func:`compute_token_advantages`."""

    token_advantages: torch.Tensor  # [B, T] float32, 0 at padding
    segment_advantages: torch.Tensor | None  # [B, K] (0 for absent segments); None for outcome estimators
    segment_ids: torch.Tensor | None  # [B, T]
    metrics: dict[str, float]
    returns: torch.Tensor | None = None  # [B, T] the critic's targets (estimators with a critic), 0 at padding


def compute_token_advantages(
    estimator: AdvantageEstimator,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_size: int,
    max_response_len: int,
    entropy: torch.Tensor | None = None,
    boundaries: torch.Tensor | None = None,
    potentials: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    reward_clip_range: tuple[float, float] | None = None,
    values: torch.Tensor | None = None,
) -> AdvantageResult:
    """Token advantages from ``estimator`` (:func:`~openrlhf_shape.algorithms.estimators.get_estimator`: the
    registered name bound to its :class:`ShapeConfig`) over a padded batch.

    Args:
        mask: ``[B, T]`` bool; rewards: ``[B]`` outcomes R (B = prompts * group_size, samples of
        one prompt contiguous); group_size: n samples per prompt; max_response_len: for L_ref.
        entropy: ``[B, T]`` (TCR); boundaries: ``[B, K-1]``; potentials: ``[B, K+1]`` padded.
        token_rewards: ``[B, T]`` reward added on every token before the returns (KL in the reward:
        ``-kl_coef * KL_t``); outcome estimators only. reward_clip_range: outcome estimators clip their
        outcome term into it after the baseline (``--reward.clip_range``; SHAPE/MRT get R clipped already).
        values: ``[B, T]`` the critic's values (GAE; it also fills :attr:`AdvantageResult.returns`).
    """
    mask = mask.bool()
    batch = mask.shape[0]
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.shape != (batch,):
        raise ValueError(f"rewards must be [B] = [{batch}], got {tuple(rewards.shape)}")
    if group_size < 1 or batch % group_size:
        raise ValueError(f"batch {batch} is not a multiple of group_size {group_size} (--rollout.n_samples_per_prompt)")
    if not estimator.needs_segments:
        return _sequence_level(estimator, SequenceInputs(rewards, mask, group_size, token_rewards, reward_clip_range, values))

    grouped, cfg = rewards.view(-1, group_size), estimator.cfg
    _check_segment_inputs(estimator, boundaries, potentials, token_rewards)
    seg_len, n_seg = segment_lengths(boundaries, _valid_lengths(mask))  # [B, K], [B]
    kmax = seg_len.shape[1]
    phi, phi_valid = _checked_potentials(potentials, rewards, n_seg, kmax)
    seg_valid = torch.arange(kmax + 1)[None, :kmax] < n_seg[:, None]
    r_term = outcome_baseline(grouped, cfg.outcome_baseline).reshape(-1)
    seg_adv, est_metrics = estimator.segment_advantages(
        SegmentInputs(potentials=phi, seg_len=seg_len, num_segments=n_seg, rewards=rewards, outcome=r_term,
                      max_response_len=max_response_len)
    )
    metrics = dict(est_metrics)
    if cfg.outcome_baseline == "group_norm_scaled":  # outcome and shaping divided by the group's std
        scale = group_reward_scale(grouped).reshape(-1)
        seg_adv, r_term = seg_adv * scale[:, None], r_term * scale
    seg_adv = torch.where(seg_valid, seg_adv, torch.zeros_like(seg_adv))
    metrics.update(shaping_to_outcome(seg_adv, r_term, seg_valid))
    seg_ids = boundaries_to_segment_ids(boundaries, mask.shape[1])
    tok, tcr_metrics = _token_credit(estimator, segment_to_token_advantages(seg_adv, seg_ids, mask), seg_ids, mask,
                                     entropy)
    metrics.update(tcr_metrics)
    metrics.update(describe(n_seg.float(), "shape/segments_per_response"))
    metrics.update(describe(seg_len[seg_valid].float(), "shape/segment_length"))
    metrics.update(_potential_metrics(phi, phi_valid, n_seg, seg_adv, seg_valid, tok, mask, rewards))
    return AdvantageResult(tok, seg_adv, seg_ids, metrics)


def _check_segment_inputs(estimator: AdvantageEstimator, boundaries: torch.Tensor | None,
                          potentials: torch.Tensor | None, token_rewards: torch.Tensor | None) -> None:
    if boundaries is None or potentials is None:
        raise ValueError(f"estimator {estimator.name!r} needs boundaries and potentials")
    if token_rewards is not None:
        raise ValueError(f"estimator {estimator.name!r} takes no per-token reward (KL in the reward is defined for "
                         f"the outcome estimators: {', '.join(names_with('needs_segments', False))})")


def _token_credit(estimator: AdvantageEstimator, tok: torch.Tensor, seg_ids: torch.Tensor, mask: torch.Tensor,
                  entropy: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B, T]`` segment advantages on their tokens -> after TCR when the estimator uses it (SHAPE by default;
    MRT keeps the paper's uniform credit inside a segment unless ``--shape.tcr on``), and TCR's metrics."""
    if not estimator.uses_tcr:
        return tok, {}
    if entropy is None:
        raise ValueError("TCR needs the token entropy (or pass --shape.tcr off)")
    cfg = estimator.cfg
    w = tcr_weights(entropy, seg_ids, mask, cfg.tcr_beta, cfg.tcr_delta_min, cfg.tcr_delta_max, cfg.tcr_eps)
    return torch.where(mask, tok * w, torch.zeros_like(tok)), describe(w[mask], "shape/tcr_weight")


def _sequence_level(estimator: AdvantageEstimator, x: SequenceInputs) -> AdvantageResult:
    """Outcome estimators (GRPO, REINFORCE++, ...): token advantages ``[B, T]`` from the outcomes, no segments.
    ``adv/sequence`` describes each response's mean token advantage (its one advantage when gamma is 1 and
    there is no per-token reward)."""
    tok, returns = estimator.advantages_and_returns(x) if estimator.needs_critic else (estimator.token_advantages(x), None)
    mask = x.mask
    if tok.shape != mask.shape:
        raise RuntimeError(f"{estimator.name} returned advantages of shape {tuple(tok.shape)} for a {tuple(mask.shape)} batch")
    tok = torch.where(mask, tok.to(torch.float32), torch.zeros(mask.shape))
    per_response = tok.sum(-1) / mask.sum(-1).clamp(min=1)
    metrics: dict[str, float] = {}
    metrics.update(describe(per_response, "adv/sequence"))
    metrics.update(advantage_by_outcome(tok, mask, x.rewards))
    return AdvantageResult(tok, None, None, metrics, returns)


def _checked_potentials(potentials: torch.Tensor, rewards: torch.Tensor, n_seg: torch.Tensor,
                        kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(potentials ``[B, K+1]`` float32, 0 beyond a row's last one; valid ``[B, K+1]`` bool) after checking
    their shape, that they lie in [0, 1], and that each row ends at its outcome (Phi_K = R)."""
    batch = rewards.shape[0]
    phi = torch.as_tensor(potentials, dtype=torch.float32)
    if phi.shape != (batch, kmax + 1):
        raise ValueError(f"potentials must be [B, K+1] = [{batch}, {kmax + 1}], got {tuple(phi.shape)}")
    phi_valid = torch.arange(kmax + 1)[None, :] <= n_seg[:, None]
    if not torch.isfinite(phi[phi_valid]).all() or ((phi[phi_valid] < 0) | (phi[phi_valid] > 1)).any():
        raise ValueError("potentials must be finite and lie in [0, 1] at every valid boundary")
    phi = torch.where(phi_valid, phi, torch.zeros_like(phi))  # beyond a row's last potential: unused
    final = phi.gather(1, n_seg[:, None]).squeeze(1)
    if not torch.allclose(final, rewards.clamp(0, 1)):
        raise ValueError("the last potential of each response must equal its outcome R (Phi_K = R, no probe)")
    return phi, phi_valid


def _potential_metrics(phi: torch.Tensor, phi_valid: torch.Tensor, n_seg: torch.Tensor, seg_adv: torch.Tensor,
                       seg_valid: torch.Tensor, tok: torch.Tensor, mask: torch.Tensor,
                       rewards: torch.Tensor) -> dict[str, float]:
    """Potentials, segment advantages, advantage by outcome, potential drops and gain by start regime."""
    metrics: dict[str, float] = {}
    metrics.update(describe(phi[phi_valid], "shape/phi"))
    metrics.update(describe(seg_adv[seg_valid], "adv/segment"))
    metrics.update(advantage_by_outcome(tok, mask, rewards))
    metrics["shape/potential_drop_rate"] = potential_drop_rate(phi, n_seg)
    for name, (total, count) in gain_by_start_regime(phi, n_seg).items():
        metrics[f"shape/gain_by_start/{name}/sum"] = total
        metrics[f"shape/gain_by_start/{name}/count"] = float(count)
    return metrics


def pad_potentials(per_response: list[torch.Tensor], kmax: int) -> torch.Tensor:
    """Stack variable-length potentials ``[n_i + 1]`` into ``[B, kmax + 1]`` (0-padded)."""
    out = torch.zeros(len(per_response), kmax + 1, dtype=torch.float32)
    for i, p in enumerate(per_response):
        if p.numel() > kmax + 1:
            raise ValueError(f"response {i} has {p.numel() - 1} segments > K = {kmax}")
        out[i, : p.numel()] = p.float()
    return out


def boundaries_as_lists(boundaries: torch.Tensor) -> list[list[int]]:
    """``[B, K-1]`` -1-padded -> per-response Python lists of interior boundaries."""
    return [[int(b) for b in row if int(b) != PAD_BOUNDARY] for row in boundaries]
