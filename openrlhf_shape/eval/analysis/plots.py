"""Matplotlib (Agg, headless) renderings of the data from ``compute.py``; one PNG per figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from openrlhf_shape.algorithms.metrics import REGIMES  # noqa: E402
from openrlhf_shape.eval.analysis.compute import REGIME_LABELS  # noqa: E402

METHOD_COLORS = {"grpo": "#7f7f7f", "mrt": "#1f77b4", "shape": "#d62728"}
_CYCLE = ["#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def colors_for(labels: list[str], estimators: list[str]) -> dict[str, str]:
    """GRPO grey, MRT blue, SHAPE red (the first run of each); everything else from a cycle."""
    out, used, k = {}, set(), 0
    for lab, est in zip(labels, estimators):
        c = METHOD_COLORS.get(est)
        if c is None or c in used:
            c = _CYCLE[k % len(_CYCLE)]
            k += 1
        used.add(c)
        out[lab] = c
    return out


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_curves(panels: list[tuple[str, str, dict[str, dict[str, list[float]]]]], colors: dict[str, str], path: Path, title: str) -> str:
    """Side-by-side panels of per-step curves. ``panels``: (title, y label, {run label: curve})."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (ptitle, ylabel, curves) in zip(axes[0], panels):
        for label, c in curves.items():
            ax.plot(c["steps"], c["values"], color=colors[label], alpha=0.25, linewidth=1)
            ax.plot(c["steps"], c["smoothed"], color=colors[label], linewidth=2, label=label)
        ax.set_title(ptitle)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_gain_contribution(data: dict[str, Any], path: Path) -> str:
    """Grouped bars: x = start regime, one bar per group, value = % of shifted gain."""
    groups = data["groups"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(groups)
    x = np.arange(len(REGIMES))
    for i, g in enumerate(groups):
        vals = [data["percent"][g][r] for r in REGIMES]
        bars = ax.bar(x + (i - (len(groups) - 1) / 2) * width, vals, width, label=g)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"{REGIME_LABELS[r]} start" for r in REGIMES])
    ax.set_ylabel("share of (shifted) potential gain, %")
    ax.set_title(f"Gain contribution by start regime (appendix B.3, eps={data['eps']})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_length_grid(cells: dict[str, dict[str, dict[str, Any]]], colors: dict[str, str], path: Path, title: str) -> str:
    """Rows = runs, columns = benchmarks (or one column): density histogram + KDE curve.
    ``cells[run label][column] = length_distribution(...)``."""
    rows = list(cells)
    cols = sorted({c for per in cells.values() for c in per})
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(max(4.4 * len(cols), 7.0), 2.8 * len(rows)), squeeze=False)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            d = cells[r].get(c)
            if d is None:
                ax.set_axis_off()
                continue
            ax.hist(d["lengths"], bins=30, density=True, color=colors[r], alpha=0.35)
            ax.plot(d["grid"], d["density"], color=colors[r], linewidth=2)
            if d.get("limit"):
                ax.axvline(d["limit"], color="k", linestyle="--", linewidth=1)
            ax.set_title(f"{r} on {c}" if c else r, fontsize=9)
            ax.set_xlabel("response tokens")
            ax.set_ylabel("density")
    fig.suptitle(title)
    return _save(fig, path)


def plot_length_by_difficulty(data: dict[str, Any], colors: dict[str, str], path: Path) -> str:
    """Grouped box plots (median, IQR box, 1.5 IQR whiskers, no outliers) per difficulty bin."""
    labels = data["bins"]
    runs = list(data["runs"])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels) * max(1, len(runs)) / 1.5), 4.2))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        pos = np.arange(len(labels)) + (i - (len(runs) - 1) / 2) * width
        series = [v if v else [np.nan] for v in data["runs"][r]["lengths"]]
        bp = ax.boxplot(series, positions=pos, widths=width * 0.9, showfliers=False, patch_artist=True)
        for box in bp["boxes"]:
            box.set_facecolor(colors[r])
            box.set_alpha(0.5)
        ax.plot([], [], color=colors[r], linewidth=6, alpha=0.5, label=f"{r} (slope {data['runs'][r]['median_slope_per_bin']:.0f} tok/bin)")
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set_xlabel(f"difficulty bin ({data['source']})")
    ax.set_ylabel("response tokens")
    ax.set_title("Response length vs problem difficulty (appendix B.4)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
