r"""Exact shortcut before Math-Verify for the one answer shape where its verdict is known in advance.

Claim: if the extracted answer and the gold label are both *canonical integers* -- the regex
``0|-?[1-9][0-9]{0,29}`` (no sign on zero, no ``+``, no leading zeros, no separators, at most 30
digits) -- then Math-Verify 0.9.0, as called by :func:`~openrlhf_shape.rewards.math_verify_pool.verify_one`,
returns True iff the two strings are identical.

Why: ``parse("$n$")`` of such a string yields ``[Integer(n), "n"]`` (sympy integer plus the
extracted string) on both sides; ``verify`` compares every (gold, pred) pair: two sympy
``Integer`` values through ``sympy_str_eq`` and the integer branch of ``sympy_numeric_eq`` (exact
``==``, no float rounding: that branch applies only when one side is a ``Float``), the two strings
by ``==``, and mixed pairs are False. Canonical spelling makes integer equality and string
equality the same thing. Everything else -- ``01``, ``+1``, ``-0``, ``1,000`` (Math-Verify reads
a thousands separator), ``1.0``, ``50\\%``, fractions, decimals -- goes to Math-Verify, because
there its verdict is not a string comparison (it is not even symmetric: answer ``01`` matches
label ``1`` but answer ``1`` does not match label ``01``). ``tests/rewards/test_probe_scoring.py``
checks the claim against Math-Verify on such cases. The one difference from the pool: Math-Verify
can time out on a loaded machine and score a correct answer 0; the shortcut never times out.

Second claim: an answer matching ``-?(0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]`` (a decimal with at most
9 integer and 6 fraction digits whose value is not an integer, e.g. ``10.9``, ``-0.25``) never
matches a canonical-integer label. Math-Verify parses it to a ``Float``; with a ``Float`` on one
side ``sympy_numeric_eq`` compares both sides rounded to 6 decimals, and the decimal is its own
6-decimal rounding (at most 15 significant digits, within sympy's 15-digit float precision),
which is not an integer; the strings differ, and ``sympy_symbolic_eq`` (simplify(a - b) == 0)
fails for a non-zero difference. ``117.0`` (an integer value) and ``117.0000001`` (7 fraction
digits, which rounding could merge) are left to Math-Verify.
"""

from __future__ import annotations

import re

CANONICAL_INT_RE = re.compile(r"0|-?[1-9][0-9]{0,29}")
# a decimal that is not an integer: at most 9 integer digits, 1-6 fraction digits, last one non-zero
NON_INTEGER_DECIMAL_RE = re.compile(r"-?(0|[1-9][0-9]{0,8})\.[0-9]{0,5}[1-9]")


def is_canonical_int(text: str) -> bool:
    """True for ``0``, ``7``, ``-12``, ``1000``; False for ``01``, ``+1``, ``-0``, ``1,000``, ``1.0``."""
    return CANONICAL_INT_RE.fullmatch(text) is not None


def fast_verdict(answer: str | None, label: str) -> float | None:
    """Math-Verify's verdict when it is known without running it (see module doc), else None.
    ``answer`` is the extracted answer (None: nothing extracted)."""
    if answer is None or not is_canonical_int(label):
        return None
    if is_canonical_int(answer):
        return 1.0 if answer == label else 0.0
    if NON_INTEGER_DECIMAL_RE.fullmatch(answer):
        return 0.0
    return None
