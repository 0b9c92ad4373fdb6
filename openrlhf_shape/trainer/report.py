"""The run report: per-phase time split and per-step accuracy of one invocation (report.md, summary.json)."""

from __future__ import annotations

import json
import os
from typing import Any

from openrlhf_shape.trainer.phases import PHASES


def write_report(run_dir: str, history: list[dict], setup_seconds: float) -> dict[str, Any]:
    """A short markdown report of this invocation (steps run, per-phase time split, accuracy)."""
    if not history:
        return {}
    phase_tot = {p: sum(h.get(f"time/{p}", 0.0) for h in history) for p in PHASES}
    step_tot = sum(h["time/step"] for h in history)
    summary = {
        "steps": [h["step"] for h in history],
        "setup_seconds": setup_seconds,
        "step_seconds_total": step_tot,
        "phase_seconds": phase_tot,
        "accuracy": [h.get("rollout/accuracy") for h in history],
        "response_length": [h.get("rollout/response_length/mean") for h in history],
    }
    lines = [
        f"# Run report: {os.path.basename(run_dir)}",
        "",
        f"Steps {history[0]['step']}..{history[-1]['step']}, set-up {setup_seconds:.1f} s, steps {step_tot:.1f} s.",
        "",
        "| phase | seconds | share |",
        "| --- | ---: | ---: |",
    ]
    for p, v in phase_tot.items():
        if v > 0:
            lines.append(f"| {p} | {v:.1f} | {100 * v / max(step_tot, 1e-9):.1f}% |")

    def mean(key: str) -> float | None:
        vals = [h[key] for h in history if isinstance(h.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    idle = {side: mean(f"time/{side}_idle_share") for side in ("engine", "rank")}
    summary["idle_share"] = idle
    if None not in idle.values():
        lines += ["", f"Idle share of the steps' wall time: engines {100 * idle['engine']:.0f}%, ranks {100 * idle['rank']:.0f}%."]
    if mean("async/staleness") is not None:  # --train.async_enable
        overlap = sum(h.get("async/overlap_seconds", 0.0) for h in history)
        summary["async_overlap_seconds"] = overlap
        lines.append(f"Asynchronous (one step off): mean staleness {mean('async/staleness'):.2f} updates; the engines' "
                     f"work overlapped the update for {overlap:.1f} s, so the phase shares above can sum past 100%.")
    lines += ["", "| step | accuracy | mean length | segments | drop rate | loss | held-out accuracy |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for h in history:
        held_out = f"{h['eval/accuracy']:.3f}" if "eval/accuracy" in h else ""
        lines.append(
            f"| {h['step']} | {h.get('rollout/accuracy', float('nan')):.3f} | {h.get('rollout/response_length/mean', 0):.0f} | "
            f"{h.get('shape/segments_per_response/mean', float('nan')):.2f} | {h.get('shape/potential_drop_rate', float('nan')):.2f} | "
            f"{h.get('actor/loss', float('nan')):.4f} | {held_out} |"
        )
    lines += _sample_table(history, summary)
    lines += _instrument_table(history, summary)
    lines += _probe_time_table(history, summary)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


# Sample counts per step as (metric, column title, format); a column shows when any step logged it. Dynamic
# filtering (--algo.dynamic_filtering_enable) adds the prompts it took, its refill rounds and groups dropped.
SAMPLE_COUNTS = (
    ("rollout/prompts_consumed", "prompts consumed", ".0f"),
    ("rollout/refill_rounds", "refill rounds", ".0f"),
    ("rollout/filtered_groups", "groups filtered", ".0f"),
    ("rollout/filter_pass_rate", "filter pass rate", ".2f"),
    ("actor/samples", "samples trained", ".0f"),
    ("actor/dropped_samples", "dropped (drop_last)", ".0f"),
    ("actor/updates", "updates", ".0f"),
)


def _sample_table(history: list[dict], summary: dict[str, Any]) -> list[str]:
    """Per step: the prompts the step took (refills included), the refill rounds, the groups the filter dropped and
    the share that passed, the samples of the trained batch, those a short last mini-batch left out, the updates."""
    cols = [c for c in SAMPLE_COUNTS if any(isinstance(h.get(c[0]), (int, float)) for h in history)]
    summary["sample_counts"] = {key: [h.get(key) for h in history] for key, _, _ in cols}
    if not cols:
        return []
    return ["", "Samples per step (the dropped ones: per pass over the batch, each --actor.max_epochs pass).", ""] + \
        _column_table(history, cols)


def _column_table(history: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    """A markdown table: one row per step, one column per (metric, title, format); blank where a step lacks it."""
    lines = ["| step | " + " | ".join(title for _, title, _ in cols) + " |", "| ---: |" + " ---: |" * len(cols)]
    for h in history:
        cells = [format(h[key], fmt) if isinstance(h.get(key), (int, float)) else "" for key, _, fmt in cols]
        lines.append(f"| {h['step']} | " + " | ".join(cells) + " |")
    return lines


# Where the engines' time and the probes went (issue 49; the tail columns with --shape.entropy_source engine).
PROBE_TIME = (
    ("time/generate_engine_busy_share", "engines busy in generate", ".0%"),
    ("rollout/tail_share", "generate's tail", ".0%"),
    ("time/probes_engine_busy_share", "engines busy in probes", ".0%"),
    ("probe/overlapped_samples", "probe samples hidden", ".0f"),
    ("probe/exposed_samples", "exposed", ".0f"),
    ("probe/overlapped_tokens", "probe tokens hidden", ".0f"),
    ("probe/exposed_tokens", "exposed", ".0f"),
)


def _probe_time_table(history: list[dict], summary: dict[str, Any]) -> list[str]:
    """Per step: the engines' busy share of the generate and probes phases, the generate phase's tail share, and the
    probe work done inside the generate phase (hidden) or after it (exposed); their series go to ``summary`` too."""
    cols = [c for c in PROBE_TIME if any(isinstance(h.get(c[0]), (int, float)) for h in history)]
    summary["probe_time"] = {key: [h.get(key) for h in history] for key, _, _ in cols}
    if not cols:
        return []
    return ["", "Where the engines' time and the probes went (docs/architecture.md, \"Probes in the rollout's tail\"): "
            "the tail is the engines' rollout steps with fewer than half of their slots decoding; hidden probe work "
            "was sent while rollout responses still decoded, exposed work ran after.", ""] + _column_table(history, cols)


# The advantage instruments (issue 23) as (metric, column title, format); a column shows when any step logged it.
INSTRUMENTS = (
    ("shape/shaping_to_outcome", "shaping / outcome", ".2f"),
    ("adv/correct/mean", "adv correct", "+.3f"),
    ("adv/wrong/mean", "adv wrong", "+.3f"),
    ("adv/wrong/std", "adv wrong std", ".3f"),
    ("shape/length_tax/mean", "length tax", ".4f"),
    ("shape/sign_reversal_rate", "sign reversals", ".2f"),
    ("alarm/length_drop", "length drop", "+.2f"),
)


def _instrument_table(history: list[dict], summary: dict[str, Any]) -> list[str]:
    """Per step: the size of the shaping against the outcome term, the advantage of correct and of wrong
    responses (wrong answers near 0 get no push away), what the length discount takes, and the length alarm;
    their series go to ``summary`` too."""
    cols = [c for c in INSTRUMENTS if any(isinstance(h.get(c[0]), (int, float)) for h in history)]
    fired = [h["step"] for h in history if h.get("alarm/length_collapse")]
    summary["instruments"] = {key: [h.get(key) for h in history] for key, _, _ in cols}
    summary["length_alarm_steps"] = fired
    if not cols:
        return []
    return ["", "Advantage instruments (README, metrics): "
            + (f"the length alarm fired at step(s) {fired}." if fired else "the length alarm did not fire."), ""] + \
        _column_table(history, cols)
