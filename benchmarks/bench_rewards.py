"""Math-Verify verifications per second through MathVerifyScorer (process pool, per-call deadline).

    .venv/bin/python benchmarks/bench_rewards.py [--n 2000] [--workers 2]
    .venv/bin/python benchmarks/bench_rewards.py --probes [--synthetic]   # probe batches, plain vs fast scoring

``--probes`` scores one real probe batch of the demo model two ways in one run, interleaved, median of
``--repeats`` (each repeat on fresh pools warmed on other answers, see ``_compare``): "plain" is what
the trainer did before (every completion through the Math-Verify pool, the label parsed on every
call), "new" is DedupProbeScorer over a pool of the same size. Its last line is
``probe scoring: plain_per_s=A new_per_s=B speedup=S``. Before it, ``--malformed-rates`` (default 5%
and 2%) score the demo batch's keys with most malformed answers replaced by clean wrong integers
(same duplicate structure, smaller share that only Math-Verify can decide), and ``--synthetic``
a synthetic batch shaped like a capable model's probes (labelled as such).

Inputs are varied (no two identical, so no parser cache helps): boxed integers, fractions in
several spellings, decimals, wrong answers, answers in prose, probe-like unclosed boxes; a second
pass adds 2% pathological inputs to show what the deadline costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
    cfg = ProbeConfig(num_probes=m, max_tokens=st.probe.max_tokens)
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


def _capable_probe_batch(prompts: int, n: int, states: int, m: int, seed: int = 0,
                         malformed: float = 0.02) -> tuple[list[str], list[str]]:
    """A synthetic probe batch shaped like a capable model's (not the demo model's): labels of the
    bundled training set (integers and fractions as they occur), ``prompts`` x ``n`` responses x
    ``states`` probed states x ``m`` samples; each state has a potential drawn from Beta(1/2, 1/2)
    (mass near 0 and 1); a sample gives the label (in one of three spellings) with that probability,
    else one of three wrong values of the state, and with probability ``malformed`` a cut-off or
    text answer that only Math-Verify can judge; then a few tokens of trailing text."""
    from openrlhf_shape.data.prompts import bundled_math_path

    rng = random.Random(seed)
    with open(bundled_math_path("train")) as f:
        labels_all = [json.loads(line)["answer"] for line in f if line.strip()]
    tails = ["}$.", "}$", "}", "}$.\n\nThe", "}$ is the answer.", "} \\end{align}", "}$, so"]
    junk = ["\\frac{", "x = ", "the answer is", "12 + ", "\\text{", "\\sqrt{2", "(3, ", "a"]

    def spellings(label: str) -> list[str]:
        m_ = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", label)
        if m_:
            sgn, a, b = m_.groups()
            return [label, f"{sgn}{a}/{b}", f"{sgn}\\dfrac{{{a}}}{{{b}}}"]
        return [label, label, label + "."]

    def wrong(label: str) -> str:
        m_ = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", label)
        if m_:
            a, b = int(m_.group(2)), int(m_.group(3))
            return rng.choice([f"\\frac{{{a + 1}}}{{{b}}}", f"{a}/{b + 1}", str(a), f"\\frac{{{b}}}{{{a}}}"])
        v = int(label)
        return str(rng.choice([v + 1, v - 1, 2 * v, v + 10, -v if v else 3]))

    texts, labs = [], []
    for _ in range(prompts):
        label = rng.choice(labels_all)
        for _ in range(n * states):
            phi = rng.betavariate(0.5, 0.5)
            wrongs = [wrong(label) for _ in range(3)]
            for _ in range(m):
                if rng.random() < malformed:
                    ans = rng.choice(junk) + str(rng.randint(0, 99))
                elif rng.random() < phi:
                    ans = rng.choice(spellings(label))
                else:
                    ans = rng.choice(wrongs)
                texts.append("\\boxed{" + ans + rng.choice(tails))
                labs.append(label)
    return texts, labs


def _probe_key(text: str, label: str) -> tuple[tuple, bool]:
    """(the scorer's (answer, label) key, whether only Math-Verify can give its verdict)."""
    from openrlhf_shape.rewards.fast_path import fast_verdict
    from openrlhf_shape.rewards.probe_scoring import score_key

    key, answer = score_key(text, label, 10**9)
    return key, fast_verdict(answer, label) is None


def _demo_keys_with_malformed_rate(texts: list[str], labels: list[str], rate: float,
                                   seed: int = 0) -> tuple[list[str], list[str], float]:
    """The demo batch with its duplicate structure kept and only its malformed share changed.

    Every distinct (answer, label) key of the demo batch keeps its completions (so the number of
    distinct keys, i.e. the measured duplicate rate, is exactly the demo's). Keys that only
    Math-Verify can decide (malformed text such as ``11+21*282=11\\times(2``) are kept, in a random
    order, while their completions stay within ``rate`` of the batch; every other such key gets a
    clean wrong integer of its own (``\\boxed{N}.``, N distinct per key) in all its completions.
    Returns (texts, labels, achieved malformed share of completions)."""
    members: dict[tuple, list[int]] = {}
    slow: list[tuple] = []
    for i, (text, label) in enumerate(zip(texts, labels)):
        key, needs_mv = _probe_key(text, label)
        if key not in members:
            members[key] = []
            if needs_mv:
                slow.append(key)
        members[key].append(i)
    random.Random(seed).shuffle(slow)
    out, kept, budget = list(texts), 0, rate * len(texts)
    for j, key in enumerate(slow):
        if kept + len(members[key]) <= budget:
            kept += len(members[key])
            continue
        for i in members[key]:
            out[i] = f"\\boxed{{{100003 + j}}}."  # no label of the bundled set is this large
    return out, list(labels), kept / len(texts)


def _malformed_share(texts: list[str], labels: list[str]) -> float:
    """Share of completions whose verdict only Math-Verify can give (no exact shortcut applies)."""
    return sum(_probe_key(t, lab)[1] for t, lab in zip(texts, labels)) / max(1, len(texts))


WARMUP = 200  # verifications that warm each fresh pool before a timed pass


def _compare(texts: list[str], labels: list[str], args) -> dict:
    """Score one batch plainly (the trainer before: every completion through the pool, label parsed
    per call) and with :class:`DedupProbeScorer`, interleaved, median seconds of ``args.repeats``.

    Each repeat starts both pools afresh and warms them on ``WARMUP`` other verifications (varied
    answers from :func:`_cases`), as a trainer's long-lived pool is warm from earlier steps. Not on
    this batch itself: a worker that verified these very answers before has them in sympy's caches
    (a second pass over the demo's malformed answers runs ~2x faster), which a new step's answers
    would not find; a cold pool, on the other hand, pays one-time parser and sympy set-up inside the
    timing (fresh workers ran the demo batch's malformed answers ~2x slower)."""
    from openrlhf_shape.rewards import MathVerifyScorer
    from openrlhf_shape.rewards.probe_scoring import DedupProbeScorer

    plain_s, new_s, pool_s, same = [], [], [], True
    for _ in range(args.repeats):  # interleaved, so load on the shared machine hits both alike
        with MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout, cache_gold=False) as plain_pool, \
                MathVerifyScorer(num_workers=args.workers, timeout_s=args.timeout) as new_pool:
            warm_texts, warm_labels = _cases(WARMUP, seed=1000 + len(plain_s))
            plain_pool.score(warm_texts, warm_labels)  # start and warm the workers outside the timing
            new_pool.score(warm_texts, warm_labels)
            t0 = time.perf_counter()
            plain = plain_pool.score(texts, labels)
            plain_s.append(time.perf_counter() - t0)
            fast = DedupProbeScorer(new_pool)  # fresh per-step verdict cache each repeat
            t0 = time.perf_counter()
            new = fast.score(texts, labels)
            new_s.append(time.perf_counter() - t0)
            pool_s.append(fast.last.pool_seconds)
            same &= new == plain
            workers = plain_pool.num_workers
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"n": len(texts), "plain": med(plain_s), "new": med(new_s), "pool": med(pool_s), "same": same,
            "workers": workers, "stats": fast.last, "accuracy": sum(plain) / len(plain)}


