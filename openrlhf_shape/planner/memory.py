"""Memory formulas, one function per term, each returning its bytes and the formula with its inputs.

Units: bytes. "Per GPU" means one Megatron rank (one GPU) or one GPU of a vLLM engine. Every
formula is a closed form of the model shape (:class:`~openrlhf_shape.planner.model.ModelShape`)
and the layout; nothing is measured here. ``tests/planner/test_memory_measured.py`` checks the
Megatron terms against the peak memory of real CPU ranks.

What the Megatron rank holds (our worker, megatron-core 0.16.1):

* weights: ``param_bytes`` per local parameter (bf16 on GPU, fp32 on CPU);
* gradients: the DDP grad buffer over all local parameters. The worker sets
  ``grad_reduce_in_fp32=True`` (megatron-core's default is False, i.e. grads in the param dtype),
  so 4 B/param. The distributed optimizer reduce-scatters in place: the buffer is not sharded;
* optimizer: Adam ``m`` and ``v`` in fp32 (8 B/param) plus an fp32 master copy (4 B/param) when
  the weights are bf16 (no master copy for fp32 weights: the optimizer steps them directly).
  The distributed optimizer shards all of it over DP;
* activations at ``micro_batch_max_tokens`` (see :func:`layer_activation_elems`), in flight for
  ``min(pp - stage, micro-batches)`` micro-batches under 1F1B;
* the chunked log-prob/entropy scratch (:mod:`openrlhf_shape.actor.logprobs`) on the last stage.

Mixture-of-experts models (``qwen3_moe``; megatron-core's process groups, ``parallel_state.initialize_model_parallel``):
a rank holds ``num_experts / EP`` experts of each sparse layer of its stage, each split ``ETP`` ways
(``--megatron.expert_tensor_parallel_size``, megatron-core's ``expert_tensor_parallel_size``; unset: the TP size),
plus the non-expert parameters (attention, norms, the router ``[E, h]`` kept whole on every TP rank,
embeddings) split by TP/PP as for a dense model. Expert parameters are replicated over the expert-data-parallel
group of ``EDP = world / (ETP x EP x PP)`` ranks, so the distributed optimizer shards their fp32 master and Adam
state over EDP and the rest over DP; the DDP grad buffers (dense and expert) are not sharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openrlhf_shape.planner.model import ModelShape

GiB = 1024**3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
SPECS = ("te", "local")


@dataclass(frozen=True)
class Term:
    """One line of the plan: ``bytes`` and the formula that produced it, with its inputs."""

    name: str
    bytes: int
    formula: str

    @property
    def gib(self) -> float:
        return self.bytes / GiB


# ----------------------------------------------------------------------------- model states
def weights_term(n_local: int, dtype: str) -> Term:
    b = DTYPE_BYTES[dtype]
    return Term("weights", n_local * b, f"{n_local:,} local params x {b} B ({dtype})")


def grads_term(n_local: int, grad_dtype: str = "fp32") -> Term:
    b = DTYPE_BYTES[grad_dtype]
    return Term(
        "grads",
        n_local * b,
        f"{n_local:,} local params x {b} B ({grad_dtype} DDP grad buffer, grad_reduce_in_fp32; not sharded by the distributed optimizer)",
    )


def optimizer_term(n_local: int, dtype: str, dp: int, distributed: bool, adam_state: bool = True,
                   n_expert: int = 0, edp: int = 1) -> Term:
    """``adam_state=False``: before the first optimizer step (Adam's m and v are created by the
    step; the fp32 master copy of bf16 weights exists from the optimizer's construction).

    MoE: ``n_local`` counts the non-expert parameters (sharded over DP), ``n_expert`` the local expert
    parameters, sharded over the expert-data-parallel group ``edp`` by the distributed optimizer."""
    master = 4 if dtype != "fp32" else 0
    per = (8 if adam_state else 0) + master
    shard = dp if distributed else 1
    eshard = edp if distributed else 1
    what = {12: "fp32 master + Adam m, v", 8: "Adam m, v (fp32 weights: no master copy)",
            4: "fp32 master; Adam m, v not created yet", 0: "nothing yet: fp32 weights, Adam m, v not created"}[per]
    how = f"/ DP {dp} (distributed optimizer)" if distributed else "(not sharded: --megatron.use_distributed_optimizer false)"
    if not n_expert:
        return Term("optimizer", n_local * per // shard, f"{n_local:,} local params x {per} B ({what}) {how}")
    ehow = f"/ EDP {edp}" if distributed else "(not sharded)"
    return Term("optimizer", n_local * per // shard + n_expert * per // eshard,
                f"({n_local:,} non-expert params x {per} B {how}) + ({n_expert:,} local expert params x {per} B {ehow}) ({what})")


def optimizer_step_transient(model: ModelShape, tp: int, spec: str, *, n_shard: int, dtype: str) -> Term:
    """Temporaries of one optimizer step. TE FusedAdam (the TE spec's environment) updates in
    place. Without TE, megatron-core 0.16 falls back to torch's AdamW: on CUDA its multi-tensor
    (foreach) path builds sqrt(v) for every parameter of the shard at once (4 B x shard); on CPU
    (single-tensor path) about 2 temporaries the size of the largest parameter."""
    if spec == "te":
        return Term("optimizer step temporaries", 0, "TE FusedAdam updates in place")
    if dtype != "fp32":
        return Term("optimizer step temporaries", 4 * n_shard,
                    f"{n_shard:,} shard params x 4 B (torch AdamW foreach on CUDA: sqrt(v) of the whole shard)")
    largest = max(model.embedding_params(tp), model.hidden * 2 * model.intermediate // tp)
    return Term("optimizer step temporaries", 2 * largest * 4,
                f"2 x largest param {largest:,} x 4 B (torch AdamW single-tensor on CPU: sqrt(v) and the update)")


# ----------------------------------------------------------------------------- activations
ATTENTIONS = ("megatron", "sdpa", "flash")


def layer_activation_elems(
    model: ModelShape, *, tp: int, sp: bool, seq_len: int, spec: str, attention: str | None = None,
    sparse: bool = False, etp: int | None = None, imbalance: float = 1.0,
) -> dict[str, float]:
    """Elements saved for backward by one decoder layer, per token, split by origin.

    Assumed factors (``local``: Megatron's local spec as run on CPU, checked tensor by tensor with
    saved-tensor hooks on megatron-core 0.16.1 + torch 2.13; ``te``: the transformer-engine spec on
    GPU, derived, not measured here):

    * norms: local = torch RMSNorm keeps x and x*rstd, the linear after it keeps its output: 3 h
      per norm; te = fused norm+linear keeps x and ln_out: 2 h per norm. Two norms per layer.
      Under sequence parallel these are h/tp (Megatron's linears keep the local shard and
      all-gather again in backward); without it, full h on every TP rank.
    * attention: linear_qkv output (q + 2 kv) and the projection input (q), /tp;
      Qwen3's q/k norms keep 2 q + kv more; local spec (unfused DotProductAttention) keeps q,
      expanded k and v for GQA (3 q) and the softmax probabilities (heads x seq per token);
      te (flash attention) keeps q, k, v after RoPE (q + 2 kv) and no seq^2 term. ``attention``
      overrides the spec's default: ``megatron`` (unfused, the local spec's default), ``sdpa``
      (torch scaled_dot_product_attention in the local spec: assumed to keep what flash keeps),
      ``flash`` (the TE spec's fused attention).
    * MLP (SwiGLU): fc1 output (2 I) plus local: 3 I (silu output, gated product, one copy);
      te: 2 I (silu output, gated product). All /tp.
    * sparse (MoE) layer instead of the MLP (``sparse=True``), per token of the micro-batch, with
      ``s = 1/tp`` of the tokens on a rank under sequence parallel (1 without), top-k ``k``, expert width
      ``I_e``, ``E`` experts: the router's logits and probabilities (2 E s; fp32 in Megatron, counted at
      the activation dtype); the dispatched copies of the hidden state kept for the experts' fc1 backward
      after the all-to-all and the expert-TP all-gather (k h ETP s) and the combined output (k h s); each
      expert's fc1 output and SwiGLU as in the dense MLP on k tokens (k (2 + 3|2) I_e s: the ETP all-gather
      multiplies the tokens by ETP, the width is I_e / ETP). Routing is assumed balanced up to
      ``imbalance`` (``--plan.moe_load_imbalance``): the busiest rank's tokens over the even share.
    """
    h, q, kv, i, a = model.hidden, model.q_dim, model.kv_dim, model.intermediate, model.heads
    hn = h / tp if sp else h
    out: dict[str, float] = {}
    per_norm = 3 if spec == "local" else 2
    out["norms"] = 2 * per_norm * hn
    out["qkv + proj input"] = (q + 2 * kv + q) / tp
    if model.qk_norm:
        out["q/k norms"] = (2 * q + kv) / tp
    attention = attention or ("megatron" if spec == "local" else "flash")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if attention == "megatron":
        out["attention (q, k, v expanded)"] = 3 * q / tp
        out["attention probs"] = a * seq_len / tp
    else:
        out[f"attention ({attention}: q, k, v)"] = (q + 2 * kv) / tp
    if sparse:
        s_tok = 1 / tp if sp else 1.0
        k, ie, e = model.experts_per_tok, model.moe_intermediate, model.num_experts
        etp = etp or tp
        out["router (logits, probs)"] = 2 * e * s_tok
        out["moe dispatch + combine (k copies of h)"] = imbalance * k * h * (etp + 1) * s_tok
        out["experts (fc1 out + swiglu)"] = imbalance * k * (2 * ie + (3 * ie if spec == "local" else 2 * ie)) * s_tok
    else:
        out["mlp (fc1 out + swiglu)"] = (2 * i + (3 * i if spec == "local" else 2 * i)) / tp
    return out


def activation_terms(
    model: ModelShape,
    *,
    tp: int,
    pp: int,
    stage: int,
    sp: bool,
    tokens: int,
    seq_len: int,
    recompute: str,
    dtype: str,
    spec: str,
    num_micro_batches: int,
    forward_only: bool = False,
    attention: str | None = None,
    etp: int | None = None,
    imbalance: float = 1.0,
) -> list[Term]:
    """Activations of one rank of pipeline stage ``stage`` at a micro-batch of ``tokens`` tokens
    (padded rows x seq_len). 1F1B keeps ``min(pp - stage, num_micro_batches)`` micro-batches in
    flight. Full recompute (uniform, one layer per checkpoint, as the worker configures it) keeps
    each layer's input only and rebuilds one layer's activations at a time in backward. MoE: the
    stage's sparse layers use the sparse-layer elements of :func:`layer_activation_elems`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    b = DTYPE_BYTES[dtype]
    stage_layers = model.stage_layers(pp, stage)
    n_sparse = sum(1 for layer in stage_layers if model.is_sparse(layer))
    n_layers = len(stage_layers)
    kinds = ([(False, n_layers - n_sparse)] if n_layers - n_sparse else []) + ([(True, n_sparse)] if n_sparse else [])
    per_kind = {sp_: layer_activation_elems(model, tp=tp, sp=sp, seq_len=seq_len, spec=spec, attention=attention,
                                            sparse=sp_, etp=etp, imbalance=imbalance) for sp_, _ in kinds}
    elems = per_kind[max(per_kind, key=lambda k: sum(per_kind[k].values()))]  # the larger layer kind
    full_layer = sum(elems.values())
    hn = model.hidden / tp if sp else model.hidden
    if forward_only:
        return [_forward_only_term(model, tp=tp, sp=sp, tokens=tokens, b=b, hn=hn, n_sparse=n_sparse,
                                   n_layers=n_layers, etp=etp, imbalance=imbalance, elems=elems)]
    in_flight = max(1, min(pp - stage, num_micro_batches))
    return [
        _stored_term(kinds, per_kind, n_layers=n_layers, n_sparse=n_sparse, hn=hn, in_flight=in_flight, tokens=tokens,
                     b=b, recompute=recompute, sp=sp, tp=tp),
        Term(
            "activations (backward working set)",
            int(tokens * full_layer * b),
            f"one layer rebuilt/back-propagated: {tokens} tokens x {full_layer:.0f} elems x {b} B",
        ),
    ]


