"""Build docs/results/learning_curve.{json,md} (+ figures) from learning-curve run directories.

    python scripts/summarize_learning_curve.py runs/learn-grpo runs/learn-shape --out docs/results \
        [--notes notes.md] [--command "..."] [--pool GRPO=runs/g1,runs/g2,runs/g3 SHAPE=...]

Reads each run's ``run.json`` and ``metrics.jsonl`` (written by the trainer with configs/cpu-learn.yaml):
the held-out evals (``eval/accuracy`` with ``eval/accuracy_ci_low/high``, ``eval/response_length/mean``
with its CI) at step 0 (``--eval.val_before_train``), in the middle and at the end, and the per-step
training reward. "base" is the step-0 eval, "trained" the last eval. A run whose last step is below its
``trainer.num_steps`` is marked partial. Also draws the held-out curve with CIs and runs ``analyze``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from openrlhf_shape.eval.analysis.runs import read_metrics, saved_value

FIG_DIR = "learning_curve"


def _eval_point(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": int(rec["step"]),
        "accuracy": rec["eval/accuracy"],
        "ci_low": rec["eval/accuracy_ci_low"],
        "ci_high": rec["eval/accuracy_ci_high"],
        "length": rec["eval/response_length/mean"],
        "length_ci_low": rec["eval/response_length_ci_low"],
        "length_ci_high": rec["eval/response_length_ci_high"],
        "truncated_rate": rec.get("eval/truncated_rate"),
        "num_problems": int(rec.get("eval/num_problems", 0)),
        "samples_per_problem": int(rec.get("eval/samples_per_problem", 0)),
        "eval_seconds": rec.get("time/eval"),
    }


def _mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _held_out_protocol(cfg: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides a held-out eval's numbers for a given policy (a saved config of any layout)."""
    def v(*paths: str) -> Any:
        return saved_value(cfg, *paths)

    return {"eval_data": v("eval.dataset", "data.eval_data"), "eval_max_samples": v("eval.max_samples", "data.eval_max_samples"),
            "input_template": v("data.input_template"),
            "max_new_tokens": v("rollout.max_new_tokens", "sampling.max_tokens"),
            "pretrain": v("actor.model_name_or_path", "actor.pretrain"), "seed": v("train.seed", "trainer.seed"),
            "eval_n_samples_per_prompt": v("eval.n_samples_per_prompt", "trainer.eval_n_samples_per_prompt",
                                           "trainer.eval_n_samples"),
            **{f"eval_{k}": v(f"eval.{k}", f"trainer.eval_{k}") for k in ("temperature", "top_p", "top_k")}}


def run_label(entry: dict[str, Any]) -> str | None:
    """The estimator's name, plus the outcome baseline when it is not the paper's (``shape+group_norm``)."""
    est, baseline = entry.get("estimator"), entry.get("config", {}).get("outcome_baseline")
    return f"{est}+{baseline}" if est and baseline not in (None, "none") else est