def _report(name: str, r: dict) -> None:
    st = r["stats"]
    print(f"{name}: {r['n']} completions; distinct (answer, label) keys {st.unique} (duplicate rate "
          f"{1 - st.unique / r['n']:.3f}); decided by the exact shortcuts {st.fast}, sent to Math-Verify {st.pool}; "
          f"accuracy {r['accuracy']:.3f}")
    print(f"  with {r['workers']} workers each: plain {r['plain']:.3f} s, "
          f"new {r['new']:.4f} s (Math-Verify pool {r['pool']:.4f} s, keys + shortcuts {r['new'] - r['pool']:.4f} s); "
          f"scores identical: {r['same']}")


def probes_main(args) -> None:
    texts, labels = _demo_probe_batch(args.probe_batch, args.prompts, args.samples, args.m)
    print(f"repeats {args.repeats}, interleaved, medians (the machine may be shared: see `uptime`)")
    if args.synthetic:
        syn = _compare(*_capable_probe_batch(args.prompts, args.samples, 4, args.m), args)
        _report("synthetic capable-model batch (bundled labels, Beta(1/2,1/2) potentials, 2% malformed)", syn)
        print(f"probe scoring (synthetic capable-model batch): plain_per_s={syn['n'] / syn['plain']:.0f} "
              f"new_per_s={syn['n'] / syn['new']:.0f} speedup={syn['plain'] / syn['new']:.1f}")
    for rate in args.malformed_rates:  # the demo's duplicate structure, fewer malformed answers
        t_r, l_r, got = _demo_keys_with_malformed_rate(texts, labels, rate)
        r = _compare(t_r, l_r, args)
        _report(f"demo keys, malformed answers cut to {got:.3f} of completions", r)
        print(f"probe scoring (demo duplicate structure, {got:.1%} malformed): plain_per_s={r['n'] / r['plain']:.0f} "
              f"new_per_s={r['n'] / r['new']:.0f} speedup={r['plain'] / r['new']:.1f}")
    demo = _compare(texts, labels, args)
    _report(f"demo probe batch ({args.probe_batch}; {_malformed_share(texts, labels):.1%} of completions malformed)",
            demo)
    print(f"probe scoring: plain_per_s={demo['n'] / demo['plain']:.0f} new_per_s={demo['n'] / demo['new']:.0f} "
          f"speedup={demo['plain'] / demo['new']:.1f}")


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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--malformed-rates", type=float, nargs="*", default=[0.05, 0.02],
                    help="--probes: also the demo batch's keys with malformed answers cut to these shares")
    ap.add_argument("--synthetic", action="store_true",
                    help="--probes: also a synthetic batch shaped like a capable model's probes (clean answers)")
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
