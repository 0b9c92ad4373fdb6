"""The critic tests' reference (tests/megatron, tests/zero): a ValueBatch for the ragged batch, and plain torch updates
of the Hugging Face value model (``actor/value_model.py``) with the critic's loss (``algorithms/loss.py``
``value_loss``, held to OpenRLHF's ValueLoss), torch's AdamW, clipping by the global norm and the LR schedule."""

from __future__ import annotations

import torch

from openrlhf_shape.batch import ValueBatch, length_mask

CRITIC_CLIP = 0.2
# the critic's own optimiser (not the actor's TRAIN_CFG one): the worker must train with what init_critic got
CRITIC_OPTIM = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, min_lr=1e-4, lr_warmup_steps=1,
                    lr_scheduler="cosine_warmup_with_min_lr", total_steps=4, max_norm=0.5, micro_batch_max_tokens=64)


def critic_optim(base):
    """``base`` (a rank's ``OptimConfig``) with :data:`CRITIC_OPTIM`."""
    import dataclasses

    own = {k: v for k, v in CRITIC_OPTIM.items() if k not in ("lr", "betas", "eps")}
    adam = dataclasses.replace(base.adam, lr=CRITIC_OPTIM["lr"], betas=CRITIC_OPTIM["betas"], eps=CRITIC_OPTIM["eps"])
    return dataclasses.replace(base, adam=adam, **own)


def hf_values(model, batch) -> list[torch.Tensor]:
    """Per sample the HF value model's values of its R response tokens' states, ``[R]`` float32 (with grad)."""
    return [model(torch.tensor([s]), torch.arange(len(s))[None])[0, p - 1:len(s) - 1]
            for s, p in zip(batch.sequences, batch.prompt_lens)]


def critic_batch(value_dir: str, ragged: dict) -> ValueBatch:
    """The ragged batch with old values = the model's values + noise (so the clip acts on some tokens), returns of
    order 1 and a few masked tokens."""
    from openrlhf_shape.actor.value_model import load_value_model

    seq = ValueBatch(sequences=ragged["sequences"], prompt_lens=ragged["prompt_lens"],
                     old_values=torch.zeros(0, 0), returns=torch.zeros(0, 0), loss_mask=torch.zeros(0, 0))
    g = torch.Generator().manual_seed(3)
    b, t = len(seq), seq.response_width
    with torch.no_grad():
        vals = hf_values(load_value_model(value_dir, dtype=torch.float32), seq)
    old = torch.zeros(b, t)
    for i, v in enumerate(vals):
        old[i, :len(v)] = v
    old += 0.3 * torch.randn(b, t, generator=g)
    mask = length_mask(seq.response_lens, t) & (torch.rand(b, t, generator=g) > 0.1)
    return ValueBatch(sequences=seq.sequences, prompt_lens=seq.prompt_lens, old_values=old,
                      returns=torch.randn(b, t, generator=g), loss_mask=mask)


def reference_updates(value_dir: str, batch: ValueBatch, optim, steps: int,
                      head_seed: int | None = None) -> tuple[dict, list[dict]]:
    """``steps`` plain torch updates of the HF value model on ``batch`` (``optim``: the rank's ``OptimConfig``,
    weight decay 0; ``head_seed``: a causal LM's drawn head). Returns (its state dict after, per step loss / grad
    norm / clip fraction / lr)."""
    from openrlhf_shape.actor.lr_schedule import lr_at
    from openrlhf_shape.actor.value_model import load_value_model
    from openrlhf_shape.algorithms.loss import value_loss

    model = load_value_model(value_dir, dtype=torch.float32, head_seed=head_seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim.adam.lr, betas=optim.adam.betas, eps=optim.adam.eps, weight_decay=0.0)
    mask = batch.loss_mask.bool()
    out = []
    for step in range(steps):
        lr = lr_at(optim, step)
        for group in opt.param_groups:
            group["lr"] = lr
        v2 = torch.zeros(batch.old_values.shape)
        v2 = v2.index_put(_where(batch), torch.cat(hf_values(model, batch)))
        loss, m = value_loss(v2, batch.old_values, batch.returns, mask, CRITIC_CLIP, num_global_tokens=int(mask.sum()))
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, optim.max_norm))
        opt.step()
        opt.zero_grad()
        n = float(m["num_tokens"])
        out.append({"critic_loss": float(loss.detach()), "critic_grad_norm": norm, "critic_lr": lr,
                    "critic_clipfrac": float(m["value_clipfrac_sum"]) / n, "values": float(m["values_sum"]) / n})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, out


def _where(batch: ValueBatch) -> tuple[torch.Tensor, torch.Tensor]:
    lens = batch.response_lens
    rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)])
    cols = torch.cat([torch.arange(n) for n in lens])
    return rows, cols
