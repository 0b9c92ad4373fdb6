"""The package's layers, as one table of floors, and the one test of them.

A room is a folder of ``openrlhf_shape/`` or one of its top-level modules (``__init__`` is the package's own). A room
imports only from rooms on floors below its own, and no file imports itself back through others (no circle between
files, inside a room or across rooms). The edges are every import (at the top, inside a function, under
``TYPE_CHECKING``) and every string naming a package module, which importlib, a Ray actor or a subprocess imports
(``tests/support/imports.py``). The package imports nothing from ``tests/``. The picture in ``docs/architecture.md``
("Who imports whom") is this table, drawn by :func:`picture`; the last tests plant an upward import, a circle and an
importlib edge in a copy of the package and see each reported.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.imports import PACKAGE, PKG_DIR, Edge, edges, package_modules

REPO = PKG_DIR.parent
# floor -> its rooms; a room imports only from lower floors
FLOORS: dict[int, tuple[str, ...]] = {
    5: ("cli",),
    4: ("planner", "trainer"),
    3: ("cluster", "config", "eval", "testing"),  # eval: its model loader exports Megatron checkpoints
    2: ("megatron", "zero"),
    1: ("actor", "rollout"),
    0: ("__init__", "algorithms", "batch", "busy_clock", "checkpoint_dir", "data", "platform", "rewards", "rng",
        "startup_gc", "weight_sync"),
}
FLOOR_OF = {room: floor for floor, rooms in FLOORS.items() for room in rooms}


def room(module: str) -> str | None:
    """The room of a package module (None outside the package)."""
    parts = module.split(".")
    return None if parts[0] != PACKAGE else parts[1] if len(parts) > 1 else "__init__"


def upward(found: list[Edge]) -> list[str]:
    """The edges from a room to one on its own floor or above, as ``source:line -> target (how)``."""
    return [f"{e.source}:{e.line} -> {e.target} ({e.how}; floor {FLOOR_OF[room(e.source)]} -> "
            f"{FLOOR_OF[room(e.target)]})" for e in found if room(e.target) not in (None, room(e.source))
            and FLOOR_OF[room(e.source)] <= FLOOR_OF[room(e.target)]]


def circles(found: list[Edge]) -> list[list[str]]:
    """The circles between package modules: strongly connected sets of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in found:
        if room(e.target) is not None:
            graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def picture() -> str:
    """The table as docs/architecture.md draws it, top floor first."""
    return "\n".join(f"{floor}  " + "  ".join(FLOORS[floor]) for floor in sorted(FLOORS, reverse=True))


@pytest.fixture(scope="module")
def found() -> list[Edge]:
    return edges()


def test_every_room_has_one_floor() -> None:
    listed = [r for rooms in FLOORS.values() for r in rooms]
    assert len(listed) == len(set(listed)), "a room on two floors"
    rooms = {room(m) for m in package_modules()}
    assert rooms == set(listed), f"not in the table: {sorted(rooms - set(listed))}; gone: {sorted(set(listed) - rooms)}"


def test_rooms_import_only_from_lower_floors(found) -> None:
    assert not upward(found), "\n".join(["imports on the same floor or upward:"] + upward(found))


def test_no_circle_between_files(found) -> None:
    assert not circles(found), circles(found)


def test_the_package_imports_nothing_from_the_tests(found) -> None:
    """What ships works without a checkout's ``tests/``: no module imports ``support`` or ``tests``."""
    bad = [f"{e.source}:{e.line} -> {e.target}" for e in found if e.target in ("support", "tests")]
    assert not bad, bad


def test_the_picture_in_the_docs_is_the_table() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Who imports whom"):]
    drawn = section.split("```")[1].strip("\n")
    assert drawn == picture(), f"docs/architecture.md's picture should read:\n{picture()}"


# ---- the test fails where it should: a copy of the package with one planted edge each
def _copy(tmp_path: Path) -> Path:
    root = tmp_path / PACKAGE
    shutil.copytree(PKG_DIR, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _plant(root: Path, rel: str, code: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + "\n\n" + code)


def test_a_planted_upward_import_inside_a_function_is_caught(tmp_path) -> None:
    root = _copy(tmp_path)
    assert not upward(edges(root))
    _plant(root, "rollout/seeds.py", "def _planted():\n    from openrlhf_shape.trainer.setup import Run\n    return Run\n")
    found = upward(edges(root))
    assert len(found) == 1 and found[0].startswith(f"{PACKAGE}.rollout.seeds:")
    assert found[0].endswith(f"-> {PACKAGE}.trainer.setup (import; floor 1 -> 4)")


def test_a_planted_circle_between_two_files_of_a_room_is_caught(tmp_path) -> None:
    root = _copy(tmp_path)
    assert not circles(edges(root))
    _plant(root, "trainer/phases.py", "def _planted():\n    from openrlhf_shape.trainer import experience\n")
    assert circles(edges(root)) == [[f"{PACKAGE}.trainer.experience", f"{PACKAGE}.trainer.phases"]]
    assert not upward(edges(root))  # one room: only the circle shows it


def test_a_planted_importlib_edge_is_caught(tmp_path) -> None:
    root = _copy(tmp_path)
    assert not upward(edges(root))
    _plant(root, "weight_sync/base.py",
           "def _planted():\n    import importlib\n\n    return importlib.import_module('openrlhf_shape.cluster.runtime')\n")
    found = upward(edges(root))
    assert len(found) == 1 and f"{PACKAGE}.weight_sync.base:" in found[0]
    assert found[0].endswith(f"-> {PACKAGE}.cluster.runtime (string; floor 0 -> 3)")
