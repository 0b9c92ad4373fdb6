"""The forward passes of one Megatron rank: log-probs and entropy of a batch (forward only) and one optimizer step
(the policy loss over the mini-batch, MoE router losses, clipping, Adam). Functions of the rank's
:class:`~openrlhf_shape.megatron.state.ActorState`, run through Megatron's pipeline schedule inside the worker's
device mode.

Each data-parallel rank takes its shard of the batch and cuts it into micro-batches by a token budget (packed into
one THD row each unless ``--actor.pack_samples false``); the last pipeline stage applies the output layer in chunks
(:func:`openrlhf_shape.actor.logprobs.vocab_parallel_logprobs_entropy`) to the response positions only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from openrlhf_shape.actor.batching import MicroBatch, micro_batch_budget, rank_micro_batches, validate_batch
from openrlhf_shape.actor.cp_comm import sum_over_cp
from openrlhf_shape.actor.cp_split import CpShard, cp_shard
from openrlhf_shape.actor.logprobs import vocab_parallel_logprobs_entropy
from openrlhf_shape.actor.lr_schedule import apply_lr
from openrlhf_shape.actor.micro_batch_loss import METRIC_KEYS, micro_batch_loss, step_metrics
from openrlhf_shape.batch import SequenceBatch, TrainBatch, length_mask
from openrlhf_shape.megatron.attention import packed_seq_params, varlen_kernel
from openrlhf_shape.megatron.routing_replay import MicroBatchRouting, routing_for_pass
from openrlhf_shape.megatron.router_loss import router_loss_scale, router_losses_on, router_padding_mask
from openrlhf_shape.megatron.state import ActorState


def holds_results() -> bool:
    """The last stage's first TP and CP rank (CP ranks end with the same per-sample results: one reports)."""
    from megatron.core import parallel_state as mpu

    return (mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0)


def plan(state: ActorState, batch: SequenceBatch, *, forward_only: bool) -> tuple[list[int], list[MicroBatch]]:
    """This DP rank's sample indices and its micro-batches (same on TP/PP peers): packed into one THD row
    each (every attention of this backend takes them: ``megatron/attention.py``, TE) unless
    ``optim.pack_samples`` is off, under ``--rollout.max_tokens_per_gpu`` for a forward-only pass. With expert
    parallelism every MoE layer's forward and backward is an all-to-all over the data-parallel ranks of the
    expert group, so all DP ranks run as many micro-batches as the longest plan. Context parallelism: each
    sequence padded to :attr:`MegatronConfig.sequence_multiple`, and a micro-batch holds CP x the per-GPU budget
    (each CP rank computes 1/CP of it)."""
    from megatron.core import parallel_state as mpu

    cfg, optim = state.cfg, state.cfg.optim
    cp = cfg.context_parallel_size
    return rank_micro_batches(
        batch, dp_size=state.dp_size, dp_rank=mpu.get_data_parallel_rank(),
        max_tokens=cp * micro_batch_budget(optim, forward_only=forward_only), packed=optim.pack_samples,
        pad_id=int(getattr(state.hf_config, "pad_token_id", None) or 0),
        # sequence parallel splits the sequence dimension over the TP ranks, CP each sequence into 2 x CP chunks
        pad_multiple=cfg.pack_multiple if optim.pack_samples else max(cfg.sequence_multiple, cfg.pack_multiple),
        doc_multiple=cfg.sequence_multiple, equal_counts=cfg.expert_model_parallel_size > 1)


def _cp_view(state: ActorState, mb: MicroBatch) -> CpShard | None:
    """This CP rank's positions of ``mb`` (None without context parallelism)."""
    from megatron.core import parallel_state as mpu

    cp = state.cfg.context_parallel_size
    return cp_shard(mb, cp, mpu.get_context_parallel_rank()) if cp > 1 else None


