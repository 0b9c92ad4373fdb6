"""Step-time cost model: seconds per training step by phase, from FLOPs, bytes and the printed
assumptions of :class:`~openrlhf_shape.planner.assumptions.PlanOptions`.

Phases (the synchronous trainer runs them one after the other, nothing overlaps, and the step is their sum;
with ``--train.async_enable`` on a disaggregated layout the engines' rollout decode and rewards of the next
batch overlap the ranks' update, and at ``--train.max_staleness 2`` the probes too:
:func:`~openrlhf_shape.planner.async_cost.async_step` composes the same phases into that schedule):

* rollout decode: each engine runs ``c`` sequences at once (``min(vllm_max_num_seqs, its samples,
  KV capacity / mean sequence length)``); a decode step reads the engine's weights and the KV of
  its ``c`` sequences from HBM (bandwidth bound) or does ``2 x params x c`` FLOPs (compute bound),
  whichever is slower. Time = max(tokens / throughput, the longest response at one sequence per
  step), i.e. the batch cannot finish before its longest response;
* probes (:func:`probe_roofline`): ``K x m`` probes per response; each is a prefix-cache hit on the
  response so far (nothing recomputed), a prefill of the forced-answer suffix (compute bound: FLOPs at
  the forward pass's MFU measured by the GPU kit) and ``probe_max_tokens`` decode steps, run in waves of
  ``vllm_max_num_seqs`` probes; a decode step reads the weights once and every probe's context KV
  (paged attention reads a shared prefix once per sequence), or is compute bound, whichever is slower;
* log-probs: one forward of every sequence (2 x params FLOPs/token + attention) over all ranks;
* update: forward + backward (6 x params FLOPs/token + attention; 8 x with full recompute) per epoch,
  stretched by the pipeline bubble ``(pp - 1) / micro-batches``;
* weight sync: rank 0 gathers the bf16 weights to its host, ships them to the other nodes, each
  engine loads its shard (plus the sleep level 1 wake-up copy); a plan with a placement replaces this guess by
  the estimate of the transport the trainer picks (``planner/sync_time.py``, copy rates measured on an H200);
* rewards: a fixed guess (Math-Verify runs on CPU).

Mixture-of-experts models: FLOPs count the *active* parameters (the router and ``k`` experts per sparse
layer, :meth:`ModelShape.active_params`); a decode step reads the non-expert weights and the experts its
tokens touch (``1 - (1 - k/E)^c`` of them at ``c`` tokens per step, routing assumed uniform); the
all-to-all dispatch and combine of every sparse layer over the EP group (and the all-gather /
reduce-scatter over expert TP) are a phase of their own (:func:`moe_alltoall`), not overlapped with compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.lengths import ResponseLengths
from openrlhf_shape.planner.model import ModelShape
from openrlhf_shape.planner.packing import Packing


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    how: str
    # seconds of this phase that belong to other phases' places in the schedule (the MoE all-to-all:
    # ("log-probs + entropy", s), ("update", s)); empty: the phase stands on its own
    parts: tuple[tuple[str, float], ...] = ()
    # SHAPE probes under --train.async_enable: seconds to prefill each response's prompt + response once more,
    # because new weights arrive between the rollout and the probes and reset the prefix cache (the cached KV
    # came from the old weights). Synchronous probes follow their rollout and find it cached (0 there).
    cold_cache_seconds: float = 0.0
    # rollout decode under partial rollouts (--plan.partial_rollout_cap_tokens): a window decodes at most the cap's
    # steps and unfinished responses continue in the next one, so the tail no longer bounds the window; None: off
    partial_seconds: float | None = None
    # rollout decode: seconds and decode steps past the bulk (the engine below its slot count, one long response
    # after another finishing); the SHAPE probes under --shape.entropy_source engine: the seconds of them the
    # rollout's tail hides (:func:`tail_overlap`) and how
    tail_seconds: float = 0.0
    tail_steps: float = 0.0
    hidden_seconds: float = 0.0
    hidden_how: str = ""


def flops_per_token(model: ModelShape, seq_len: float, *, backward: bool, recompute: bool) -> float:
    """Model FLOPs per token: 2 x active params (matmuls; all params for a dense model) + causal attention
    2 x 2 x layers x q_dim x seq/2, times 3 for forward+backward (4 with full recompute)."""
    fwd = 2 * model.active_params() + 2 * model.layers * model.q_dim * seq_len
    if not backward:
        return fwd
    return fwd * (4 if recompute else 3)


def experts_touched(model: ModelShape, tokens: float) -> float:
    """Expected fraction of a sparse layer's experts that ``tokens`` tokens route to, each picking ``k`` of
    ``E`` uniformly and independently: ``1 - (1 - k/E)^tokens`` (1.0 for a dense model)."""
    if not model.is_moe:
        return 1.0
    return 1.0 - (1.0 - model.experts_per_tok / model.num_experts) ** max(tokens, 1.0)


def decode_weight_bytes(model: ModelShape, tokens: float, dtype_bytes: int = 2) -> float:
    """Weight bytes a forward of ``tokens`` tokens reads (whole engine): every non-expert weight and the
    experts those tokens touch (:func:`experts_touched`)."""
    expert = model.expert_params()
    return ((model.total_params() - expert) + expert * experts_touched(model, tokens)) * dtype_bytes


def decode_rate(model: ModelShape, engine_tp: int, concurrent: float, mean_ctx: float, opt: PlanOptions) -> tuple[float, float]:
    """(tokens/s of one engine at ``concurrent`` sequences, seconds of one decode step)."""
    bw = opt.hbm_gbs * 1e9 * opt.decode_efficiency
    weights = decode_weight_bytes(model, concurrent) / engine_tp
    kv = concurrent * mean_ctx * model.kv_bytes_per_token(engine_tp)
    t_mem = (weights + kv) / bw
    t_compute = 2 * model.active_params() / engine_tp * concurrent / (opt.peak_tflops * 1e12 * opt.mfu)
    t = max(t_mem, t_compute)
    return concurrent / t, t


def moe_alltoall(model: ModelShape, *, tokens_per_dp: float, passes: float, tp: int, pp: int, sp: bool, ep: int,
                 etp: int, gpus_per_node: int, opt: PlanOptions) -> tuple[float, str]:
    """Seconds one GPU spends in the experts' token exchange over ``passes`` forward-equivalents of
    ``tokens_per_dp`` tokens (the tokens of one data-parallel replica), and how.

    Per token on the rank (``1/tp`` of the replica's tokens under sequence parallel) and sparse layer of its
    stage, one forward sends ``k`` copies of the hidden state (bf16) to the EP group and gets them back
    (dispatch + combine: ``2 k h 2 B (EP-1)/EP``), and all-gathers then reduce-scatters them over expert TP
    (``2 k h 2 B (ETP-1)``), times ``--plan.moe_load_imbalance``. Backward moves the same again, a full
    recompute once more (the callers' ``passes``). Megatron orders expert ranks ETP innermost then EP, so an
    EP group covers ``ETP x EP`` consecutive ranks: inside a node it runs over NVLink (``--plan.nvlink_gbs``);
    wider, the share of peers on other nodes goes over InfiniBand (``--plan.ib_gbs`` per GPU), the rest over
    NVLink, concurrently; both at ``--plan.a2a_efficiency``."""
    if not model.is_moe or passes <= 0:
        return 0.0, "dense model"
    kh = model.experts_per_tok * model.hidden * 2 * opt.moe_load_imbalance  # bytes of k copies of one token
    ep_node = max(1, min(ep, gpus_per_node // etp))  # EP peers on the rank's own node (itself included)
    intra = 2 * kh * (ep_node - 1) / ep
    inter = 2 * kh * (ep - ep_node) / ep
    ag = 2 * kh * (etp - 1)
    eff = opt.a2a_efficiency
    per_tok_layer = max(intra / (opt.nvlink_gbs * 1e9), inter / (opt.ib_gbs * 1e9)) / eff + ag / (opt.nvlink_gbs * 1e9 * eff)
    local_tokens = tokens_per_dp / (tp if sp else 1)
    sparse_layers = len(model.moe_layers) / pp
    t = passes * local_tokens * sparse_layers * per_tok_layer
    span = "inside a node (NVLink)" if ep_node == ep else f"over {ep // ep_node} nodes ({ep - ep_node} of {ep} EP peers over InfiniBand)"
    how = (f"{passes:g} pass(es) x {local_tokens:,.0f} tokens/GPU x {sparse_layers:.0f} sparse layers x "
           f"[EP {ep} dispatch + combine {(intra + inter) / 1e3:.1f} kB {span}"
           + (f", ETP {etp} all-gather + reduce-scatter {ag / 1e3:.1f} kB (NVLink)" if etp > 1 else "")
           + f"] per token-layer at a2a efficiency {eff:g}")
    return t, how


def _probe_parts(model: ModelShape, engine_tp: int, probes: float, suffix_tokens: int, decode_tokens: int,
                 context_tokens: float, opt: PlanOptions) -> dict[str, float]:
    """The roofline's terms (:func:`probe_roofline`): seconds of the prefill (``prefill``), the wave (``wave``
    probes) and ``waves``, the decode step's seconds (``step``; ``mem``, ``cmp``), the step's weight read alone
    (``weights``), GFLOP per suffix token (``f``), the context per probe (``ctx`` tokens) and its KV's share of the
    bytes a step reads (``kv_share``)."""
    gpu = opt.peak_tflops * 1e12
    bw = opt.hbm_gbs * 1e9 * opt.decode_efficiency
    f_prefill = 2 * model.active_params() + 2 * 2 * model.layers * model.q_dim * (context_tokens + suffix_tokens / 2)
    wave = max(1.0, min(float(opt.vllm_max_num_seqs), probes))
    ctx = context_tokens + suffix_tokens + decode_tokens / 2
    weights = decode_weight_bytes(model, wave) / engine_tp
    bytes_step = weights + wave * ctx * model.kv_bytes_per_token(engine_tp)
    t_mem, t_cmp = bytes_step / bw, 2 * model.active_params() / engine_tp * wave / (gpu * opt.mfu)
    return dict(prefill=probes * suffix_tokens * f_prefill / (engine_tp * gpu * opt.prefill_mfu), wave=wave,
                waves=math.ceil(probes / wave), step=max(t_mem, t_cmp), mem=t_mem, cmp=t_cmp,
                weights=min(weights / bw, max(t_mem, t_cmp)), f=f_prefill, ctx=ctx, kv_share=1 - weights / bytes_step)


def probe_roofline(model: ModelShape, *, engine_tp: int, probes: float, suffix_tokens: int, decode_tokens: int,
                   context_tokens: float, opt: PlanOptions) -> tuple[float, str]:
    """Seconds of one engine's probe phase, and how they were reached.

    ``probes``: probes on this engine; ``context_tokens``: the mean prefix a probe continues (prompt plus the
    response up to its boundary, served from the prefix cache). Prefill: ``probes x suffix`` tokens at
    ``2 x params + attention over the context`` FLOPs each, at ``--plan.prefill_mfu``. Decode: waves of
    ``min(vllm_max_num_seqs, probes)`` probes x ``decode_tokens`` steps; a step reads the engine's weight
    shard plus each probe's context KV at ``hbm_gbs x decode_efficiency``, or computes ``2 x params`` per
    probe at ``mfu``, whichever is slower. Each probe reads its own copy of the shared prefix: vLLM 0.32 has no
    shared-prefix (cascade) attention (docs/architecture.md, "Where the probe time goes")."""
    if probes <= 0:
        return 0.0, "no probes"
    p = _probe_parts(model, engine_tp, probes, suffix_tokens, decode_tokens, context_tokens, opt)
    t_decode = p["waves"] * decode_tokens * p["step"]
    how = (f"prefill {probes:,.0f} probes x {suffix_tokens} suffix tokens x {p['f'] / 1e9:.1f} GFLOP / "
           f"({engine_tp} GPU x {opt.peak_tflops:g} TFLOPS x prefill MFU {opt.prefill_mfu}) = {p['prefill']:.0f} s; "
           f"decode {p['waves']:.0f} waves of {p['wave']:.0f} x {decode_tokens} steps x {p['step'] * 1e3:.1f} ms "
           f"({'HBM' if p['mem'] >= p['cmp'] else 'compute'} bound, context KV {100 * p['kv_share']:.0f}% of the bytes "
           f"read, {p['ctx']:,.0f} tokens per probe) = {t_decode:.0f} s")
    return p["prefill"] + t_decode, how


def tail_overlap(*, tail_seconds: float, tail_steps: float, probe_seconds: float, prefill_seconds: float,
                 decode_steps: float, weight_read_seconds: float, first_round_share: float) -> tuple[float, str]:
    """Seconds of one engine's probes the rollout's tail hides when each response's first probe round is sent as
    it finishes (``--shape.entropy_source engine``), and how.

    The tail (``tail_seconds``, ``tail_steps`` decode steps) runs few sequences, HBM bound on the weights: a probe
    folded into a tail step shares that step's weight read, but its own context KV is read on top (the step gets
    longer: exposed). So the tail hides, of the first round (``first_round_share`` of the probes): the weight reads
    of its decode steps (``min(decode_steps x share, tail_steps) x weight_read_seconds``) and its suffix prefill,
    compute the memory-bound tail leaves idle (``min(prefill_seconds x share, tail_seconds)``); at most
    ``probe_seconds``."""
    steps = min(decode_steps * first_round_share, tail_steps)
    prefill = min(prefill_seconds * first_round_share, tail_seconds)
    hidden = min(probe_seconds, steps * weight_read_seconds + prefill)
    how = (f"tail {tail_seconds:.0f} s / {tail_steps:,.0f} steps; first round {100 * first_round_share:.0f}% of the "
           f"probes: {steps:,.0f} decode steps share the tail's weight reads ({weight_read_seconds * 1e3:.1f} ms "
           f"each) + suffix prefill {prefill:.0f} s in the tail's idle compute = {hidden:.0f} s hidden of "
           f"{probe_seconds:.0f} s; their context KV reads stay exposed")
    return hidden, how


def step_time(
    model: ModelShape,
    *,
    world: int,
    tp: int,
    pp: int,
    dp: int,
    recompute: bool,
    num_engines: int,
    engine_tp: int,
    samples: int,
    prompt_tokens: int,
    response_tokens: int,
    max_response_tokens: int,
    probes_per_response: int,
    probe_suffix_tokens: int,
    probe_decode_tokens: int,
    epochs: int,
    micro_batch_tokens: int,
    train_batch_size: int,
    kv_tokens_per_engine: int,
    nodes: int,
    colocate: bool,
    sleep_level: int,
    opt: PlanOptions,
    ep: int = 1,
    etp: int | None = None,
    sequence_parallel: bool = False,
    gpus_per_node: int = 8,
    lengths: ResponseLengths | None = None,
    packing: Packing | None = None,
    cp: int = 1,
    probe_first_round_share: float = 1.0,
) -> list[Phase]:
    """The phases of one synchronous step, in seconds each: rollout, probes, log-probs, update, sync, rewards.

    ``lengths``: the response-length distribution (None: every response ``response_tokens`` long, cut at
    ``max_response_tokens``); ``packing``: the tokens the ranks compute (None: ``samples x (prompt + response)``);
    ``cp``: the context-parallel size (its K/V exchange is a phase of its own); ``probe_first_round_share``: the
    share of a state's probes in its first round (an adaptive rule's first round over m), the part the rollout's
    tail can hide (``Phase.hidden_seconds`` of the probes, :func:`tail_overlap`)."""
    per_engine = samples / num_engines
    lengths = lengths or ResponseLengths.from_mean(response_tokens, 0.0, max_response_tokens)
    phases = [_rollout_decode(model, engine_tp, per_engine, prompt_tokens, lengths, samples, kv_tokens_per_engine, opt)]
    if probes_per_response:
        phases.append(_probe_phase(model, engine_tp, per_engine, prompt_tokens, response_tokens, probes_per_response,
                                   probe_suffix_tokens, probe_decode_tokens, opt, phases[0], probe_first_round_share))
    packing = packing or Packing.uniform(samples, prompt_tokens + response_tokens, micro_batch_tokens * cp, dp)
    phases += _training_phases(model, world=world, tp=tp, pp=pp, dp=dp, recompute=recompute, epochs=epochs,
                               packing=packing, train_batch_size=train_batch_size, samples=samples, opt=opt, ep=ep,
                               etp=etp, sequence_parallel=sequence_parallel, gpus_per_node=gpus_per_node, cp=cp)
    phases.append(_weight_sync(model, engine_tp, nodes, colocate, sleep_level, opt))
    phases.append(Phase("rewards", opt.reward_seconds, "--plan.reward_seconds (Math-Verify on CPU)"))
    return phases


def decode_tail_seconds(per_engine: float, concurrent: float, longest: float, t_one: float, t_bulk: float) -> float:
    """Seconds of one engine's decode given its bulk throughput time ``t_bulk`` and the batch's longest response.

    All ``per_engine`` sequences running at once (``per_engine <= concurrent``): the batch lasts as long as its
    longest response, ``max(t_bulk, longest x t_one)``. Queued (more sequences than slots): continuous batching
    admits a request whenever a slot frees, so the longest response may be admitted as the queue drains and then
    runs on while the others finish: list scheduling's bound, ``t_bulk + (1 - 1/c) x longest x t_one`` (its steps
    at falling concurrency cost about one sequence's step, ``t_one``)."""
    if per_engine <= concurrent:
        return max(t_bulk, longest * t_one)
    return t_bulk + (1 - 1 / concurrent) * longest * t_one