def _forward_only_term(model: ModelShape, *, tp: int, sp: bool, tokens: int, b: int, hn: float, n_sparse: int,
                       n_layers: int, etp: int | None, imbalance: float, elems: dict[str, float]) -> Term:
    """No graph is kept: what is alive at once inside one layer. MLP: residual + norm output
    (2 h) + fc1 output (2 I) + silu output and gated product (2 I); attention: residual +
    qkv output + normed/roped q, k + attention output (+ the [heads, seq] scores when unfused).
    Sparse layer: residual + norm output, the router's logits and probabilities, the dispatched
    copies and the experts' outputs (2 k h ETP s), fc1 output and gated product (3 k I_e s)."""
    q, kv, i = model.q_dim / tp, model.kv_dim / tp, model.intermediate / tp
    mlp_live = 2 * hn + 4 * i
    what = "MLP 2 h + 4 I"
    if n_sparse:
        s_tok = 1 / tp if sp else 1.0
        k, e_tp = model.experts_per_tok, etp or tp
        moe_live = 2 * hn + s_tok * (2 * model.num_experts + imbalance * k * (2 * e_tp * model.hidden + 3 * model.moe_intermediate))
        if n_sparse == n_layers or moe_live > mlp_live:
            mlp_live, what = moe_live, "MoE 2 h + s (2 E + k (2 ETP h + 3 I_e))"
    attn_live = hn + (q + 2 * kv) + (q + kv) + q + elems.get("attention probs", 0.0) * 2
    live = max(mlp_live, attn_live)
    return Term("activations (forward only)", int(tokens * live * b),
                f"{tokens} tokens x max({what} = {mlp_live:.0f}, attention {attn_live:.0f}) elems/token x {b} B (live inside one layer)")


