"""The numbers behind every analysis figure (numpy only; plotting lives in ``plots.py``).

Each function returns plain dicts/lists so the report can print them and tests can check them
against hand-computed values.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from openrlhf_shape.algorithms.metrics import REGIMES, gain_contribution_percent
from openrlhf_shape.eval.analysis.runs import Run

REGIME_LABELS = {"low": "Low", "mid_low": "Mid-Low", "mid_high": "Mid-High", "high": "High"}

# Appendix B.4 names "five difficulty bins" without giving edges: equal-width bins of D in [0, 1].
DIFFICULTY_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DIFFICULTY_LABELS = ("[0, .2)", "[.2, .4)", "[.4, .6)", "[.6, .8)", "[.8, 1]")


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of the last ``window`` values up to each point (shorter at the start). [steps] -> [steps]."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    x = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def curve(run: Run, key: str, smooth: int) -> dict[str, list[float]] | None:
    """{steps, values, smoothed} of one metric, or None when the run never logged it."""
    s, v = run.series(key)
    if s.size == 0:
        return None
    return {"steps": s.tolist(), "values": v.tolist(), "smoothed": trailing_mean(v, smooth).tolist()}


def window_gain_averages(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Average raw gain per transition by start regime over ``records`` (summed sums / summed counts).

    Returns {regime: {"sum", "count", "mean"}}; a regime with no transitions has mean NaN.
    """
    out = {}
    for r in REGIMES:
        s = sum(float(rec.get(f"shape/gain_by_start/{r}/sum", 0.0)) for rec in records)
        n = sum(int(rec.get(f"shape/gain_by_start/{r}/count", 0)) for rec in records)
        out[r] = {"sum": s, "count": n, "mean": s / n if n else math.nan}
    return out


def gain_contribution(runs: Sequence[Run], window: int = 10, eps: float = 0.03) -> dict[str, Any] | None:
    """Fig. 6 / appendix B.3: share of potential gain by start regime.

    Groups: "Initial" = the first ``window`` steps of the first MRT run (of the first run with gain
    data when there is no MRT run), then the last ``window`` steps of every run with gain data.
    Normalisation is global over all groups and regimes: G' = G - (G_min - eps), P = G' / sum G'.
    A regime without transitions in a group gets 0% and is left out of G_min.
    """
    with_gain = [r for r in runs if r.has("shape/gain_by_start/low/count")]
    if not with_gain:
        return None
    first = next((r for r in with_gain if r.estimator == "mrt"), with_gain[0])
    groups: list[tuple[str, Sequence[dict[str, Any]]]] = [(f"Initial ({first.label}, first {window})", first.window("first", window))]
    groups += [(f"{r.label} (last {window})", r.window("last", window)) for r in with_gain]
    raw = {name: window_gain_averages(recs) for name, recs in groups}
    finite = {g: {r: v["mean"] for r, v in per.items() if not math.isnan(v["mean"])} for g, per in raw.items()}
    pct = gain_contribution_percent(finite, eps=eps)
    percent = {g: {r: float(pct.get(g, {}).get(r, 0.0)) for r in REGIMES} for g in raw}
    return {"groups": [g for g, _ in groups], "window": window, "eps": eps, "raw": raw, "percent": percent}


def gaussian_kde(samples: Sequence[float], grid: Sequence[float]) -> tuple[np.ndarray, float]:
    """Gaussian KDE density of ``samples`` at ``grid`` points; bandwidth by Scott's rule
    h = std(ddof=1) * n^(-1/5), floored at 1 (token lengths are integers). Returns (density, h)."""
    x = np.asarray(samples, dtype=np.float64)
    g = np.asarray(grid, dtype=np.float64)
    if x.size == 0:
        raise ValueError("KDE of no samples")
    sd = float(x.std(ddof=1)) if x.size > 1 else 0.0
    h = max(sd * x.size ** (-0.2), 1.0)
    z = (g[:, None] - x[None, :]) / h
    dens = np.exp(-0.5 * z * z).sum(axis=1) / (x.size * h * math.sqrt(2.0 * math.pi))
    return dens, h


def length_distribution(lengths: Sequence[int], limit: int | None = None, grid_points: int = 200) -> dict[str, Any]:
    """Histogram + KDE data of response lengths ([responses] tokens)."""
    x = np.asarray(lengths, dtype=np.float64)
    hi = float(max(x.max(), limit or 0))
    grid = np.linspace(0.0, hi * 1.02 + 1.0, grid_points)
    dens, h = gaussian_kde(x, grid)
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "median": float(np.median(x)),
        "max": float(x.max()),
        "at_limit": int((x >= limit).sum()) if limit else 0,
        "limit": limit,
        "bandwidth": h,
        "grid": grid.tolist(),
        "density": dens.tolist(),
        "lengths": x.astype(int).tolist(),
    }


LENGTH_LIMIT_KEYS = ("max_response_len", "generate_max_len", "max_new_tokens", "max_tokens")


