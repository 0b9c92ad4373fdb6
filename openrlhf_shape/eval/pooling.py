"""Held-out results of several training runs of one arm (seeds), pooled per problem.

The trainer writes every held-out eval's per-problem results to ``<run_dir>/evals/step_XXXXXX.jsonl``
(``trainer/heldout.py``). For an arm trained with k seeds, :func:`pool_runs` takes the [runs, problems]
matrices of pass rates and mean lengths at one step. The point estimate is the mean over runs and
problems. The 95% interval is a two-level percentile bootstrap: each draw resamples the runs (seeds)
with replacement, then the problems with replacement, so both the training-seed spread and the
finite problem set widen it (with 3 seeds the seed level is coarse: it is what 3 seeds can say).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from openrlhf_shape.eval.metrics import ProblemResult

EVAL_DIR = "evals"  # <run_dir>/evals/step_XXXXXX.jsonl: one row per held-out problem


def write_problem_results(run_dir: str, step: int, problems: list[ProblemResult]) -> str:
    """Each problem's pass rate and mean length at ``step`` (atomic JSONL; the trainer's held-out eval
    calls it): what pools seeds and runs per problem, which a step's summary numbers cannot."""
    from openrlhf_shape.eval.frontier import write_jsonl_atomic

    path = os.path.join(run_dir, EVAL_DIR, f"step_{step:06d}.jsonl")
    write_jsonl_atomic([{"problem_id": p.problem_id, "pass_rate": p.pass_rate, "mean_tokens": p.mean_tokens,
                         "n": p.n, "truncated": p.truncated} for p in problems], path)
    return path


def read_problem_results(run_dir: str, step: int) -> dict[str, dict]:
    """problem_id -> {"pass_rate", "mean_tokens", "n", ...} of ``run_dir``'s eval at ``step``."""
    path = os.path.join(run_dir, EVAL_DIR, f"step_{step:06d}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no held-out eval at step {step} in {run_dir} (evals ran at "
                                f"{eval_steps(run_dir) or 'no step'})")
    with open(path) as f:
        return {row["problem_id"]: row for row in map(json.loads, f)}


def eval_steps(run_dir: str) -> list[int]:
    """Steps with per-problem held-out results in ``run_dir``."""
    d = os.path.join(run_dir, EVAL_DIR)
    if not os.path.isdir(d):
        return []
    return sorted(int(f[5:11]) for f in os.listdir(d) if f.startswith("step_") and f.endswith(".jsonl"))


@dataclass
class Pooled:
    """One arm at one step: means over runs and problems, two-level bootstrap 95% intervals."""

    step: int
    runs: int
    problems: int
    accuracy: float
    accuracy_ci: tuple[float, float]
    length: float
    length_ci: tuple[float, float]
    per_run_accuracy: list[float]
    per_run_length: list[float]