def response_logprobs(state: ActorState, hidden: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool):
    """hidden [s(/tp under SP)(/cp), b, h] on the last stage -> (logp [N], entropy [N]) for mb's responses.
    Under CP each rank computes its own positions' and :func:`sum_over_cp` hands every CP rank all N."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    gpt = state.gpt
    if state.cfg.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    view = _cp_view(state, mb)
    pos, rows, targets = ((mb.resp_pos, mb.resp_rows, mb.resp_targets) if view is None else
                          (view.resp_pos, view.resp_rows, mb.resp_targets[view.resp_local]))
    h = hidden[pos.to(hidden.device), rows.to(hidden.device)]  # [N, h] (under CP: [n] of this rank's)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
    vocab_start = mpu.get_tensor_model_parallel_rank() * weight.shape[0]
    lp, en = vocab_parallel_logprobs_entropy(
        h,
        weight,
        targets.to(hidden.device),
        vocab_start=vocab_start,
        temperature=temperature,
        tp_group=mpu.get_tensor_model_parallel_group(),
        chunk_size=state.cfg.optim.entropy_chunk_size,
        with_entropy=with_entropy,
    )
    if view is None:
        return lp, en
    group, held = mpu.get_context_parallel_group(), view.resp_local.to(hidden.device)
    return sum_over_cp(lp, held, group), (sum_over_cp(en, held, group) if en is not None else None)


def run_schedule(state: ActorState, mbs: list[MicroBatch], loss_fn, *, forward_only: bool,
                 routing: MicroBatchRouting | None = None) -> list:
    """``mbs`` through Megatron's pipeline schedule; the last stage stops at the final norm and hands each micro-batch's
    hidden states ``[s, b, h]`` to ``loss_fn(mb, hidden)``; returns the last stage's ``loss_fn`` records."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gpt = state.gpt
    masked = router_losses_on(state) and not forward_only
    kernel = varlen_kernel(state.platform)  # flash-attn's varlen kernel only under a GPU profile

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        ids, pos, extra = _rank_inputs(state, mb, kernel, router_mask=masked)
        if routing is not None:
            routing.before(mb)
        saved, gpt.post_process = gpt.post_process, False  # stop after the final norm: we apply the output layer in chunks
        try:
            out = model(ids, pos, None, **extra)
        finally:
            gpt.post_process = saved
        if routing is not None:
            routing.after(mb)
        return out, functools.partial(loss_fn, mb)

    max_len = max(mb.input_ids.shape[1] for mb in mbs)
    fb = get_forward_backward_func()
    with router_loss_scale(state, mbs, forward_only=forward_only):
        return fb(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[state.model],
            num_microbatches=len(mbs),
            seq_length=max_len,
            micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only,
        )


def _rank_inputs(state: ActorState, mb: MicroBatch, kernel: str, *, router_mask: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input ids, position ids, keyword arguments) of ``mb`` for this rank's model call: under CP the rank's
    chunks of every sequence; THD ``packed_seq_params`` (global document bounds) for a packed micro-batch; the
    router's padding mask when router losses are on (pads and fillers stay out of them)."""
    device, view = state.device, _cp_view(state, mb)
    ids, pos = mb.input_ids, mb.position_ids
    extra: dict[str, Any] = {}
    if router_mask:
        extra["padding_mask"] = router_padding_mask(mb)
    if view is not None:
        ids, pos = ids[:, view.index], pos[:, view.index]
        extra = {k: v[:, view.index] for k, v in extra.items()}
    extra = {k: v.to(device) for k, v in extra.items()}
    if mb.packed:
        extra["packed_seq_params"] = packed_seq_params(mb.cu_seqlens, device=device, kernel=kernel,
                                                       context_parallel=state.cfg.context_parallel_size)
    return ids.to(device), pos.to(device), extra


def logprobs_and_entropy(state: ActorState, batch: SequenceBatch | dict) -> dict:
    """Forward only; the worker's ``compute_logprobs_and_entropy`` (its docstring says the output). Results on the
    last PP stage's TP rank 0 (:func:`holds_results`), ``{}`` elsewhere."""
    batch = validate_batch(batch)
    temperature = float(batch.temperature)
    shard, mbs = plan(state, batch, forward_only=True)
    state.model.eval()

    def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
        lp, en = response_logprobs(state, hidden, mb, temperature, with_entropy=True)
        zero = torch.zeros((), device=hidden.device)
        return zero, torch.tensor(0, dtype=torch.int), {"mb": mb, "logp": lp.float().cpu(), "entropy": en.float().cpu()}

    routing = routing_for_pass(state.routing, state.cfg.routing_replay, batch, update=False)
    with torch.no_grad(), (routing.active() if routing else contextlib.nullcontext()):
        store = run_schedule(state, mbs, loss_fn, forward_only=True, routing=routing)
    state.model.train()
    if not holds_results() or not shard:
        return {}
    out: dict[str, Any] = {"indices": [], "log_probs": [], "entropy": [], "micro_batches": len(mbs)}
    if routing is not None:
        out["routed_experts"] = []
    for rec in store:
        mb = rec["mb"]
        for row, (a, b) in zip(mb.rows, mb.resp_offsets):
            out["indices"].append(row)
            out["log_probs"].append(rec["logp"][a:b].clone())
            out["entropy"].append(rec["entropy"][a:b].clone())
            if routing is not None:
                out["routed_experts"].append(routing.recorded[row] if routing.records else
                                             torch.as_tensor(batch.routed_experts[row]).to(routing.replay.dtype))
    return out


