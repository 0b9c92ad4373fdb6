"""Memory of one DeepSpeed ZeRO rank (``--actor.backend deepspeed``), in the Megatron planner's terms.

With N parameters, data-parallel size d, parameter bytes b (2 bf16, 4 fp32) and ZeRO stage s:

* weights: ``N b`` (stages 0-2: every rank holds the whole model) or ``N b / d`` (stage 3), plus,
  under stage 3, the parameters gathered for the layer being computed (the largest layer, or the
  largest weight-sync bucket, whichever is larger) as a transient;
* gradients: ``N b`` (stages 0, 1: the full gradient before the reduce) or ``N b / d`` (stages 2, 3:
  each rank keeps its partition) plus one reduce bucket (``reduce_bucket_elems x b``) in flight;
* optimizer: Adam m and v (8 B/param) and an fp32 master copy (4 B/param; ZeRO keeps one even for fp32
  weights, only stage 0 with fp32 weights steps them in place): ``N x 12 / d`` from stage 1 up, ``N x 12``
  (``N x 8`` fp32) at stage 0;
  ``--ds.adam_offload`` moves all of it to host memory (it leaves the GPU; see :func:`zero_host_term`).
* activations and the chunked log-prob scratch: the Megatron formulas at TP 1 (the HF decoder layer
  keeps the same tensors; gradient checkpointing = full recompute).
"""

from __future__ import annotations

from openrlhf_shape.planner.memory import (
    DTYPE_BYTES,
    MegatronMemory,
    Term,
    activation_terms,
    logprob_scratch_term,
    optimizer_step_transient,
)
from openrlhf_shape.planner.model import ModelShape

ZERO_STAGES = (0, 1, 2, 3)


def zero_weights_term(n: int, dtype: str, dp: int, stage: int) -> Term:
    b = DTYPE_BYTES[dtype]
    if stage == 3:
        return Term("weights", n * b // dp, f"{n:,} params x {b} B ({dtype}) / DP {dp} (ZeRO-3: partitioned)")
    return Term("weights", n * b, f"{n:,} params x {b} B ({dtype}) (ZeRO-{stage}: every rank holds them all)")


def zero_grads_term(n: int, dtype: str, dp: int, stage: int, bucket_elems: int) -> Term:
    b = DTYPE_BYTES[dtype]
    bucket = min(bucket_elems, n) * b
    if stage >= 2:
        return Term("grads", n * b // dp + bucket,
                    f"{n:,} params x {b} B / DP {dp} (ZeRO-{stage}: partitioned) + one reduce bucket {min(bucket_elems, n):,} x {b} B")
    return Term("grads", n * b, f"{n:,} params x {b} B (ZeRO-{stage}: the full gradient before the reduce)")


def zero_optimizer_term(n: int, dtype: str, dp: int, stage: int, adam_offload: bool, adam_state: bool = True) -> Term:
    # ZeRO-1/2/3 keep an fp32 master partition even for fp32 weights (a clone of the flat group); stage 0 with
    # fp32 weights steps them in place.
    per = (8 if adam_state else 0) + (4 if dtype != "fp32" or stage >= 1 else 0)
    shard = dp if stage >= 1 else 1
    if adam_offload:
        return Term("optimizer", 0, f"{n:,} params x {per} B / DP {shard} on host (--ds.adam_offload): 0 on the GPU")
    what = "fp32 master + Adam m, v" if per == 12 else "Adam m, v (fp32 weights stepped in place)" if per == 8 else f"{per} B"
    how = f"/ DP {dp} (ZeRO-{stage})" if stage >= 1 else "(ZeRO-0: not sharded)"
    return Term("optimizer", n * per // shard, f"{n:,} params x {per} B ({what}) {how}")


def zero_host_term(model: ModelShape, dtype: str, dp: int, stage: int, ranks_on_node: int) -> Term:
    """Host memory that ``--ds.adam_offload`` takes on one node: each rank's optimizer partition."""
    n = model.total_params()
    per = 12  # fp32 master partition + Adam m, v (offload needs stage >= 1)
    shard = dp if stage >= 1 else 1
    return Term("Adam states offloaded (--ds.adam_offload)", n * per // shard * ranks_on_node,
                f"{n:,} params x {per} B / DP {shard} x {ranks_on_node} ranks on the node")


def zero_memory(
    model: ModelShape,
    *,
    dp: int,
    stage: int,
    micro_batch_tokens: int,
    seq_len: int | None = None,
    recompute: str = "full",
    dtype: str = "bf16",
    adam_offload: bool = False,
    logprob_chunk: int = 1024,
    spec: str = "te",
    forward_only: bool = False,
    adam_state: bool = True,
    reduce_bucket_elems: int = 50_000_000,
    gather_bucket_bytes: int = 0,
) -> MegatronMemory:
    """The terms of one ZeRO rank (returned as a one-stage :class:`MegatronMemory`). ``spec`` selects
    the attention activation formula (``te``: flash attention on GPU; ``local``: CPU)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    n = model.total_params()
    static = [zero_weights_term(n, dtype, dp, stage)]
    if not forward_only:
        static.append(zero_grads_term(n, dtype, dp, stage, reduce_bucket_elems))
    static.append(zero_optimizer_term(n, dtype, dp, stage, adam_offload, adam_state))
    acts = activation_terms(model, tp=1, pp=1, stage=0, sp=False, tokens=micro_batch_tokens,
                            seq_len=seq_len or micro_batch_tokens, recompute=recompute, dtype=dtype, spec=spec,
                            num_micro_batches=1, forward_only=forward_only)
    stored = [t for t in acts if t.name == "activations (stored)"]
    transient = [t for t in acts if t.name != "activations (stored)"]
    transient.append(logprob_scratch_term(model, tp=1, tokens=micro_batch_tokens, chunk=logprob_chunk,
                                          param_dtype=dtype, forward_only=forward_only))
    if stage == 3:
        largest = max(model.layer_params(1), model.embedding_params(1))  # one decoder layer or the embedding
        gathered = max(largest * DTYPE_BYTES[dtype], gather_bucket_bytes)
        stored.append(Term("ZeRO-3 gathered parameters", gathered,
                           f"max(largest module {largest:,} params x {DTYPE_BYTES[dtype]} B, one weight-sync bucket)"))
    step = [] if forward_only or adam_offload else [
        optimizer_step_transient(model, 1, spec, n_shard=n // (dp if stage >= 1 else 1), dtype=dtype)]
    return MegatronMemory(0, static, stored, transient, step, n)