def _rollout_decode(model: ModelShape, engine_tp: int, per_engine: float, prompt_tokens: int, lengths: ResponseLengths,
                    samples: int, kv_tokens_per_engine: int, opt: PlanOptions) -> Phase:
    """Decode of one engine's responses: the bulk at its throughput, then the tail of the batch's longest response
    (the expected longest of all ``samples``, :meth:`ResponseLengths.longest`; :func:`decode_tail_seconds`). Under
    partial rollouts (``--plan.partial_rollout_cap_tokens``) a window's tail stops at the cap (``Phase.partial_seconds``)."""
    response_tokens = lengths.mean()
    longest = lengths.longest(samples)
    seq = prompt_tokens + response_tokens
    conc = max(1.0, min(opt.vllm_max_num_seqs, per_engine, kv_tokens_per_engine / max(seq, 1)))
    mean_ctx = prompt_tokens + response_tokens / 2
    if opt.decode_tokens_per_s_per_gpu:
        rate = opt.decode_tokens_per_s_per_gpu * engine_tp
        t_one = engine_tp / opt.decode_tokens_per_s_per_gpu  # assumed step time at one sequence
        how_rate = f"--plan.decode_tokens_per_s_per_gpu {opt.decode_tokens_per_s_per_gpu:g}"
    else:
        rate, _ = decode_rate(model, engine_tp, conc, mean_ctx, opt)
        _, t_one = decode_rate(model, engine_tp, 1, prompt_tokens + longest / 2, opt)
        how_rate = f"{conc:.0f} concurrent seqs/engine, {rate / engine_tp:,.0f} tok/s/GPU from HBM {opt.hbm_gbs:g} GB/s x {opt.decode_efficiency}"
    gen_tokens = per_engine * response_tokens
    t_tp = gen_tokens / rate
    t = decode_tail_seconds(per_engine, conc, longest, t_one, t_tp)
    cap = opt.partial_rollout_cap_tokens
    partial = decode_tail_seconds(per_engine, conc, min(longest, cap), t_one, t_tp) if cap else None
    how_partial = (f"; partial rollouts (a window decodes at most {cap} steps of a response): tail at "
                   f"{min(longest, cap):,.0f} steps, {partial:.0f} s per window" if cap else "")
    how_tail = (f"longest response {longest:,.0f} steps x {t_one * 1e3:.1f} ms" if per_engine <= conc else
                f"+ tail (1 - 1/{conc:.0f}) x longest response {longest:,.0f} steps x {t_one * 1e3:.1f} ms")
    return Phase("rollout decode", t,
                 f"{gen_tokens:,.0f} tokens/engine / {rate:,.0f} tok/s = {t_tp:.0f} s, {how_tail} -> {t:.0f} s "
                 f"(the longest of {samples} responses); {how_rate}; lengths {lengths.describe()}{how_partial}",
                 partial_seconds=partial, tail_seconds=t - t_tp, tail_steps=(t - t_tp) / t_one)


