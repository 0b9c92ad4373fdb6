"""The planner for long responses (issue 36, item 5): context parallelism in the memory plan and the placement,
the long-context presets (fit with CP, refused without), the response-length distribution and its tail, packed
micro-batches in the time model, partial rollouts and the async engine:trainer split search."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_dry_run import _dry_run

from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import parse_plan_options
from openrlhf_shape.planner.async_cost import async_step
from openrlhf_shape.planner.cost import decode_tail_seconds
from openrlhf_shape.planner.lengths import ResponseLengths
from openrlhf_shape.planner.memory import megatron_memory_stages
from openrlhf_shape.planner.model import ModelShape
from openrlhf_shape.planner.plan import build_plan
from openrlhf_shape.planner.split import search_split

REPO = Path(__file__).resolve().parents[2]
LONG_PRESETS = ("qwen3-4b-thinking-64k.yaml", "qwen3-4b-shape-32k.yaml")


def _plan(preset: str, flags: list[str] | None = None, plan_flags: list[str] | None = None):
    cfg = load_config(str(REPO / "configs" / preset), flags or [], check_paths=False)
    return build_plan(cfg, parse_plan_options(plan_flags or []), f"configs/{preset}")


# ----------------------------------------------------------------------------- presets and the CP check
@pytest.mark.parametrize("preset", LONG_PRESETS)
def test_long_presets_fit_8_gpus_with_cp_and_are_refused_without(capsys, preset):
    rc, out = _dry_run(capsys, "--config", f"configs/{preset}")
    assert rc == 0, out
    assert "FITS: smallest margin" in out and "x CP 2 x DP 4" in out
    assert "1 node(s) x 8 GPUs, colocated" in out and "rank   1 (tp 0, cp 1, pp 0, dp 0)" in out
    rc, out = _dry_run(capsys, "--config", f"configs/{preset}", "--megatron.context_parallel_size", "1")
    assert rc == 2, out
    refusal = out.split("REFUSED:")[1]
    assert "log-probs phase" in refusal and "raise --megatron.context_parallel_size (now 1" in refusal


def test_64k_preset_reads_the_thinking_models_config():
    plan = _plan("qwen3-4b-thinking-64k.yaml")
    assert plan.model.name == "Qwen3-4B-Thinking-2507" and plan.inputs["max_seq"] == 10240 + 64000
    # the same architecture as Qwen3-4B: the same parameter count
    assert plan.model.total_params() == ModelShape.from_file(REPO / "configs/models/Qwen3-4B.json").total_params()


def test_cp_flag_loads_and_its_layout_errors_name_the_flags():
    flags = ["--megatron.context_parallel_size", "2"]
    cfg = load_config(str(REPO / "configs/qwen3-4b.yaml"), flags, check_paths=False)
    assert cfg.megatron.context_parallel_size == 2
    with pytest.raises(ValueError, match=r"the DeepSpeed backend's flag is --ds.ring_attn_size"):
        load_config(str(REPO / "configs/qwen3-4b.yaml"), flags + ["--actor.backend", "deepspeed",
                    "--megatron.tensor_model_parallel_size", "1", "--megatron.sequence_parallel", "false"],
                    check_paths=False)
    with pytest.raises(ValueError, match=r"not a multiple of TP x PP x CP = 16"):
        load_config(str(REPO / "configs/qwen3-4b.yaml"), ["--megatron.context_parallel_size", "8"],
                    check_paths=False)


# ----------------------------------------------------------------------------- CP in the memory plan
TINY = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True)


def test_cp_divides_activations_and_adds_the_gathered_kv_by_hand():
    """Tiny Qwen3 (h 64, I 128, 4 layers, 4/2 heads x 16, V 1000), one 4096-token sequence, TP 1, full recompute,
    TE spec, bf16. CP 2: each rank holds 2048 tokens."""
    model = ModelShape.from_dict(TINY)
    kw = dict(tp=1, pp=1, dp=4, recompute="full", dtype="bf16", spec="te", logprob_chunk=512, seq_len=4096)
    one = megatron_memory_stages(model, micro_batch_tokens=4096, cp=1, **kw)[0].as_dict()
    two = megatron_memory_stages(model, micro_batch_tokens=2048, cp=2, **kw)[0].as_dict()
    # stored: 4 layers x tokens x layer input 64 x 2 B
    assert one["activations (stored)"] == 4 * 4096 * 64 * 2 == 2097152
    assert two["activations (stored)"] == 4 * 2048 * 64 * 2 == 1048576
    # one layer's backward working set (te): norms 2x2x64 + qkv/proj (64+2x32+64) + q/k norms (2x64+32)
    # + attention (64+2x32) + mlp (2x128 + 2x128) = 256 + 192 + 160 + 128 + 512 = 1248 elems per token
    assert one["activations (backward working set)"] == 4096 * 1248 * 2
    assert two["activations (backward working set)"] == 2048 * 1248 * 2
    # log-prob head: hidden [tokens, 64] fp32 x 3 + 4 x [512, 1000] fp32 + output-weight grad [1000, 64] bf16
    assert one["log-prob/entropy scratch"] == 4096 * 64 * 4 * 3 + 4 * 512 * 1000 * 4 + 1000 * 64 * 2
    assert two["log-prob/entropy scratch"] == 2048 * 64 * 4 * 3 + 4 * 512 * 1000 * 4 + 1000 * 64 * 2
    # K and V of the whole sequence and their gradients: 4 x 4096 x kv_dim 32 x 2 B
    assert "CP K/V all-gather (one layer)" not in one
    assert two["CP K/V all-gather (one layer)"] == 4 * 4096 * 32 * 2 == 1048576
    assert one["weights"] == two["weights"]  # CP splits sequences, not parameters


def test_a_plans_cp_rank_holds_its_share_of_the_sequence():
    p1 = _plan("qwen3-4b-shape-32k.yaml", ["--megatron.context_parallel_size", "1"])
    p2 = _plan("qwen3-4b-shape-32k.yaml")
    assert p1.micro_batch_tokens == 33792 and p2.micro_batch_tokens == 16896  # ceil(33792 / 2)
    assert (p1.dp, p2.dp) == (8, 4)
    fwd1, fwd2 = (p.megatron_fwd.as_dict()["activations (forward only)"] for p in (p1, p2))
    assert fwd1 == 2 * fwd2
    cp = next(ph for ph in p2.phases if ph.name == "CP K/V exchange")
    # per token-layer: 1 other chunk x K, V x kv_dim 1024 x 2 B; passes 1 (log-probs) + 3 (update, recompute)
    tokens = p2.packing.computed / (p2.dp * 2)
    assert cp.seconds == pytest.approx(4 * tokens * 36 * (2 * 1024 * 2) / (450e9 * 0.5))


# ----------------------------------------------------------------------------- lengths and their tail
def test_length_distribution_and_the_tail_by_hand():
    # no cut in reach (cap 10^9): mu = ln(mean) - sigma^2 / 2 = ln 1000 - 0.125 = 6.782755
    d = ResponseLengths.from_mean(1000, 0.5, 10**9)
    assert d.mu == pytest.approx(math.log(1000) - 0.125, abs=1e-9) and d.mean() == pytest.approx(1000)
    # the longest of 99: q(0.99) = exp(6.782755 + 0.5 x 2.326348) = exp(7.945929) = 2824.1
    assert d.longest(99) == pytest.approx(math.exp(6.782755279 + 0.5 * 2.326347874), rel=1e-9)
    assert d.longest(99) == pytest.approx(2824.1, abs=0.1)
    # cut at 2000: the cut mean 1000 needs a larger mu; the longest of 99 is the cap, 4.4% reach it
    c = ResponseLengths.from_mean(1000, 0.5, 2000)
    assert c.mean() == pytest.approx(1000, rel=1e-9) and c.mu > d.mu and c.longest(99) == 2000
    assert c.truncated_share() == pytest.approx(1 - 0.5 * (1 + math.erf((math.log(2000) - c.mu) / 0.5 / math.sqrt(2))))
    # the tail term: 256 sequences on 64 slots, bulk 100 s, the longest 2824.1 steps at 3 ms: list scheduling's bound
    assert decode_tail_seconds(256, 64, 2824.1, 0.003, 100.0) == pytest.approx(100.0 + 63 / 64 * 2824.1 * 0.003)
    assert decode_tail_seconds(32, 64, 2824.1, 0.003, 5.0) == pytest.approx(2824.1 * 0.003)  # all at once


def test_the_decode_phase_is_bulk_plus_tail_and_partial_rollouts_cut_the_tail():
    plan = _plan("qwen3-4b.yaml")
    dec = next(p for p in plan.phases if p.name == "rollout decode")
    longest = plan.lengths.longest(1024)
    assert longest == 16384  # the batch's longest of 1024 reaches the cap (5.7% do)
    assert "+ tail (1 - 1/75) x longest response 16,384 steps" in dec.how and dec.partial_seconds is None
    capped = _plan("qwen3-4b.yaml", plan_flags=["--plan.partial_rollout_cap_tokens", "4096"])
    dec_c = next(p for p in capped.phases if p.name == "rollout decode")
    assert dec_c.seconds == dec.seconds  # the synchronous step keeps the whole tail
    # bulk + (1 - 1/c) x L x t_one with L = 16384 (whole tail) and 4096 (cut): the tail shrinks 4x, the bulk stays
    bulk = (4 * dec_c.partial_seconds - dec.seconds) / 3
    assert bulk == pytest.approx(469, abs=0.5) and "= 469 s, + tail" in dec.how
    tail = dec.seconds - dec_c.partial_seconds
    assert tail == pytest.approx(0.75 * (dec.seconds - bulk))
    a, a_c = plan.async_plan.shape[0], capped.async_plan.shape[0]
    # the engines stay the bottleneck: the window shrinks by the cut tail and the ranks wait less
    assert a_c.seconds == pytest.approx(a.seconds - tail) and a_c.rank_idle < a.rank_idle


def test_packed_tokens_are_the_trainers_micro_batch_plan():
    from openrlhf_shape.actor.batching import padding_report

    plan = _plan("qwen3-4b.yaml")
    lengths = [256 + r for r in plan.lengths.batch(1024)]
    rep = padding_report(lengths, plan.micro_batch_tokens, dp_size=plan.dp)
    assert plan.packing.computed == rep["packed"]["computed_tokens"] and plan.packing.padded == rep["padded"]["computed_tokens"]
    assert plan.packing.padded > plan.packing.computed  # sigma 0.5: rows of unequal length pad
    assert plan.packing.attention_seq == pytest.approx(sum(s * s for s in lengths) / sum(lengths))
    flat = _plan("qwen3-4b.yaml", plan_flags=["--plan.response_length_sigma", "0"])
    assert flat.packing.padded == flat.packing.computed == 1024 * (256 + 8192)


# ----------------------------------------------------------------------------- the split search
def _brute_force(preset: str, max_gpus: int, plan_flags: list[str]):
    from openrlhf_shape.planner.split import variant

    cfg = load_config(str(REPO / "configs" / preset), [], check_paths=False)
    options = parse_plan_options(plan_flags)
    block = cfg.megatron.tensor_model_parallel_size * cfg.megatron.context_parallel_size
    etp = cfg.vllm.tensor_parallel_size
    found = []
    for r in range(1, max_gpus + 1):
        for e in range(1, max_gpus + 1):
            if r % block or cfg.train.batch_size % (r // block) or r + e * etp > max_gpus:
                continue
            plan = build_plan(variant(cfg, r, e), options, preset)
            if plan.fits:
                found.append((async_step(plan.phases, 1).seconds * (r + e * etp), r + e * etp, r, e))
    return min(found)


@pytest.mark.parametrize("preset,max_gpus", [("qwen3-4b.yaml", 16), ("qwen3-4b-shape-32k.yaml", 12)])
def test_split_search_finds_the_brute_force_split(preset, max_gpus):
    flags = ["--plan.split_max_gpus", str(max_gpus), "--plan.partial_rollout_cap_tokens", "8192"]
    cfg = load_config(str(REPO / "configs" / preset), [], check_paths=False)
    best = search_split(build_plan(cfg, parse_plan_options(flags), f"configs/{preset}"), cfg).best
    gpu_s, gpus, r, e = _brute_force(preset, max_gpus, flags)
    assert (best.rank_gpus, best.engines) == (r, e)
    assert best.gpu_seconds == pytest.approx(gpu_s, rel=1e-9)


def test_split_search_is_reported_with_each_sides_idle_share(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-4b.yaml")
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("async split search"))
    assert "at most 16 GPUs" in line and "best " in line and "engines idle" in line and "ranks idle" in line
    assert "  the configured split: 8 rank GPUs + 4 engine(s) x TP 2 = 16 GPUs" in out
