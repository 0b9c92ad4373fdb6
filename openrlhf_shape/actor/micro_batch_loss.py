"""The policy loss of one micro-batch and the metrics of one optimizer step, shared by every training
backend: a backend computes the flat per-token log-probs and entropy of a micro-batch's responses
(its own forward), and both backends then run this same code, so their losses and metrics agree by
construction (the cross-backend parity tests check the forwards).

Sums, not means, leave a micro-batch (``METRIC_KEYS``): the backend adds them over micro-batches and
all-reduces them over ranks; :func:`step_metrics` divides by the global token count once. The policy loss leaves
as the micro-batch's share (already over the global count), whatever its aggregation (a token or a sample mean).
"""

from __future__ import annotations

import torch

from openrlhf_shape.actor.batching import MicroBatch, take_rows
from openrlhf_shape.algorithms.kl import kl_loss_sum
from openrlhf_shape.algorithms.loss import policy_loss
from openrlhf_shape.batch import TrainBatch

# pg_loss: the micro-batch's share of the mini-batch's policy loss (already over the global count); kl_sum /
# kl_tokens / logprobs_diff_sum: the KL to the reference and log pi - log pi_ref (KL in the loss only; kl_tokens 0
# when the batch has no KL term)
METRIC_KEYS = ("pg_loss", "clipfrac_low_sum", "clipfrac_high_sum", "approx_kl_sum", "num_tokens",
               "entropy_sum", "nonfinite", "kl_sum", "kl_tokens", "logprobs_diff_sum")