def _stored_term(kinds: list[tuple[bool, int]], per_kind: dict[bool, dict[str, float]], *, n_layers: int, n_sparse: int,
                 hn: float, in_flight: int, tokens: int, b: int, recompute: str, sp: bool, tp: int) -> Term:
    """What the stage keeps for backward over ``in_flight`` micro-batches, per layer kind (dense, sparse)."""
    if recompute == "full":
        stored_sum = n_layers * hn
        desc = f"{n_layers} layers x layer input {hn:.0f}"
    elif recompute == "selective":
        stored_sum = sum(n * (sum(per_kind[k].values()) - per_kind[k].get("attention probs", 0.0)) for k, n in kinds)
        desc = " + ".join(f"{n} {'sparse' if k else 'dense'} layers x {sum(per_kind[k].values()) - per_kind[k].get('attention probs', 0.0):.0f}"
                          for k, n in kinds) + " (all but the attention probabilities)"
    else:
        stored_sum = sum(n * sum(per_kind[k].values()) for k, n in kinds)
        desc = " + ".join(f"{n} {'sparse ' if k else ''}layers x (" + " + ".join(f"{name} {v:.0f}" for name, v in per_kind[k].items()) + ")"
                          for k, n in kinds)
    if not n_sparse:  # dense: one layer kind, the same formula text as before MoE
        stored = stored_sum / n_layers
        desc = desc.split(" x ", 1)[1]
        if recompute == "none":
            desc = desc[1:-1]  # the parentheses around the one kind's terms
        how = f"{in_flight} micro-batch(es) in flight x {n_layers} layers x {tokens} tokens x [{desc}] elems x {b} B"
        nbytes = int(in_flight * n_layers * tokens * stored * b)
    else:
        how = f"{in_flight} micro-batch(es) in flight x {tokens} tokens x [{desc}] elems x {b} B"
        nbytes = int(in_flight * tokens * stored_sum * b)
    return Term("activations (stored)", nbytes, how + f" (recompute={recompute}, sp={sp}, tp={tp})")


