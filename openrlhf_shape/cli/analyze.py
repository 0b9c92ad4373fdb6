"""``openrlhf-shape analyze``: the paper's analysis figures from training runs (and their evals).

Example::

    openrlhf-shape analyze runs/grpo runs/mrt runs/shape --labels GRPO MRT SHAPE \\
        --base_eval runs/base_eval --out_dir runs/analysis
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="training run directories (run.json + metrics.jsonl)")
    p.add_argument("--out_dir", required=True, help="where the PNGs, analysis.json and report.html go")
    p.add_argument("--labels", nargs="+", default=None, help="legend name per run (default: run.json name)")
    p.add_argument("--eval_reports", nargs="+", default=None,
                   help="per run: eval report.json (or dir) of its final model; '-' keeps the default "
                        "(default: <run>/eval/report.json when present)")
    p.add_argument("--base_eval", default=None, help="base-model eval report for fig. 9 difficulty D = 1 - pass rate")
    p.add_argument("--window", type=int, default=10, help="steps in the first/last windows (fig. 6, fig. 10)")
    p.add_argument("--smooth", type=int, default=5, help="trailing-mean window of the smoothed curves")
    p.add_argument("--eps", type=float, default=0.03, help="floor shift of the appendix B.3 normalisation")
    p.add_argument("--benchmarks", nargs="+", default=None, help="eval benchmarks shown in fig. 10 (default: all)")


def run(args: argparse.Namespace) -> int:
    from openrlhf_shape.eval.analysis import analyze

    reports = None if args.eval_reports is None else [None if r == "-" else r for r in args.eval_reports]
    path = analyze(
        args.run_dirs,
        args.out_dir,
        args.labels,
        eval_reports=reports,
        base_eval=args.base_eval,
        window=args.window,
        smooth=args.smooth,
        eps=args.eps,
        benchmarks=args.benchmarks,
    )
    print(f"wrote {path}")
    return 0
