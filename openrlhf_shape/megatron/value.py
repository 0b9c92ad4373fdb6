"""The value model (reward model / critic in OpenRLHF's format, :mod:`openrlhf_shape.actor.value_model`) on a
Megatron rank, forward only: the policy's GPT stages in the rank's layout (TP / PP / DP, sequence parallel) whose
last stage's output layer is the ``[1, h]`` value head (mbridge's ``make_value_model``), replicated over its TP
ranks (one output row cannot be split), and the values of a batch's states from the final hidden states.
Functions of the rank's :class:`~openrlhf_shape.megatron.state.ActorState`, run inside the worker's device mode.
"""

from __future__ import annotations

from typing import Any

import torch

from openrlhf_shape.actor.batching import MicroBatch, validate_batch
from openrlhf_shape.actor.value_model import (init_value_head, read_checkpoint_tensor, value_head_format,
                                              value_positions)
from openrlhf_shape.batch import SequenceBatch
from openrlhf_shape.megatron.build import build_model
from openrlhf_shape.megatron.state import ActorState
from openrlhf_shape.megatron.step import holds_results, plan, run_schedule


def build_value_model(state: ActorState, hf_dir: str, *, default_prefix: str, head_seed: int | None,
                      train: bool = False) -> dict:
    """Build ``hf_dir``'s value model into ``state`` (forward only; ``train``: with DDP and the optimizer of
    ``state.cfg.optim``, the critic); a directory without a head (a causal LM) needs ``head_seed``, from which every
    last-stage rank draws the same head. Returns the model's description."""
    from megatron.core import parallel_state as mpu
    from transformers import AutoConfig

    if state.cfg.context_parallel_size > 1:
        raise ValueError("a value model does not run under --megatron.context_parallel_size > 1 yet: set it to 1 "
                         "for the reward model / critic ranks")
    fmt = value_head_format(AutoConfig.from_pretrained(hf_dir), default_prefix)
    in_dir = read_checkpoint_tensor(hf_dir, f"{fmt.prefix}.weight") is not None
    if not in_dir and head_seed is None:
        raise ValueError(f"{hf_dir} has no value head '{fmt.prefix}.weight': pass an OpenRLHF reward model / "
                         "critic directory, or set --ds.value_head_prefix to the head's name")
    info = build_model(state, hf_dir, train=train, value_head=fmt.prefix, head_in_dir=in_dir)
    if not in_dir and mpu.is_pipeline_last_stage():
        head = state.gpt.output_layer
        with torch.no_grad():
            init_value_head(head, head.weight.shape[1], head_seed)
    if not in_dir and state.optimizer is not None:
        state.optimizer.reload_model_params()  # bf16: the fp32 main copy of the drawn head
    state.value_format = fmt
    return {**info, "value_head_prefix": fmt.prefix, "mean": fmt.mean, "std": fmt.std}


def state_values(state: ActorState, hidden: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, list]:
    """hidden ``[s(/tp under SP), b, h]`` on the last stage -> (raw values ``[M]`` float32 of ``mb``'s states, per
    sample its slice); every TP rank holds the whole head and computes the same loss.

    Gradients: without SP every TP rank sees the whole sequence, so the head's gradient is whole on each (not marked
    ``sequence_parallel``: Megatron reduces it over data parallelism only). Under SP the head scores the rank's
    chunk and the values are gathered (their backward takes the rank's chunk back): the head's gradient is that
    chunk's part, and Megatron sums the ``sequence_parallel`` head over TP, as it does the norms."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    weight = state.gpt.output_layer.weight  # [1, h]
    scores = torch.nn.functional.linear(hidden, weight.to(hidden.dtype))  # [s(/tp), b, 1]
    if state.cfg.sequence_parallel:
        scores = gather_from_sequence_parallel_region(scores, tensor_parallel_output_grad=False)
    rows, pos, offsets = value_positions(mb)
    return scores[pos.to(scores.device), rows.to(scores.device), 0].float(), offsets


def values(state: ActorState, batch: SequenceBatch | dict) -> dict[str, Any]:
    """Forward only; the worker's ``compute_values`` (its docstring says the output). Results on the last PP
    stage's TP rank 0 (:func:`~openrlhf_shape.megatron.step.holds_results`), ``{}`` elsewhere."""
    batch = validate_batch(batch)
    shard, mbs = plan(state, batch, forward_only=True)
    state.model.eval()

    def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
        vals, offsets = state_values(state, hidden, mb)
        zero = torch.zeros((), device=hidden.device)
        return zero, torch.tensor(0, dtype=torch.int), {"mb": mb, "values": vals.cpu(), "offsets": offsets}

    with torch.no_grad():
        store = run_schedule(state, mbs, loss_fn, forward_only=True)
    state.model.train()
    if not holds_results() or not shard:
        return {}
    out: dict[str, Any] = {"indices": [], "values": [], "micro_batches": len(mbs)}
    for rec in store:
        for row, (a, b) in zip(rec["mb"].rows, rec["offsets"]):
            out["indices"].append(row)
            out["values"].append(rec["values"][a:b].clone())
    return out
