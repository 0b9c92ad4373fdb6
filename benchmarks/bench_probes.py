"""Probe cost on the CPU smoke config: prefill actually computed per response token (vs the cost
floor in docs/architecture.md) and probe wall time / main rollout wall time, measured in one run.

    .venv/bin/python benchmarks/bench_probes.py                 # tiny random Qwen3 (thinking suffix)
    .venv/bin/python benchmarks/bench_probes.py --model demo    # SmolLM2-135M (answer suffix)

Rollout: P prompts x n samples, up to T tokens. Probes: K-1 interior boundaries per response
(uniform positions: the cost does not depend on where entropy puts them) + s_0 per prompt, m samples
each, 16 tokens. Probes run twice: right after the rollout (its KV still cached: the colocated-off
or CPU case) and after reset_prefix_cache() (what a GPU sleep between rollout and probes leaves).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from openrlhf_shape.platform import detect_platform  # noqa: E402  (driverless: decides for this process)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _questions(n: int) -> list[tuple[str, str]]:
    from openrlhf_shape.data.prompts import bundled_math_path

    rows = [json.loads(line) for line in open(bundled_math_path("train"))]
    return [(r["question"], str(r["answer"])) for r in rows[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (random Qwen3), 'demo' (SmolLM2-135M) or an HF dir")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=256, help="response length cap T")
    ap.add_argument("--K", type=int, default=8, help="segments per response")
    ap.add_argument("--m", type=int, default=8, help="probe samples per state")
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()

    from openrlhf_shape.rewards import MathVerifyScorer
    from openrlhf_shape.rollout import (
        EngineConfig,
        EngineGroup,
        ProbeConfig,
        ProbeSuffixes,
        SamplingConfig,
        VLLMEngine,
        estimate_potentials,
    )

    if args.model == "tiny":
        from openrlhf_shape.testing import make_tiny_model

        model_dir = str(make_tiny_model(tempfile.mkdtemp(prefix="bench_probes_"), arch="qwen3"))
    elif args.model == "demo":
        from openrlhf_shape.data.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = args.model

    engine = VLLMEngine(
        EngineConfig(model_path=model_dir, block_size=args.block_size, max_model_len=2048, kv_cache_gib=1.0)
, platform=detect_platform())
    group = EngineGroup([engine])
    tok = group.get_tokenizer()
    qa = _questions(args.prompts)
    prompts = []
    for q, _ in qa:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tok.encode(text, add_special_tokens=False))

    t0 = time.perf_counter()
    rollout = group.generate(prompts, SamplingConfig(n=args.n, max_tokens=args.max_tokens))
    rollout_s = time.perf_counter() - t0
    resp = [g.token_ids for g in rollout]
    prm = [prompts[g.prompt_index] for g in rollout]
    labels = [qa[g.prompt_index][1] for g in rollout]
    bounds = [sorted({len(r) * j // args.K for j in range(1, args.K)} - {0, len(r)}) for r in resp]
    total_T = sum(len(r) for r in resp)
    mean_T = total_T / len(resp)

    cfg = ProbeConfig(num_probes=args.m, max_tokens=args.probe_tokens)
    suffixes = ProbeSuffixes.from_tokenizer(tok, cfg)
    any_think = suffixes.think_end_id is not None
    S = len(suffixes.think_ids if any_think else suffixes.answer_ids)  # approx: most states use it
    B = engine.get_block_size()
    states = sum(len(b) for b in bounds) + len(prompts)
    K_eff = states / len(resp)

    with MathVerifyScorer(num_workers=2) as scorer:
        warm = estimate_potentials(group, prm, resp, bounds, labels, [0.0] * len(resp), scorer, cfg, suffixes)
        group.reset_prefix_cache()
        cold = estimate_potentials(group, prm, resp, bounds, labels, [0.0] * len(resp), scorer, cfg, suffixes)
    group.shutdown()

    floor_design = 1 + args.K * (B / 2 + S) / mean_T  # docs/architecture.md: once per state, response not cached
    floor_m_warm = K_eff * (S + args.m * B / 2) / mean_T  # each of m samples redoes the last partial block
    floor_m_cold = 1 + floor_m_warm
    print(f"model={os.path.basename(model_dir)} block={B} suffix_tokens={S} prompts={len(prompts)} n={args.n}")
    print(f"responses={len(resp)} mean_T={mean_T:.1f} probe states={states} (K_eff={K_eff:.2f}/response) m={args.m}")
    print(f"main rollout: {rollout_s:.2f} s, {total_T / rollout_s:.1f} tok/s")
    for name, res, floor_m in (("cache warm (after rollout)", warm, floor_m_warm), ("cache reset first", cold, floor_m_cold)):
        st = res.stats
        computed = st["probe/prompt_tokens"] - st["probe/cached_tokens"]
        print(f"-- probes, {name}:")
        print(f"   prompt tokens {st['probe/prompt_tokens']:.0f}, cached {st['probe/cached_tokens']:.0f} "
              f"(hit rate {st['probe/prefix_hit_rate']:.3f}), decode tokens {st['probe/tokens']:.0f}")
        print(f"   prefill computed per response token: {computed / total_T:.3f}  "
              f"(floor with m-fold partial block {floor_m:.3f}; design floor 1+K(B/2+S)/T = {floor_design:.3f}; "
              f"target <= 1.1)")
        print(f"   probe wall {st['probe/seconds']:.2f} s (generate {st['probe/generate_seconds']:.2f} s, "
              f"score {st['probe/score_seconds']:.2f} s); probe/rollout wall = {st['probe/seconds'] / rollout_s:.2f} "
              f"(generate only {st['probe/generate_seconds'] / rollout_s:.2f})")


if __name__ == "__main__":
    main()
