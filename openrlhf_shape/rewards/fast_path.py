r"""Exact shortcuts before Math-Verify for the answer shapes where its verdict is known in advance.

``fast_verdict(answer, label)`` returns Math-Verify 0.9.0's verdict (as called by
:func:`~openrlhf_shape.rewards.math_verify_pool.verify_one` on a response whose extracted answer is
``answer``) without running it, or None when it cannot be sure. It only answers when the label is a
*simple rational*:

- a canonical integer ``0|-?[1-9][0-9]{0,29}`` (no sign on zero, no ``+``, no leading zeros, no
  separators, at most 30 digits), or
- a reduced fraction ``-?\frac{a}{b}`` with canonical a >= 1, b >= 2 and gcd(a, b) = 1 (the form
  of every non-integer label of the bundled maths set).

Cases (each checked against Math-Verify in ``tests/rewards/test_probe_scoring.py``):

1. Answer a canonical integer, label a canonical integer: the verdict is string equality. ``parse``
   of ``$n$`` yields ``[Integer(n), "n"]`` on both sides; ``verify`` compares every (gold, pred)
   pair: two sympy ``Integer`` values through ``sympy_str_eq`` and the integer branch of
   ``sympy_numeric_eq`` (exact ``==``; float rounding applies only when one side is a ``Float``),
   the two strings by ``==``; mixed pairs are False. Canonical spelling makes integer equality and
   string equality the same thing.
2. Answer a *simple rational* spelling -- a canonical integer, ``-?\frac{c}{d}`` / ``-?\dfrac{c}{d}``
   (canonical c >= 0, d >= 1, no sign inside the braces) or ``-?c/d`` -- and the label a simple
   rational: the verdict is equality of the two rational values (``\frac{14}{12}`` matches
   ``\frac{7}{6}``, ``\frac{4}{2}`` matches ``2``, ``1`` does not match ``\frac{7}{6}``). Both
   sides parse to exact sympy rationals (no ``Float``), so ``sympy_numeric_eq`` compares them
   exactly and ``sympy_symbolic_eq`` (``simplify(a - b) == 0``) agrees: equal values give True,
   different values a non-zero rational difference and False whatever the strings say.
3. Answer a decimal that is not an integer, ``-?(0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]`` (at most 9
   integer and 6 fraction digits, e.g. ``10.9``, ``-0.25``), label a canonical integer: False.
   Math-Verify parses it to a ``Float``; with a ``Float`` on one side ``sympy_numeric_eq`` compares
   both sides rounded to 6 decimals, and the decimal is its own 6-decimal rounding (at most 15
   significant digits, within sympy's 15-digit float precision), which is not an integer; the
   strings differ, and ``simplify(a - b)`` is a non-zero number.

Everything else goes to Math-Verify, including spellings where a string or value shortcut would be
wrong: ``01`` (matches label ``1``, but answer ``1`` does not match label ``01``: not even
symmetric), ``+1``, ``-0``, ``1,000`` (a thousands separator), ``1.0``, ``50\%``, decimals against a
fraction (``0.166667`` matches ``\frac{1}{6}`` after 6-decimal rounding), ``\frac{-3}{14}``, and any
text: a digit-free answer is not safe either (``x-x`` matches label ``0``). The one difference from
the pool: Math-Verify can time out on a loaded machine and score a correct answer 0; a shortcut
never times out.
"""

from __future__ import annotations

import re
from fractions import Fraction
from math import gcd

_INT = r"(?:0|[1-9][0-9]{0,29})"
CANONICAL_INT_RE = re.compile(r"0|-?[1-9][0-9]{0,29}")
# a decimal that is not an integer: at most 9 integer digits, 1-6 fraction digits, last one non-zero
NON_INTEGER_DECIMAL_RE = re.compile(r"-?(0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]")
# label side: -\frac{a}{b} with canonical a, b (reducedness checked in code)
LABEL_FRACTION_RE = re.compile(rf"(-?)\\frac\{{({_INT})\}}\{{({_INT})\}}")
# answer side: -\frac{c}{d}, -\dfrac{c}{d}, -c/d
ANSWER_FRACTION_RE = re.compile(rf"(-?)\\d?frac\{{({_INT})\}}\{{({_INT})\}}")
ANSWER_SLASH_RE = re.compile(rf"(-?)({_INT})/({_INT})")


def is_canonical_int(text: str) -> bool:
    """True for ``0``, ``7``, ``-12``, ``1000``; False for ``01``, ``+1``, ``-0``, ``1,000``, ``1.0``."""
    return CANONICAL_INT_RE.fullmatch(text) is not None


def label_value(label: str) -> Fraction | None:
    """The value of a simple-rational label (canonical integer or reduced ``-?\\frac{a}{b}``, b >= 2),
    else None (the label is then left to Math-Verify)."""
    if CANONICAL_INT_RE.fullmatch(label):
        return Fraction(int(label))
    m = LABEL_FRACTION_RE.fullmatch(label)
    if m is None:
        return None
    a, b = int(m.group(2)), int(m.group(3))
    if a < 1 or b < 2 or gcd(a, b) != 1:
        return None
    return Fraction(-a if m.group(1) else a, b)


def answer_value(answer: str) -> Fraction | None:
    """The value of a simple-rational answer spelling (canonical integer, ``-?\\frac{c}{d}``,
    ``-?\\dfrac{c}{d}``, ``-?c/d`` with canonical c >= 0, d >= 1), else None."""
    if CANONICAL_INT_RE.fullmatch(answer):
        return Fraction(int(answer))
    m = ANSWER_FRACTION_RE.fullmatch(answer) or ANSWER_SLASH_RE.fullmatch(answer)
    if m is None:
        return None
    c, d = int(m.group(2)), int(m.group(3))
    if d < 1:
        return None
    return Fraction(-c if m.group(1) else c, d)


def fast_verdict(answer: str | None, label: str) -> float | None:
    """Math-Verify's verdict when it is known without running it (see module doc), else None.
    ``answer`` is the extracted answer (None: nothing extracted)."""
    if answer is None:
        return None
    gold = label_value(label)
    if gold is None:
        return None
    pred = answer_value(answer)
    if pred is not None:
        return 1.0 if pred == gold else 0.0
    if gold.denominator == 1 and NON_INTEGER_DECIMAL_RE.fullmatch(answer):
        return 0.0
    return None