def logprob_scratch_term(
    model: ModelShape, *, tp: int, tokens: int, chunk: int, param_dtype: str, forward_only: bool
) -> Term:
    """Last stage: final hidden states [tokens, h] in fp32 (output, the response-position gather
    and its gradient: 3 copies) plus one chunk of the vocab-parallel log-prob/entropy: fp32
    [chunk, V/tp] temporaries (3 in forward, 4 when the chunk is recomputed in backward) and, in
    backward, the output-layer weight gradient [V/tp, h] before it is added to the grad buffer."""
    c = min(chunk, tokens)
    v = model.vocab // tp
    copies = 3 if forward_only else 4
    hidden = tokens * model.hidden * 4 * (1 if forward_only else 3)
    chunk_b = copies * c * v * 4
    wgrad = 0 if forward_only else v * model.hidden * DTYPE_BYTES[param_dtype]
    return Term(
        "log-prob/entropy scratch",
        hidden + chunk_b + wgrad,
        f"hidden {tokens} x {model.hidden} x 4 B x {1 if forward_only else 3} + {copies} x [{c} x {v}] fp32"
        + ("" if forward_only else f" + output-weight grad {v} x {model.hidden} x {DTYPE_BYTES[param_dtype]} B"),
    )


# ----------------------------------------------------------------------------- the public entry point
@dataclass
class MegatronMemory:
    """Megatron terms of the worst pipeline stage; ``peak`` is what a rank reaches in the phase."""

    stage: int
    static: list[Term]
    stored: list[Term]  # activations kept for backward: they add up
    transient: list[Term]  # alive one after the other (log-prob chunk, then one layer's backward): the largest counts
    step: list[Term]
    n_local: int

    @property
    def static_bytes(self) -> int:
        return sum(t.bytes for t in self.static)

    @property
    def dynamic_bytes(self) -> int:
        """Stored activations + the largest transient (the log-prob backward finishes before the
        first layer's backward starts)."""
        return sum(t.bytes for t in self.stored) + max([t.bytes for t in self.transient] or [0])

    @property
    def peak(self) -> int:
        """States + the larger of (activations + transient) and the optimizer step's temporaries
        (the step runs after backward has freed the activations)."""
        return self.static_bytes + max(self.dynamic_bytes, sum(t.bytes for t in self.step))

    @property
    def terms(self) -> list[Term]:
        return self.static + self.stored + self.transient + self.step

    def peak_terms(self) -> list[Term]:
        """The terms that add up to :attr:`peak` (the largest transient, or the optimizer step)."""
        dyn = self.stored + sorted(self.transient, key=lambda t: -t.bytes)[:1]
        if sum(t.bytes for t in self.step) > sum(t.bytes for t in dyn):
            dyn = list(self.step)
        return self.static + dyn

    def as_dict(self) -> dict[str, int]:
        out = {t.name: t.bytes for t in self.terms}
        out["total"] = self.peak
        out["stage"] = self.stage
        return out