def response_length_limit(config: dict[str, Any]) -> int | None:
    """The training response-length limit from a run's config (searched in nested sections too)."""
    stack = [config]
    while stack:
        d = stack.pop(0)
        for k in LENGTH_LIMIT_KEYS:
            if isinstance(d.get(k), (int, float)) and d[k] > 0:
                return int(d[k])
        stack.extend(v for v in d.values() if isinstance(v, dict))
    return None


def training_lengths(run: Run, window: int) -> list[int]:
    """Every response length of the last ``window`` steps (``rollout/response_lengths`` lists)."""
    out: list[int] = []
    for rec in run.window("last", window):
        out.extend(int(v) for v in rec.get("rollout/response_lengths", []) or [])
    return out


def difficulty_bin(d: float) -> int:
    """Index 0..4 of the equal-width bin of D in [0, 1] (1.0 goes to the last bin)."""
    if not (0.0 <= d <= 1.0):
        raise ValueError(f"difficulty D must be in [0, 1], got {d}")
    return min(int(d * 5.0 + 1e-9), 4)


def box_stats(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and 1.5 IQR whiskers (clipped to the data), as in appendix B.4."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    if x.size == 0:
        return {"n": 0}
    q1, med, q3 = (float(v) for v in np.percentile(x, [25, 50, 75]))
    iqr = q3 - q1
    lo_w = float(x[x >= q1 - 1.5 * iqr].min())
    hi_w = float(x[x <= q3 + 1.5 * iqr].max())
    return {"n": int(x.size), "q1": q1, "median": med, "q3": q3, "iqr": iqr, "whisker_lo": lo_w, "whisker_hi": hi_w, "mean": float(x.mean())}


def _problem_key(bench: str, pid: Any) -> tuple[str, str]:
    return bench, str(pid)


def base_difficulties(base_report: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(benchmark, problem_id) -> D = 1 - base-model pass rate (appendix B.4)."""
    out = {}
    for b in base_report["benchmarks"]:
        for p in b["problems"]:
            rate = float(np.mean(p["scores"])) if "scores" in p else float(p["pass_rate"])
            out[_problem_key(b["name"], p["problem_id"])] = 1.0 - rate
    return out


def length_by_difficulty(runs: Sequence[Run], base_report: dict[str, Any] | None) -> dict[str, Any] | None:
    """Fig. 9: response lengths of each run's eval, binned by problem difficulty.

    With ``base_report`` (the base model's eval): D = 1 - pass rate, five equal-width bins. Without
    it: the data's own ``difficulty`` field, one bin per distinct level. None when neither exists
    or no run has an eval report.
    """
    evaluated = [r for r in runs if r.eval_report]
    if not evaluated:
        return None
    if base_report is not None:
        dmap = base_difficulties(base_report)
        labels = list(DIFFICULTY_LABELS)
        key_of = lambda bench, p: (difficulty_bin(dmap[_problem_key(bench, p["problem_id"])])  # noqa: E731
                                   if _problem_key(bench, p["problem_id"]) in dmap else None)
        source = "base-model pass rate: D = 1 - pass rate"
    else:
        levels = sorted(
            {p["difficulty"] for r in evaluated for b in r.eval_report["benchmarks"] for p in b["problems"] if p.get("difficulty") is not None},
            key=lambda v: (isinstance(v, str), v),
        )
        if not levels:
            return None
        labels = [str(v) for v in levels]
        key_of = lambda bench, p: levels.index(p["difficulty"]) if p.get("difficulty") is not None else None  # noqa: E731
        source = "the data's difficulty field"
    per_run: dict[str, Any] = {}
    for r in evaluated:
        bins: list[list[int]] = [[] for _ in labels]
        skipped = 0
        for b in r.eval_report["benchmarks"]:
            for p in b["problems"]:
                k = key_of(b["name"], p)
                if k is None:
                    skipped += 1
                    continue
                bins[k].extend(int(t) for t in p["num_tokens"])
        stats = [box_stats(v) for v in bins]
        xs = [i for i, s in enumerate(stats) if s["n"]]
        slope = float(np.polyfit(xs, [stats[i]["median"] for i in xs], 1)[0]) if len(xs) >= 2 else math.nan
        per_run[r.label] = {"lengths": bins, "stats": stats, "median_slope_per_bin": slope, "problems_without_difficulty": skipped}
    return {"bins": labels, "source": source, "runs": per_run}


def run_summary(run: Run, window: int) -> dict[str, Any]:
    """Last-``window`` means of the headline metrics (NaN when not logged)."""
    keys = [
        "rollout/accuracy",
        "rollout/response_length/mean",
        "shape/segments_per_response/mean",
        "shape/segment_length/mean",
        "shape/potential_drop_rate",
        "shape/gamma/mean",
        "shape/tcr_weight/mean",
        "probe/tokens",
        "probe/prefix_hit_rate",
        "time/step",
        "time/generate",
        "time/probes",
        "time/logprobs",
        "time/train",
        "time/sync",
    ]
    recs = run.window("last", window)
    out: dict[str, Any] = {"label": run.label, "estimator": run.estimator, "steps": len(run.records), "last_step": int(run.records[-1]["step"])}
    for k in keys:
        vals = [float(r[k]) for r in recs if isinstance(r.get(k), (int, float))]
        out[k] = float(np.mean(vals)) if vals else math.nan
    return out
