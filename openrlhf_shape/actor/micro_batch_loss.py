"""The policy loss of one micro-batch and the metrics of one optimizer step, shared by every training
backend: a backend computes the flat per-token log-probs and entropy of a micro-batch's responses
(its own forward), and both backends then run this same code, so their losses and metrics agree by
construction (the cross-backend parity tests check the forwards).

Sums, not means, leave a micro-batch (``METRIC_KEYS``): the backend adds them over micro-batches and
all-reduces them over ranks; :func:`step_metrics` divides by the global token count once.
"""

from __future__ import annotations

import torch

from openrlhf_shape.actor.batching import MicroBatch, take_rows
from openrlhf_shape.algorithms.kl import kl_loss_sum
from openrlhf_shape.algorithms.loss import policy_loss
from openrlhf_shape.batch import TrainBatch

# kl_sum / kl_tokens: the KL to the reference (KL in the loss only; kl_tokens 0 when the batch has no KL term)
METRIC_KEYS = ("pg_loss_sum", "clipfrac_low_sum", "clipfrac_high_sum", "approx_kl_sum", "num_tokens",
               "entropy_sum", "nonfinite", "kl_sum", "kl_tokens")


def micro_batch_loss(lp: torch.Tensor, en: torch.Tensor, mb: MicroBatch, batch: TrainBatch, masks: torch.Tensor,
                     num_global_tokens: int, *, eps_low: float, eps_high: float,
                     dual_clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/DAPO loss of ``mb`` and its metric sums.

    ``lp``, ``en``: ``[N]`` log-probs (with grad) and entropies of the micro-batch's response tokens,
    concatenated in ``mb.resp_offsets`` order; ``masks``: the batch's ``[B, T]`` valid-token mask;
    ``num_global_tokens``: valid tokens of the whole mini-batch on all ranks (the loss's denominator).
    A filler micro-batch (``mb.rows`` empty: a rank with fewer micro-batches than its peers, or none
    of the samples) is fully masked and contributes zero loss and zero metrics. With ``batch.kl_loss`` (KL in the
    loss) the loss gains ``coef x`` the KL estimate summed over the valid tokens / ``num_global_tokens``.
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
    lp2 = lp.new_zeros(rows, tmax).index_put(where, lp)  # [rows, T_mb]
    ent = torch.zeros(rows, tmax, dtype=torch.float32, device=dev).index_put(where, en.float())
    if mb.rows:  # [B, T] -> this micro-batch's rows, cut to its longest response
        sel = torch.tensor(mb.rows, dtype=torch.long)
        old = take_rows(batch.old_log_probs, sel, tmax).float().to(dev)
        adv = take_rows(batch.advantages, sel, tmax).float().to(dev)
        msk = take_rows(masks, sel, tmax).to(dev)
        isw = take_rows(batch.is_weights, sel, tmax).float().to(dev) if batch.is_weights is not None else None
    else:
        old = torch.zeros(rows, tmax, dtype=torch.float32, device=dev)
        adv, msk, isw = torch.zeros_like(old), torch.zeros(rows, tmax, dtype=torch.bool, device=dev), None
    loss, m = policy_loss(lp2.float(), old, adv, msk, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                          num_global_tokens=max(num_global_tokens, 1), is_weights=isw)
    stats = {k: float(m[k]) for k in METRIC_KEYS if k in m}
    stats["entropy_sum"] = float((ent * msk).sum())
    stats["kl_sum"] = stats["kl_tokens"] = 0.0
    if batch.kl_loss is not None:
        term = batch.kl_loss
        ref = (take_rows(batch.ref_log_probs, torch.tensor(mb.rows, dtype=torch.long), tmax).float().to(dev)
               if mb.rows else torch.zeros_like(old))
        kl = kl_loss_sum(lp2.float(), ref, msk, term.estimator, old_log_probs=old,
                         unbiased_gradient=term.unbiased_gradient)
        loss = loss + term.coef * kl / max(num_global_tokens, 1)
        stats["kl_sum"], stats["kl_tokens"] = float(kl.detach()), float(msk.sum())
    stats["nonfinite"] = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
    return loss, stats


def step_metrics(sums: torch.Tensor, *, grad_norm: float, lr: float, ok: bool, step: int) -> dict[str, float]:
    """One optimizer step's metrics from the all-reduced ``sums`` (``[len(METRIC_KEYS)]``, float64): per-token
    means over the mini-batch's valid tokens, identical on every rank. ``ok`` False: the update was skipped
    (non-finite loss or gradients), ``grad_norm`` reads NaN."""
    n_tok = max(sums[METRIC_KEYS.index("num_tokens")].item(), 1.0)

    def mean(key: str) -> float:
        return sums[METRIC_KEYS.index(key)].item() / n_tok

    low, high = mean("clipfrac_low_sum"), mean("clipfrac_high_sum")
    kl_tokens = sums[METRIC_KEYS.index("kl_tokens")].item()
    kl = {"kl": sums[METRIC_KEYS.index("kl_sum")].item() / kl_tokens} if kl_tokens > 0 else {}  # KL in the loss
    return {
        **kl,
        "loss": mean("pg_loss_sum"),
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