def megatron_memory(model: ModelShape, **kwargs: Any) -> MegatronMemory:
    """All Megatron terms for every pipeline stage (the keywords of :func:`megatron_memory_stages`);
    returns the stage with the highest peak.

    ``seq_len`` (the padded row length, for the local spec's seq^2 attention term) defaults to
    ``micro_batch_tokens`` (one row per micro-batch, the worst case)."""
    return max(megatron_memory_stages(model, **kwargs), key=lambda mem: mem.peak)


def megatron_memory_stages(
    model: ModelShape,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_tokens: int,
    seq_len: int | None = None,
    recompute: str = "full",
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    grad_dtype: str = "fp32",
    distributed_optimizer: bool = True,
    logprob_chunk: int = 1024,
    spec: str = "te",
    num_micro_batches: int = 1,
    forward_only: bool = False,
    with_optimizer: bool = True,
    adam_state: bool = True,
    attention: str | None = None,
    ep: int = 1,
    etp: int | None = None,
    moe_imbalance: float = 1.0,
) -> list[MegatronMemory]:
    """:func:`megatron_memory` for every pipeline stage, stage 0 first.

    MoE (``model.is_moe``): ``ep`` = ``--megatron.expert_model_parallel_size``, ``etp`` = the expert
    tensor-parallel size (None: ``tp``, megatron-core's default); ``moe_imbalance`` scales the experts'
    activations (busiest rank over the balanced share)."""
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    etp = etp or tp
    edp = expert_data_parallel_size(tp=tp, dp=dp, ep=ep, etp=etp)
    seq_len = seq_len or micro_batch_tokens
    out: list[MegatronMemory] = []
    for stage in range(pp):
        n_dense = model.stage_params(tp, pp, stage)
        n_expert = model.stage_expert_params(etp, ep, pp, stage)
        n_local = n_dense + n_expert
        static = [weights_term(n_local, dtype)]
        if with_optimizer:
            static.append(grads_term(n_local, grad_dtype))
            static.append(optimizer_term(n_dense, dtype, dp, distributed_optimizer, adam_state, n_expert=n_expert, edp=edp))
        if n_expert:
            static[0] = Term("weights", static[0].bytes, static[0].formula + f"; {n_expert:,} of them expert params "
                             f"({model.num_experts} experts / EP {ep} per sparse layer, each / ETP {etp})")
        acts = activation_terms(
            model, tp=tp, pp=pp, stage=stage, sp=sequence_parallel, tokens=micro_batch_tokens, seq_len=seq_len,
            recompute=recompute, dtype=dtype, spec=spec, num_micro_batches=num_micro_batches, forward_only=forward_only,
            attention=attention, etp=etp, imbalance=moe_imbalance,
        )
        stored = [t for t in acts if t.name == "activations (stored)"]
        transient = [t for t in acts if t.name != "activations (stored)"]
        if stage == pp - 1:
            transient.append(logprob_scratch_term(model, tp=tp, tokens=micro_batch_tokens, chunk=logprob_chunk,
                                                  param_dtype=dtype, forward_only=forward_only))
        n_shard = (n_dense // dp + n_expert // edp) if distributed_optimizer else n_local
        step = [] if forward_only else [optimizer_step_transient(model, tp, spec, n_shard=n_shard, dtype=dtype)]
        out.append(MegatronMemory(stage, static, stored, transient, step, n_local))
    return out


def expert_data_parallel_size(*, tp: int, dp: int, ep: int, etp: int) -> int:
    """Megatron's expert-data-parallel size ``world / (ETP x EP x PP)`` = ``TP x DP / (ETP x EP)``; raises
    when the layout does not divide (megatron-core refuses it at ``initialize_model_parallel``)."""
    if (tp * dp) % (etp * ep):
        raise ValueError(
            f"--megatron.expert_model_parallel_size {ep} x expert TP {etp} must divide TP {tp} x DP {dp} "
            f"(world / PP): megatron-core needs world % (ETP x EP x PP) == 0")
    return tp * dp // (etp * ep)


def megatron_update_peak_bytes(
    model_cfg: dict[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    micro_batch_tokens: int,
    recompute: str = "full",
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    optimizer: str = "adam",
    distributed_optimizer: bool = True,
    logprob_chunk: int = 1024,
    seq_len: int | None = None,
    spec: str | None = None,
    forward_only: bool = False,
    adam_state: bool = True,
    train_state: bool = True,
    attention: str | None = None,
    ep: int = 1,
    etp: int | None = None,
) -> dict[str, int]:
    """Predicted peak bytes of one Megatron rank for an update (or a log-prob pass with
    ``forward_only=True``) of one micro-batch of ``micro_batch_tokens`` tokens.

    ``model_cfg``: a Hugging Face ``config.json`` as a dict. ``spec``: ``te`` (GPU, default for
    bf16) or ``local`` (CPU, default for fp32). ``adam_state=False`` models a rank before its first
    optimizer step (Adam's m, v do not exist yet; e.g. a log-prob pass right after ``init_model``);
    ``train_state=False`` a forward-only model without DDP grad buffer and optimizer
    (``init_model(train=False)``). ``attention``: ``flash`` (TE spec default), ``megatron``
    (unfused, local spec default) or ``sdpa`` (local spec with torch SDPA). MoE configs (``qwen3_moe``):
    ``ep`` / ``etp`` are the expert-parallel and expert tensor-parallel sizes (``etp`` None: ``tp``).
    Returns every term by name plus ``total`` (bytes)
    and ``stage`` (the pipeline stage with the highest peak). Comparable to
    ``torch.cuda.max_memory_allocated()`` minus what was allocated before the model was built
    (CUDA context and NCCL buffers are outside the allocator and not included).
    """
    if optimizer != "adam":
        raise ValueError(f"optimizer {optimizer!r}: only 'adam' is modelled")
    model = ModelShape.from_dict(model_cfg)
    mem = megatron_memory(
        model, tp=tp, pp=pp, dp=dp, micro_batch_tokens=micro_batch_tokens, seq_len=seq_len, recompute=recompute,
        sequence_parallel=sequence_parallel, dtype=dtype, distributed_optimizer=distributed_optimizer,
        logprob_chunk=logprob_chunk, spec=spec or ("local" if dtype == "fp32" else "te"), forward_only=forward_only,
        adam_state=adam_state, with_optimizer=train_state, attention=attention, ep=ep, etp=etp,
    )
    return mem.as_dict()


# ----------------------------------------------------------------------------- vLLM
@dataclass
class VllmMemory:
    """One GPU of a vLLM engine: the budget ``gpu_memory_utilization x GPU memory`` holds the
    weights, the profiling peak of activations and the KV cache (what is left)."""

    budget: Term
    weights: Term
    activations: Term
    kv_cache: Term
    outside: list[Term] = field(default_factory=list)  # CUDA context, CUDA graphs: outside the budget
    kv_tokens: int = 0

    @property
    def awake_bytes(self) -> int:
        return self.budget.bytes + sum(t.bytes for t in self.outside)


def vllm_memory(
    model: ModelShape,
    *,
    engine_tp: int,
    gpu_bytes: int,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    cuda_graph_bytes: int,
    context_bytes: int,
    dtype_bytes: int = 2,
) -> VllmMemory:
    budget = int(utilization * gpu_bytes)
    # every expert lives in the engine (split over its TP workers, or spread over them with vLLM's expert parallelism)
    w = model.total_params() * dtype_bytes // engine_tp
    # Profiling run: one forward of max_num_batched_tokens (largest live set: MLP fc1 output +
    # a few hidden-size tensors) plus the sampler's fp32 logits for max_num_seqs rows. MoE: the fused-MoE
    # kernel's caches per token instead of the MLP's: k x (fc1 output 2 I_e/etp + activation I_e/etp + output h).
    if model.is_moe:
        mlp = model.experts_per_tok * (3 * model.moe_intermediate // engine_tp + model.hidden)
        mlp_how = "k (3 I_e/etp + h)"
    else:
        mlp = 2 * model.intermediate // engine_tp
        mlp_how = "2 I/etp"
    act = max_num_batched_tokens * dtype_bytes * (4 * model.hidden + mlp) + max_num_seqs * model.vocab * 4 * 2
    kv = budget - w - act
    per_tok = model.kv_bytes_per_token(engine_tp, dtype_bytes)
    return VllmMemory(
        budget=Term("vLLM budget", budget, f"gpu_memory_utilization {utilization} x {gpu_bytes / GiB:.1f} GiB"),
        weights=Term("vLLM weights", w, f"{model.total_params():,} params{' (all experts)' if model.is_moe else ''} x {dtype_bytes} B / engine TP {engine_tp}"),
        activations=Term(
            "vLLM profiling peak", act,
            f"{max_num_batched_tokens} batched tokens x {dtype_bytes} B x (4 h + {mlp_how}) + {max_num_seqs} seqs x V x 4 B x 2",
        ),
        kv_cache=Term("vLLM KV cache", kv, f"budget - weights - profiling peak; {per_tok:,} B/token "
                      f"(2 x {model.layers} layers x {max(1, model.kv_heads // engine_tp)} kv heads x {model.head_dim} x {dtype_bytes} B)"),
        outside=[
            Term("vLLM CUDA context", context_bytes, "assumed (--plan.cuda_context_gib)"),
            Term("vLLM CUDA graphs", cuda_graph_bytes, "assumed (--plan.vllm_cuda_graph_gib)"),
        ],
        kv_tokens=max(0, kv) // per_tok,
    )
