"""A Python file that is not an importable module (a script, a benchmark, an agent or reward file, one file of
OpenRLHF's installed source) loaded as a module by its path, for the tests that check what such a file computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_file(path: str | Path, name: str | None = None) -> ModuleType:
    """The module ``path`` defines, named ``name`` (default: the file's stem). It is not put in ``sys.modules``: each
    call runs the file afresh."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
