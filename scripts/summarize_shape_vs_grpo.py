"""Build docs/results/shape_vs_grpo.{md,json} (+ figures) from the run directories of scripts/shape_vs_grpo.sh.

    python scripts/summarize_shape_vs_grpo.py runs/shape_vs_grpo --frontier FILE --out docs/results \
        [--notes docs/results/shape_vs_grpo/notes.md]

Run directories are named ``<arm>-s<seed>`` (arms: grpo, shape, shape-gn, shape-g07, shape-gns). Every run found is
listed, finished or not; no seed is dropped. The pooled table takes, per arm, the runs that evaluated a
step (the mean over seeds and held-out problems, two-level bootstrap CIs, eval/pooling.py); the
differences pair seed i of an arm with seed i of its reference (GRPO; the paper-form SHAPE for the gamma_min 0.7
check), problem by problem. The instruments (shaping over
outcome, the advantage of wrong and of correct responses, the alarm) are per-step means over each arm's
seeds from metrics.jsonl. ``--notes`` is the verdict's reasoning, written by a person after reading the
numbers, and is included as is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from openrlhf_shape.eval.analysis.runs import read_metrics, saved_value
from openrlhf_shape.eval.pooling import eval_steps, paired_difference, pool_runs, read_problem_results

ARMS = {  # directory prefix -> label
    "grpo": "GRPO",
    "shape": "SHAPE (paper form)",
    "shape-gn": "SHAPE + group_norm outcome",
    "shape-g07": "SHAPE gamma_min 0.7 (mechanism check)",
    "shape-gns": "SHAPE + group_norm_scaled outcome (one seed)",
}
# (arm, its reference), paired on the seeds both have: every SHAPE form against GRPO, and the gamma_min 0.7
# check against the paper-form SHAPE at 0.9 (the paper's ablation: -6.3 points, -26% tokens)
COMPARED = (("shape", "grpo"), ("shape-gn", "grpo"), ("shape-gns", "grpo"), ("shape-g07", "shape"))
INSTRUMENTS = ("rollout/accuracy", "rollout/response_length/mean", "shape/shaping_to_outcome",
               "adv/wrong/mean", "adv/correct/mean", "shape/gamma/mean", "shape/length_tax/mean",
               "shape/sign_reversal_rate", "alarm/length_collapse")
PAPER = "the paper: SHAPE +2.6 to +3.8 points over GRPO at 23-32% fewer tokens; gamma_min 0.7: -6.3 points, -26% tokens"


def find_runs(root: str) -> dict[str, dict[int, str]]:
    """arm -> seed -> run directory, for every ``<arm>-s<seed>`` directory under ``root``."""
    found: dict[str, dict[int, str]] = {}
    for name in sorted(os.listdir(root)):
        m = re.fullmatch(r"(.+)-s(\d+)", name)
        if m and m.group(1) in ARMS and os.path.isdir(os.path.join(root, name)):
            found.setdefault(m.group(1), {})[int(m.group(2))] = os.path.join(root, name)
    return found


def run_status(run_dir: str) -> dict[str, Any]:
    """Steps done and planned, wall seconds, the evals it has, and the steps its alarm fired."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    info: dict[str, Any] = {}
    if os.path.exists(os.path.join(run_dir, "run.json")):
        with open(os.path.join(run_dir, "run.json")) as f:
            info = json.load(f)
    planned = saved_value(info.get("config", {}), "train.num_steps", "trainer.num_steps") if info else None
    # the commit of each segment of the run (run.json; older archives: commit.txt, written at archive time)
    code = [c["commit"][:7] + ("+dirty" if c.get("dirty") else "") for c in info.get("code", []) if c.get("commit")]
    if not code and os.path.exists(os.path.join(run_dir, "commit.txt")):
        with open(os.path.join(run_dir, "commit.txt")) as f:
            code = [f.read().strip()[:7]]
    train = [r for r in rows if r["step"] > 0 and "rollout/accuracy" in r]
    heldout = {step: _mean_pass_rate(run_dir, step) for step in eval_steps(run_dir)}
    return {"dir": run_dir, "steps": train[-1]["step"] if train else 0, "planned": planned, "code": code,
            "finished": os.path.exists(os.path.join(run_dir, "summary.json")),
            "train_seconds": round(sum(r.get("time/step", 0.0) for r in train), 1),
            "evals": sorted(heldout),
            "heldout": heldout,
            "alarm_steps": [r["step"] for r in train if r.get("alarm/length_collapse")],
            "series": {k: [r.get(k) for r in train] for k in INSTRUMENTS}}