def _probe_phase(model: ModelShape, engine_tp: int, per_engine: float, prompt_tokens: int, response_tokens: float,
                 probes_per_response: int, probe_suffix_tokens: int, probe_decode_tokens: int, opt: PlanOptions,
                 rollout: Phase, first_round_share: float) -> Phase:
    """The SHAPE probes of one engine's responses (roofline), with the cold-cache prefill an async step adds and
    the seconds the ``rollout`` decode's tail hides under ``--shape.entropy_source engine``."""
    seq = prompt_tokens + response_tokens
    probes, ctx = per_engine * probes_per_response, prompt_tokens + response_tokens / 2
    # a probe continues the response at a boundary: on average half of it (segments cut it evenly)
    t_probes, how_probes = probe_roofline(model, engine_tp=engine_tp, probes=probes, suffix_tokens=probe_suffix_tokens,
                                          decode_tokens=probe_decode_tokens, context_tokens=ctx, opt=opt)
    parts = _probe_parts(model, engine_tp, probes, probe_suffix_tokens, probe_decode_tokens, ctx, opt)
    hidden, how_hidden = tail_overlap(tail_seconds=rollout.tail_seconds, tail_steps=rollout.tail_steps,
                                      probe_seconds=t_probes, prefill_seconds=parts["prefill"],
                                      decode_steps=parts["waves"] * probe_decode_tokens,
                                      weight_read_seconds=parts["weights"], first_round_share=first_round_share)
    # async: the new weights reset the cache between rollout and probes: every response is prefilled again
    f_ctx = flops_per_token(model, seq / 2, backward=False, recompute=False)
    t_cold = per_engine * seq * f_ctx / (engine_tp * opt.peak_tflops * 1e12 * opt.prefill_mfu)
    return Phase("SHAPE probes", t_probes, f"{per_engine:.0f} responses/engine x {probes_per_response} probes: "
                                           + how_probes, cold_cache_seconds=t_cold, hidden_seconds=hidden,
                 hidden_how=how_hidden)


