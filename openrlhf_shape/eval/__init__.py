"""Evaluation (avg@N pass@1, appendix B.1.2) and the paper's analysis figures (section 5).

Public API::

    evaluate(cfg: EvalConfig) -> EvalReport
    analyze(run_dirs: list[str], out_dir: str, labels: list[str] | None = None, **kw) -> str  # report path

Names are imported lazily so that ``import openrlhf_shape.eval.metrics`` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BenchmarkSpec": "openrlhf_shape.eval.config",
    "EvalConfig": "openrlhf_shape.eval.config",
    "PRESETS": "openrlhf_shape.eval.config",
    "EvalReport": "openrlhf_shape.eval.report",
    "BenchmarkResult": "openrlhf_shape.eval.report",
    "ProblemResult": "openrlhf_shape.eval.metrics",
    "bootstrap_ci": "openrlhf_shape.eval.metrics",
    "evaluate": "openrlhf_shape.eval.runner",
    "analyze": "openrlhf_shape.eval.analysis",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'openrlhf_shape.eval' has no attribute {name!r}")