def summarize_run(run_dir: str, base_from: str | None = None) -> dict[str, Any]:
    """One estimator's entry of learning_curve.json.

    ``base_from``: another run directory whose step-0 eval is this run's base, for a run started with
    ``--eval.val_before_train false``; its held-out protocol and base model must equal this run's.
    """
    with open(os.path.join(run_dir, "run.json")) as f:
        info = json.load(f)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if base_from and not any(r["step"] == 0 for r in records):
        with open(os.path.join(base_from, "run.json")) as f:
            base_cfg = json.load(f).get("config", {})
        if _held_out_protocol(base_cfg) != _held_out_protocol(info.get("config", {})):
            raise ValueError(f"--base_from {base_from}: its held-out eval settings differ from {run_dir}'s")
        records = [r for r in read_metrics(os.path.join(base_from, "metrics.jsonl")) if r["step"] == 0] + records
    cfg = info.get("config", {})
    num_steps = int(saved_value(cfg, "train.num_steps", "trainer.num_steps", default=0))
    evals = [_eval_point(r) for r in records if "eval/accuracy_ci_low" in r]
    train = [r for r in records if r["step"] > 0 and "rollout/accuracy" in r]
    summary_path = os.path.join(run_dir, "summary.json")
    setup_s = None
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            setup_s = json.load(f).get("setup_seconds")
    step0 = [r for r in records if r["step"] == 0]
    step_s = [r["time/step"] for r in train if "time/step" in r]
    seconds = (setup_s or 0.0) + sum(r.get("time/eval", 0.0) for r in step0) + sum(step_s)
    last_step = train[-1]["step"] if train else 0
    base = evals[0] if evals and evals[0]["step"] == 0 else None
    trained = evals[-1] if evals and evals[-1]["step"] > 0 else None
    out: dict[str, Any] = {
        "estimator": info.get("estimator"),
        "run_dir": run_dir,
        "steps": last_step,
        "num_steps_planned": num_steps,
        "partial": last_step < num_steps,
        "seconds": round(seconds, 1),
        "setup_seconds": setup_s,
        "base": base,
        "trained": trained,
        "curve": evals,
        "train_reward": [r.get("rollout/reward/mean", r.get("rollout/accuracy")) for r in train],
        "train_accuracy": [r.get("rollout/accuracy") for r in train],
        "train_response_length": [r.get("rollout/response_length/mean") for r in train],
        "step_seconds_mean": _mean(step_s),
        "phase_seconds_mean": {p: _mean([r[f"time/{p}"] for r in train if f"time/{p}" in r])
                               for p in ("generate", "logprobs", "probes", "train", "sync", "eval", "checkpoint")},
        "base_from": base_from if base_from and base and not any(r["step"] == 0 for r in read_metrics(
            os.path.join(run_dir, "metrics.jsonl"))) else None,
        "bar_cleared": bool(base and trained and trained["ci_low"] > base["ci_high"]),
        "config": {"learning_rate": saved_value(cfg, "actor.adam.lr", "actor.learning_rate", "megatron.lr"),
                   "train_batch_size": saved_value(cfg, "train.batch_size", "actor.train_batch_size"),
                   "rollout_batch_size": saved_value(cfg, "rollout.batch_size", "rollout.rollout_batch_size"),
                   "n_samples_per_prompt": saved_value(cfg, "rollout.n_samples_per_prompt", "sampling.n"),
                   "max_new_tokens": saved_value(cfg, "rollout.max_new_tokens", "sampling.max_tokens"),
                   "outcome_baseline": saved_value(cfg, "shape.outcome_baseline"),
                   "seed": saved_value(cfg, "train.seed", "trainer.seed")},
    }
    return out


