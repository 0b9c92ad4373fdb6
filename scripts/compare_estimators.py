"""The CPU comparison experiment: GRPO, MRT and SHAPE on the embedded default, same seed/data/steps.

For each estimator: train from configs/cpu-smoke.yaml (its HF export lands in <out>/<est>/hf), then
evaluate base and trained policies on held-out bundled test problems (avg@N pass@1, Math-Verify,
bootstrap CIs) and write the comparison report (figures + tables) with ``analyze``.

    .venv/bin/python scripts/compare_estimators.py --out runs/compare [--steps 4] [--eval_problems 48] [--n 4]

A few CPU steps of a 135M model move accuracy by less than the confidence intervals: the report
prints the intervals so that is visible. It is a plumbing and metrics comparison, not a result.
"""

from __future__ import annotations

import argparse
import json
import os

from openrlhf_shape.data.prompts import bundled_math_path
from openrlhf_shape.eval import BenchmarkSpec, EvalConfig, analyze, evaluate
from openrlhf_shape.rollout.engine import EngineConfig
from openrlhf_shape.config import load_config
from openrlhf_shape.trainer.ppo_trainer import resolve_model_dir, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The training prompt (configs/cpu-smoke.yaml's input_template), so base and trained policies see the same task.
PROMPT = "{question}\nGive only the final answer, in the form \\boxed{answer}."


def _eval(model: str, out_dir: str, args) -> None:
    bench = BenchmarkSpec(name="bundled_test", source=bundled_math_path("test"), input_key="question",
                          label_key="answer", n_samples=args.n)
    cfg = EvalConfig(model_path=model, benchmarks=[bench], out_dir=out_dir, preset="cpu", n_samples=args.n,
                     max_new_tokens=args.max_new_tokens, limit=args.eval_problems, engine=EngineConfig(seed=args.seed, max_model_len=None),
                     prompt_template=PROMPT)
    evaluate(cfg)  # writes report.md / report.json into out_dir (resumable)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/compare")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--estimators", default="grpo,mrt,shape")
    ap.add_argument("--eval_problems", type=int, default=48)
    ap.add_argument("--n", type=int, default=4, help="samples per eval problem (avg@n)")
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42)
    args, extra = ap.parse_known_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    base_dir = os.path.join(out, "base_eval")
    _eval(resolve_model_dir("demo"), base_dir, args)
    runs = []
    for est in args.estimators.split(","):
        run_dir = os.path.join(out, est)
        cfg = load_config(os.path.join(ROOT, "configs", "cpu-smoke.yaml"), [
            "--algo.advantage.estimator", est, "--train.num_steps", str(args.steps),
            "--ckpt.output_dir", run_dir, "--train.seed", str(args.seed), "--ckpt.resume", "auto",
            "--eval.steps", "0", "--ckpt.save_hf", "true", *extra])
        run_training(cfg)
        _eval(os.path.join(run_dir, "hf"), os.path.join(run_dir, "eval"), args)
        runs.append(run_dir)
    report = analyze(runs, os.path.join(out, "report"), labels=args.estimators.split(","), base_eval=base_dir)
    print(f"comparison report: {report}")
    for name, folder in [("base", base_dir)] + [(r.rsplit(os.sep, 1)[-1], os.path.join(r, "eval")) for r in runs]:
        with open(os.path.join(folder, "report.md")) as f:
            overall = [line for line in f if line.startswith("| **Overall")]
        print(f"{name:>6}: {overall[0].strip() if overall else '(no overall row)'}")
    for r in runs:
        with open(os.path.join(r, "metrics.jsonl")) as f:
            steps = [json.loads(line)["time/step"] for line in f]
        print(f"{os.path.basename(r):>6}: mean step {sum(steps) / len(steps):.1f} s over {len(steps)} steps")


if __name__ == "__main__":
    main()
