"""Math-Verify verifications per second through MathVerifyScorer (process pool, per-call deadline).

    .venv/bin/python benchmarks/bench_rewards.py [--n 2000] [--workers 2]

Inputs are varied (no two identical, so no parser cache helps): boxed integers, fractions in
several spellings, decimals, wrong answers, answers in prose, probe-like unclosed boxes; a second
pass adds 2% pathological inputs to show what the deadline costs.
"""

from __future__ import annotations

import argparse
import random
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    from openrlhf_shape.rewards import MathVerifyScorer

    with MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout) as scorer:
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
