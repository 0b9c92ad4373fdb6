"""``analyze(run_dirs, out_dir, labels) -> report path``: the paper's figures for GRPO / MRT / SHAPE runs.

Writes into ``out_dir``:

    fig_training_curves.png     accuracy and response length over steps (fig. 3), rollout and
                                held-out (eval/accuracy, eval/response_length/mean when logged)
    fig7_potential_drop.png     potential drop rate over steps (runs with SHAPE metrics)
    fig6_gain_contribution.png  gain contribution by start regime, appendix B.3 normalisation
    fig10_lengths_train.png     response-length histograms + KDE from the last training steps
    fig10_lengths_eval.png      the same per benchmark from each run's eval report (when present)
    fig9_length_by_difficulty.png  length by difficulty bin, appendix B.4 (needs eval reports)
    analysis.json               every number the figures show
    report.html                 all figures side by side with their tables

A figure whose inputs no run has is skipped and the report says why.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

from openrlhf_shape.algorithms.metrics import REGIMES
from openrlhf_shape.eval.analysis import compute, plots
from openrlhf_shape.eval.analysis.runs import Run, load_eval_report, load_run, unique_labels


def _fmt(v: Any, nd: int = 3) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return html.escape(str(v))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def analyze(
    run_dirs: list[str],
    out_dir: str,
    labels: list[str] | None = None,
    *,
    eval_reports: list[str | None] | None = None,
    base_eval: str | None = None,
    window: int = 10,
    smooth: int = 5,
    eps: float = 0.03,
    benchmarks: list[str] | None = None,
) -> str:
    """Make every figure the runs support and return the path of ``report.html``.

    Args:
        run_dirs: training run directories (``run.json`` + ``metrics.jsonl``).
        labels: legend names, one per run (default: ``run.json`` name).
        eval_reports: per run, an eval report.json (or dir) of its final model; default
            ``<run>/eval/report.json`` when it exists.
        base_eval: the base model's eval report, for fig. 9 difficulty D = 1 - pass rate.
        window: steps in the "first/last N steps" windows (fig. 6, fig. 10, summary).
        smooth: trailing-mean window of the smoothed curves.
        benchmarks: eval benchmarks to show in fig. 10 (default: all).
    """
    runs = _load_runs(run_dirs, labels, eval_reports, window, smooth)
    base = load_eval_report(base_eval) if base_eval else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = plots.colors_for([r.label for r in runs], [r.estimator for r in runs])

    data: dict[str, Any] = {"runs": [{"label": r.label, "path": r.path, "estimator": r.estimator} for r in runs]}
    figures: list[dict[str, Any]] = [  # {"key", "title", "png" | None, "note", "table"}, in the report's order
        _training_curves_figure(runs, colors, out, smooth, data),
        _potential_drop_figure(runs, colors, out, smooth, window, data),
        _gain_figure(runs, out, window, eps, data),
        _train_lengths_figure(runs, colors, out, window, data),
        _eval_lengths_figure(runs, colors, out, benchmarks, data),
        _difficulty_figure(runs, base, colors, out, data),
    ]
    summary = [compute.run_summary(r, window) for r in runs]
    data["summary"] = summary
    (out / "analysis.json").write_text(json.dumps(data, indent=1, default=float))
    report = out / "report.html"
    report.write_text(_html(runs, figures, summary, window, out))
    return str(report)


def _load_runs(run_dirs: list[str], labels: list[str] | None, eval_reports: list[str | None] | None, window: int,
               smooth: int) -> list[Run]:
    """The runs after checking the arguments, each with a label no other run has."""
    if not run_dirs:
        raise ValueError("analyze needs at least one run directory")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} names for {len(run_dirs)} runs")
    if eval_reports is not None and len(eval_reports) != len(run_dirs):
        raise ValueError(f"--eval_reports has {len(eval_reports)} entries for {len(run_dirs)} runs")
    if window < 1 or smooth < 1:
        raise ValueError("--window and --smooth must be >= 1")
    runs: list[Run] = [
        load_run(d, labels[i] if labels else None, eval_reports[i] if eval_reports else None)
        for i, d in enumerate(run_dirs)
    ]
    for r, lab in zip(runs, unique_labels([r.label for r in runs])):
        r.label = lab
    return runs


def _training_curves_figure(runs: list[Run], colors: dict[str, str], out: Path, smooth: int, data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 3: rollout accuracy and response length over steps, and the held-out metrics the trainer logs every
    few steps ("eval/accuracy", "eval/response_length/mean", or per benchmark "eval/<benchmark>/accuracy")."""
    acc = {r.label: c for r in runs if (c := compute.curve(r, "rollout/accuracy", smooth))}
    length = {r.label: c for r in runs if (c := compute.curve(r, "rollout/response_length/mean", smooth))}
    eval_keys = sorted({k for r in runs for rec in r.records for k in rec
                        if k.startswith("eval/") and k.endswith(("accuracy", "response_length/mean"))})[:4]
    eval_curves = {k: {r.label: c for r in runs if (c := compute.curve(r, k, 1))} for k in eval_keys}
    data["training_curves"] = {"accuracy": acc, "response_length": length, "eval": eval_curves}
    png = None
    if acc or length:
        png = plots.plot_curves(
            [("Rollout accuracy", "accuracy", acc), ("Response length", "tokens", length)]
            + [("held-out " + k[len("eval/"):], "tokens" if k.endswith("length/mean") else "accuracy", c)
               for k, c in eval_curves.items()],
            colors, out / "fig_training_curves.png", f"Training curves (thin: raw, bold: trailing mean of {smooth})",
        )
    return {"key": "training_curves", "title": "Accuracy and response length over steps", "png": png,
            "note": None if png else "no run logged rollout/accuracy or rollout/response_length/mean",
            "table": _table(["run", "first acc", "last acc", "first len", "last len"],
                            [[lab, acc[lab]["values"][0] if lab in acc else math.nan, acc[lab]["values"][-1] if lab in acc else math.nan,
                              length[lab]["values"][0] if lab in length else math.nan, length[lab]["values"][-1] if lab in length else math.nan]
                             for lab in [r.label for r in runs]])}


