"""The value model (reward model / critic, OpenRLHF's format: :mod:`openrlhf_shape.actor.value_model`) on a
DeepSpeed rank, forward only: the HF base model and its value head under an engine without optimizer, partitioned
as the reference is (ZeRO-3: every parameter over the ranks, the head gathered around its own forward; other
stages: whole on every rank), and the values of a batch's states."""

from __future__ import annotations

from typing import Any

import torch

from openrlhf_shape.actor.batching import MicroBatch
from openrlhf_shape.actor.value_model import load_value_model, value_positions
from openrlhf_shape.zero.state import ZeroState


def init_value_engine(state: ZeroState, hf_dir: str, attn_implementation: str, *, default_prefix: str,
                      head_seed: int | None) -> dict:
    """Load ``hf_dir``'s value model into ``state.engine`` (forward only); returns its description."""
    import deepspeed

    cfg = state.cfg
    model = load_value_model(hf_dir, dtype=cfg.params_dtype, attn_implementation=attn_implementation,
                             default_prefix=default_prefix, head_seed=head_seed)
    model.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg.ds_reference_config(), dist_init_required=False)
    state.engine, state.base_optimizer = engine, None
    state.hf_config, state.hf_dir, state.step = model.decoder.config, hf_dir, 0
    state.value_format = model.fmt
    fmt = model.fmt
    return {"num_parameters": int(n_params), "model_type": state.hf_config.model_type, "tp": 1, "pp": 1,
            "dp": state.dp_size, "zero_stage": 3 if cfg.zero_stage == 3 else 0, "dtype": str(cfg.params_dtype),
            "backend": "deepspeed", "value_head_prefix": fmt.prefix, "mean": fmt.mean, "std": fmt.std}


def value_outputs(state: ZeroState, mbs: list[MicroBatch], device: torch.device) -> dict[str, Any]:
    """``{"indices", "values"}``: per sample of ``mbs`` its raw values ``[R + 1]`` float32 on CPU
    (:func:`~openrlhf_shape.actor.value_model.value_positions`). Fillers run too (ZeRO-3 gathers are collective)."""
    out: dict[str, Any] = {"indices": [], "values": [], "micro_batches": len(mbs)}
    state.engine.eval()
    with torch.no_grad():
        for mb in mbs:
            rows, pos, offsets = value_positions(mb)
            values = state.engine(mb.input_ids.to(device), mb.position_ids.to(device), rows.to(device),
                                  pos.to(device)).float().cpu()
            for row, (a, b) in zip(mb.rows, offsets):
                out["indices"].append(row)
                out["values"].append(values[a:b].clone())
    return out
