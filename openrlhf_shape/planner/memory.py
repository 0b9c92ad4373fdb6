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


def optimizer_term(n_local: int, dtype: str, dp: int, distributed: bool, adam_state: bool = True) -> Term:
    """``adam_state=False``: before the first optimizer step (Adam's m and v are created by the
    step; the fp32 master copy of bf16 weights exists from the optimizer's construction)."""
    master = 4 if dtype != "fp32" else 0
    per = (8 if adam_state else 0) + master
    shard = dp if distributed else 1
    what = {12: "fp32 master + Adam m, v", 8: "Adam m, v (fp32 weights: no master copy)",
            4: "fp32 master; Adam m, v not created yet", 0: "nothing yet: fp32 weights, Adam m, v not created"}[per]
    how = f"/ DP {dp} (distributed optimizer)" if distributed else "(not sharded: --megatron.use_distributed_optimizer false)"
    return Term("optimizer", n_local * per // shard, f"{n_local:,} local params x {per} B ({what}) {how}")


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
    model: ModelShape, *, tp: int, sp: bool, seq_len: int, spec: str, attention: str | None = None
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
) -> list[Term]:
    """Activations of one rank of pipeline stage ``stage`` at a micro-batch of ``tokens`` tokens
    (padded rows x seq_len). 1F1B keeps ``min(pp - stage, num_micro_batches)`` micro-batches in
    flight. Full recompute (uniform, one layer per checkpoint, as the worker configures it) keeps
    each layer's input only and rebuilds one layer's activations at a time in backward."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    b = DTYPE_BYTES[dtype]
    elems = layer_activation_elems(model, tp=tp, sp=sp, seq_len=seq_len, spec=spec, attention=attention)
    full_layer = sum(elems.values())
    hn = model.hidden / tp if sp else model.hidden
    n_layers = model.layers // pp
    terms: list[Term] = []
    if forward_only:
        # No graph is kept: what is alive at once inside one layer. MLP: residual + norm output
        # (2 h) + fc1 output (2 I) + silu output and gated product (2 I); attention: residual +
        # qkv output + normed/roped q, k + attention output (+ the [heads, seq] scores when unfused).
        q, kv, i = model.q_dim / tp, model.kv_dim / tp, model.intermediate / tp
        mlp_live = 2 * hn + 4 * i
        attn_live = hn + (q + 2 * kv) + (q + kv) + q + elems.get("attention probs", 0.0) * 2
        live = max(mlp_live, attn_live)
        terms.append(Term("activations (forward only)", int(tokens * live * b),
                          f"{tokens} tokens x max(MLP 2 h + 4 I = {mlp_live:.0f}, attention {attn_live:.0f}) elems/token x {b} B (live inside one layer)"))
        return terms
    in_flight = max(1, min(pp - stage, num_micro_batches))
    if recompute == "full":
        stored = hn
        desc = f"layer input {hn:.0f}"
    elif recompute == "selective":
        stored = full_layer - elems.get("attention probs", 0.0)
        desc = f"{stored:.0f} (all but the attention probabilities)"
    else:
        stored = full_layer
        desc = " + ".join(f"{k} {v:.0f}" for k, v in elems.items())
    terms.append(
        Term(
            "activations (stored)",
            int(in_flight * n_layers * tokens * stored * b),
            f"{in_flight} micro-batch(es) in flight x {n_layers} layers x {tokens} tokens x [{desc}] elems x {b} B"
            f" (recompute={recompute}, sp={sp}, tp={tp})",
        )
    )
    terms.append(
        Term(
            "activations (backward working set)",
            int(tokens * full_layer * b),
            f"one layer rebuilt/back-propagated: {tokens} tokens x {full_layer:.0f} elems x {b} B",
        )
    )
    return terms


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
) -> list[MegatronMemory]:
    """:func:`megatron_memory` for every pipeline stage, stage 0 first."""
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    seq_len = seq_len or micro_batch_tokens
    out: list[MegatronMemory] = []
    for stage in range(pp):
        n_local = model.stage_params(tp, pp, stage)
        static = [weights_term(n_local, dtype)]
        if with_optimizer:
            static.append(grads_term(n_local, grad_dtype))
            static.append(optimizer_term(n_local, dtype, dp, distributed_optimizer, adam_state))
        acts = activation_terms(
            model, tp=tp, pp=pp, stage=stage, sp=sequence_parallel, tokens=micro_batch_tokens, seq_len=seq_len,
            recompute=recompute, dtype=dtype, spec=spec, num_micro_batches=num_micro_batches, forward_only=forward_only,
            attention=attention,
        )
        stored = [t for t in acts if t.name == "activations (stored)"]
        transient = [t for t in acts if t.name != "activations (stored)"]
        if stage == pp - 1:
            transient.append(logprob_scratch_term(model, tp=tp, tokens=micro_batch_tokens, chunk=logprob_chunk,
                                                  param_dtype=dtype, forward_only=forward_only))
        n_shard = n_local // dp if distributed_optimizer else n_local
        step = [] if forward_only else [optimizer_step_transient(model, tp, spec, n_shard=n_shard, dtype=dtype)]
        out.append(MegatronMemory(stage, static, stored, transient, step, n_local))
    return out


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
) -> dict[str, int]:
    """Predicted peak bytes of one Megatron rank for an update (or a log-prob pass with
    ``forward_only=True``) of one micro-batch of ``micro_batch_tokens`` tokens.

    ``model_cfg``: a Hugging Face ``config.json`` as a dict. ``spec``: ``te`` (GPU, default for
    bf16) or ``local`` (CPU, default for fp32). ``adam_state=False`` models a rank before its first
    optimizer step (Adam's m, v do not exist yet; e.g. a log-prob pass right after ``init_model``);
    ``train_state=False`` a forward-only model without DDP grad buffer and optimizer
    (``init_model(train=False)``). ``attention``: ``flash`` (TE spec default), ``megatron``
    (unfused, local spec default) or ``sdpa`` (local spec with torch SDPA).
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
        adam_state=adam_state, with_optimizer=train_state, attention=attention,
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
    w = model.total_params() * dtype_bytes // engine_tp
    # Profiling run: one forward of max_num_batched_tokens (largest live set: MLP fc1 output +
    # a few hidden-size tensors) plus the sampler's fp32 logits for max_num_seqs rows.
    act = max_num_batched_tokens * dtype_bytes * (4 * model.hidden + 2 * model.intermediate // engine_tp) + max_num_seqs * model.vocab * 4 * 2
    kv = budget - w - act
    per_tok = model.kv_bytes_per_token(engine_tp, dtype_bytes)
    return VllmMemory(
        budget=Term("vLLM budget", budget, f"gpu_memory_utilization {utilization} x {gpu_bytes / GiB:.1f} GiB"),
        weights=Term("vLLM weights", w, f"{model.total_params():,} params x {dtype_bytes} B / engine TP {engine_tp}"),
        activations=Term(
            "vLLM profiling peak", act,
            f"{max_num_batched_tokens} batched tokens x {dtype_bytes} B x (4 h + 2 I/etp) + {max_num_seqs} seqs x V x 4 B x 2",
        ),
        kv_cache=Term("vLLM KV cache", kv, f"budget - weights - profiling peak; {per_tok:,} B/token "
                      f"(2 x {model.layers} layers x {max(1, model.kv_heads // engine_tp)} kv heads x {model.head_dim} x {dtype_bytes} B)"),
        outside=[
            Term("vLLM CUDA context", context_bytes, "assumed (--plan.cuda_context_gib)"),
            Term("vLLM CUDA graphs", cuda_graph_bytes, "assumed (--plan.vllm_cuda_graph_gib)"),
        ],
        kv_tokens=max(0, kv) // per_tok,
    )