def _training_phases(model: ModelShape, *, world: int, tp: int, pp: int, dp: int, recompute: bool, epochs: int,
                     packing: Packing, train_batch_size: int, samples: int, opt: PlanOptions, ep: int, etp: int | None,
                     sequence_parallel: bool, gpus_per_node: int, cp: int = 1) -> list[Phase]:
    """Log-probs + entropy, the update (with the PP bubble) and, for MoE, the expert all-to-all of both; for CP > 1
    the K/V exchange of both. Tokens are the packed micro-batches' (``packing``)."""
    phases: list[Phase] = []
    gpu_flops = opt.peak_tflops * 1e12 * opt.mfu
    total_tokens, seq = packing.computed, packing.attention_seq
    f_lp = flops_per_token(model, seq, backward=False, recompute=False)
    phases.append(Phase("log-probs + entropy", total_tokens * f_lp / (world * gpu_flops),
                        f"{total_tokens:,.0f} tokens x {f_lp / 1e9:.1f} GFLOP/token / ({world} GPUs x {opt.peak_tflops:g} TFLOPS x MFU {opt.mfu})"))
    f_tr = flops_per_token(model, seq, backward=True, recompute=recompute)
    # micro-batches of one DP rank per optimizer step (the pipeline fills and drains once per step)
    mbs_per_dp = max(1.0, packing.micro_batches / dp * train_batch_size / samples)
    bubble = (pp - 1) / mbs_per_dp
    t_up = epochs * total_tokens * f_tr / (world * gpu_flops) * (1 + bubble)
    phases.append(Phase("update", t_up,
                        f"{epochs} epoch(s) x {total_tokens:,.0f} tokens x {f_tr / 1e9:.1f} GFLOP/token / ({world} x {opt.peak_tflops:g} x {opt.mfu})"
                        f" x (1 + bubble {bubble:.2f}: PP {pp}, {mbs_per_dp:.1f} micro-batches per DP rank); {packing.describe()}"))
    passes_up = epochs * (3 if recompute else 2)
    if cp > 1:
        comm = dict(tokens_per_gpu=total_tokens / (dp * cp), tp=tp, pp=pp, cp=cp, gpus_per_node=gpus_per_node, opt=opt)
        t_lp, how_cp = cp_exchange(model, passes=1, **comm)
        t_upd, _ = cp_exchange(model, passes=passes_up, **comm)
        phases.append(Phase("CP K/V exchange", t_lp + t_upd, f"log-probs {t_lp:.1f} s + update {t_upd:.1f} s; {how_cp}",
                            parts=(("log-probs + entropy", t_lp), ("update", t_upd))))
    if model.is_moe:
        etp = etp or tp
        comm = dict(tokens_per_dp=total_tokens / dp, tp=tp, pp=pp, sp=sequence_parallel, ep=ep, etp=etp,
                    gpus_per_node=gpus_per_node, opt=opt)
        t_lp, how_a2a = moe_alltoall(model, passes=1, **comm)
        t_upd, _ = moe_alltoall(model, passes=passes_up, **comm)
        phases.append(Phase("MoE all-to-all", t_lp + t_upd,
                            f"log-probs {t_lp:.0f} s + update {t_upd:.0f} s (forward, backward"
                            f"{', recompute' if recompute else ''} x {epochs} epoch(s)); log-probs: {how_a2a}",
                            parts=(("log-probs + entropy", t_lp), ("update", t_upd))))
    return phases


