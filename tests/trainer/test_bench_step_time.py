"""benchmarks/bench_step_time.py: its summary maths on synthetic metrics.jsonl files (warm-up dropped, eval and
checkpoint out of the step, runs paired by repeat, medians, the ratio as the median of the pairs' ratios), its
variants' flags against the preset, and one tiny end-to-end run of the script whose output must parse."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.modules import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_step_time.py"


@pytest.fixture(scope="module")
def bench():
    return load_file(SCRIPT)


def _write_run(path: Path, step_s: float, generate: float, probes: float | None, extra: dict | None = None) -> str:
    """A 3-step run's metrics.jsonl: step 1 a slow warm-up, steps 2 and 3 at ``step_s`` -/+ 2 s (step 3 also
    writes the final checkpoint, 5 s, and the run's log line counts it in time/step)."""
    path.mkdir(parents=True)
    rows = [{"step": 1, "time/step": 300.0, "time/generate": 90.0, "time/rewards": 9.0, "time/logprobs": 50.0}]
    for step, t in ((3, step_s + 2.0 + 5.0), (2, step_s - 2.0)):  # out of order: the reader sorts by step
        row = {"step": step, "time/step": t, "time/generate": generate, "time/rewards": 0.5, "time/logprobs": 6.0,
               "time/train": 20.0, "rollout/tokens": 2000.0 + step, **(extra or {})}
        if probes is not None:
            row |= {"time/probes": probes, "probe/tokens": 1000.0, "probe/overlapped_tokens": 600.0,
                    "probe/exposed_tokens": 400.0, "rollout/tail_share": 0.3}
        if step == 3:
            row |= {"time/checkpoint": 5.0, "checkpoint": "/x/checkpoints/step_3"}
        rows.append(row)
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_a_run_is_summarized_over_steps_after_warmup(bench, tmp_path):
    rows = bench.read_rows(_write_run(tmp_path / "run", 50.0, 11.0, 5.0))
    assert [r["step"] for r in rows] == [1, 2, 3]
    s = bench.summarize_run(rows)
    assert s["steps_measured"] == [2, 3]
    assert s["step_seconds_each"] == [48.0, 52.0]  # step 3 without its checkpoint's 5 s
    assert s["step_seconds"] == 50.0
    assert s["phases"]["generate"] == 11.0 and s["phases"]["probes"] == 5.0 and s["phases"]["segment"] == 0.0
    assert "checkpoint" not in s["phases"] and "eval" not in s["phases"]
    assert s["figures"]["rollout/tokens"] == 2002.5 and s["figures"]["probe/overlapped_tokens"] == 600.0
    assert s["figures"]["rollout/mismatch/entropy_abs_diff"] is None  # no run step logged it
    # one step: that step is measured (nothing else ran)
    one = bench.summarize_run([{"step": 1, "time/step": 30.0, "time/generate": 3.0}])
    assert one["steps_measured"] == [1] and one["step_seconds"] == 30.0 and one["phases"]["generate"] == 3.0


def test_runs_are_paired_by_repeat(bench, tmp_path):
    # SHAPE 60, 44, 52 s against GRPO 40, 48, 55 s: pairs 1.5, 0.917, 0.945 -> 0.945; the medians' ratio would be
    # 52 / 48 = 1.083 and pairs of sorted runs 1.091, so only pairing repeat with repeat gives 0.945
    shape = [bench.summarize_run(bench.read_rows(_write_run(tmp_path / f"shape_r{r}", t, g, p,
                                                            {"rollout/mismatch/entropy_abs_diff": d})))
             for r, (t, g, p, d) in enumerate([(60.0, 12.0, 6.0, 1e-5), (44.0, 10.0, 4.0, 3e-5),
                                               (52.0, 11.0, 5.0, 2e-5)], 1)]
    grpo = [bench.summarize_run(bench.read_rows(_write_run(tmp_path / f"grpo_r{r}", t, g, None)))
            for r, (t, g) in enumerate([(40.0, 9.0), (48.0, 10.0), (55.0, 12.0)], 1)]
    c = bench.compare(shape, grpo)
    assert c["pair_ratios"] == [1.5, round(44 / 48, 4), round(52 / 55, 4)]
    assert c["ratio"] == pytest.approx(52 / 55)
    assert c["shape_step_seconds"] == 52.0 and c["grpo_step_seconds"] == 48.0
    # per phase: the median of the pairs' differences (probes: 6, 4, 5 against none; generate: 12 - 9, 10 - 10,
    # 11 - 12 -> 0, where the medians' difference would say 11 - 10 = 1)
    assert c["phase_difference"]["probes"] == 5.0 and c["phase_difference"]["generate"] == 0.0
    assert c["phase_difference"]["train"] == 0.0 and c["shape_phases"]["generate"] == 11.0
    assert c["grpo_phases"]["probes"] == 0.0
    assert c["shape_figures"]["rollout/mismatch/entropy_abs_diff"] == 2e-5
    assert c["grpo_figures"]["probe/exposed_tokens"] is None and c["shape_figures"]["rollout/tail_share"] == 0.3
    with pytest.raises(ValueError, match="pairs need both"):
        bench.compare(shape, grpo[:2])


