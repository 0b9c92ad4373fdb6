"""Who imports whom in the package, as the layer test (``tests/test_layers.py``) and the boundary tests read it.

An edge is every import statement (at the top, inside a function, under ``TYPE_CHECKING``; relative ones resolved)
and every string that names a package module, ``"openrlhf_shape.x.y"`` or ``"openrlhf_shape.x.y:Name"``: what
``importlib``, a Ray actor or a subprocess will import, an edge the import statements do not show.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "openrlhf_shape"
PKG_DIR = Path(__file__).resolve().parents[2] / PACKAGE
_MODULE_STRING = re.compile(rf"{PACKAGE}(\.[A-Za-z_]\w*)+(:[\w.]+)?")


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` (``how``: ``import`` or ``string``). ``target`` is a package module
    (dotted; a package is its ``__init__``) or, outside the package, the top-level name imported."""

    source: str
    target: str
    line: int
    how: str


def package_modules(root: Path = PKG_DIR) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root`` (the package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` (``a.b.C``, ``a.b:C``) lives in: its longest prefix that is a module."""
    name = name.split(":")[0]
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, package: str, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(target, how) of one AST node; ``package``: the package a relative import starts from."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        mod = ".".join(base + ([node.module] if node.module else []))
        subs = [f"{mod}.{a.name}" for a in node.names]
        # `from pkg import sub` imports the submodule; any other name comes from pkg itself
        names = [s for s in subs if s in modules] + ([mod] if any(s not in modules for s in subs) else [])
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.fullmatch(node.value):
        return [(t, "string") for t in [_resolve(node.value, modules)] if t]
    else:
        return []
    out = []
    for name in names:
        inside = name == PACKAGE or name.startswith(PACKAGE + ".")
        target = _resolve(name, modules) if inside else name.split(".")[0]
        if target:
            out.append((target, "import"))
    return out


def edges(root: Path = PKG_DIR) -> list[Edge]:
    """Every edge of every module under ``root``, self-references left out."""
    modules, out = package_modules(root), []
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            out += [Edge(source, t, node.lineno, how) for t, how in _targets(node, package, modules) if t != source]
    return out
