#!/usr/bin/env python
"""Generate the bundled small maths set ``openrlhf_shape/data/bundled_math.jsonl``.

Every problem is generated from a seed and its answer is computed exactly with
``fractions.Fraction``; each answer is then checked with Math-Verify: ``\\boxed{answer}`` must
verify against itself and against the exact rational value, and must NOT verify against a wrong
value (answer + 1), so a broken answer string cannot slip through.

Difficulty levels (1-5):
  1  one-step integer arithmetic with one-digit numbers       ("What is 7 + 5?")
  2  one-step arithmetic with two-digit numbers, negative results, exact division
  3  two operations, or a one-step word problem
  4  fractions (sum, difference, product, "3/4 of 20"), linear equations, two-step word problems
  5  multi-step word problems and expressions mixing fractions and negatives

Usage:
  python scripts/make_math_set.py                       # writes the bundled file (seed 0)
  python scripts/make_math_set.py --measure             # + accuracy of the demo model per level
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "openrlhf_shape" / "data" / "bundled_math.jsonl"

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena",
         "Mia", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells", "coins", "stamps"]


def fmt(value: Fraction) -> str:
    """Answer string: ``12``, ``-5``, ``\\frac{3}{4}``, ``-\\frac{3}{4}`` (always in lowest terms)."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def frac_text(value: Fraction) -> str:
    """How a fraction appears inside a question: ``3/4`` (or ``-3/4``); integers as plain numbers."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _rand_frac(rng: random.Random, max_den: int = 9, allow_int: bool = False) -> Fraction:
    while True:
        den = rng.randint(2, max_den)
        num = rng.randint(1, den * 2 if allow_int else den - 1)
        f = Fraction(num, den)
        if allow_int or f.denominator != 1:
            return f


# Each generator returns (question, exact answer).
Problem = tuple[str, Fraction]


def level1(rng: random.Random) -> Problem:
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"What is {a} + {b}?", Fraction(a + b)
    if kind == "sub":
        a = rng.randint(2, 9)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", Fraction(a - b)
    a, b = rng.randint(2, 5), rng.randint(2, 9)
    return f"What is {a} times {b}?", Fraction(a * b)


def level2(rng: random.Random) -> Problem:
    kind = rng.choice(["add", "sub", "sub_neg", "mul", "div"])
    if kind == "add":
        a, b = rng.randint(10, 60), rng.randint(2, 30)
        return f"What is {a} + {b}?", Fraction(a + b)
    if kind == "sub":
        a = rng.randint(11, 40)
        b = rng.randint(2, a - 1)
        return f"What is {a} - {b}?", Fraction(a - b)
    if kind == "sub_neg":
        a, b = rng.randint(1, 15), rng.randint(5, 30)
        while a >= b:
            b = rng.randint(5, 30)
        return f"What is {a} - {b}?", Fraction(a - b)
    if kind == "mul":
        a, b = rng.randint(6, 12), rng.randint(3, 12)
        return f"What is {a} times {b}?", Fraction(a * b)
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    return f"What is {b * q} divided by {b}?", Fraction(q)


def level3(rng: random.Random) -> Problem:
    kind = rng.choice(["a*b+c", "(a+b)*c", "a-b*c", "word_add", "word_sub", "word_mul"])
    if kind == "a*b+c":
        a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 30)
        return f"What is {a} * {b} + {c}?", Fraction(a * b + c)
    if kind == "(a+b)*c":
        a, b, c = rng.randint(2, 15), rng.randint(2, 15), rng.randint(2, 9)
        return f"What is ({a} + {b}) * {c}?", Fraction((a + b) * c)
    if kind == "a-b*c":
        a, b, c = rng.randint(1, 30), rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} - {b} * {c}?", Fraction(a - b * c)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == "word_add":
        a, b = rng.randint(5, 40), rng.randint(5, 40)
        return (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
                Fraction(a + b))
    if kind == "word_sub":
        a = rng.randint(15, 60)
        b = rng.randint(2, a - 1)
        return (f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?",
                Fraction(a - b))
    a, b = rng.randint(3, 12), rng.randint(3, 12)
    return (f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?",
            Fraction(a * b))


def level4(rng: random.Random) -> Problem:
    kind = rng.choice(["frac_add", "frac_sub", "frac_mul", "frac_of", "linear", "word_two_step"])
    if kind in ("frac_add", "frac_sub", "frac_mul"):
        x, y = _rand_frac(rng), _rand_frac(rng)
        op, value = {"frac_add": ("+", x + y), "frac_sub": ("-", x - y), "frac_mul": ("*", x * y)}[kind]
        return f"What is {frac_text(x)} {op} {frac_text(y)}?", value
    if kind == "frac_of":
        den = rng.randint(2, 8)
        num = rng.randint(1, den - 1)
        whole = den * rng.randint(2, 12)
        return f"What is {num}/{den} of {whole}?", Fraction(num, den) * whole
    if kind == "linear":
        a, x = rng.randint(2, 9), rng.randint(-10, 15)
        b = rng.choice([v for v in range(-20, 21) if v != 0])
        c = a * x + b
        lhs = f"{a}x + {b}" if b >= 0 else f"{a}x - {-b}"
        return f"Solve for x: {lhs} = {c}.", Fraction(x)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 9), rng.randint(3, 12), rng.randint(1, 20)
    total = a * b
    c = min(c, total - 1)
    return (f"{name} buys {a} packs of {item} with {b} {item} in each pack, then gives {c} {item} "
            f"to a friend. How many {item} does {name} have left?", Fraction(total - c))


def level5(rng: random.Random) -> Problem:
    kind = rng.choice(["tank", "share", "mixed_expr", "linear_frac", "price"])
    if kind == "tank":
        den1 = rng.randint(2, 6)
        num1 = rng.randint(1, den1 - 1)
        cap = den1 * rng.randint(4, 20)
        den2 = rng.randint(2, 5)
        num2 = rng.randint(1, den2 - 1)
        water = Fraction(num1, den1) * cap
        left = water * (1 - Fraction(num2, den2))
        return (f"A tank holds {cap} liters and is {num1}/{den1} full. Then {num2}/{den2} of the water "
                f"in the tank is used. How many liters of water are left?", left)
    if kind == "share":
        name = rng.choice(NAMES)
        total = rng.randint(20, 90)
        f1 = _rand_frac(rng, 6)
        f2 = _rand_frac(rng, 6)
        first = Fraction(total) * f1
        left = (total - first) * (1 - f2)
        return (f"{name} has {total} dollars, spends {frac_text(f1)} of it on lunch and then spends "
                f"{frac_text(f2)} of what remains on a book. How many dollars does {name} have left?", left)
    if kind == "mixed_expr":
        x, y, z = _rand_frac(rng, 8), _rand_frac(rng, 8), _rand_frac(rng, 8)
        sign = rng.choice([1, -1])
        x = x * sign
        return f"What is ({frac_text(x)}) * {frac_text(y)} + {frac_text(z)}?", x * y + z
    if kind == "linear_frac":
        a = _rand_frac(rng, 6)
        b = _rand_frac(rng, 6)
        c = rng.randint(1, 12)
        # a * x + b = c  ->  x = (c - b) / a
        return f"Solve for x: ({frac_text(a)})x + {frac_text(b)} = {c}.", (c - b) / a
    name = rng.choice(NAMES)
    n1, p1, n2, p2 = rng.randint(2, 6), rng.randint(2, 9), rng.randint(2, 6), rng.randint(2, 9)
    paid = (n1 * p1 + n2 * p2) // 10 * 10 + rng.choice([10, 20, 50])
    return (f"{name} buys {n1} notebooks at {p1} dollars each and {n2} pens at {p2} dollars each, and pays "
            f"with {paid} dollars. How much change, in dollars, does {name} get?", Fraction(paid - n1 * p1 - n2 * p2))


LEVELS: dict[int, Callable[[random.Random], Problem]] = {1: level1, 2: level2, 3: level3, 4: level4, 5: level5}


def verify_answer(answer: str, value: Fraction) -> None:
    """Raise ``ValueError`` unless Math-Verify agrees ``\\boxed{answer}`` == value (and != value + 1)."""
    import sympy
    from math_verify import parse, verify

    boxed = parse(f"\\boxed{{{answer}}}")
    if not boxed:
        raise ValueError(f"math_verify cannot parse \\boxed{{{answer}}}")
    exact = [sympy.Rational(value.numerator, value.denominator)]
    wrong = [sympy.Rational(value.numerator, value.denominator) + 1]
    if not verify(boxed, boxed):
        raise ValueError(f"\\boxed{{{answer}}} does not verify against itself")
    if not verify(exact, boxed):
        raise ValueError(f"\\boxed{{{answer}}} does not verify against its exact value {value}")
    if verify(wrong, boxed):
        raise ValueError(f"\\boxed{{{answer}}} also verifies against the wrong value {value + 1}")


def generate(seed: int = 0, train_per_level: int = 80, test_per_level: int = 20) -> list[dict]:
    """Deterministic list of problems: for each level, ``train_per_level`` + ``test_per_level`` unique
    questions (no question appears twice, in particular not in both splits)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    for split, per_level in (("test", test_per_level), ("train", train_per_level)):
        for level, gen in LEVELS.items():
            made = 0
            while made < per_level:
                question, value = gen(rng)
                if question in seen:
                    continue
                seen.add(question)
                rows.append({"question": question, "answer": fmt(value), "difficulty": level,
                             "split": split, "source": "generated", "_value": value})
                made += 1
    for i, row in enumerate(rows):
        row["id"] = f"gen-{row['split']}-{i:04d}"
    return rows


