"""avg@N pass@1 arithmetic and bootstrap confidence intervals (numpy only, no I/O).

The paper (appendix B.1.2) samples N responses per problem and reports the mean accuracy:

    pass_rate(problem) = (#correct of its N samples) / N
    accuracy(benchmark) = mean over problems of pass_rate        (avg@N pass@1)

Every problem of a benchmark has the same N, so this equals the mean over all responses; token
usage is the mean number of generated tokens over all responses (truncated ones included).
"Overall" is the macro average over benchmarks (each benchmark weighs the same, as in the paper's
"Avg" column), and its confidence interval comes from a stratified bootstrap: problems are
resampled with replacement inside every benchmark, then the benchmark means are averaged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class ProblemResult:
    """All samples of one problem. ``scores``/``num_tokens`` have length N (one per response)."""

    problem_id: str
    scores: list[float]
    num_tokens: list[int]
    finish_reasons: list[str] = field(default_factory=list)
    difficulty: float | int | str | None = None  # from the data, when the data has it

    def __post_init__(self) -> None:
        if len(self.scores) == 0:
            raise ValueError(f"problem {self.problem_id!r}: no samples")
        if len(self.scores) != len(self.num_tokens):
            raise ValueError(
                f"problem {self.problem_id!r}: {len(self.scores)} scores but "
                f"{len(self.num_tokens)} token counts"
            )

    @property
    def n(self) -> int:
        return len(self.scores)

    @property
    def pass_rate(self) -> float:
        """Mean score of the N samples (scores are 0/1 from Math-Verify)."""
        return float(np.mean(np.asarray(self.scores, dtype=np.float64)))

    @property
    def mean_tokens(self) -> float:
        return float(np.mean(np.asarray(self.num_tokens, dtype=np.float64)))

    @property
    def truncated(self) -> int:
        """Responses that stopped at the token limit (finish_reason == "length")."""
        return sum(1 for r in self.finish_reasons if r == "length")


def avg_at_n(problems: Sequence[ProblemResult]) -> float:
    """avg@N pass@1 in [0, 1]: the mean of the per-problem pass rates."""
    if not problems:
        raise ValueError("avg@N of an empty benchmark")
    return float(np.mean([p.pass_rate for p in problems]))


def mean_tokens(problems: Sequence[ProblemResult]) -> float:
    """Mean generated tokens per response over every response of the benchmark."""
    if not problems:
        raise ValueError("mean tokens of an empty benchmark")
    return float(np.mean(np.concatenate([np.asarray(p.num_tokens, np.float64) for p in problems])))


def _check_boot(n_boot: int, confidence: float) -> None:
    if n_boot < 1:
        raise ValueError(f"bootstrap_samples must be >= 1, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _percentile_interval(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``values`` ([problems], one number per problem).

    Problems are resampled with replacement ``n_boot`` times with ``numpy.random.default_rng(seed)``;
    the same inputs and seed always give the same interval.
    """
    _check_boot(n_boot, confidence)
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap_ci wants a non-empty 1-D array, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    return _percentile_interval(x[idx].mean(axis=1), confidence)


def stratified_bootstrap_macro_ci(
    groups: Sequence[Sequence[float] | np.ndarray],
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """CI of the macro mean (mean over groups of each group's mean), resampling inside each group.

    ``groups``: one 1-D array per benchmark of per-problem values.
    """
    _check_boot(n_boot, confidence)
    if not groups:
        raise ValueError("stratified bootstrap of zero groups")
    rng = np.random.default_rng(seed)
    boot_means = np.zeros(n_boot, dtype=np.float64)
    for g in groups:
        x = np.asarray(g, dtype=np.float64)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"every group must be a non-empty 1-D array, got shape {x.shape}")
        idx = rng.integers(0, x.size, size=(n_boot, x.size))
        boot_means += x[idx].mean(axis=1)
    return _percentile_interval(boot_means / len(groups), confidence)
