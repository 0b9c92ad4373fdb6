"""No function in ``openrlhf_shape/`` runs over 60 lines: a function that fits a screen can be read whole.

A function's length is counted from its ``def`` line to its last line (decorators left out); a nested function's
lines count in its parent as well as on their own. This was held for the config package alone before.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "openrlhf_shape"
MAX_LINES = 60


def _long_functions() -> list[str]:
    """``path:name (lines)`` of every function over ``MAX_LINES`` lines in the package."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(PKG).as_posix()}:{node.name}"
                if lines > MAX_LINES:
                    found.append(f"{where} ({lines})")
    return found


def test_no_function_over_sixty_lines():
    long = _long_functions()
    assert not long, "split these into helpers:\n" + "\n".join(long)
