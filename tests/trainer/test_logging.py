"""Run logging: JSONL per step (fsynced), resume truncation of redone steps, TensorBoard events."""

import json
import os
import subprocess

from openrlhf_shape.trainer.logging_utils import MetricsLogger, checkpoint_row, code_version


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_jsonl_and_tensorboard(tmp_path):
    run = str(tmp_path / "run")
    lg = MetricsLogger(run, {"estimator": "shape", "config": {}}, tensorboard=True)
    lg.log(1, {"rollout/accuracy": 0.25, "rollout/response_lengths": [3, 4], "actor/loss": float("nan")})
    lg.log(2, {"rollout/accuracy": 0.5})
    lg.close()
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["rollout/response_lengths"] == [3, 4]
    assert rows[0]["actor/loss"] == "nan"  # strict JSON: non-finite floats become strings
    assert json.load(open(os.path.join(run, "run.json")))["estimator"] == "shape"
    events = [f for f in os.listdir(os.path.join(run, "tensorboard")) if f.startswith("events.out.tfevents")]
    assert events and os.path.getsize(os.path.join(run, "tensorboard", events[0])) > 0


def test_resume_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    run = str(tmp_path / "run")
    lg = MetricsLogger(run, {}, resume_step=None)
    for s in (1, 2, 3):
        lg.log(s, {"x": float(s)})
    lg.close()
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "x": ')  # a crash mid-write
    lg = MetricsLogger(run, {}, resume_step=2)
    assert [(r["step"], r["x"]) for r in lg.resumed_rows] == [(1, 1.0), (2, 2.0)]  # what a resumed run builds on
    lg.log(3, {"x": 30.0})
    lg.close()
    assert _steps(os.path.join(run, "metrics.jsonl")) == [1, 2, 3]
    # a fresh (non-resumed) run keeps the old file aside instead of appending to it
    lg = MetricsLogger(run, {}, resume_step=None)
    lg.close()
    assert os.path.getsize(os.path.join(run, "metrics.jsonl")) == 0
    assert any(name.endswith(".old") for name in os.listdir(run))


def test_a_resumed_step_without_its_line_gets_the_line_its_checkpoint_kept(tmp_path):
    """A run stopped after step 2's checkpoint, before step 2's line: the resumed run writes the checkpoint's copy
    (with the step's own time, marked), once; a line that is there is kept as it is."""
    run = str(tmp_path / "run")
    lg = MetricsLogger(run, {}, resume_step=None)
    lg.log(1, {"x": 1.0})
    kept = checkpoint_row({"x": 2.0, "actor/loss": float("nan"), "rollout/response_lengths": [3, 4]})
    lg.close()  # stopped here: step 2's checkpoint written, its line not
    lg = MetricsLogger(run, {}, resume_step=2, resume_row=kept)
    assert [(r["step"], r["x"]) for r in lg.resumed_rows] == [(1, 1.0), (2, 2.0)]
    lg.log(3, {"x": 3.0})
    lg.close()
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["time"] == kept["time"] < rows[2]["time"] and rows[1]["resume/line_from_checkpoint"] == 1.0
    assert rows[1]["actor/loss"] == "nan" and rows[1]["rollout/response_lengths"] == [3, 4]
    assert "resume/line_from_checkpoint" not in rows[0] and "resume/line_from_checkpoint" not in rows[2]
    # resumed from step 2 again: its line is there now, and stays the only one
    MetricsLogger(run, {}, resume_step=2, resume_row=checkpoint_row({"x": 99.0})).close()
    assert [(r["step"], r["x"]) for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))] == [(1, 1.0),
                                                                                                          (2, 2.0)]


def test_run_json_records_the_code_of_every_segment_of_a_resumed_run(tmp_path):
    """A result is tied to the commit that produced it: code_version() is this checkout's HEAD, and a
    resumed run's run.json keeps the code of the first segment beside the resumed one's."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    code = code_version()
    if head.returncode != 0:  # not a checkout (an sdist): nothing to record
        assert code is None
        return
    assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    run = str(tmp_path / "run")
    MetricsLogger(run, {"name": "r", "code": [{"from_step": 0, "commit": "aaa", "dirty": False}]}).close()
    MetricsLogger(run, {"name": "r", "code": [{"from_step": 2, "commit": "bbb", "dirty": True}]}, resume_step=2).close()
    info = json.load(open(os.path.join(run, "run.json")))
    assert [(c["from_step"], c["commit"]) for c in info["code"]] == [(0, "aaa"), (2, "bbb")]
    MetricsLogger(run, {"name": "r", "code": [{"from_step": 0, "commit": "ccc", "dirty": False}]}).close()
    assert [c["commit"] for c in json.load(open(os.path.join(run, "run.json")))["code"]] == ["ccc"]  # a fresh run