def _potential_drop_figure(runs: list[Run], colors: dict[str, str], out: Path, smooth: int, window: int,
                           data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 7: potential drop rate over steps."""
    drop = {r.label: c for r in runs if (c := compute.curve(r, "shape/potential_drop_rate", smooth))}
    data["potential_drop_rate"] = drop
    png = plots.plot_curves([("Potential drop rate", "share of transitions with Phi_{k+1} < Phi_k", drop)], colors,
                            out / "fig7_potential_drop.png", "Potential drop rate during training (fig. 7)") if drop else None
    missing = [r.label for r in runs if r.label not in drop]
    return {"key": "potential_drop", "title": "Fig. 7: potential drop rate over steps", "png": png,
            "note": (f"no potential metrics for: {', '.join(missing)} (GRPO has no probes)" if missing else None) if png
            else "no run logged shape/potential_drop_rate",
            "table": _table(["run", "mean (all steps)", f"mean (last {window})"],
                            [[lab, sum(c["values"]) / len(c["values"]), sum(c["values"][-window:]) / len(c["values"][-window:])] for lab, c in drop.items()])}


def _gain_figure(runs: list[Run], out: Path, window: int, eps: float, data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 6: gain contribution by start regime."""
    gain = compute.gain_contribution(runs, window=window, eps=eps)
    data["gain_contribution"] = gain
    png = plots.plot_gain_contribution(gain, out / "fig6_gain_contribution.png") if gain else None
    rows = []
    if gain:
        for g in gain["groups"]:
            rows.append([g] + [f"{gain['percent'][g][r]:.1f}% (avg {_fmt(gain['raw'][g][r]['mean'])}, n={gain['raw'][g][r]['count']})" for r in REGIMES])
    return {"key": "gain_contribution", "title": "Fig. 6: potential gain contribution by start regime", "png": png,
            "note": None if gain else "no run logged shape/gain_by_start/* (GRPO runs have no potentials)",
            "table": _table(["group"] + [compute.REGIME_LABELS[r] for r in REGIMES], rows)}


def _train_lengths_figure(runs: list[Run], colors: dict[str, str], out: Path, window: int, data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 10 (training): response-length distributions of the last ``window`` steps' rollouts."""
    train_cells = {}
    for r in runs:
        lens = compute.training_lengths(r, window)
        if lens:
            limit = compute.response_length_limit(r.config)
            train_cells[r.label] = {f"last {window} steps": compute.length_distribution(lens, limit)}
    data["lengths_train"] = train_cells
    png = plots.plot_length_grid(train_cells, colors, out / "fig10_lengths_train.png",
                                 "Training response lengths: histogram + KDE (fig. 10 style)") if train_cells else None
    return {"key": "lengths_train", "title": f"Fig. 10 (training): response-length distribution, last {window} steps", "png": png,
            "note": None if png else "no run logged rollout/response_lengths",
            "table": _table(["run", "responses", "mean", "median", "max", "at limit", "KDE bandwidth"],
                            [[lab, d["n"], d["mean"], d["median"], d["max"], d["at_limit"], d["bandwidth"]] for lab, per in train_cells.items() for d in per.values()])}


def _eval_lengths_figure(runs: list[Run], colors: dict[str, str], out: Path, benchmarks: list[str] | None,
                         data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 10: response-length distributions per benchmark of each run's eval report."""
    eval_cells: dict[str, dict[str, Any]] = {}
    for r in runs:
        if not r.eval_report:
            continue
        for b in r.eval_report["benchmarks"]:
            if benchmarks and b["name"] not in benchmarks:
                continue
            lens = [t for p in b["problems"] for t in p["num_tokens"]]
            if lens:
                eval_cells.setdefault(r.label, {})[b["name"]] = compute.length_distribution(lens, int(b["max_new_tokens"]))
    data["lengths_eval"] = eval_cells
    png = plots.plot_length_grid(eval_cells, colors, out / "fig10_lengths_eval.png",
                                 "Eval response lengths per benchmark: histogram + KDE (fig. 10)") if eval_cells else None
    return {"key": "lengths_eval", "title": "Fig. 10: response-length distribution per benchmark (eval)", "png": png,
            "note": None if png else "no run has an eval report (run `openrlhf-shape eval --out_dir <run>/eval`)",
            "table": _table(["run", "benchmark", "responses", "mean", "median", "at limit"],
                            [[lab, b, d["n"], d["mean"], d["median"], d["at_limit"]] for lab, per in eval_cells.items() for b, d in per.items()])}


def _difficulty_figure(runs: list[Run], base: dict[str, Any] | None, colors: dict[str, str], out: Path,
                       data: dict[str, Any]) -> dict[str, Any]:
    """Fig. 9: response length by difficulty bin (appendix B.4)."""
    diff = compute.length_by_difficulty(runs, base)
    data["length_by_difficulty"] = diff
    png = plots.plot_length_by_difficulty(diff, colors, out / "fig9_length_by_difficulty.png") if diff else None
    rows = []
    if diff:
        for lab, rd in diff["runs"].items():
            rows.append([lab] + [f"{_fmt(s.get('median', math.nan))} [{_fmt(s.get('q1', math.nan))}, {_fmt(s.get('q3', math.nan))}] n={s['n']}" for s in rd["stats"]] + [rd["median_slope_per_bin"]])
    return {"key": "length_by_difficulty", "title": "Fig. 9: response length by difficulty bin", "png": png,
            "note": None if diff else "needs eval reports of the runs and a difficulty: --base_eval (base-model eval report) or a 'difficulty' field in the data",
            "table": _table(["run"] + (diff["bins"] if diff else []) + ["median slope / bin"], rows)}


def _html(runs: list[Run], figures: list[dict[str, Any]], summary: list[dict[str, Any]], window: int, out: Path) -> str:
    keys = [k for k in summary[0] if k not in ("label", "estimator")]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>SHAPE analysis</title><style>",
        "body{font-family:sans-serif;margin:20px} .grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:18px}",
        ".card{border:1px solid #ddd;border-radius:6px;padding:10px} img{max-width:100%} table{border-collapse:collapse;font-size:12px}",
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right} .note{color:#a60;font-size:13px}</style></head><body>",
        "<h1>SHAPE / MRT / GRPO analysis</h1>",
        "<p>Runs: " + ", ".join(f"<b>{html.escape(r.label)}</b> ({html.escape(r.estimator)}, {len(r.records)} steps, <code>{html.escape(r.path)}</code>)" for r in runs) + "</p>",
        f"<h2>Summary (mean of the last {window} steps)</h2>",
        _table(["run", "estimator"] + keys, [[s["label"], s["estimator"]] + [s[k] for k in keys] for s in summary]),
    ]
    ev_rows = [
        [r.label, b["name"], b["n_samples"], 100 * b["accuracy"], f"[{100 * b['accuracy_ci'][0]:.1f}, {100 * b['accuracy_ci'][1]:.1f}]", b["mean_tokens"]]
        for r in runs if r.eval_report for b in r.eval_report["benchmarks"]
    ]
    if ev_rows:
        parts += ["<h2>Final-model evaluation (avg@N pass@1, Math-Verify)</h2>",
                  _table(["run", "benchmark", "N", "accuracy %", "CI", "mean tokens"], ev_rows)]
    parts.append("<h2>Figures</h2><div class='grid'>")
    for f in figures:
        parts.append(f"<div class='card'><h3>{html.escape(f['title'])}</h3>")
        if f["png"]:
            parts.append(f"<img src='{html.escape(Path(f['png']).relative_to(out).as_posix())}'>")
        if f["note"]:
            parts.append(f"<p class='note'>{html.escape(f['note'])}</p>")
        parts.append(f["table"] + "</div>")
    parts.append("</div></body></html>")
    return "\n".join(parts)