def plot_heldout(entries: dict[str, dict[str, Any]], path: str) -> None:
    """Held-out accuracy and mean length per eval step with 95% CI bars, one line per estimator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "#7f7f7f", "mrt": "#1f77b4", "shape": "#d62728", "shape+group_norm": "#ff7f0e"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, (name, e) in enumerate(entries.items()):
        c = e["curve"]
        if not c:
            continue
        x = [p["step"] + (i - 0.5) * 0.15 for p in c]  # a small offset so the bars do not hide each other
        for ax, key, lo, hi, scale in ((axes[0], "accuracy", "ci_low", "ci_high", 100.0),
                                       (axes[1], "length", "length_ci_low", "length_ci_high", 1.0)):
            y = [p[key] * scale for p in c]
            err = [[(p[key] - p[lo]) * scale for p in c], [(p[hi] - p[key]) * scale for p in c]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=colors.get(name, colors.get(e["estimator"])),
                        label=name.upper() + (" (partial)" if e["partial"] else ""))
    n = _samples_per_problem(entries)
    axes[0].set_ylabel(f"held-out avg@{n} pass@1 (%)")
    axes[1].set_ylabel("mean response tokens")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, 100 held-out problems x {n} samples (T 0.6), 95% bootstrap CIs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fmt_acc(p: dict[str, Any] | None) -> str:
    return f"{100 * p['accuracy']:.1f}% [{100 * p['ci_low']:.1f}, {100 * p['ci_high']:.1f}]" if p else "-"


def _fmt_len(p: dict[str, Any] | None) -> str:
    return f"{p['length']:.1f} [{p['length_ci_low']:.1f}, {p['length_ci_high']:.1f}]" if p else "-"


def _overlap(a: dict, b: dict, lo: str, hi: str) -> bool:
    return not (a[lo] > b[hi] or b[lo] > a[hi])


def _samples_per_problem(entries: dict[str, Any]) -> int:
    """N of avg@N, from the runs' own step-0/last evals (the eval's samples per problem)."""
    ns = {int(p["samples_per_problem"]) for e in entries.values() for p in e["curve"] if p.get("samples_per_problem")}
    return ns.pop() if len(ns) == 1 else 0


def render_markdown(data: dict[str, Any], notes: str | None) -> str:
    ests = data["estimators"]
    n = _samples_per_problem(ests)
    lines = ["# CPU learning curve: GRPO and SHAPE on SmolLM2-135M", ""]
    if any(e["partial"] for e in ests.values()):
        lines += ["**Partial:** at least one run stopped before its planned steps (see the `steps` column).", ""]
    commands = data["command"] if isinstance(data["command"], list) else [data["command"]]
    lines += ["Reproduce (2-core CPU machine, no GPU):", "", "```bash", *commands, "```", "",
              f"Machine: {data['machine']}", "",
              f"Held-out: all 100 bundled test problems x {n} samples at T 0.6 (top-p 0.95, top-k 40), avg@{n} pass@1 "
              "with 95% percentile-bootstrap CIs over problems; step 0 is the base policy (`--eval.val_before_train`).",
              "", "| estimator | steps | held-out accuracy, step 0 | middle | trained | mean tokens, step 0 | trained "
              "| bar (trained low > base high) | run seconds | mean step s | probes s/step |",
              "| --- | ---: | --- | --- | --- | --- | --- | :---: | ---: | ---: | ---: |"]
    for name, e in ests.items():
        mid = e["curve"][len(e["curve"]) // 2] if len(e["curve"]) >= 3 else None
        probes = e["phase_seconds_mean"].get("probes")
        lines.append(
            f"| {name.upper()} | {e['steps']}/{e['num_steps_planned']} | {_fmt_acc(e['base'])} | "
            f"{_fmt_acc(mid) + ' (step ' + str(mid['step']) + ')' if mid else '-'} | {_fmt_acc(e['trained'])} | "
            f"{_fmt_len(e['base'])} | {_fmt_len(e['trained'])} | {'yes' if e['bar_cleared'] else 'no'} | "
            f"{e['seconds']:.0f} | {e['step_seconds_mean'] or 0:.0f} | {probes if probes is None else f'{probes:.1f}'} |")
    for name, e in ests.items():
        if e.get("base_from"):
            lines += ["", f"{name.upper()}'s step-0 (base) eval is the one of `{e['base_from']}`: the same base model, "
                      "held-out problems, sampling settings and seed (every eval request's seed derives from the "
                      "run's seed), so the same numbers; the run itself used `--eval.val_before_train false`."]
    lines += ["", f"![held-out curve]({FIG_DIR}/heldout_curve.png)", ""]
    lines += ["Per-step training reward (rollouts at T 1.0, 8 prompts x 4 samples):", ""]
    for name, e in ests.items():
        lines.append(f"- {name.upper()}: " + ", ".join(f"{r:.2f}" for r in e["train_reward"]))
    lines += ["", "Per-step mean rollout length (tokens):", ""]
    for name, e in ests.items():
        lines.append(f"- {name.upper()}: " + ", ".join(f"{r:.0f}" for r in e["train_response_length"]))
    g, s = ests.get("grpo"), ests.get("shape")
    if g and s and g["trained"] and s["trained"]:
        gt, st = g["trained"], s["trained"]
        lines += ["", "## SHAPE vs GRPO (computed from the numbers above)", "",
                  f"- Accuracy: SHAPE {_fmt_acc(st)} vs GRPO {_fmt_acc(gt)}; the intervals "
                  + ("overlap: no difference is resolved at this sample size." if _overlap(st, gt, "ci_low", "ci_high")
                     else "do not overlap."),
                  f"- Length: SHAPE {_fmt_len(st)} vs GRPO {_fmt_len(gt)} tokens; the intervals "
                  + ("overlap." if _overlap(st, gt, "length_ci_low", "length_ci_high") else "do not overlap."),
                  f"- Step time: SHAPE {s['step_seconds_mean']:.0f} s vs GRPO {g['step_seconds_mean']:.0f} s per step "
                  f"(both runs shared the machine); SHAPE's probes took {s['phase_seconds_mean'].get('probes') or 0:.1f} s "
                  "per step."]
    lines += ["", "Figures from `openrlhf-shape analyze` of the runs: "
              + ", ".join(f"[{os.path.basename(p)}]({FIG_DIR}/{os.path.basename(p)})" for p in data["figures"]), ""]
    if notes:
        lines += [notes.strip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--notes", default=None, help="a markdown file appended to learning_curve.md (the discussion)")
    ap.add_argument("--command", action="append", default=None,
                    help="a command that reproduces the runs (repeat for several); default: the script's")
    ap.add_argument("--machine", default="2 CPU cores, 24 GiB RAM, no GPU; shared with other jobs during the runs")
    ap.add_argument("--no_analyze", action="store_true")
    ap.add_argument("--base_from", nargs="*", default=[], metavar="EST=DIR",
                    help="step-0 eval of EST taken from run DIR (same held-out protocol), e.g. grpo=runs/attempt1/learn-grpo")
    ap.add_argument("--pool", nargs="*", default=[], metavar="ARM=DIR,DIR,...",
                    help="seeds of one arm pooled per problem (openrlhf_shape/eval/pooling.py), a table per arm and "
                         "eval step appended to learning_curve.md, e.g. GRPO=runs/grpo-s1,runs/grpo-s2,runs/grpo-s3")
    args = ap.parse_args(argv)
    base_from = dict(x.split("=", 1) for x in args.base_from)
    pools = {name: dirs.split(",") for name, dirs in (x.split("=", 1) for x in args.pool)}
    entries = {}
    for d in args.run_dirs:
        with open(os.path.join(d, "run.json")) as f:
            est = json.load(f).get("estimator")
        e = summarize_run(d, base_from.get(est))
        entries[run_label(e) or os.path.basename(d)] = e
    fig_dir = os.path.join(args.out, FIG_DIR)
    os.makedirs(fig_dir, exist_ok=True)
    plot_heldout(entries, os.path.join(fig_dir, "heldout_curve.png"))
    figures = []
    if not args.no_analyze:
        from openrlhf_shape.eval import analyze

        tmp = os.path.join(fig_dir, "_analyze")
        analyze(list(args.run_dirs), tmp, labels=[k.upper() for k in entries])
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".png"):
                shutil.copy(os.path.join(tmp, name), os.path.join(fig_dir, name))
                figures.append(os.path.join(fig_dir, name))
        shutil.rmtree(tmp)
    data = {"command": args.command or ["bash scripts/learning_curve.sh grpo shape"], "machine": args.machine, "estimators": entries,
            "figures": [os.path.relpath(f, args.out) for f in figures]}
    with open(os.path.join(args.out, "learning_curve.json"), "w") as f:
        json.dump(data, f, indent=1)
    notes = open(args.notes).read() if args.notes else None
    if pools:
        from openrlhf_shape.eval.pooling import pooled_table

        table = ("## Seeds pooled per problem\n\nMean over seeds and problems; 95% two-level bootstrap "
                 "(seeds, then problems) from each eval's per-problem results.\n\n" + pooled_table(pools))
        notes = table + ("\n" + notes if notes else "")
    with open(os.path.join(args.out, "learning_curve.md"), "w") as f:
        f.write(render_markdown(data, notes))
    for name, e in entries.items():
        print(f"{name}: base {_fmt_acc(e['base'])} -> trained {_fmt_acc(e['trained'])}, "
              f"len {_fmt_len(e['base'])} -> {_fmt_len(e['trained'])}, steps {e['steps']}/{e['num_steps_planned']}, "
              f"bar {'cleared' if e['bar_cleared'] else 'not cleared'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
