"""The KL term of the policy loss (``--algo.kl.use_loss``) in the loss both backends share
(openrlhf_shape/actor/micro_batch_loss.py): summed over micro-batches it is coef x the token mean of the k3
estimate over the whole mini-batch, written out here by hand, with the matching gradient; without the term the
loss and its metrics are as before."""

from __future__ import annotations

import math

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch
from openrlhf_shape.actor.micro_batch_loss import METRIC_KEYS, micro_batch_loss, step_metrics
from openrlhf_shape.algorithms.loss import policy_loss
from openrlhf_shape.batch import KLLossTerm, TrainBatch

SEQS = [[5, 6, 7, 8, 9], [5, 6, 1, 2], [3, 4, 4, 4, 4, 4]]
PLENS = [2, 2, 3]  # responses of 3, 2 and 3 tokens
OLD = [torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-0.2, -3.0]), torch.tensor([-1.1, -0.9, -0.3])]
REF = [torch.tensor([-1.5, -0.5, -1.0]), torch.tensor([-0.7, -1.0]), torch.tensor([-1.0, -1.2, -0.3])]
ADV = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-0.5, -0.5]), torch.tensor([0.25, 0.25, 0.25])]
NEW = [torch.tensor([-0.9, -0.6, -1.8]), torch.tensor([-0.25, -2.5]), torch.tensor([-1.0, -1.0, -0.4])]
COEF = 0.05


def _batch(kl_loss: KLLossTerm | None) -> TrainBatch:
    b = TrainBatch.from_ragged(SEQS, PLENS, OLD, ADV)
    b.ref_log_probs = TrainBatch.from_ragged(SEQS, PLENS, REF, ADV).old_log_probs if kl_loss else None
    b.kl_loss = kl_loss
    b.validate()
    return b


def _run(batch: TrainBatch) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Two micro-batches (rows 0 and 2, then row 1) as a rank would run them: (summed loss, the new log-probs
    with their gradients, the all-reduced metric sums)."""
    masks = batch.loss_mask.bool()
    total, leaves, sums = torch.zeros(()), [], torch.zeros(len(METRIC_KEYS), dtype=torch.float64)
    for rows in ([0, 2], [1]):
        mb = build_micro_batch(SEQS, PLENS, rows)
        lp = torch.cat([NEW[r] for r in rows]).clone().requires_grad_(True)
        loss, stats = micro_batch_loss(lp, torch.zeros_like(lp), mb, batch, masks, int(masks.sum()),
                                       eps_low=0.2, eps_high=0.28, dual_clip=None)
        loss.backward()
        total, leaves = total + loss.detach(), leaves + [lp]
        sums += torch.tensor([stats[k] for k in METRIC_KEYS], dtype=torch.float64)
    return total, leaves, sums


def test_kl_in_the_loss_is_coef_times_the_global_token_mean_of_k3():
    base, base_leaves, base_sums = _run(_batch(None))
    got, leaves, sums = _run(_batch(KLLossTerm(COEF, "k3")))
    # by hand: 8 valid tokens; r = new - ref per token; k3 = e^-r - 1 + r; d k3 / d new = 1 - e^-r
    r = [NEW[i] - REF[i] for i in range(3)]
    k3_sum = sum(float((torch.exp(-x) - 1 + x).sum()) for x in r)
    assert float(got) == pytest.approx(float(base) + COEF * k3_sum / 8, abs=1e-6)
    pg, _ = policy_loss(torch.nn.utils.rnn.pad_sequence(NEW, batch_first=True),
                        torch.nn.utils.rnn.pad_sequence(OLD, batch_first=True),
                        torch.nn.utils.rnn.pad_sequence(ADV, batch_first=True), _batch(None).loss_mask)
    assert float(base) == pytest.approx(float(pg), abs=1e-6)  # the policy part is the plain policy loss
    for lp, lp0, rows in zip(leaves, base_leaves, ([0, 2], [1])):
        want = torch.cat([COEF * (1 - torch.exp(-r[i])) / 8 for i in rows])
        assert torch.allclose(lp.grad - lp0.grad, want, atol=1e-7)
    m, m0 = step_metrics(sums, grad_norm=1.0, lr=1e-3, ok=True, step=1), step_metrics(base_sums, grad_norm=1.0,
                                                                                       lr=1e-3, ok=True, step=1)
    assert m["kl"] == pytest.approx(k3_sum / 8, abs=1e-7) and "kl" not in m0
    assert m["loss"] == pytest.approx(m0["loss"])  # "loss" stays the policy loss (OpenRLHF's policy_loss)
    assert math.isfinite(m["kl"])


def test_kl_term_needs_reference_log_probs():
    b = TrainBatch.from_ragged(SEQS, PLENS, OLD, ADV)
    b.kl_loss = KLLossTerm(COEF, "k1")
    with pytest.raises(ValueError, match="ref_log_probs"):
        b.validate()