def _mean_pass_rate(run_dir: str, step: int) -> float:
    """The run's held-out avg@N at ``step`` (mean over problems of each problem's pass rate)."""
    rows = read_problem_results(run_dir, step).values()
    return sum(r["pass_rate"] for r in rows) / max(len(rows), 1)


def arm_series(statuses: list[dict[str, Any]], key: str) -> list[float | None]:
    """Per-step mean of ``key`` over the arm's runs (None where no run has the step)."""
    n = max((len(s["series"][key]) for s in statuses), default=0)
    out = []
    for i in range(n):
        vals = [s["series"][key][i] for s in statuses if i < len(s["series"][key]) and s["series"][key][i] is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def plot(runs: dict[str, dict[int, str]], statuses: dict[str, dict[int, dict]], path: str) -> None:
    """Held-out accuracy per eval step (pooled per seed) and training length per step, every seed drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "#7f7f7f", "shape": "#d62728", "shape-gn": "#ff7f0e", "shape-g07": "#9467bd", "shape-gns": "#2ca02c"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm, seeds in runs.items():
        for j, (seed, d) in enumerate(sorted(seeds.items())):
            label = ARMS[arm] if j == 0 else None
            steps = eval_steps(d)
            if steps:
                accs = [100 * pool_runs([d], s, n_boot=1).accuracy for s in steps]
                axes[0].plot(steps, accs, marker="o", color=colors[arm], alpha=0.8, label=label)
            st = statuses[arm][seed]["series"]
            x = list(range(1, len(st["rollout/response_length/mean"]) + 1))
            axes[1].plot(x, st["rollout/response_length/mean"], color=colors[arm], alpha=0.7, label=label)
            axes[2].plot(x, st["rollout/accuracy"], color=colors[arm], alpha=0.7, label=label)
    for ax, y in zip(axes, ("held-out avg@8 pass@1 (%)", "training mean response tokens", "training accuracy")):
        ax.set_xlabel("training step")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M on the frontier-filtered training set; every seed drawn", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _heldout_cell(heldout: dict[int, float]) -> str:
    """``step 0: 15.8%, 6: 27.3%, 12: 20.9%`` (the alarm's column beside it says whether lengths collapsed)."""
    return ", ".join(f"{'step ' if i == 0 else ''}{step}: {100 * acc:.1f}%" for i, (step, acc) in enumerate(sorted(heldout.items()))) or "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def build(root: str, frontier: str, out: str, notes: str | None) -> dict[str, Any]:
    runs = find_runs(root)
    if "grpo" not in runs:
        raise SystemExit(f"{root}: no grpo-s<seed> run directories (run scripts/shape_vs_grpo.sh first)")
    statuses = {arm: {s: run_status(d) for s, d in seeds.items()} for arm, seeds in runs.items()}
    with open(frontier) as f:
        kept = [json.loads(line) for line in f if line.strip()]
    rates = sorted(r["pass_rate"] for r in kept)

    lines = ["# SHAPE against GRPO on the CPU demo (three seeds, frontier-filtered training set)", "",
             "Generated by `python scripts/summarize_shape_vs_grpo.py` from the run directories of "
             "`bash scripts/shape_vs_grpo.sh` (configs/cpu-learn.yaml: 12 steps x 8 prompts x 4 samples, "
             "lr 2e-5, K 4, m 4; held-out: the 100 bundled test problems x 8 samples at T 0.6).", "",
             f"Training set: `{frontier}`, {len(kept)} of the 400 bundled training problems whose base-policy "
             f"pass rate (8 samples at the rollouts' T 1.0) lies in [0.1, 0.7]; median pass rate "
             f"{rates[len(rates) // 2]:.3f}." if rates else "", "", "## Every run", "",
             "| arm | seed | steps | finished | training seconds | held-out avg@8 at each eval | alarm fired at | code |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, seeds in runs.items():
        for s, st in sorted(statuses[arm].items()):
            lines.append(f"| {ARMS[arm]} | {s} | {st['steps']}/{st['planned'] if st['planned'] is not None else '?'} | {'yes' if st['finished'] else 'NO'} | "
                         f"{st['train_seconds']:.0f} | {_heldout_cell(st['heldout'])} | {st['alarm_steps'] or '-'} | {', '.join(st['code']) or '?'} |")

    pooled: dict[str, list[dict]] = {}
    lines += ["", "## Held-out accuracy and length, seeds pooled", "",
              "| arm | step | seeds | avg@8 pass@1 [95% CI] | per seed | mean tokens [95% CI] | per seed |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, seeds in runs.items():
        dirs = [seeds[s] for s in sorted(seeds)]
        steps = sorted(set.union(*(set(eval_steps(d)) for d in dirs)))
        for step in steps:
            have = [d for d in dirs if step in eval_steps(d)]
            p = pool_runs(have, step)
            pooled.setdefault(arm, []).append({"step": step, **p.__dict__})
            lines.append(f"| {ARMS[arm]} | {step} | {p.runs} | {_pct(p.accuracy)}% [{_pct(p.accuracy_ci[0])}, "
                         f"{_pct(p.accuracy_ci[1])}] | {', '.join(_pct(a) for a in p.per_run_accuracy)} | "
                         f"{p.length:.1f} [{p.length_ci[0]:.1f}, {p.length_ci[1]:.1f}] | "
                         f"{', '.join(f'{x:.1f}' for x in p.per_run_length)} |")

    diffs: dict[str, dict] = {}
    lines += ["", "## Differences, paired by seed and problem, at every common eval after step 0", "",
              f"({PAPER}.)", "", "| arm | minus | step | pairs | accuracy difference, points [95% CI] | tokens, arm / reference [95% CI] |",
              "| --- | --- | --- | --- | --- | --- |"]
    for arm, ref in COMPARED:
        if arm not in runs or ref not in runs:
            continue
        seeds = sorted(set(runs[arm]) & set(runs[ref]))
        common = [s for s in seeds if set(eval_steps(runs[arm][s])) & set(eval_steps(runs[ref][s]))]
        if not common:
            continue
        steps = set.intersection(*(set(eval_steps(runs[a][s])) for s in common for a in (arm, ref)))
        by_step = []
        for step in sorted(x for x in steps if x > 0):  # the middle of training too: the last eval alone hides the path
            d = paired_difference([runs[ref][s] for s in common], [runs[arm][s] for s in common], step)
            by_step.append(d.__dict__)
            lines.append(f"| {ARMS[arm]} | {ARMS[ref]} | {step} | {d.runs} | {100 * d.accuracy:+.1f} [{100 * d.accuracy_ci[0]:+.1f}, "
                         f"{100 * d.accuracy_ci[1]:+.1f}] | {d.length_ratio:.2f} [{d.length_ratio_ci[0]:.2f}, "
                         f"{d.length_ratio_ci[1]:.2f}] |")
        if by_step:  # top level: the last common eval
            diffs[arm] = {"reference": ref, "seeds": common, **by_step[-1], "by_step": by_step}

    lines += ["", "## Instruments, per training step (mean over each arm's seeds)", ""]
    series = {arm: {k: arm_series(list(statuses[arm].values()), k) for k in INSTRUMENTS} for arm in runs}
    for k in INSTRUMENTS:
        lines += [f"`{k}`:", "", "| arm | " + " | ".join(str(i + 1) for i in range(12)) + " |",
                  "| --- |" + " --- |" * 12]
        for arm in runs:
            vals = series[arm][k]
            fmt = ".3f" if k == "shape/length_tax/mean" else ".2f"  # in units of R: about 0.01
            lines.append(f"| {ARMS[arm]} | " + " | ".join("-" if v is None else format(v, fmt) for v in vals[:12]) + " |")
        lines.append("")
    lines += ["![curves](shape_vs_grpo/curves.png)", ""]
    if notes:
        with open(notes) as f:
            lines += ["## Verdict", "", f.read().strip(), ""]

    os.makedirs(os.path.join(out, "shape_vs_grpo"), exist_ok=True)
    plot(runs, statuses, os.path.join(out, "shape_vs_grpo", "curves.png"))
    data = {"runs": {a: {str(s): st for s, st in v.items()} for a, v in statuses.items()}, "pooled": pooled,
            "differences": diffs, "instruments": series, "frontier": {"file": frontier, "kept": len(kept)}}
    for name, text in (("shape_vs_grpo.md", "\n".join(lines) + "\n"), ("shape_vs_grpo.json", json.dumps(data, indent=1))):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="directory holding <arm>-s<seed> run directories")
    ap.add_argument("--frontier", required=True, help="the filtered training file the runs used")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--notes", default=None, help="markdown with the verdict's reasoning (included as is)")
    args = ap.parse_args(argv)
    notes = args.notes
    if notes is None and os.path.exists(os.path.join(args.out, "shape_vs_grpo", "notes.md")):
        notes = os.path.join(args.out, "shape_vs_grpo", "notes.md")
    build(args.root, args.frontier, args.out, notes)
    print(f"wrote {os.path.join(args.out, 'shape_vs_grpo.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
