"""The critic on a DeepSpeed rank (``--algo.advantage.estimator gae``): the value model of
:mod:`~openrlhf_shape.zero.value` under a training engine with the critic's own AdamW, clipping and LR schedule
(``--critic.*``), and one optimizer step of OpenRLHF's clipped value loss (:mod:`~openrlhf_shape.actor.critic_loss`)
over a mini-batch, accumulated over micro-batches as the policy's step is (:mod:`~openrlhf_shape.zero.worker`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from openrlhf_shape.actor.batching import MicroBatch
from openrlhf_shape.actor.critic_loss import CRITIC_KEYS, critic_masks, critic_metrics, micro_batch_value_loss
from openrlhf_shape.actor.value_model import load_value_model, value_positions
from openrlhf_shape.batch import ValueBatch
from openrlhf_shape.zero.state import ZeroState


def init_critic_engine(state: ZeroState, hf_dir: str, attn_implementation: str, make_optimizer: Callable, *,
                       on_gpu: bool, default_prefix: str, head_seed: int | None) -> dict:
    """Load ``hf_dir``'s value model into a training engine (``state.cfg.optim``: the critic's); returns its
    description. ``make_optimizer(module)``: the worker's AdamW with its no-decay groups."""
    import deepspeed

    cfg = state.cfg
    model = load_value_model(hf_dir, dtype=cfg.params_dtype, attn_implementation=attn_implementation,
                             default_prefix=default_prefix, head_seed=head_seed)
    with torch.no_grad():  # own storage, not a view of the memory-mapped checkpoint: colocation frees storages
        for p in model.parameters():
            if not p.untyped_storage().resizable():
                p.data = p.data.clone()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg.ds_config(on_gpu=on_gpu),
                                           dist_init_required=False)
    state.engine, state.base_optimizer = engine, optimizer
    state.hf_config, state.hf_dir, state.step = model.decoder.config, hf_dir, 0
    state.value_format = model.fmt
    state.apply_lr()
    return {"num_parameters": int(n_params), "model_type": state.hf_config.model_type, "tp": 1, "pp": 1,
            "dp": state.dp_size, "zero_stage": cfg.zero_stage, "dtype": str(cfg.params_dtype), "backend": "deepspeed",
            "value_head_prefix": model.fmt.prefix, "mean": model.fmt.mean, "std": model.fmt.std, "critic": True}


def critic_step(state: ZeroState, batch: ValueBatch, mbs: list[MicroBatch], *, value_clip: float | None,
                device: torch.device) -> dict[str, float]:
    """One optimizer step of the critic over ``batch`` (``mbs``: this rank's micro-batches, topped up with fillers);
    float metrics (:func:`~openrlhf_shape.actor.critic_loss.critic_metrics`), identical on every rank."""
    masks = critic_masks(batch)
    num_global_tokens = int(masks.sum())
    lr_used = state.apply_lr()
    sums = torch.zeros(len(CRITIC_KEYS), dtype=torch.float64)
    engine = state.engine
    engine.train()
    for k, mb in enumerate(mbs):
        engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
        rows, pos, offsets = value_positions(mb)
        vals = engine(mb.input_ids.to(device), mb.position_ids.to(device), rows.to(device), pos.to(device)).float()
        loss, stats = micro_batch_value_loss(vals, offsets, mb, batch, masks, num_global_tokens, value_clip)
        for j, key in enumerate(CRITIC_KEYS):
            sums[j] += float(stats[key])
        engine.backward(loss * dist.get_world_size())  # DeepSpeed averages over the ranks; the loss is a global mean
    engine.step()
    sums = sums.to(device)
    dist.all_reduce(sums)
    sums = sums.cpu()
    overflow = bool(getattr(engine.optimizer, "overflow", False))
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm) if norm is not None else float("nan")
    ok = not overflow and math.isfinite(grad_norm)
    if ok:
        state.step += 1
    return critic_metrics(sums, grad_norm=grad_norm, lr=lr_used, ok=ok, step=state.step)
