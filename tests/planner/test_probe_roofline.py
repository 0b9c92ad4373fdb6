"""The planner's probe term as a roofline (issue 24, part 6): a suffix prefill at the forward MFU plus
``probe_max_tokens`` decode steps in waves, each step reading the weights and every probe's context KV.
Checked against the arithmetic written out for Qwen3-4B at engine TP 2, and for how it moves with the
context, the wave size and the bandwidth; the dry run prints the SHAPE/GRPO ratio it implies."""

from __future__ import annotations

import math

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import probe_roofline
from openrlhf_shape.planner.model import MODELS_DIR, ModelShape

QWEN3_4B = ModelShape.from_file(MODELS_DIR / "Qwen3-4B.json")


def test_the_arithmetic_for_qwen3_4b() -> None:
    opt = PlanOptions()
    probes, suffix, decode, ctx = 32_768, 31, 16, 4_352  # 256 responses x 128 probes; prompt 256 + half of 8,192
    got, how = probe_roofline(QWEN3_4B, engine_tp=2, probes=probes, suffix_tokens=suffix, decode_tokens=decode,
                              context_tokens=ctx, opt=opt)
    n = QWEN3_4B.total_params()
    assert 4.0e9 < n < 4.1e9
    # prefill: 2 FLOPs per parameter plus QK^T and AV over the context for each suffix token
    flops = probes * suffix * (2 * n + 4 * 36 * 32 * 128 * (ctx + suffix / 2))
    prefill = flops / (2 * 989e12 * 0.44)
    # decode: 128 waves of 256 probes x 16 steps; a step reads the weight shard and 256 contexts of KV
    # (K and V, 36 layers, 8 KV heads / TP 2, head 128, bf16)
    kv_per_token = 2 * 36 * 4 * 128 * 2
    step_bytes = n * 2 / 2 + 256 * (ctx + suffix + decode / 2) * kv_per_token
    decode_s = 128 * 16 * step_bytes / (3350e9 * 0.5)
    assert got == pytest.approx(prefill + decode_s, rel=1e-9)
    assert 10 < prefill < 15 and 100 < decode_s < 115  # the decode's context reads are the bill
    assert "HBM bound" in how and "context KV 95%" in how


def test_it_moves_with_context_wave_and_bandwidth() -> None:
    kw = dict(engine_tp=2, probes=4096, suffix_tokens=31, decode_tokens=16)
    base, _ = probe_roofline(QWEN3_4B, context_tokens=4_000, opt=PlanOptions(), **kw)
    longer, _ = probe_roofline(QWEN3_4B, context_tokens=8_000, opt=PlanOptions(), **kw)
    assert 1.8 < longer / base < 2.05  # KV reads dominate: twice the context, about twice the time
    wide, _ = probe_roofline(QWEN3_4B, context_tokens=4_000, opt=PlanOptions(vllm_max_num_seqs=1024), **kw)
    assert wide == pytest.approx(base, rel=0.05)  # HBM bound: bigger waves read as many bytes in all
    fast, _ = probe_roofline(QWEN3_4B, context_tokens=4_000, opt=PlanOptions(hbm_gbs=6700.0), **kw)
    assert fast < 0.6 * base
    short, how = probe_roofline(QWEN3_4B, context_tokens=16, opt=PlanOptions(), **kw)
    assert short < base / 5 and "context KV" in how
    assert probe_roofline(QWEN3_4B, context_tokens=100, opt=PlanOptions(), engine_tp=2, probes=0, suffix_tokens=31,
                          decode_tokens=16)[0] == 0.0
    assert math.isfinite(base)


def test_dry_run_prints_the_shape_over_grpo_ratio(capsys) -> None:
    assert main(["train", "--config", "configs/qwen3-4b.yaml", "--dry_run"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("step time estimate"))
    ratio = float(line.split("SHAPE/GRPO ")[1].split()[0])
    assert 1.0 < ratio < 1.5 and "the paper measured 1.17 at K = 8" in line
    assert main(["train", "--config", "configs/qwen3-4b.yaml", "--algo.advantage.estimator", "group_norm", "--dry_run"]) == 0
    grpo = capsys.readouterr().out
    assert "SHAPE/GRPO" not in next(ln for ln in grpo.splitlines() if ln.startswith("step time estimate"))
