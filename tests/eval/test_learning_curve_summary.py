"""scripts/summarize_learning_curve.py on run directories in the trainer's format: base = step-0 eval,
trained = last eval, the bar, partial runs, and the markdown table."""

import json

import pytest
from eval_test_helpers import load_script


def _load():
    return load_script("summarize_learning_curve")


def _eval(acc, lo, hi, length):
    return {"eval/accuracy": acc, "eval/accuracy_ci_low": lo, "eval/accuracy_ci_high": hi,
            "eval/response_length/mean": length, "eval/response_length_ci_low": length - 3,
            "eval/response_length_ci_high": length + 3, "eval/num_problems": 100.0,
            "eval/samples_per_problem": 4.0, "time/eval": 60.0}


def _run(tmp_path, name, estimator, num_steps, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"estimator": estimator, "config": {"trainer": {"num_steps": num_steps}}}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(d)


def _step(step, acc, **extra):
    return {"step": step, "rollout/accuracy": acc, "rollout/reward/mean": acc, "rollout/response_length/mean": 40.0,
            "time/step": 100.0, "time/probes": 10.0, **extra}


def test_summary_base_trained_bar_and_partial(tmp_path):
    mod = _load()
    g = _run(tmp_path, "g", "grpo", 2, [{"step": 0, **_eval(0.15, 0.10, 0.21, 50)}, _step(1, 0.2),
                                        _step(2, 0.3, **_eval(0.30, 0.24, 0.37, 35))])
    s = _run(tmp_path, "s", "shape", 4, [{"step": 0, **_eval(0.15, 0.10, 0.21, 50)}, _step(1, 0.2),
                                         _step(2, 0.2, **_eval(0.20, 0.14, 0.26, 40))])
    out = tmp_path / "out"
    assert mod.main([g, s, "--out", str(out), "--no_analyze"]) == 0
    data = json.loads((out / "learning_curve.json").read_text())
    grpo, shape = data["estimators"]["grpo"], data["estimators"]["shape"]
    assert grpo["base"]["step"] == 0 and grpo["trained"]["step"] == 2
    assert grpo["bar_cleared"] and not grpo["partial"] and grpo["steps"] == 2
    assert not shape["bar_cleared"] and shape["partial"]  # 0.14 <= 0.21; stopped at step 2 of 4
    assert grpo["train_reward"] == [0.2, 0.3] and grpo["seconds"] == 60.0 + 200.0
    md = (out / "learning_curve.md").read_text()
    assert "Partial" in md and "| GRPO | 2/2 | 15.0% [10.0, 21.0]" in md and "30.0% [24.0, 37.0]" in md
    assert (out / "learning_curve" / "heldout_curve.png").stat().st_size > 0


def test_base_from_another_run_with_the_same_protocol(tmp_path):
    mod = _load()
    proto = {"trainer": {"num_steps": 2, "eval_n_samples_per_prompt": 4, "seed": 42}, "data": {"eval_max_samples": 100}}
    base = _run(tmp_path, "base", "grpo", 2, [{"step": 0, **_eval(0.15, 0.10, 0.21, 50)}])
    run = _run(tmp_path, "run", "grpo", 2, [_step(1, 0.2), _step(2, 0.3, **_eval(0.30, 0.24, 0.37, 35))])
    for d in (base, run):
        (tmp_path / d / "run.json").write_text(json.dumps({"estimator": "grpo", "config": proto}))
    e = mod.summarize_run(run, base_from=base)
    assert e["base"]["accuracy"] == 0.15 and e["base_from"] == base and e["bar_cleared"]
    # the run written after flag = path (train / eval sections), its base before: the same protocol
    (tmp_path / run / "run.json").write_text(json.dumps({"estimator": "grpo", "config": {
        "train": {"num_steps": 4, "seed": 42}, "eval": {"n_samples_per_prompt": 4, "max_samples": 100}}}))
    e = mod.summarize_run(run, base_from=base)
    assert e["base_from"] == base and e["num_steps_planned"] == 4 and e["partial"] and e["config"]["seed"] == 42
    other = {**proto, "trainer": {**proto["trainer"], "eval_n_samples_per_prompt": 2}}
    (tmp_path / "base" / "run.json").write_text(json.dumps({"estimator": "grpo", "config": other}))
    with pytest.raises(ValueError, match="held-out eval settings differ"):
        mod.summarize_run(run, base_from=base)


def test_a_run_with_another_outcome_baseline_gets_its_own_label():
    mod = _load()
    assert mod.run_label({"estimator": "shape", "config": {"outcome_baseline": "none"}}) == "shape"
    assert mod.run_label({"estimator": "shape", "config": {"outcome_baseline": "group_norm"}}) == "shape+group_norm"
    assert mod.run_label({"estimator": "grpo", "config": {}}) == "grpo"