def train_step(state: ActorState, batch: TrainBatch) -> dict:
    """One optimizer step over ``batch`` (the worker's ``train_step``): this rank's DP shard through the schedule,
    the loss normalised by the mini-batch's valid response tokens; a non-finite loss or gradient skips the update.
    Returns float metrics, identical on all ranks."""
    optim = state.cfg.optim
    eps_low, eps_high = optim.policy_clip_low_high
    masks = batch.loss_mask.bool() & length_mask(batch.response_lens, batch.loss_mask.shape[1])
    num_global_tokens = int(masks.sum())
    num_global_samples = int(masks.any(-1).sum())  # gspo's sample-level denominator
    temperature = float(batch.temperature)

    def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
        lp, en = response_logprobs(state, hidden, mb, temperature, with_entropy=True)
        loss, stats = micro_batch_loss(lp, en, mb, batch, masks, num_global_tokens, eps_low=eps_low,
                                       eps_high=eps_high, dual_clip=optim.dual_clip,
                                       loss_type=optim.policy_loss_type, num_global_samples=num_global_samples)
        return loss, torch.tensor(int(stats["num_tokens"]), dtype=torch.int), stats

    shard, mbs = plan(state, batch, forward_only=False)
    state.model.train()
    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()
    routing = routing_for_pass(state.routing, state.cfg.routing_replay, batch, update=True)
    with routing.active() if routing else contextlib.nullcontext():
        store = run_schedule(state, mbs, loss_fn, forward_only=False, routing=routing)
    sums, ok, grad_norm, lr_used = summed_update(state, store, bool(shard), METRIC_KEYS)
    return step_metrics(sums, grad_norm=grad_norm, lr=lr_used, ok=ok, step=state.step)


def summed_update(state: ActorState, store: list, has_shard: bool,
                  keys: tuple[str, ...]) -> tuple[torch.Tensor, bool, float, float]:
    """The end of a training pass (the policy's and the critic's): the micro-batches' records of ``store`` summed per
    ``keys`` over the whole world (results live on one rank per DP replica; the others add zeros), then the
    optimizer step unless ``nonfinite`` is counted. Returns the sums ``[len(keys)]`` float64 on CPU, applied,
    grad norm, LR."""
    sums = torch.zeros(len(keys), dtype=torch.float64)
    if holds_results() and has_shard:
        for rec in store:
            for j, k in enumerate(keys):
                sums[j] += float(rec[k])
    sums = sums.to(state.device)
    dist.all_reduce(sums)
    sums = sums.cpu()
    ok, grad_norm, lr = optimizer_update(state, loss_finite=sums[keys.index("nonfinite")].item() == 0)
    return sums, ok, grad_norm, lr


def optimizer_update(state: ActorState, *, loss_finite: bool) -> tuple[bool, float, float]:
    """After the backward of a mini-batch: set the step's LR, clip to ``optim.max_norm`` by the global norm and step
    Adam; a non-finite loss or gradient skips the update (the step count then stays). Returns (updated, grad norm,
    LR); the policy's and the critic's updates (``megatron/critic.py``) share it."""
    optim = state.cfg.optim
    lr_used = apply_lr(state.optimizer, optim, state.step)
    found_inf = state.optimizer.prepare_grads()
    grad_norm = float(state.optimizer.get_grad_norm()) if not found_inf else float("nan")
    ok = loss_finite and not found_inf and math.isfinite(grad_norm)
    if ok:
        if optim.max_norm > 0:
            _clip_to_total_norm(state.optimizer, optim.max_norm, grad_norm)
        ok = bool(state.optimizer.step_with_ready_grads())
    if ok:
        state.step += 1
    else:
        state.optimizer.zero_grad()
    return ok, grad_norm, lr_used


def _clip_to_total_norm(optimizer, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / total_norm)`` (``total_norm``: the global L2 norm over all
    parameters, from ``optimizer.get_grad_norm()``).

    A MoE model with expert parallelism has a ``ChainedOptimizer`` of two parts (dense parameters, reduced
    over data parallelism; experts, over the expert-data-parallel group), whose ``clip_grad_norm`` refuses
    more than one part; each part is clipped by the norm of the whole model, as megatron-core's own step does.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm, total_norm,
                                         opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
