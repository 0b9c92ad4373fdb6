"""Final-answer extraction from model output (pure string code, no sympy).

Order: the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces; else ``\\boxed 5`` (the
brace-less form); else the content of an unclosed last ``\\boxed{`` up to the end (a probe cut by
its token budget: ``\\boxed{12}`` may arrive as ``\\boxed{12``); else "final answer is X"; else
None (the caller then lets Math-Verify search the whole text).
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FINAL_ANSWER_RE = re.compile(r"final answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.|$|\n)", re.IGNORECASE)


def _match_braces(text: str, open_pos: int) -> int | None:
    """Index of the brace closing the one at ``open_pos`` (escaped braces ``\\{`` ignored) or None."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_box_start(text: str) -> tuple[int, int] | None:
    """(start of the command, index right after it) of the last boxed-style command, or None."""
    best = None
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        while pos != -1:
            after = pos + len(cmd)
            # \boxed must not be a prefix of a longer command name (e.g. \boxedsomething)
            if after >= len(text) or not text[after].isalpha():
                if best is None or pos > best[0]:
                    best = (pos, after)
                break
            pos = text.rfind(cmd, 0, pos)
    return best


def extract_last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``); None if absent
    or unclosed. ``extract_last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"``."""
    found = _last_box_start(text)
    if found is None:
        return None
    _, after = found
    rest = text[after:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        open_pos = after + (len(rest) - len(stripped))
        close = _match_braces(text, open_pos)
        if close is None:
            return None
        return text[open_pos + 1 : close].strip()
    if rest.startswith(" "):  # "\boxed 5" form: one token up to whitespace / $ / end
        m = re.match(r"\s+([^\s$]+)", rest)
        if m:
            return m.group(1).rstrip(".")
    return None


def extract_unclosed_boxed(text: str) -> str | None:
    """Content after the last ``\\boxed{`` when its brace is never closed (trailing ``$``, ``.`` and
    whitespace removed); None when there is no such box or the content is empty."""
    found = _last_box_start(text)
    if found is None:
        return None
    _, after = found
    rest = text[after:].lstrip()
    if not rest.startswith("{"):
        return None
    if _match_braces(rest, 0) is not None:
        return None
    content = rest[1:].strip().rstrip("$.").strip()
    return content or None


def extract_final_answer_phrase(text: str) -> str | None:
    """The X of the last "final answer is X" (without ``$`` and a trailing period), or None."""
    matches = list(_FINAL_ANSWER_RE.finditer(text))
    if not matches:
        return None
    ans = matches[-1].group(1).strip().rstrip(".")
    return ans or None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, how) with how in {"boxed", "unclosed_boxed", "final_answer_phrase", "none"}."""
    for how, fn in (
        ("boxed", extract_last_boxed),
        ("unclosed_boxed", extract_unclosed_boxed),
        ("final_answer_phrase", extract_final_answer_phrase),
    ):
        ans = fn(text)
        if ans is not None:
            return ans, how
    return None, "none"