def test_goal_report_and_final_line(bench):
    run = {"steps_measured": [2, 3], "step_seconds": 50.0, "step_seconds_each": [50.0, 50.0],
           "phases": {p: 1.0 for p in bench.TIMED}, "figures": {k: None for k in bench.FIGURES}}
    fast, slow = {"ratio": 1.05}, {"ratio": 1.0501}
    assert bench.goal_line("demo", {"shape_engine": fast, "shape_trainer": slow}) == (
        "goal SHAPE <= 1.05x GRPO on the demo: shape_engine met (1.05), shape_trainer not met (1.05)")
    comp = bench.compare([dict(run, step_seconds=55.0)], [run])
    result = {"steps": 3, "repeats": 1, "smoke": False, "extra_flags": [], "shape_flags": "", "wall_s": 60.0,
              "load_average": {"start": [0.5, 0.4, 0.3], "end": [1.5, 1.4, 1.3]},
              "variants": {"demo": {"flags": [], "runs": {"shape_trainer": [run], "grpo": [run]},
                                    "comparisons": {"shape_trainer": comp},
                                    "segmentation_equal_engine_vs_trainer": None}}}
    assert bench.final_line(result) == "step time: demo shape_trainer=1.10"
    md = bench.markdown(result)
    assert "load average at start 0.50 0.40 0.30, at end 1.50 1.40 1.30" in md
    assert "shape_trainer not met (1.10)" in md and md.endswith("step time: demo shape_trainer=1.10")


def test_segmentation_statistics_compared_step_by_step(bench):
    a = [{"step": 1, "shape/segment_length/mean": 20.0, "shape/segments_per_response/mean": 3.5},
         {"step": 2, "shape/segment_length/mean": 21.0, "shape/segments_per_response/mean": 3.0}]
    b = [{"step": 1, "shape/segment_length/mean": 20.0, "shape/segments_per_response/mean": 3.5},
         {"step": 2, "shape/segment_length/mean": 21.5, "shape/segments_per_response/mean": 3.0},
         {"step": 3}]
    assert bench.same_segmentation(a, b) == [True, False]
    assert bench.same_segmentation([{"step": 1}], [{"step": 1}]) == [False]  # nothing to compare is no evidence


def test_arms_and_variants_load_on_the_preset(bench):
    from openrlhf_shape.config import load_config

    arms = bench.arm_flags(["trainer", "engine"])
    assert list(arms) == ["shape_trainer", "shape_engine", "grpo"]  # SHAPE first, GRPO last in every repeat
    for variant in bench.VARIANTS:
        for arm, own in arms.items():
            flags = [*bench.run_flags("/tmp/bench", 3)[2:], *bench.variant_flags(variant, 512, 4), *own]
            cfg = load_config(bench.PRESET, flags, check_paths=False)
            assert cfg.shape.entropy_source == ("engine" if arm == "shape_engine" else "trainer")
            assert cfg.eval.steps == 0 and cfg.ckpt.save_steps == 0 and cfg.train.num_steps == 3
            if variant == "long":  # 4 prompts x 4 samples: the update's one batch of 16
                samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
                assert (cfg.rollout.max_new_tokens, samples, cfg.train.batch_size) == (512, 16, 16)
    with pytest.raises(ValueError, match="--variants"):
        bench.variant_flags("huge", 512, 4)


def test_flags_that_would_reach_grpo_are_refused(bench, monkeypatch, capsys):
    for argv in (["--shape.entropy_source", "engine"], ["--shape-flags", "--shape.entropy_source engine"],
                 ["--entropy-source", "both"]):
        monkeypatch.setattr(sys, "argv", ["bench_step_time.py", *argv])
        with pytest.raises(SystemExit):
            bench.parse_args()
        assert "--entropy-source" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.distributed
def test_smoke_run_writes_a_report_that_parses(tmp_path):
    """The whole script, tiny: one repeat of SHAPE (engine entropies, probes in the tail) and GRPO, one step each."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--steps", "1", "--repeats", "1", "--variants", "demo",
           "--entropy-source", "engine", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    check_report(out, proc.stdout)


def check_report(out: Path, stdout: str) -> None:
    """What the smoke run must have written to ``out`` and printed (``stdout``)."""
    res = json.loads((out / "bench_step_time.json").read_text())
    demo = res["variants"]["demo"]
    assert set(demo["runs"]) == {"shape_engine", "grpo"} and len(res["load_average"]["end"]) == 3
    for runs in demo["runs"].values():
        assert runs[0]["steps_measured"] == [1] and runs[0]["step_seconds"] > 0
        assert runs[0]["phases"]["generate"] > 0 and runs[0]["phases"]["train"] > 0
        assert not os.path.exists(os.path.join(runs[0]["dir"], "checkpoints"))  # deleted once read
    c = demo["comparisons"]["shape_engine"]
    assert math.isfinite(c["ratio"]) and c["ratio"] > 0 and c["pair_ratios"] == [round(c["ratio"], 4)]
    assert c["shape_phases"]["probes"] > 0 and c["grpo_phases"]["probes"] < 0.01  # GRPO's phase: a no-op call
    assert c["shape_figures"]["rollout/mismatch/entropy_abs_diff"] >= 0  # engine vs trainer entropies, measured
    assert c["shape_figures"]["probe/tokens"] > 0 and c["grpo_figures"]["probe/tokens"] is None
    assert res["goal_met"] == {"shape_engine": c["ratio"] <= 1.05}
    assert res["final_line"] in stdout and (out / "bench_step_time.md").read_text().startswith("# SHAPE vs GRPO")
