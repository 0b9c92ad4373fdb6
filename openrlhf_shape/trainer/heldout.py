"""Held-out metrics of the in-training eval: avg@N pass@1 and mean response length, with 95% CIs.

The arithmetic is the eval package's (``openrlhf_shape.eval.metrics``), so a number logged during
training means the same as one from ``openrlhf-shape eval``: N samples per problem, pass rate per
problem, mean over problems; the interval is a percentile bootstrap over problems. The scores are the
training answers' (``ShapeTrainer.evaluate``): Math-Verify's, as that tool's, or a reward function's
(``--reward.remote_url``) ``scores``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from openrlhf_shape.eval.metrics import ProblemResult, avg_at_n, bootstrap_ci, mean_tokens


def group_results(prompt_index: Sequence[int], scores: Sequence[float], num_tokens: Sequence[int],
                  finish_reasons: Sequence[str] | None = None) -> list[ProblemResult]:
    """One :class:`ProblemResult` per problem from flat per-response lists ([responses] each).

    ``prompt_index[i]`` names the problem of response ``i``; problems come back in index order.
    """
    if not len(prompt_index) == len(scores) == len(num_tokens):
        raise ValueError(f"{len(prompt_index)} prompt indices, {len(scores)} scores, {len(num_tokens)} token counts")
    by_problem: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompt_index):
        by_problem[int(p)].append(i)
    reasons = list(finish_reasons) if finish_reasons is not None else None
    return [
        ProblemResult(problem_id=str(p), scores=[float(scores[i]) for i in idx],
                      num_tokens=[int(num_tokens[i]) for i in idx],
                      finish_reasons=[str(reasons[i]) for i in idx] if reasons is not None else [])
        for p, idx in sorted(by_problem.items())
    ]


def heldout_metrics(problems: Sequence[ProblemResult], *, n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """``eval/*`` metrics of one held-out pass.

    accuracy: avg@N pass@1 in [0, 1]; response_length: generated tokens per response. The CIs
    are 95% percentile bootstraps over problems (accuracy from per-problem pass rates, length from
    per-problem mean tokens). ``eval/truncated_rate`` is the share of responses that hit the token limit.
    """
    acc_lo, acc_hi = bootstrap_ci([p.pass_rate for p in problems], n_boot=n_boot, seed=seed)
    len_lo, len_hi = bootstrap_ci([p.mean_tokens for p in problems], n_boot=n_boot, seed=seed)
    responses = sum(p.n for p in problems)
    return {
        "eval/accuracy": avg_at_n(problems),
        "eval/accuracy_ci_low": acc_lo,
        "eval/accuracy_ci_high": acc_hi,
        "eval/response_length/mean": mean_tokens(problems),
        "eval/response_length_ci_low": len_lo,
        "eval/response_length_ci_high": len_hi,
        "eval/truncated_rate": float(sum(p.truncated for p in problems) / responses),
        "eval/num_problems": float(len(problems)),
        "eval/samples_per_problem": float(responses / len(problems)),
    }

