"""Math-Verify verifications per second through MathVerifyScorer (process pool, per-call deadline).

    .venv/bin/python benchmarks/bench_rewards.py [--n 2000] [--workers 2]
    .venv/bin/python benchmarks/bench_rewards.py --probes      # one real probe batch, plain vs fast scoring

Inputs are varied (no two identical, so no parser cache helps): boxed integers, fractions in
several spellings, decimals, wrong answers, answers in prose, probe-like unclosed boxes; a second
pass adds 2% pathological inputs to show what the deadline costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def _cases(n: int, seed: int = 0, pathological: float = 0.0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        a, b = rng.randint(1, 400), rng.randint(2, 97)
        kind = i % 6
        if rng.random() < pathological:
            texts.append("\\boxed{" + "{" * 5000 + "7^{7^{7^{7}}}" + "}" * 5000 + "}")
            labels.append(str(a))
        elif kind == 0:
            texts.append(f"so the sum is {a} and thus \\boxed{{{a}}}.")
            labels.append(str(a))
        elif kind == 1:
            texts.append(f"The final answer is $\\boxed{{\\dfrac{{{a}}}{{{b}}}}}$")
            labels.append(f"\\frac{{{a}}}{{{b}}}")
        elif kind == 2:
            texts.append(f"we get $x = {a / 4}$ so the answer is {a / 4}")
            labels.append(f"\\frac{{{a}}}{{4}}")
        elif kind == 3:
            texts.append(f"\\boxed{{{a + 1}}}")
            labels.append(str(a))
        elif kind == 4:
            texts.append(f"\\boxed{{{a}\\sqrt{{{b}}}}}")
            labels.append(f"{a}\\sqrt{{{b}}}")
        else:
            texts.append(f"The final answer is $\\boxed{{{a}/{b}")  # probe cut before the brace
            labels.append(f"\\frac{{{a}}}{{{b}}}")
    return texts, labels


def _demo_probe_batch(path: str, prompts: int, n: int, m: int) -> tuple[list[str], list[str]]:
    """Probe completions of the CPU demo model (prompts x n responses, s_0 + entropy boundaries, m
    samples each, as in training), cached as JSON at ``path``."""
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
        return data["texts"], data["labels"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from demo_states import build_demo_states

    from openrlhf_shape.rollout import ProbeConfig, ProbeSuffixes, SamplingConfig, build_probe_prompt

    st = build_demo_states(prompts, n)
    cfg = ProbeConfig(num_probes=m, max_tokens=st.shape.probe_max_tokens)
    suf = ProbeSuffixes.from_tokenizer(st.tokenizer, cfg)
    requests, labels, seen = [], [], set()
    for p, r, bs, lab in zip(st.prompts, st.responses, st.boundary_lists, st.labels):
        for b in ([0] if tuple(p) not in seen else []) + bs:
            requests.append(build_probe_prompt(p, r, b, suf))
            labels.append(lab)
        seen.add(tuple(p))
    gens = st.group.generate(requests, SamplingConfig(n=m, max_tokens=cfg.max_tokens))
    st.group.shutdown()
    texts = ["\\boxed{" + g.text for g in gens]
    labs = [labels[g.prompt_index] for g in gens]
    with open(path, "w") as f:
        json.dump({"texts": texts, "labels": labs, "prompts": prompts, "n": n, "m": m}, f)
    return texts, labs


def probes_main(args) -> None:
    from openrlhf_shape.rewards import MathVerifyScorer
    from openrlhf_shape.rewards.probe_scoring import DedupProbeScorer

    texts, labels = _demo_probe_batch(args.probe_batch, args.prompts, args.samples, args.m)
    # plain: the scorer before this change (one Math-Verify call per completion, label re-parsed
    # each time); new: distinct keys once, exact shortcuts, labels parsed once per worker.
    with MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout, cache_gold=False) as plain_pool, \
            MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout) as new_pool:
        plain_pool.score(["\\boxed{1}"], ["1"])  # start the workers outside the timing
        new_pool.score(["\\boxed{1}"], ["0"])
        plain_s, new_s, same = [], [], True
        for _ in range(args.repeats):  # interleaved, so load on the shared machine hits both alike
            t0 = time.perf_counter()
            plain = plain_pool.score(texts, labels)
            plain_s.append(time.perf_counter() - t0)
            fast = DedupProbeScorer(new_pool)  # fresh per-step verdict cache each repeat
            t0 = time.perf_counter()
            new = fast.score(texts, labels)
            new_s.append(time.perf_counter() - t0)
            same &= new == plain
        workers = plain_pool.num_workers
    st = fast.last
    a, b = sorted(plain_s)[len(plain_s) // 2], sorted(new_s)[len(new_s) // 2]
    print(f"probe batch: {len(texts)} completions of the demo model ({args.probe_batch}); "
          f"distinct (answer, label) keys {st.unique} (duplicate rate {1 - st.unique / len(texts):.3f}); "
          f"decided by the exact shortcuts {st.fast}, sent to Math-Verify {st.pool}; accuracy {sum(plain) / len(plain):.3f}")
    print(f"median of {args.repeats} interleaved runs with {workers} workers each (machine shared): plain {a:.3f} s, "
          f"new {b:.4f} s; scores identical: {same}")
    print(f"probe scoring: plain_per_s={len(texts) / a:.0f} new_per_s={len(texts) / b:.0f} speedup={a / b:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=0, help="0: one per available core")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--probes", action="store_true", help="score one real probe batch plainly and with fast scoring")
    ap.add_argument("--probe-batch", default=os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_shape",
                                                          "demo_probe_batch.json"))
    ap.add_argument("--prompts", type=int, default=8, help="--probes: prompts of the demo batch")
    ap.add_argument("--samples", type=int, default=4, help="--probes: responses per prompt")
    ap.add_argument("--m", type=int, default=8, help="--probes: probe samples per state")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.probes:
        os.makedirs(os.path.dirname(args.probe_batch), exist_ok=True)
        return probes_main(args)
    from openrlhf_shape.rewards import MathVerifyScorer

    with MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout) as scorer:
        args.workers = scorer.num_workers
        scorer.score(["\\boxed{1}"], ["1"])  # start the workers outside the timing
        for name, frac in (("clean", 0.0), ("2% pathological", 0.02)):
            texts, labels = _cases(args.n, seed=1 if frac else 0, pathological=frac)
            before = scorer.stats()
            t0 = time.perf_counter()
            scores = scorer.score(texts, labels)
            dt = time.perf_counter() - t0
            after = scorer.stats()
            delta = {k: after[k] - before[k] for k in after}
            print(f"{name}: {args.n} verifications in {dt:.2f} s = {args.n / dt:.0f}/s with {args.workers} workers "
                  f"({1000 * dt * args.workers / args.n:.2f} ms per verification-worker); "
                  f"accuracy {sum(scores) / len(scores):.3f}; timeouts {delta['timeouts']}, errors {delta['errors']}, "
                  f"restarts {delta['restarts']}")


if __name__ == "__main__":
    main()