def _two_level_ci(m: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of the mean of ``m`` [runs, problems], runs then problems resampled."""
    rng = np.random.default_rng(seed)
    r, p = m.shape
    runs = rng.integers(0, r, size=(n_boot, r))
    probs = rng.integers(0, p, size=(n_boot, p))
    means = np.array([m[np.ix_(runs[b], probs[b])].mean() for b in range(n_boot)])
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def pool_runs(run_dirs: list[str], step: int, *, n_boot: int = 2000, seed: int = 0) -> Pooled:
    """Pool ``run_dirs`` (one arm, several seeds) at ``step``; every run must have evaluated the same
    problems."""
    if not run_dirs:
        raise ValueError("pool_runs needs at least one run directory")
    results = [read_problem_results(d, step) for d in run_dirs]
    ids = sorted(results[0])
    for d, res in zip(run_dirs[1:], results[1:]):
        if sorted(res) != ids:
            raise ValueError(f"{d} evaluated other problems at step {step} than {run_dirs[0]} "
                             f"({len(res)} vs {len(ids)}): pooling needs the same held-out set")
    acc = np.array([[res[i]["pass_rate"] for i in ids] for res in results], dtype=np.float64)
    length = np.array([[res[i]["mean_tokens"] for i in ids] for res in results], dtype=np.float64)
    return Pooled(step=step, runs=len(run_dirs), problems=len(ids), accuracy=float(acc.mean()),
                  accuracy_ci=_two_level_ci(acc, n_boot, seed), length=float(length.mean()),
                  length_ci=_two_level_ci(length, n_boot, seed + 1),
                  per_run_accuracy=[float(x) for x in acc.mean(axis=1)],
                  per_run_length=[float(x) for x in length.mean(axis=1)])


@dataclass
class Difference:
    """Arm B minus arm A at one step, paired by seed (the i-th run of each) and by problem."""

    step: int
    runs: int
    problems: int
    accuracy: float  # points of pass rate (fraction), B - A
    accuracy_ci: tuple[float, float]
    length_ratio: float  # mean tokens of B over A
    length_ratio_ci: tuple[float, float]


def paired_difference(a_dirs: list[str], b_dirs: list[str], step: int, *, n_boot: int = 2000,
                      seed: int = 0) -> Difference:
    """B - A held-out accuracy and B / A mean length at ``step``, runs paired in order (seed i of A with
    seed i of B: same data order and same held-out problems). The interval resamples the pairs, then the
    problems, as :func:`pool_runs` does; pairing removes the problems' own difficulty from the spread,
    which is what makes a difference narrower than the two arms' intervals side by side."""
    if len(a_dirs) != len(b_dirs) or not a_dirs:
        raise ValueError(f"paired_difference needs the same number of runs per arm, got {len(a_dirs)} and {len(b_dirs)}")
    a = [read_problem_results(d, step) for d in a_dirs]
    b = [read_problem_results(d, step) for d in b_dirs]
    ids = sorted(a[0])
    for d, res in zip(a_dirs + b_dirs, a + b):
        if sorted(res) != ids:
            raise ValueError(f"{d} evaluated other problems at step {step} than {a_dirs[0]}: pairing needs the same held-out set")

    def mat(results: list[dict], key: str) -> np.ndarray:
        return np.array([[res[i][key] for i in ids] for res in results], dtype=np.float64)

    diff = mat(b, "pass_rate") - mat(a, "pass_rate")
    la, lb = mat(a, "mean_tokens"), mat(b, "mean_tokens")
    rng = np.random.default_rng(seed)
    r, p = diff.shape
    ratios, diffs = [], []
    for _ in range(n_boot):
        ix = np.ix_(rng.integers(0, r, r), rng.integers(0, p, p))
        diffs.append(diff[ix].mean())
        ratios.append(lb[ix].mean() / max(la[ix].mean(), 1e-9))
    return Difference(step=step, runs=r, problems=p, accuracy=float(diff.mean()),
                      accuracy_ci=tuple(float(x) for x in np.percentile(diffs, [2.5, 97.5])),
                      length_ratio=float(lb.mean() / max(la.mean(), 1e-9)),
                      length_ratio_ci=tuple(float(x) for x in np.percentile(ratios, [2.5, 97.5])))


def pooled_table(arms: dict[str, list[str]], steps: list[int] | None = None) -> str:
    """Markdown: per arm and step, pooled accuracy and length with intervals and the per-seed values.
    ``steps``: None = the steps every run of every arm evaluated."""
    if steps is None:
        common = None
        for dirs in arms.values():
            for d in dirs:
                s = set(eval_steps(d))
                common = s if common is None else common & s
        steps = sorted(common or [])
    lines = ["| arm | step | seeds | held-out accuracy [95% CI] | per seed | mean tokens [95% CI] | per seed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, dirs in arms.items():
        for step in steps:
            p = pool_runs(dirs, step)
            lines.append(
                f"| {name} | {step} | {p.runs} | {100 * p.accuracy:.1f}% [{100 * p.accuracy_ci[0]:.1f}, "
                f"{100 * p.accuracy_ci[1]:.1f}] | {', '.join(f'{100 * a:.1f}' for a in p.per_run_accuracy)} | "
                f"{p.length:.1f} [{p.length_ci[0]:.1f}, {p.length_ci[1]:.1f}] | "
                f"{', '.join(f'{x:.1f}' for x in p.per_run_length)} |")
    return "\n".join(lines) + "\n"
