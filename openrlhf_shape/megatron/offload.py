"""Which tensors of a Megatron rank belong to the offload groups (colocation); the moving is the
backend-neutral :class:`~openrlhf_shape.actor.offload.StateOffloader`.

* ``params``: the model's parameters and DDP's contiguous parameter buffers (and anything sharing
  their storage, e.g. fp32 optimizer shards that are views of them);
* ``grads``: ``main_grad`` buffers;
* ``optimizer``: optimizer states (Adam moments) and fp32 master copies of bf16 parameters.
"""

from __future__ import annotations

from typing import Iterable

import torch

from openrlhf_shape.actor.offload import GROUPS


def state_tensors(model_chunks: Iterable, optimizer) -> dict[str, list[torch.Tensor]]:
    """group -> tensors of the model chunks and the (possibly chained) Megatron optimizer."""
    out: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for chunk in model_chunks:
        for p in chunk.parameters():
            out["params"].append(p.data)
            g = getattr(p, "main_grad", None)
            if g is not None:
                out["grads"].append(g)
        # DDP's contiguous buffers; a forward-only model (the reference's bare module) has none: its
        # ``buffers`` is ``nn.Module.buffers``, a method
        ddp_buffers = [getattr(chunk, n, None) for n in ("buffers", "expert_parallel_buffers")]
        for buf in [b for bufs in ddp_buffers if isinstance(bufs, (list, tuple)) for b in bufs]:
            if getattr(buf, "param_data", None) is not None:
                out["params"].append(buf.param_data)
            if getattr(buf, "grad_data", None) is not None:
                out["grads"].append(buf.grad_data)
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:  # a ChainedOptimizer holds several
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:  # fp32 master params / shards
                out["optimizer"].extend(p.data for p in group["params"])
            for state in inner.state.values():
                out["optimizer"].extend(v for v in state.values() if torch.is_tensor(v) and v.numel() > 0)
            for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
                for grp in getattr(opt, name, None) or []:
                    out["optimizer"].extend(p.data for p in grp)
    return out
