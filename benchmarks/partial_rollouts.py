"""The engines' idle share with and without partial rollouts (``--train.partial_rollout_enable``) on a long-tailed
response-length distribution: one run of each, the same engine, prompts and window count.

    .venv/bin/python benchmarks/partial_rollouts.py                       # idle machine: the numbers to report
    .venv/bin/python benchmarks/partial_rollouts.py --smoke               # a few seconds: does it run

What one window of asynchronous training asks of the engines, W times in a row (no trainer: the ranks' side does
not change what the engines do, and a weight sync between windows is stood in for by the prefix-cache reset it
causes):

* plain (one step off): the next batch, ``--prompts`` x ``--n`` responses of up to ``--max-new-tokens``, in one
  generate call: the window lasts as long as its longest response, while the other requests are done;
* partial: :meth:`~openrlhf_shape.rollout.partial.PartialRolloutPool.collect` of ``--prompts`` finished groups,
  responses cut every ``--chunk`` tokens and carried to the next window (what ``trainer/partial.py`` does).

Lengths: a tiny random Qwen3 (vocabulary 1024) stops when it samples one of ``--stop-ids`` token ids (about
``1024 / stop_ids`` tokens on average, geometric: many short responses and a long tail, cut at the budget).

Reported per mode, over the windows after the first (the partial pool fills its pipeline there):

* ``slot_idle_share``: the engines' idle share in decode slots. A generate call holds (requests) x (its longest
  continuation) slots, all requests decoding together; the slots of requests already finished while the longest
  runs decode nothing. The trainer logs the same number per step (``rollout/slot_idle_share``).
* ``window_s`` (the engines' seconds per batch: what the ranks wait for when generation is the longer side),
  ``tokens_per_s`` (decoded tokens per engine second), and the finished responses' length quantiles.

The final line gives both modes and the ratios partial / plain. One run each; timings need an idle machine (say
the load: ``uptime``), the idle shares do not (they count tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompt groups per batch (--rollout.batch_size)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128, help="--rollout.partial_chunk_tokens")
    ap.add_argument("--stop-ids", type=int, default=8, help="stop token ids (mean length ~ 1024 / this)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.chunk, args.windows, args.stop_ids = 2, 2, 32, 8, 3, 64
    return args


def _engine(args):
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout import EngineConfig, EngineGroup, VLLMEngine
    from openrlhf_shape.testing import make_tiny_model

    model_dir = str(make_tiny_model(tempfile.mkdtemp(prefix="bench_partial_"), arch="qwen3", seed=args.seed))
    cfg = EngineConfig(model_path=model_dir, max_model_len=args.prompt_len + args.max_new_tokens + 8,
                       kv_cache_gib=float(os.environ["VLLM_CPU_KVCACHE_SPACE"]), dtype="float32", seed=args.seed)
    return EngineGroup([VLLMEngine(cfg, platform=detect_platform())])


def _prompt_batches(args, count: int) -> list[list[SimpleNamespace]]:
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    return [[SimpleNamespace(prompt_ids=torch.randint(10, 1000, (args.prompt_len,), generator=gen).tolist())
             for _ in range(args.prompts)] for _ in range(count)]


def _plain(group, sampling, batches, args) -> list[dict]:
    from openrlhf_shape.trainer.experience import slot_idle_share

    rows = []
    for w in range(args.windows):
        t0 = time.perf_counter()
        gens = group.generate([it.prompt_ids for it in batches[w]], sampling)
        seconds = time.perf_counter() - t0
        lengths = [len(g.token_ids) for g in gens]
        rows.append({"seconds": seconds, "tokens": sum(lengths), "slot_idle_share": slot_idle_share(lengths),
                     "lengths": lengths})
        group.reset_prefix_cache()  # what a weight sync does between windows
    return rows


def _partial(group, sampling, batches, args) -> list[dict]:
    from openrlhf_shape.rollout.partial import PartialRolloutPool

    pool, feed, rows = PartialRolloutPool(args.chunk, args.max_new_tokens, args.n, args.seed), list(batches), []
    for w in range(args.windows):
        t0 = time.perf_counter()
        done, stats = pool.collect(group, sampling, w, args.prompts, lambda: feed.pop(0) if feed else None)
        seconds = time.perf_counter() - t0
        rows.append({"seconds": seconds, "tokens": stats.tokens, "slot_idle_share": stats.slot_idle_share,
                     "lengths": [len(r.tokens) for g in done for r in g.responses], "rounds": stats.rounds,
                     "in_flight_groups": pool.num_unfinished()})
        group.reset_prefix_cache()
    return rows


def _summary(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    lengths = sorted(x for r in steady for x in r["lengths"])
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    slots = sum(r["tokens"] / max(1e-9, 1 - r["slot_idle_share"]) for r in steady)
    return {"window_s": statistics.mean(r["seconds"] for r in steady),
            "tokens_per_s": sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady),
            "slot_idle_share": 1 - sum(r["tokens"] for r in steady) / slots if slots else 0.0,
            "length_p50": q(0.5), "length_p90": q(0.9), "length_max": lengths[-1], "windows": rows}


def main() -> None:
    args = _args()
    from openrlhf_shape.rollout import SamplingConfig

    group = _engine(args)
    try:
        sampling = SamplingConfig(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=True,
                                  seed=args.seed, stop_token_ids=list(range(100, 100 + args.stop_ids)))
        # the partial pool may admit up to ceil(max_new / chunk) batches ahead: give both modes the same prompts
        batches = _prompt_batches(args, args.windows * (1 + args.max_new_tokens // args.chunk) + 1)
        load = os.getloadavg()[0]
        result = {"args": vars(args), "load_1min_before": load,
                  "plain": _summary(_plain(group, sampling, batches, args)),
                  "partial": _summary(_partial(group, sampling, batches, args)),
                  "load_1min_after": os.getloadavg()[0]}
    finally:
        group.shutdown()
    p, q = result["plain"], result["partial"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"partial_rollouts: slot_idle_share plain={p['slot_idle_share']:.3f} partial={q['slot_idle_share']:.3f} "
          f"ratio={q['slot_idle_share'] / max(p['slot_idle_share'], 1e-9):.2f}; window_s plain={p['window_s']:.2f} "
          f"partial={q['window_s']:.2f} ratio={q['window_s'] / max(p['window_s'], 1e-9):.2f}; tokens_per_s "
          f"plain={p['tokens_per_s']:.0f} partial={q['tokens_per_s']:.0f}; lengths p50/p90/max {p['length_p50']}/"
          f"{p['length_p90']}/{p['length_max']}; load {result['load_1min_before']:.1f}->{result['load_1min_after']:.1f}")


if __name__ == "__main__":
    main()