def micro_batch_loss(lp: torch.Tensor, en: torch.Tensor, mb: MicroBatch, batch: TrainBatch, masks: torch.Tensor,
                     num_global_tokens: int, *, eps_low: float, eps_high: float, dual_clip: float | None,
                     loss_type: str = "ppo",
                     num_global_samples: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss (``loss_type``: ppo | gspo | cispo, algorithms/loss.py) of ``mb`` and its metric sums.

    ``lp``, ``en``: ``[N]`` log-probs (with grad) and entropies of the micro-batch's response tokens,
    concatenated in ``mb.resp_offsets`` order; ``masks``: the batch's ``[B, T]`` valid-token mask;
    ``num_global_tokens`` / ``num_global_samples``: valid tokens / samples with a valid token of the whole
    mini-batch on all ranks (the token-level / gspo's sample-level loss denominator; samples None: from ``masks``).
    A filler micro-batch (``mb.rows`` empty: a rank with fewer micro-batches than its peers, or none
    of the samples) is fully masked and contributes zero loss and zero metrics. With ``batch.kl_loss`` (KL in the
    loss) the loss gains ``coef x`` the KL estimate summed over the valid tokens / ``num_global_tokens``.
    gspo with the rollout correction on (``batch.is_weights``) takes its ratio against the engines' log-probs and
    applies no weights, as OpenRLHF's GSPO.
    """
    rows = max(len(mb.resp_offsets), 1)
    tmax = max([1] + [b - a for a, b in mb.resp_offsets])
    dev = lp.device
    if lp.numel():
        row_idx = torch.cat([torch.full((b - a,), k, dtype=torch.long) for k, (a, b) in enumerate(mb.resp_offsets)])
        col_idx = torch.cat([torch.arange(b - a) for a, b in mb.resp_offsets])
    else:
        row_idx = col_idx = torch.zeros(0, dtype=torch.long)
    where = (row_idx.to(dev), col_idx.to(dev))
    lp2 = lp.new_zeros(rows, tmax).index_put(where, lp).float()  # [rows, T_mb]
    ent = torch.zeros(rows, tmax, dtype=torch.float32, device=dev).index_put(where, en.float())
    old, adv, msk, isw, ref = _row_tensors(batch, mb, masks, tmax, rows, dev)
    base = old  # the log-probs the ratio is taken against
    if loss_type == "gspo" and isw is not None:  # OpenRLHF's GSPO under the correction: against the engines'
        base, isw = _take(batch.rollout_log_probs, mb, tmax, rows, dev, "rollout_log_probs"), None
    samples = int(masks.bool().any(-1).sum()) if num_global_samples is None else num_global_samples
    loss, m = policy_loss(lp2, base, adv, msk, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                          num_global_tokens=max(num_global_tokens, 1), is_weights=isw, loss_type=loss_type,
                          num_global_samples=max(samples, 1))
    stats = {k: float(m[k]) for k in METRIC_KEYS if k in m}
    stats["pg_loss"] = float(loss.detach())
    stats["entropy_sum"] = float((ent * msk).sum())
    stats["kl_sum"] = stats["kl_tokens"] = stats["logprobs_diff_sum"] = 0.0
    if batch.kl_loss is not None:
        term = batch.kl_loss
        kl = kl_loss_sum(lp2, ref, msk, term.estimator, old_log_probs=old, unbiased_gradient=term.unbiased_gradient)
        loss = loss + term.coef * kl / max(num_global_tokens, 1)
        stats["kl_sum"], stats["kl_tokens"] = float(kl.detach()), float(msk.sum())
        stats["logprobs_diff_sum"] = float(((lp2.detach() - ref) * msk).sum())
    stats["nonfinite"] = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
    return loss, stats


def _take(t: torch.Tensor | None, mb: MicroBatch, tmax: int, rows: int, dev: torch.device,
          name: str) -> torch.Tensor:
    """The micro-batch's rows of a batch's ``[B, T]`` float tensor, ``[rows, tmax]`` float32 (zeros for a filler)."""
    if t is None:
        raise ValueError(f"this loss needs batch.{name}, which the TrainBatch does not carry")
    if not mb.rows:
        return torch.zeros(rows, tmax, dtype=torch.float32, device=dev)
    return take_rows(t, torch.tensor(mb.rows, dtype=torch.long), tmax).float().to(dev)


def _row_tensors(batch: TrainBatch, mb: MicroBatch, masks: torch.Tensor, tmax: int, rows: int,
                 dev: torch.device) -> tuple[torch.Tensor, ...]:
    """``[rows, tmax]`` old log-probs, advantages, valid mask (bool), rollout-correction weights (None when the batch
    has none) and reference log-probs (None without a KL term) of the micro-batch's rows."""
    msk = (take_rows(masks, torch.tensor(mb.rows, dtype=torch.long), tmax).to(dev) if mb.rows
           else torch.zeros(rows, tmax, dtype=torch.bool, device=dev))
    old = _take(batch.old_log_probs, mb, tmax, rows, dev, "old_log_probs")
    adv = _take(batch.advantages, mb, tmax, rows, dev, "advantages")
    isw = None if batch.is_weights is None or not mb.rows else _take(batch.is_weights, mb, tmax, rows, dev, "")
    ref = _take(batch.ref_log_probs, mb, tmax, rows, dev, "ref_log_probs") if batch.kl_loss is not None else None
    return old, adv, msk, isw, ref


def step_metrics(sums: torch.Tensor, *, grad_norm: float, lr: float, ok: bool, step: int) -> dict[str, float]:
    """One optimizer step's metrics from the all-reduced ``sums`` (``[len(METRIC_KEYS)]``, float64): the policy loss
    and per-token means over the mini-batch's valid tokens, identical on every rank. ``ok`` False: the update was skipped
    (non-finite loss or gradients), ``grad_norm`` reads NaN."""
    n_tok = max(sums[METRIC_KEYS.index("num_tokens")].item(), 1.0)

    def mean(key: str) -> float:
        return sums[METRIC_KEYS.index(key)].item() / n_tok

    low, high = mean("clipfrac_low_sum"), mean("clipfrac_high_sum")
    kl_tokens = sums[METRIC_KEYS.index("kl_tokens")].item()
    kl = {"kl": sums[METRIC_KEYS.index("kl_sum")].item() / kl_tokens,  # KL in the loss
          "logprobs_diff": sums[METRIC_KEYS.index("logprobs_diff_sum")].item() / kl_tokens} if kl_tokens > 0 else {}
    return {
        **kl,
        "loss": sums[METRIC_KEYS.index("pg_loss")].item(),  # the policy loss the update minimised
        "pg_clipfrac_low": low,
        "pg_clipfrac_high": high,
        "pg_clipfrac": low + high,
        "approx_kl": mean("approx_kl_sum"),
        "num_tokens": float(sums[METRIC_KEYS.index("num_tokens")].item()),
        "entropy": mean("entropy_sum"),
        "grad_norm": grad_norm if ok else float("nan"),
        "lr": lr,
        "skipped": 0.0 if ok else 1.0,
        "step": float(step),
    }
