"""Which tensors of a DeepSpeed engine belong to the offload groups ``params``, ``grads`` and
``optimizer`` (colocation). The moving is done by the backend-neutral storage-level
:class:`~openrlhf_shape.actor.offload.StateOffloader` (copy each distinct storage to host, resize
it to zero; onload restores it bit for bit), which works on DeepSpeed's flat buffers as well: a
parameter that is a view of a ZeRO flat group shares its storage and is moved once.

* ``params``: every parameter's data (ZeRO-1/2: views of the flat bf16/fp32 groups; ZeRO-3: each
  parameter's partition ``ds_tensor`` and any gathered or persistent full tensor);
* ``grads``: gradients still held (``.grad``, ZeRO-2's averaged partitions, ZeRO-3's gradient
  partitions); usually none between steps;
* ``optimizer``: fp32 master partitions and Adam moments (on host already under ``--ds.adam_offload``,
  where offloading them again moves nothing new but keeps the bookkeeping uniform).
"""

from __future__ import annotations

from typing import Any

import torch

_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_GRAD_ATTRS = ("averaged_gradients",)


def _flat(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def state_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """group -> tensors of ``engine`` (a ``deepspeed.DeepSpeedEngine``)."""
    out: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for p in engine.module.parameters():
        if getattr(p, "ds_tensor", None) is not None:
            out["params"].append(p.ds_tensor)
        if p.data.numel():
            out["params"].append(p.data)
        if p.grad is not None:
            out["grads"].append(p.grad)
    zopt = engine.optimizer
    for name in _GRAD_ATTRS:
        out["grads"].extend(_flat(getattr(zopt, name, None)))
    for name in _MASTER_ATTRS:
        out["optimizer"].extend(_flat(getattr(zopt, name, None)))
    inner = getattr(zopt, "optimizer", zopt)
    for state in getattr(inner, "state", {}).values():
        out["optimizer"].extend(v for v in state.values() if torch.is_tensor(v) and v.numel() > 0)
    return out
