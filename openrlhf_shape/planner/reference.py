"""The reference model in the dry-run plan (``--algo.kl.init_coef`` > 0): its memory per GPU and phase, and its
time per step.

The reference runs as ranks of their own (openrlhf_shape/cluster: ``--ref.num_nodes`` x ``--ref.num_gpus_per_node``)
in the actor's layout, forward only: per GPU its weights (the actor's TP/PP/EP shard on Megatron; on DeepSpeed
all of them, or ``1 / ref ranks`` under ZeRO-3), the forward's activations and the log-prob head's scratch while it
runs, and always its process's CUDA context and NCCL communicators. Colocated (``--train.colocate_all``) its
weights stay in host memory except during its own forward, which follows the actor's (the actor's parameters are
back on host by then, vLLM is awake); disaggregated it holds them on GPUs of its own, after the actor's. Time: one
forward of every sequence over the reference ranks, plus (colocated) its weights to the GPU and back.
"""

from __future__ import annotations

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import Phase, flops_per_token
from openrlhf_shape.planner.memory import GiB, MegatronMemory, Term, megatron_memory_stages
from openrlhf_shape.planner.model import ModelShape

PHASE = "reference log-probs"
TIME_PHASE = "reference log-probs"


def reference_memory(model: ModelShape, cfg, *, ref_world: int, micro_batch_tokens: int, max_seq: int, dtype: str,
                     spec: str) -> list[MegatronMemory]:
    """Forward-only terms of one reference rank per PP stage (weights, no gradients, no optimizer)."""
    tp, pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size
    ref_dp = max(1, ref_world // (tp * pp))
    seq = min(micro_batch_tokens, max_seq)
    if cfg.actor.backend == "deepspeed" and not model.is_moe:
        from openrlhf_shape.planner.zero_memory import zero_memory

        stage = 3 if cfg.ds.zero_stage == 3 else 0  # the reference's DeepSpeed engine: ZeRO-3 or whole weights
        mem = zero_memory(model, dp=ref_dp, stage=stage, micro_batch_tokens=micro_batch_tokens, seq_len=seq,
                          recompute="none", dtype=dtype, logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec,
                          forward_only=True)
        mem.static = [t for t in mem.static if t.name == "weights"]
        return [_named(mem)]
    kw = dict(tp=tp, pp=pp, dp=ref_dp, micro_batch_tokens=micro_batch_tokens, seq_len=seq, recompute="none",
              sequence_parallel=bool(cfg.megatron.sequence_parallel and tp > 1), dtype=dtype,
              logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec, forward_only=True, with_optimizer=False)
    if model.is_moe:
        ep = int(cfg.megatron.expert_model_parallel_size)
        kw.update(ep=ep if (tp * ref_dp) % ep == 0 else 1)
    return [_named(m) for m in megatron_memory_stages(model, **kw)]


def _named(mem: MegatronMemory) -> MegatronMemory:
    """The same terms, each named as the reference's (a phase shows the actor's and the reference's side by side)."""
    rename = lambda ts: [Term(f"reference {t.name}", t.bytes, t.formula) for t in ts]  # noqa: E731
    return MegatronMemory(mem.stage, rename(mem.static), rename(mem.stored), rename(mem.transient), [], mem.n_local)


def process_terms(options: PlanOptions) -> list[Term]:
    """What the reference rank's process holds on its GPU at any time."""
    return [Term("CUDA context (reference rank)", int(options.cuda_context_gib * GiB), "--plan.cuda_context_gib"),
            Term("NCCL buffers (reference rank)", int(options.nccl_gib * GiB), "--plan.nccl_gib")]


def offloaded_terms(ref: MegatronMemory, options: PlanOptions) -> list[Term]:
    """Colocated, outside its forward: the weights on host (0 on the GPU), the process's context on the GPU."""
    return [Term(f"{t.name} (on host: the colocation lifecycle)", 0, t.formula) for t in ref.static] + process_terms(options)


def host_term(ref: MegatronMemory, ranks_on_node: int) -> Term:
    """Colocated: every reference rank of the node keeps its weights in host memory between its forwards."""
    return Term("reference weights offloaded", ref.static_bytes * ranks_on_node,
                f"{ref.static_bytes / GiB:.2f} GiB x {ranks_on_node} reference ranks on the node")


def reference_time(model: ModelShape, *, ref_world: int, total_tokens: float, seq: float, colocate: bool,
                   weight_bytes: int, opt: PlanOptions) -> Phase:
    """One forward of every sequence over the reference ranks (the actor's log-prob rate), and colocated its weights
    to the GPU and back over PCIe; rank time, in the old-log-prob stage of the one-step-off schedule too."""
    gpu_flops = opt.peak_tflops * 1e12 * opt.mfu
    f = flops_per_token(model, seq, backward=False, recompute=False)
    t_fwd = total_tokens * f / (ref_world * gpu_flops)
    t_move = 2 * weight_bytes / (opt.pcie_gbs * 1e9) if colocate else 0.0
    how = (f"{total_tokens:,.0f} tokens x {f / 1e9:.1f} GFLOP/token / ({ref_world} GPUs x {opt.peak_tflops:g} TFLOPS x "
           f"MFU {opt.mfu})" + (f" + weights on and off the GPU 2 x {weight_bytes / 1e9:.2f} GB at {opt.pcie_gbs:g} GB/s"
                                if colocate else ""))
    return Phase(TIME_PHASE, t_fwd + t_move, how, parts=(("log-probs + entropy", t_fwd + t_move),))
