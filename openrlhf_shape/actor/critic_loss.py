"""The critic's loss of one micro-batch and the metrics of one critic update, shared by both backends (as
:mod:`~openrlhf_shape.actor.micro_batch_loss` is for the policy): a backend computes the values of a micro-batch's
states (:func:`~openrlhf_shape.actor.value_model.value_positions`), this module takes each sample's first R (its
response tokens' states) into OpenRLHF's clipped value loss (:func:`~openrlhf_shape.algorithms.loss.value_loss`)
over the mini-batch's global token count. Sums leave a micro-batch (``CRITIC_KEYS``); :func:`critic_metrics`
divides once, after the backend all-reduced them.
"""

from __future__ import annotations

import torch

from openrlhf_shape.actor.batching import MicroBatch, take_rows
from openrlhf_shape.algorithms.loss import value_loss
from openrlhf_shape.batch import ValueBatch, length_mask

CRITIC_KEYS = ("loss", "values_sum", "value_clipfrac_sum", "num_tokens", "nonfinite")


def critic_masks(batch: ValueBatch) -> torch.Tensor:
    """``[B, T]`` bool: the tokens that enter the loss (the batch's action mask within each response)."""
    return batch.loss_mask.bool()[:, :batch.response_width] & length_mask(batch.response_lens, batch.response_width)


def micro_batch_value_loss(vals: torch.Tensor, offsets: list[tuple[int, int]], mb: MicroBatch, batch: ValueBatch,
                           masks: torch.Tensor, num_global_tokens: int,
                           clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """``vals``: ``[M]`` float32 values (with grad) of ``mb``'s states, per sample its ``offsets`` slice of R + 1
    (index j < R: response token j's state); ``masks``: :func:`critic_masks`. Returns the micro-batch's share of
    the mini-batch's loss and its metric sums; a filler micro-batch (no rows) adds zero."""
    rows = max(len(offsets), 1)
    tmax = max([1] + [b - a - 1 for a, b in offsets])
    dev = vals.device
    take = [torch.arange(a, b - 1) for a, b in offsets]
    idx = torch.cat(take).to(dev) if take else torch.zeros(0, dtype=torch.long, device=dev)
    r_idx = torch.cat([torch.full((len(t),), k, dtype=torch.long) for k, t in enumerate(take)]) if take else idx.cpu()
    c_idx = torch.cat([torch.arange(len(t)) for t in take]) if take else idx.cpu()
    v2 = vals.new_zeros(rows, tmax).index_put((r_idx.to(dev), c_idx.to(dev)), vals[idx])  # [rows, tmax]
    if mb.rows:
        sel = torch.tensor(mb.rows, dtype=torch.long)
        old, ret = (take_rows(t.float(), sel, tmax).to(dev) for t in (batch.old_values, batch.returns))
        msk = take_rows(masks, sel, tmax).to(dev)
    else:
        old = ret = torch.zeros(rows, tmax, device=dev)
        msk = torch.zeros(rows, tmax, dtype=torch.bool, device=dev)
    loss, m = value_loss(v2, old, ret, msk, clip, num_global_tokens=max(num_global_tokens, 1))
    stats = {k: float(m[k]) for k in ("values_sum", "value_clipfrac_sum", "num_tokens")}
    stats["loss"] = float(loss.detach())
    stats["nonfinite"] = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
    return loss, stats


def critic_metrics(sums: torch.Tensor, *, grad_norm: float, lr: float, ok: bool, step: int) -> dict[str, float]:
    """One critic update's metrics from the all-reduced ``sums`` (``[len(CRITIC_KEYS)]`` float64), identical on every
    rank, under OpenRLHF's names (``critic_loss``, ``values``, ``critic_lr``, ``critic_grad_norm``) plus ours:
    ``critic_clipfrac`` (tokens whose clipped term was the larger), ``critic_skipped``, ``critic_step``."""
    n_tok = max(sums[CRITIC_KEYS.index("num_tokens")].item(), 1.0)
    return {
        "critic_loss": sums[CRITIC_KEYS.index("loss")].item(),
        "values": sums[CRITIC_KEYS.index("values_sum")].item() / n_tok,
        "critic_clipfrac": sums[CRITIC_KEYS.index("value_clipfrac_sum")].item() / n_tok,
        "critic_num_tokens": float(sums[CRITIC_KEYS.index("num_tokens")].item()),
        "critic_grad_norm": grad_norm if ok else float("nan"),
        "critic_lr": lr,
        "critic_skipped": 0.0 if ok else 1.0,
        "critic_step": float(step),
    }
