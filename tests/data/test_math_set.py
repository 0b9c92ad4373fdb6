"""The bundled maths set: regenerates bit for bit, answers verify with Math-Verify, sane splits."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from openrlhf_shape.data.prompts import bundled_math_path
from support.modules import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_math_set.py"


@pytest.fixture(scope="module")
def script():
    return load_file(SCRIPT)


@pytest.fixture(scope="module")
def rows():
    return [json.loads(line) for line in Path(bundled_math_path()).read_text().splitlines()]


def test_committed_file_is_what_the_script_generates(script, rows, tmp_path):
    fresh = script.generate(seed=0)
    paths = script.write(fresh, tmp_path / "bundled_math.jsonl")
    assert [p.name for p in paths] == ["bundled_math.jsonl", "bundled_math_test.jsonl", "bundled_math_train.jsonl"]
    for p in paths:
        split = p.stem.split("_")[-1]
        committed = bundled_math_path(None if split == "math" else split)
        assert p.read_text() == Path(committed).read_text(), f"{committed} is stale: rerun scripts/make_math_set.py"
    assert script.generate(seed=1)[0]["question"] != fresh[0]["question"] or \
        script.generate(seed=1)[5]["question"] != fresh[5]["question"]


def test_fields_splits_and_difficulty_mix(rows):
    assert all(set(r) == {"id", "question", "answer", "difficulty", "split", "source"} for r in rows)
    assert all(r["source"] == "generated" for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["question"] for r in rows}) == len(rows), "a question repeats (possibly across splits)"
    counts = Counter((r["split"], r["difficulty"]) for r in rows)
    assert counts == {**{("train", d): 80 for d in range(1, 6)}, **{("test", d): 20 for d in range(1, 6)}}
    for r in rows:
        assert "$" not in r["answer"] and "\\boxed" not in r["answer"]
        assert re.fullmatch(r"-?\d+|-?\\frac\{\d+\}\{\d+\}", r["answer"]), r["answer"]
    assert any("frac" in r["answer"] for r in rows) and any(r["answer"].startswith("-") for r in rows)


def test_every_answer_verifies_with_math_verify(script, rows):
    fresh = script.generate(seed=0)
    for row, gen in zip(rows, fresh):
        assert row["answer"] == script.fmt(gen["_value"])
        script.verify_answer(row["answer"], gen["_value"])  # raises on any disagreement


def test_verify_answer_rejects_wrong_answers(script):
    with pytest.raises(ValueError):
        script.verify_answer("\\frac{3}{5}", Fraction(3, 4))
    with pytest.raises(ValueError):
        script.verify_answer("12", Fraction(-12))


def _eval_expr(text: str) -> Fraction:
    """Exact value of a + - * / ( ) expression of integers, independent of the generator's code."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.Div: a / b if b else None}[type(node.op)]
        raise ValueError(f"unexpected syntax in {text!r}")

    return ev(ast.parse(text, mode="eval"))


def test_arithmetic_questions_recomputed_independently(rows):
    from math_verify import parse, verify

    checked = 0
    for r in rows:
        q = r["question"]
        m = re.fullmatch(r"What is (.+)\?", q)
        s = re.fullmatch(r"Solve for x: (.+)x ([+-]) (\S+) = (\d+|-\d+)\.", q)
        if m:
            expr = m.group(1).replace(" times ", " * ").replace(" divided by ", " / ").replace(" of ", " * ")
            expr = re.sub(r"(\d+)/(\d+)", r"(\1/\2)", expr)
            value = _eval_expr(expr)
        elif s:
            a = _eval_expr(s.group(1).strip("()"))
            b = _eval_expr(s.group(3)) * (1 if s.group(2) == "+" else -1)
            value = (_eval_expr(s.group(4)) - b) / a
        else:
            continue
        gold = parse(f"\\boxed{{{r['answer']}}}")
        assert verify(gold, parse(f"${value.numerator}/{value.denominator}$")), (q, r["answer"], value)
        checked += 1
    assert checked >= 250  # levels 1-2 entirely and most of 3-5 are plain expressions or equations
