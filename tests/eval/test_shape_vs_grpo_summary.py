"""scripts/summarize_shape_vs_grpo.py on run directories in the trainer's format: every run listed (an
unfinished one marked), seeds pooled per arm, SHAPE - GRPO paired by seed, instruments per step."""

import json

import numpy as np

from openrlhf_shape.eval.metrics import ProblemResult
from openrlhf_shape.eval.pooling import write_problem_results
from eval_test_helpers import load_script


def _load():
    return load_script("summarize_shape_vs_grpo")


def _run(root, name, rates_by_step, lengths, finished=True, wrong_adv=-0.2, section="train", code=None):
    d = root / name
    d.mkdir(parents=True)
    if section:  # run.json's config: "train" (flag = path layout) or "trainer" (run directories written before it)
        (d / "run.json").write_text(json.dumps({"config": {section: {"num_steps": 2}}, **({"code": code} if code else {})}))
    rows = [{"step": s, "rollout/accuracy": 0.1 * s, "rollout/response_length/mean": lengths[s - 1],
             "time/step": 50.0, "adv/wrong/mean": wrong_adv, "alarm/length_collapse": float(s == 2 and lengths[1] < 20)}
            for s in (1, 2)[: len(lengths)]]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for step, rates in rates_by_step.items():
        write_problem_results(str(d), step, [
            ProblemResult(problem_id=str(i), scores=[1.0] * int(r * 8) + [0.0] * (8 - int(r * 8)), num_tokens=[30] * 8)
            for i, r in enumerate(rates)])
    if finished:
        (d / "summary.json").write_text("{}")
    return str(d)


def test_every_run_listed_pooled_and_paired(tmp_path):
    mod = _load()
    root = tmp_path / "runs"
    base = np.arange(40) % 8 / 8
    for s in (1, 2):
        _run(root, f"grpo-s{s}", {0: base, 1: base, 2: np.clip(base + 0.25, 0, 1)}, [40, 35],
             code=[{"from_step": 0, "commit": "1234567abc", "dirty": False}] + [{"from_step": 1, "commit": "89abcdef0", "dirty": True}] * (s == 2))
        _run(root, f"shape-s{s}", {0: base, 1: np.clip(base + 0.125, 0, 1), 2: base}, [30, 15], wrong_adv=0.0, section="trainer" if s == 2 else "train")
    _run(root, "shape-s3", {0: base}, [30], finished=False, wrong_adv=0.0)  # cut off: listed, its step 0 pooled, not paired
    _run(root, "shape-gn-s1", {}, [], finished=False, section=None)  # killed before it wrote run.json: listed, 0/?
    _run(root, "shape-g07-s1", {0: base, 2: np.clip(base - 0.125, 0, 1)}, [30, 10])  # vs SHAPE seed 1, not GRPO
    frontier = tmp_path / "f.jsonl"
    frontier.write_text("\n".join(json.dumps({"question": "q", "answer": "1", "pass_rate": r}) for r in (0.125, 0.5, 0.625)))
    out = tmp_path / "out"
    assert mod.main([str(root), "--frontier", str(frontier), "--out", str(out)]) == 0
    md = (out / "shape_vs_grpo.md").read_text()
    data = json.loads((out / "shape_vs_grpo.json").read_text())
    assert "| SHAPE (paper form) | 3 | 1/2 | NO |" in md and "| GRPO | 1 | 2/2 | yes |" in md
    assert "| step 0: 43.8%, 1: 43.8%, 2: 67.2% |" in md  # each run's held-out avg@8 at each of its evals
    # the code each run (and each resumed segment) ran, from run.json; "?" where a run did not record it
    assert md.count("| 1234567 |") == 1 and "| 1234567, 89abcde+dirty |" in md and md.count("| ? |") == 5
    assert "| SHAPE (paper form) | 2 | 2/2 | yes |" in md  # the older run.json layout
    assert "| SHAPE + group_norm outcome | 1 | 0/? | NO |" in md
    assert [p["runs"] for p in data["pooled"]["shape"]] == [3, 2, 2]  # step 0: three seeds; steps 1, 2: two
    d = data["differences"]["shape"]
    assert d["seeds"] == [1, 2] and d["step"] == 2
    assert d["accuracy"] < 0 and d["accuracy_ci"][1] < 0  # GRPO gained 0.25 on most problems, SHAPE none
    # every common eval after step 0 is paired, the middle one too (SHAPE ahead there, behind at the end)
    assert [x["step"] for x in d["by_step"]] == [1, 2] and d["by_step"][0]["accuracy"] > 0
    assert "| SHAPE (paper form) | GRPO | 1 | 2 | +" in md and "| SHAPE (paper form) | GRPO | 2 | 2 | -" in md
    g = data["differences"]["shape-g07"]
    assert g["reference"] == "shape" and g["seeds"] == [1] and g["accuracy"] < 0
    assert "| SHAPE gamma_min 0.7 (mechanism check) | SHAPE (paper form) | 2 | 1 |" in md
    assert data["instruments"]["shape"]["adv/wrong/mean"] == [0.0, 0.0]
    assert data["runs"]["shape"]["1"]["alarm_steps"] == [2] and data["runs"]["grpo"]["1"]["alarm_steps"] == []
    assert "median pass rate 0.500" in md and (out / "shape_vs_grpo" / "curves.png").stat().st_size > 0
