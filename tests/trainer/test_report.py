"""The run report (report.md, summary.json) shows the advantage instruments of issue 23 per step."""

import json

from openrlhf_shape.trainer.report import write_report


def _step(step: int, **metrics) -> dict:
    return {"step": step, "time/step": 10.0, "time/generate": 4.0, "rollout/accuracy": 0.5,
            "rollout/response_length/mean": 30.0, **metrics}


def test_report_shows_the_advantage_instruments_and_the_alarm(tmp_path):
    history = [
        _step(1, **{"shape/shaping_to_outcome": 0.25, "adv/correct/mean": 1.1, "adv/wrong/mean": -0.01,
                    "adv/wrong/std": 0.02, "shape/length_tax/mean": 0.0123, "shape/sign_reversal_rate": 0.0}),
        _step(2, **{"shape/shaping_to_outcome": 0.5, "adv/correct/mean": 1.2, "adv/wrong/mean": -0.05,
                    "adv/wrong/std": 0.03, "shape/length_tax/mean": 0.04, "shape/sign_reversal_rate": 0.5,
                    "alarm/length_drop": 0.45, "alarm/length_collapse": 1.0}),
    ]
    summary = write_report(str(tmp_path), history, setup_seconds=1.0)
    text = (tmp_path / "report.md").read_text()
    assert "the length alarm fired at step(s) [2]" in text
    assert "| step | shaping / outcome | adv correct | adv wrong | adv wrong std | length tax | sign reversals | length drop |" in text
    assert "| 2 | 0.50 | +1.200 | -0.050 | 0.030 | 0.0400 | 0.50 | +0.45 |" in text
    assert "| 1 | 0.25 | +1.100 | -0.010 | 0.020 | 0.0123 | 0.00 |  |" in text  # no drop before two windows
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["instruments"]["adv/wrong/mean"] == [-0.01, -0.05] and saved["length_alarm_steps"] == [2]


def test_grpo_report_has_the_outcome_columns_only(tmp_path):
    history = [_step(1, **{"adv/correct/mean": 0.9, "adv/wrong/mean": -0.3, "adv/wrong/std": 0.1})]
    write_report(str(tmp_path), history, setup_seconds=1.0)
    text = (tmp_path / "report.md").read_text()
    assert "| step | adv correct | adv wrong | adv wrong std |" in text and "the length alarm did not fire" in text
    assert "shaping / outcome" not in text


def test_report_and_step_line_show_where_the_engines_time_and_the_probes_went(tmp_path):
    """Issue 49 item 3: the engines' busy share of generate and probes, the generate phase's tail share, and the
    probe work hidden in generate vs exposed after it, per step in report.md and short in the console's line."""
    from openrlhf_shape.trainer.ppo_trainer import step_line

    tail = {"time/generate_engine_busy_share": 0.92, "rollout/tail_share": 0.35, "time/probes_engine_busy_share": 0.6,
            "probe/overlapped_samples": 40.0, "probe/exposed_samples": 24.0, "probe/overlapped_tokens": 150.0,
            "probe/exposed_tokens": 100.0, "probe/tokens": 250.0}
    history = [_step(1, **tail), _step(2, **{"time/probes_engine_busy_share": 0.5, "probe/overlapped_samples": 0.0,
                                             "probe/exposed_samples": 64.0, "probe/overlapped_tokens": 0.0,
                                             "probe/exposed_tokens": 250.0})]
    summary = write_report(str(tmp_path), history, setup_seconds=1.0)
    text = (tmp_path / "report.md").read_text()
    assert ("| step | engines busy in generate | generate's tail | engines busy in probes | probe samples hidden | "
            "exposed | probe tokens hidden | exposed |") in text
    assert "| 1 | 92% | 35% | 60% | 40 | 24 | 150 | 100 |" in text
    assert "| 2 |  |  | 50% | 0 | 64 | 0 | 250 |" in text  # the ordered path: no tail, every probe after generate
    assert summary["probe_time"]["rollout/tail_share"] == [0.35, None]
    assert "tail 35%, probe tokens hidden 60%" in step_line(1, 2, {**history[0], "time/step": 10.0})
    assert "tail" not in step_line(2, 2, history[1])