def cp_exchange(model: ModelShape, *, tokens_per_gpu: float, passes: float, tp: int, pp: int, cp: int,
                gpus_per_node: int, opt: PlanOptions) -> tuple[float, str]:
    """Seconds one GPU spends exchanging K/V with its context-parallel peers over ``passes`` forward-equivalents
    of ``tokens_per_gpu`` tokens (its share, ``1/CP`` of each sequence), and how.

    Per local token and layer of its stage, a forward gathers the K and V of the other ``CP - 1`` chunks
    (``(CP - 1) x 2 x kv_dim/TP x 2 B`` received); backward sends the same volume of dK, dV back; a full recompute
    gathers once more (the callers' ``passes``). A CP group of ``TP x CP`` consecutive ranks inside a node runs over
    NVLink, else over InfiniBand, at ``--plan.a2a_efficiency``; not overlapped with the attention (an upper bound:
    TE's ring overlaps part of it)."""
    per_tok_layer = (cp - 1) * 2 * model.kv_dim / tp * 2
    inside = tp * cp <= gpus_per_node
    gbs = (opt.nvlink_gbs if inside else opt.ib_gbs) * opt.a2a_efficiency
    t = passes * tokens_per_gpu * model.layers / pp * per_tok_layer / (gbs * 1e9)
    how = (f"{passes:g} pass(es) x {tokens_per_gpu:,.0f} tokens/GPU x {model.layers // pp} layers x K/V of {cp - 1} "
           f"other chunk(s) {per_tok_layer / 1e3:.1f} kB per token-layer over {'NVLink' if inside else 'InfiniBand'} "
           f"at a2a efficiency {opt.a2a_efficiency:g}")
    return t, how


def _weight_sync(model: ModelShape, engine_tp: int, nodes: int, colocate: bool, sleep_level: int,
                 opt: PlanOptions) -> Phase:
    """bf16 weights to rank 0's host, to the other nodes, into the engines (and their wake-up after sleep level 1)."""
    w = model.total_params() * 2
    t_sync = w / (opt.pcie_gbs * 1e9) + (nodes - 1) * w / (opt.link_gbs * 1e9) + w / engine_tp / (opt.pcie_gbs * 1e9)
    wake = w / engine_tp / (opt.pcie_gbs * 1e9) if colocate and sleep_level == 1 else 0.0
    return Phase("weight sync", t_sync + wake,
                 f"{w / 1e9:.1f} GB to rank 0's host at {opt.pcie_gbs:g} GB/s + to {nodes - 1} other node(s) at "
                 f"{opt.link_gbs:g} GB/s + engine load/ wake-up of {w / engine_tp / 1e9:.1f} GB/GPU at {opt.pcie_gbs:g} GB/s")
