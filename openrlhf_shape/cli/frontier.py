"""``openrlhf-shape frontier``: keep the training problems a policy solves sometimes.

    openrlhf-shape frontier --model demo --benchmark train=openrlhf_shape/data/bundled_math_train.jsonl \\
        --input_key question --preset cpu --n_samples 8 --band 0.1 0.7 --out_dir runs/frontier \\
        --out data/train_frontier.jsonl

Takes every ``eval`` flag (the sampling, the prompt template, engines; results in ``--out_dir`` resume),
samples each problem ``--n_samples`` times, and writes the rows whose pass rate lies in ``--band`` to
``--out`` with their measured ``pass_rate`` (openrlhf_shape/eval/frontier.py).
"""

from __future__ import annotations

import argparse

from openrlhf_shape.cli import evaluate as eval_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    eval_cli.add_arguments(p)
    p.add_argument("--band", nargs=2, type=float, default=[0.1, 0.7], metavar=("LOW", "HIGH"),
                   help="keep problems whose pass rate lies in [LOW, HIGH] (default 0.1 0.7)")
    p.add_argument("--out", required=True, help="the filtered prompt file (.jsonl), with pass_rate per row")


def run(args: argparse.Namespace) -> int:
    from openrlhf_shape.data.prompts import bundled_math_path
    from openrlhf_shape.eval.data import read_rows
    from openrlhf_shape.eval.frontier import select_frontier, write_jsonl_atomic
    from openrlhf_shape.eval.runner import evaluate
    from openrlhf_shape.eval.store import ResultStore
    from openrlhf_shape.eval.config import fingerprint

    if len(args.benchmark) != 1:
        raise SystemExit("frontier: pass exactly one --benchmark NAME=FILE (the training set)")
    if args.model == "demo":
        from openrlhf_shape.trainer.setup import resolve_model_dir

        args.model = resolve_model_dir("demo")
    name, source = args.benchmark[0].split("=", 1)
    if source.startswith("bundled:"):
        source = bundled_math_path(source.split(":", 1)[1] or None)
        args.benchmark = [f"{name}={source}"]
    cfg = eval_cli.config_from_args(args)
    evaluate(cfg)
    bench = cfg.benchmarks[0]
    store = ResultStore(cfg.out_dir, bench.name, fingerprint(cfg, bench))
    rows = read_rows(bench.source)
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    sel = select_frontier(rows, store.done.values(), tuple(args.band))
    write_jsonl_atomic(sel.rows, args.out)
    print(sel.summary())
    print(f"wrote {args.out}")
    return 0