def write(rows: list[dict], out: Path) -> list[Path]:
    """Write all rows to ``out`` and each split to ``<stem>_<split>.jsonl`` beside it (atomic per file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    targets = {out: rows}
    for split in sorted({r["split"] for r in rows}):
        targets[out.with_name(f"{out.stem}_{split}.jsonl")] = [r for r in rows if r["split"] == split]
    for path, subset in targets.items():
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as fh:
            for row in subset:
                clean = {k: row[k] for k in ("id", "question", "answer", "difficulty", "split", "source")}
                fh.write(json.dumps(clean) + "\n")
        tmp.replace(path)
    return list(targets)


# ----------------------------------------------------------------------------------------------
# Measuring the demo model on the test split.

DEFAULT_TEMPLATE = "{}\nGive only the final answer, in the form \\boxed{{answer}}."


def measure(path: Path, split: str, model_dir: str | None, template: str, temperature: float,
            n_samples: int, max_tokens: int, system_prompt: str | None) -> dict[int, tuple[int, int]]:
    """Accuracy of the demo model per difficulty: {level: (correct, total)} over all samples."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from math_verify import parse, verify
    from vllm import LLM, SamplingParams

    from openrlhf_shape.data.demo_model import ensure_demo_model

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == split]
    model_dir = model_dir or ensure_demo_model()
    llm = LLM(model_dir, enforce_eager=True, block_size=32, dtype="float32", seed=0, max_model_len=2048)
    tok = llm.get_tokenizer()
    prompts = []
    for r in rows:
        msgs = [{"role": "user", "content": template.format(r["question"])}]
        if system_prompt:
            msgs.insert(0, {"role": "system", "content": system_prompt})
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n_samples)
    outs = llm.generate(prompts, params)
    stats: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    examples = []
    for r, o in zip(rows, outs):
        gold = parse(f"\\boxed{{{r['answer']}}}")
        for c in o.outputs:
            ok = bool(verify(gold, parse(c.text)))
            stats[r["difficulty"]][0] += ok
            stats[r["difficulty"]][1] += 1
            if len(examples) < 6 and r["difficulty"] in (1, 5):
                examples.append((r["question"], r["answer"], c.text, ok))
    for q, a, t, ok in examples:
        print(f"--- [{'OK' if ok else 'WRONG'}] {q}  (gold {a})\n{t}")
    return {k: (v[0], v[1]) for k, v in sorted(stats.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-per-level", type=int, default=80)
    ap.add_argument("--test-per-level", type=int, default=20)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--measure", action="store_true", help="measure the demo model's accuracy per level")
    ap.add_argument("--measure-only", action="store_true", help="do not regenerate; only measure --out")
    ap.add_argument("--split", default="test")
    ap.add_argument("--model", default=None, help="HF model dir (default: the converted demo model)")
    ap.add_argument("--template", default=DEFAULT_TEMPLATE)
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--n-samples", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)

    if not args.measure_only:
        rows = generate(args.seed, args.train_per_level, args.test_per_level)
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            def tqdm(x, **_):
                return x
        for row in tqdm(rows, desc="verifying answers"):
            verify_answer(row["answer"], row["_value"])
        write(rows, args.out)
        counts = Counter((r["split"], r["difficulty"]) for r in rows)
        print(f"wrote {len(rows)} problems to {args.out}: " +
              ", ".join(f"{s}/L{d}={n}" for (s, d), n in sorted(counts.items())))
    if args.measure or args.measure_only:
        table = measure(args.out, args.split, args.model, args.template, args.temperature,
                        args.n_samples, args.max_tokens, args.system_prompt)
        total_ok = sum(c for c, _ in table.values())
        total = sum(n for _, n in table.values())
        print(f"\naccuracy on split={args.split} (T={args.temperature}, n={args.n_samples}):")
        for level, (c, n) in table.items():
            print(f"  level {level}: {c}/{n} = {c / n:.1%}")
        print(f"  overall: {total_ok}/{total} = {total_ok / total:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
