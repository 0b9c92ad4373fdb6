"""analyze(): every figure is produced, non-empty, and its numbers match hand computations on the
synthetic runs in fixtures/synthetic_runs (see make_synthetic_runs.py for the inputs)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from openrlhf_shape.eval.analysis import analyze
from openrlhf_shape.eval.analysis.runs import read_metrics

RUNS = Path(__file__).parent / "fixtures" / "synthetic_runs"
FIGS = [
    "fig_training_curves.png",
    "fig7_potential_drop.png",
    "fig6_gain_contribution.png",
    "fig10_lengths_train.png",
    "fig10_lengths_eval.png",
    "fig9_length_by_difficulty.png",
]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    path = analyze([str(RUNS / m) for m in ("grpo", "mrt", "shape")], str(out), ["GRPO", "MRT", "SHAPE"],
                   base_eval=str(RUNS / "base_eval"), window=2, smooth=2)
    return Path(path), json.loads((out / "analysis.json").read_text())


def test_every_figure_is_written_and_not_blank(result):
    import matplotlib.image as mpimg

    report, _ = result
    html = report.read_text()
    for name in FIGS:
        png = report.parent / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 10_000, name
        img = mpimg.imread(png)
        assert img.shape[0] > 200 and img.shape[1] > 300 and float(img[..., :3].std()) > 0.05, name
        assert f"<img src='{name}'>" in html
    assert "GRPO" in html and "SHAPE" in html and "MRT" in html
    assert "<td>SHAPE</td><td>toy</td><td>2</td><td>40</td>" in html  # final-model eval table (4/10 correct)


def test_curves_match_hand_values(result):
    _, data = result
    acc = data["training_curves"]["accuracy"]["SHAPE"]
    assert acc["steps"] == [1, 2, 3, 4]
    assert acc["smoothed"] == pytest.approx([0.25, 0.375, 0.625, 0.75])
    assert data["training_curves"]["response_length"]["GRPO"]["smoothed"] == pytest.approx([40, 42, 46, 50])
    ev = data["training_curves"]["eval"]
    assert set(ev) == {"eval/accuracy", "eval/response_length/mean"} and set(ev["eval/accuracy"]) == {"MRT", "SHAPE"}
    assert ev["eval/accuracy"]["SHAPE"]["steps"] == [2, 4] and ev["eval/accuracy"]["SHAPE"]["values"] == [0.3, 0.4]
    assert ev["eval/response_length/mean"]["MRT"]["values"] == [50.0, 45.0]
    drop = data["potential_drop_rate"]
    assert set(drop) == {"MRT", "SHAPE"}  # GRPO logs no potentials
    assert drop["SHAPE"]["smoothed"] == pytest.approx([0.4, 0.35, 0.25, 0.15])


def test_gain_contribution_appendix_b3_by_hand(result):
    _, data = result
    g = data["gain_contribution"]
    assert g["groups"] == ["Initial (MRT, first 2)", "MRT (last 2)", "SHAPE (last 2)"]
    raw = g["raw"]
    # Average raw gain = summed sums / summed counts over the window.
    assert [raw["Initial (MRT, first 2)"][r]["mean"] for r in ("low", "mid_low", "mid_high", "high")] == pytest.approx([0.1, 0.05, 0.0, -0.1])
    assert [raw["MRT (last 2)"][r]["mean"] for r in ("low", "mid_low", "mid_high", "high")] == pytest.approx([0.2, 0.1, 0.0, -0.025])
    assert raw["SHAPE (last 2)"]["high"]["count"] == 0
    # G_min = -0.1 over all groups, eps = 0.03 -> shift by +0.13, then percent of each group's total.
    pct = g["percent"]
    assert [pct["Initial (MRT, first 2)"][r] for r in ("low", "mid_low", "mid_high", "high")] == pytest.approx(
        [100 * v / 0.57 for v in (0.23, 0.18, 0.13, 0.03)])
    assert [pct["MRT (last 2)"][r] for r in ("low", "mid_low", "mid_high", "high")] == pytest.approx(
        [100 * v / 0.795 for v in (0.33, 0.23, 0.13, 0.105)])
    assert [pct["SHAPE (last 2)"][r] for r in ("low", "mid_low", "mid_high", "high")] == pytest.approx(
        [100 * v / 0.84 for v in (0.43, 0.23, 0.18)] + [0.0])


def _kde(x, grid):
    x = np.asarray(x, float)
    h = x.std(ddof=1) * len(x) ** -0.2
    return [sum(math.exp(-0.5 * ((g - xi) / h) ** 2) for xi in x) / (len(x) * h * math.sqrt(2 * math.pi)) for g in grid], h


def test_length_distributions_by_hand(result):
    _, data = result
    d = data["lengths_train"]["SHAPE"]["last 2 steps"]
    assert sorted(d["lengths"]) == [20, 20, 32, 40]  # steps 3 and 4
    assert (d["n"], d["mean"], d["median"], d["limit"], d["at_limit"]) == (4, 28.0, 26.0, 64, 0)
    dens, h = _kde([20, 40, 20, 32], d["grid"][::40])
    assert d["bandwidth"] == pytest.approx(h) and h == pytest.approx(math.sqrt(96) * 4 ** -0.2)
    assert d["density"][::40] == pytest.approx(dens)
    assert np.trapezoid(d["density"], d["grid"]) == pytest.approx(1.0, abs=0.02)
    assert data["lengths_train"]["GRPO"]["last 2 steps"]["mean"] == 50.0
    e = data["lengths_eval"]["SHAPE"]["toy"]
    assert (e["n"], e["mean"], e["limit"]) == (10, 38.0, 96)


def test_length_by_difficulty_appendix_b4_by_hand(result):
    _, data = result
    diff = data["length_by_difficulty"]
    assert diff["bins"] == ["[0, .2)", "[.2, .4)", "[.4, .6)", "[.6, .8)", "[.8, 1]"]
    med = {k: [s["median"] for s in v["stats"]] for k, v in diff["runs"].items()}
    assert med == {"GRPO": [30, 50, 60, 64, 52], "MRT": [20, 30, 40, 50, 62], "SHAPE": [15, 25, 40, 50, 60]}
    # OLS slope of the bin medians over bin index 0..4: sum((x-2)(y-ybar)) / 10.
    assert {k: v["median_slope_per_bin"] for k, v in diff["runs"].items()} == pytest.approx({"GRPO": 5.8, "MRT": 10.4, "SHAPE": 11.5})
    s0 = diff["runs"]["SHAPE"]["stats"][0]
    assert (s0["q1"], s0["q3"], s0["whisker_lo"], s0["whisker_hi"], s0["n"]) == (12.5, 17.5, 10.0, 20.0, 2)


def test_summary_and_data_difficulty_fallback(tmp_path):
    # Without a base-model eval, fig. 9 bins by the data's own difficulty field (levels 1..5 here).
    path = analyze([str(RUNS / "shape")], str(tmp_path), window=2, smooth=2)
    data = json.loads((tmp_path / "analysis.json").read_text())
    diff = data["length_by_difficulty"]
    assert diff["bins"] == ["1", "2", "3", "4", "5"] and "difficulty field" in diff["source"]
    assert [s["median"] for s in diff["runs"]["shape-synthetic"]["stats"]] == [15, 25, 40, 50, 60]
    (s,) = data["summary"]
    assert (s["rollout/accuracy"], s["time/step"], s["probe/prefix_hit_rate"], s["last_step"]) == (0.75, 60.0, 0.8, 4)
    assert Path(path).is_file()


def test_grpo_only_run_skips_potential_figures_with_reasons(tmp_path):
    run = tmp_path / "grpo"
    shutil.copytree(RUNS / "grpo", run)
    shutil.rmtree(run / "eval")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rollout/acc')  # torn tail of a run still writing
    html = Path(analyze([str(run)], str(tmp_path / "out"), ["GRPO"], window=2)).read_text()
    assert (tmp_path / "out" / "fig_training_curves.png").stat().st_size > 10_000
    assert not (tmp_path / "out" / "fig6_gain_contribution.png").exists()
    assert "no run logged shape/potential_drop_rate" in html
    assert "no run has an eval report" in html


def test_response_length_limit_found_in_nested_config():
    from openrlhf_shape.eval.analysis.compute import response_length_limit

    assert response_length_limit({"rollout": {"n_samples_per_prompt": 8, "generate_max_len": 8192}}) == 8192
    assert response_length_limit({"max_response_len": 64, "x": {"max_tokens": 16}}) == 64
    assert response_length_limit({"lr": 1e-6}) is None


def test_read_metrics_last_record_of_a_step_wins(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 2, "a": 1}\n{"step": 1, "a": 0}\n\n{"step": 2, "a": 5}\n')
    assert read_metrics(p) == [{"step": 1, "a": 0}, {"step": 2, "a": 5}]
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        read_metrics(p)


def test_cli_analyze(tmp_path, capsys):
    from openrlhf_shape.cli.main import main

    rc = main(["analyze", str(RUNS / "mrt"), str(RUNS / "shape"), "--out_dir", str(tmp_path), "--labels", "MRT", "SHAPE",
               "--base_eval", str(RUNS / "base_eval"), "--window", "2"])
    assert rc == 0 and "report.html" in capsys.readouterr().out
    assert (tmp_path / "fig9_length_by_difficulty.png").is_file() and (tmp_path / "fig6_gain_contribution.png").is_file()
