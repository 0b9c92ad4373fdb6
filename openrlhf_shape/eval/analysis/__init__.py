"""The paper's analyses (section 5, appendix B.3/B.4) from training metrics and eval reports."""

from openrlhf_shape.eval.analysis.report import analyze

__all__ = ["analyze"]
