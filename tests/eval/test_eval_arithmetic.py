"""avg@N pass@1 arithmetic on known generations (real Math-Verify scoring), resume, presets, bootstrap."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from openrlhf_shape.eval.config import BenchmarkSpec, EvalConfig
from openrlhf_shape.rollout.engine import EngineConfig
from openrlhf_shape.eval.metrics import bootstrap_ci, stratified_bootstrap_macro_ci
from openrlhf_shape.eval.report import EvalReport
from openrlhf_shape.eval.runner import problem_seeds, evaluate
from openrlhf_shape.eval.store import ResultStore

from eval_test_helpers import ScriptedBackend, write_jsonl

# question -> (answer, [(response, generated tokens, finish_reason)] * N)
B1 = {
    "What is 15 - 1?": ("14", [
        (r"\boxed{14}", 12, "stop"),
        (r"so the answer is \boxed{14}.", 20, "stop"),
        (r"\boxed{13}", 8, "stop"),
        ("I keep going and going", 32, "length"),
    ]),  # 2/4 correct, mean tokens 18
    "Simplify 2/4.": (r"\frac{1}{2}", [
        (r"\boxed{\frac{1}{2}}", 10, "stop"),
        (r"$\boxed{0.5}$", 6, "stop"),
        (r"\boxed{\dfrac{1}{2}}", 14, "stop"),
        (r"\boxed{2}", 30, "stop"),
    ]),  # 3/4 correct, mean tokens 15
    "Expand (x+1)^2 - 2x.": ("x^2+1", [
        (r"\boxed{1+x^2}", 16, "stop"),
        (r"\boxed{x^2 + 1}", 16, "stop"),
        (r"\boxed{x^2+2}", 4, "stop"),
        (r"\boxed{x}", 4, "stop"),
    ]),  # 2/4 correct, mean tokens 10
}
B2 = {"What is 2 + 2?": ("4", [(r"\boxed{4}", 5, "stop"), (r"\boxed{5}", 7, "stop")])}  # 1/2, 6 tokens


def _setup(tmp_path, tokenizer):
    f1 = write_jsonl(tmp_path / "b1.jsonl", [{"problem": q, "answer": a, "difficulty": i + 1} for i, (q, (a, _)) in enumerate(B1.items())])
    f2 = write_jsonl(tmp_path / "b2.jsonl", [{"question": q, "solution": a} for q, (a, _) in B2.items()])
    script = {q: s for q, (_, s) in {**B1, **B2}.items()}
    return f1, f2, ScriptedBackend(tokenizer, script)


def _cfg(model_dir, f1, f2, out_dir, **kw):
    benches = [
        BenchmarkSpec("b1", f1, n_samples=4),
        BenchmarkSpec("b2", f2, input_key="question", label_key="solution", n_samples=2),
    ]
    return EvalConfig(model_path=model_dir, benchmarks=benches, out_dir=str(out_dir), preset="cpu", bootstrap_samples=200, **kw)


@pytest.fixture(scope="module")
def scorer():
    from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer

    s = MathVerifyScorer(num_workers=1, timeout_s=5.0)
    yield s
    s.close()


def test_known_generations_exact_accuracy_and_tokens(tmp_path, tiny_model_dir, tiny_tokenizer, scorer):
    f1, f2, backend = _setup(tmp_path, tiny_tokenizer)
    rep = evaluate(_cfg(tiny_model_dir, f1, f2, tmp_path / "out"), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    b1, b2 = rep.benchmark("b1"), rep.benchmark("b2")
    assert [p.pass_rate for p in b1.problems] == [0.5, 0.75, 0.5]
    assert [p.mean_tokens for p in b1.problems] == [18.0, 15.0, 10.0]
    assert b1.accuracy == pytest.approx((0.5 + 0.75 + 0.5) / 3)
    assert b1.mean_tokens == pytest.approx(172 / 12)
    assert b1.truncation_rate == pytest.approx(1 / 12)
    assert (b1.n_samples, b1.num_problems) == (4, 3)
    assert [p.difficulty for p in b1.problems] == [1, 2, 3]
    assert (b2.accuracy, b2.mean_tokens, b2.n_samples) == (0.5, 6.0, 2)
    assert rep.overall_accuracy == pytest.approx(((0.5 + 0.75 + 0.5) / 3 + 0.5) / 2)
    assert rep.overall_mean_tokens == pytest.approx((172 / 12 + 6.0) / 2)
    assert rep.generated_problems == 4
    lo, hi = b1.accuracy_ci
    assert 0.5 <= lo <= b1.accuracy <= hi <= 0.75  # resampling 3 problems with pass rates .5/.75/.5
    # Both files say the same, and the JSON reloads into the same report.
    again = EvalReport.load(rep.json_path)
    assert again.benchmark("b1").accuracy == b1.accuracy and again.overall_tokens_ci == rep.overall_tokens_ci
    md = open(rep.markdown_path).read()
    assert "| b1 | 3 | 4 | 58.3 |" in md and "**54.2**" in md
    saved = [json.loads(x) for x in open(tmp_path / "out" / "samples" / "b1.jsonl")]
    assert saved[0]["scores"] == [1.0, 1.0, 0.0, 0.0] and saved[0]["finish_reasons"][-1] == "length"
    assert saved[1]["responses"][1] == r"$\boxed{0.5}$"


def test_resume_skips_finished_problems(tmp_path, tiny_model_dir, tiny_tokenizer, scorer):
    f1, f2, backend = _setup(tmp_path, tiny_tokenizer)
    out = tmp_path / "out"
    first = evaluate(_cfg(tiny_model_dir, f1, f2, out, limit=2, chunk_size=1), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    assert first.generated_problems == 3  # two of b1, the one of b2
    assert backend.calls == [["What is 15 - 1?"], ["Simplify 2/4."], ["What is 2 + 2?"]]
    # A crash in the middle of a write leaves a torn last line: it is dropped and redone.
    with open(out / "samples" / "b2.jsonl", "a") as f:
        f.write('{"problem_id": "1", "scores": [1.0')
    backend.calls.clear()
    full = evaluate(_cfg(tiny_model_dir, f1, f2, out), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    assert backend.calls == [["Expand (x+1)^2 - 2x."]]  # only the problem not done before
    assert full.generated_problems == 1
    # its 4 samples carried the seeds of (--seed, benchmark, problem), not of its place in the resumed run
    pid = [json.loads(x) for x in open(out / "samples" / "b1.jsonl")][-1]["problem_id"]
    seeds = backend.seeds["Expand (x+1)^2 - 2x."]
    assert seeds == problem_seeds(0, "b1", pid, 4) and len(set(seeds)) == 4
    assert full.benchmark("b1").accuracy == pytest.approx((0.5 + 0.75 + 0.5) / 3)
    assert len(open(out / "samples" / "b1.jsonl").readlines()) == 3
    backend.calls.clear()
    done = evaluate(_cfg(tiny_model_dir, f1, f2, out), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    assert backend.calls == [] and done.generated_problems == 0
    assert done.overall_accuracy == full.overall_accuracy and done.overall_accuracy_ci == full.overall_accuracy_ci


def test_resume_refuses_changed_settings(tmp_path, tiny_model_dir, tiny_tokenizer, scorer):
    f1, f2, backend = _setup(tmp_path, tiny_tokenizer)
    out = tmp_path / "out"
    evaluate(_cfg(tiny_model_dir, f1, f2, out), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    with pytest.raises(ValueError, match="--overwrite"):
        evaluate(_cfg(tiny_model_dir, f1, f2, out, temperature=1.0), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    backend.calls.clear()
    evaluate(_cfg(tiny_model_dir, f1, f2, out, temperature=1.0, overwrite=True), backend=backend, scorer=scorer, tokenizer=tiny_tokenizer, progress=False)
    assert sum(len(c) for c in backend.calls) == 4


def test_store_keeps_records_across_instances(tmp_path):
    s = ResultStore(tmp_path, "b", {"k": 1})
    s.append([{"problem_id": "a", "scores": [1.0]}, {"problem_id": "b", "scores": [0.0]}])
    assert set(ResultStore(tmp_path, "b", {"k": 1}).done) == {"a", "b"}
    with pytest.raises(ValueError, match="other settings"):
        ResultStore(tmp_path, "b", {"k": 2})


def test_paper_preset_n_by_benchmark_name(tmp_path):
    names = {"aime24": 32, "AIME_2025": 32, "amc23": 32, "MATH-500": 2, "minerva": 4, "MinervaMATH": 4}
    cfg = EvalConfig("m", [BenchmarkSpec(n, "x.jsonl") for n in names], str(tmp_path))
    assert [cfg.n_for(b) for b in cfg.benchmarks] == list(names.values())
    assert cfg.sampling_values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "max_new_tokens": 32768}
    with pytest.raises(ValueError, match="--n_samples"):
        EvalConfig("m", [BenchmarkSpec("gsm8k", "x.jsonl")], str(tmp_path))
    over = EvalConfig("m", [BenchmarkSpec("aime24", "x", n_samples=8), BenchmarkSpec("gsm8k", "y")], str(tmp_path), n_samples=3, max_new_tokens=100)
    assert [over.n_for(b) for b in over.benchmarks] == [3, 3]
    assert over.sampling_values()["max_new_tokens"] == 100
    spec = EvalConfig("m", [BenchmarkSpec("aime24", "x", n_samples=8)], str(tmp_path))
    assert spec.n_for(spec.benchmarks[0]) == 8
    cpu = EvalConfig("m", [BenchmarkSpec("anything", "x")], str(tmp_path), preset="cpu")
    assert cpu.n_for(cpu.benchmarks[0]) == 2 and cpu.sampling_values()["max_new_tokens"] == 256
    assert cpu.chunk_for(cpu.benchmarks[0]) == 8  # 16 sequences per call / N = 2
    assert [cfg.chunk_for(cfg.benchmarks[i]) for i in (0, 3)] == [16, 256]  # 512 sequences / N (32, 2)
    # top-k off (-1) samples as the rollouts do (the frontier filter needs it); 0 and -2 are refused
    off = EvalConfig("m", [BenchmarkSpec("anything", "x")], str(tmp_path), preset="cpu", top_k=-1)
    assert off.sampling_values()["top_k"] == -1
    for bad in (0, -2):
        with pytest.raises(ValueError, match="--top_k must be -1"):
            EvalConfig("m", [BenchmarkSpec("anything", "x")], str(tmp_path), preset="cpu", top_k=bad)


def test_bad_inputs_name_the_flag(tmp_path, tiny_model_dir, tiny_tokenizer, scorer):
    f = write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "1"}])
    cfg = EvalConfig(tiny_model_dir, [BenchmarkSpec("b", f)], str(tmp_path / "o"), preset="cpu")
    with pytest.raises(KeyError, match="--benchmark_keys b=INPUT_KEY,LABEL_KEY"):
        evaluate(cfg, backend=ScriptedBackend(tiny_tokenizer, {}), scorer=scorer, tokenizer=tiny_tokenizer)
    f2 = write_jsonl(tmp_path / "b2.jsonl", [{"problem": "What is 1 + 1?", "answer": "2"}])
    short = EvalConfig(tiny_model_dir, [BenchmarkSpec("b", f2)], str(tmp_path / "o3"), preset="cpu",
                       engine=EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="--max_model_len 64 < longest prompt"):  # raised before any engine starts
        evaluate(short, scorer=scorer, tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="--preset"):
        EvalConfig("m", [BenchmarkSpec("b", f)], str(tmp_path), preset="fast")
    with pytest.raises(FileNotFoundError):
        evaluate(EvalConfig(tiny_model_dir, [BenchmarkSpec("b", str(tmp_path / "missing.jsonl"))], str(tmp_path / "o2"), preset="cpu"),
                 backend=ScriptedBackend(tiny_tokenizer, {}), scorer=scorer, tokenizer=tiny_tokenizer)


def test_bootstrap_ci_deterministic_under_seed():
    rng = np.random.default_rng(123)
    x = rng.random(50)
    a = bootstrap_ci(x, n_boot=500, seed=7)
    assert a == bootstrap_ci(x, n_boot=500, seed=7)
    assert a != bootstrap_ci(x, n_boot=500, seed=8)
    assert a[0] < x.mean() < a[1]
    groups = [x[:20], x[20:], rng.random(5)]
    s = stratified_bootstrap_macro_ci(groups, n_boot=300, seed=3)
    assert s == stratified_bootstrap_macro_ci(groups, n_boot=300, seed=3)
    assert s[0] < np.mean([g.mean() for g in groups]) < s[1]


def test_bootstrap_ci_hand_cases():
    assert bootstrap_ci([0.25, 0.25, 0.25], n_boot=100, seed=0) == (0.25, 0.25)
    # Two problems (0 and 1): a resample's mean is 0, .5 or 1 with probability 1/4, 1/2, 1/4, so
    # the 2.5% and 97.5% quantiles of many resamples are 0 and 1.
    assert bootstrap_ci([0.0, 1.0], n_boot=4000, seed=0) == (0.0, 1.0)
    lo, hi = bootstrap_ci([0.0, 1.0], n_boot=4000, confidence=0.4, seed=0)
    assert lo == hi == 0.5
    with pytest.raises(ValueError):
        bootstrap_ci([], seed=0)


def test_problem_files_jsonl_json_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from openrlhf_shape.eval.data import load_problems, read_rows

    rows = [{"problem": "1+1?", "answer": 2, "uid": "a"}, {"problem": "2+2?", "answer": "4", "uid": "b"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    (tmp_path / "p.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), tmp_path / "p.parquet")
    for suffix in ("jsonl", "json", "parquet"):
        assert [r["problem"] for r in read_rows(str(tmp_path / f"p.{suffix}"))] == ["1+1?", "2+2?"]
        probs = load_problems(BenchmarkSpec("p", str(tmp_path / f"p.{suffix}"), id_key="uid"))
        assert [(p.problem_id, p.index, p.answer) for p in probs] == [("a", 0, "2"), ("b", 1, "4")]
    assert len(load_problems(BenchmarkSpec("p", str(tmp_path / "p.jsonl")), limit=1)) == 1
    write_jsonl(tmp_path / "dup.jsonl", rows + rows[:1])
    with pytest.raises(ValueError, match="duplicate problem id 'a'"):
        load_problems(BenchmarkSpec("p", str(tmp_path / "dup.jsonl"), id_key="uid"))
    with pytest.raises(FileNotFoundError):
        read_rows(str(tmp_path / "nope.parquet"))


# OpenRLHF's reward_func interface; 1.0 only for a response that is exactly \boxed{<label>}, nothing around it.
STRICT_BOXED = r'''
import re
import torch

def reward_func(queries, prompts, labels, **kw):
    out = []
    for q, p, l in zip(queries, prompts, labels):
        m = re.fullmatch(r"\\boxed\{(.*)\}", q[len(p):].strip()) if q.startswith(p) else None
        out.append(1.0 if m and m.group(1) == l else 0.0)
    r = torch.tensor(out)
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''


class _TokenizedScript(ScriptedBackend):
    """The script's responses with their real token ids (a reward function reads prompt + response decoded)."""

    def generate(self, prompt_token_ids, sampling, request_seeds=None):
        import dataclasses

        return [dataclasses.replace(g, token_ids=self.tok.encode(g.text, add_special_tokens=False))
                for g in super().generate(prompt_token_ids, sampling, request_seeds)]


def test_eval_judged_by_a_reward_function_as_training_judges(tmp_path, tiny_model_dir, tiny_tokenizer, capsys):
    """``--reward.remote_url reward.py``: the same responses judged by the file's ``reward_func`` (OpenRLHF's
    arguments, as training's held-out eval gives them), not by Math-Verify; the report names the scorer, and a
    directory judged by one scorer does not resume under the other. The CLI takes training's --reward.* names."""
    from openrlhf_shape.cli.main import main
    from openrlhf_shape.rewards.computer import RewardConfig

    f1, f2, _ = _setup(tmp_path, tiny_tokenizer)
    backend = _TokenizedScript(tiny_tokenizer, {q: s for q, (_, s) in {**B1, **B2}.items()})
    strict = tmp_path / "strict_reward.py"
    strict.write_text(STRICT_BOXED)
    mv_cfg = _cfg(tiny_model_dir, f1, f2, tmp_path / "mv", scorer=RewardConfig(num_workers=1))
    rf_cfg = _cfg(tiny_model_dir, f1, f2, tmp_path / "rf", scorer=RewardConfig(remote_url=str(strict)))
    mv = evaluate(mv_cfg, backend=backend, tokenizer=tiny_tokenizer, progress=False)  # the default: Math-Verify
    rf = evaluate(rf_cfg, backend=backend, tokenizer=tiny_tokenizer, progress=False)
    saved = {k: [json.loads(x) for x in open(tmp_path / k / "samples" / "b1.jsonl")] for k in ("mv", "rf")}
    assert [r["responses"] for r in saved["mv"]] == [r["responses"] for r in saved["rf"]]  # the same outputs
    assert [r["scores"] for r in saved["mv"]] == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert [r["scores"] for r in saved["rf"]] == [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert mv.benchmark("b1").accuracy == pytest.approx(7 / 12) and rf.benchmark("b1").accuracy == pytest.approx(2 / 12)
    assert mv.benchmark("b2").accuracy == rf.benchmark("b2").accuracy == 0.5  # \boxed{4}: both formats agree
    assert "(judged by Math-Verify)" in mv.to_markdown()
    assert f"(judged by --reward.remote_url {strict})" in open(rf.markdown_path).read()
    assert json.loads(open(rf.json_path).read())["config"]["judged_by"] == f"--reward.remote_url {strict}"
    with pytest.raises(ValueError, match="--overwrite"):  # Math-Verify's results are not resumed by the function
        evaluate(dataclasses.replace(mv_cfg, scorer=rf_cfg.scorer), backend=backend, tokenizer=tiny_tokenizer,
                 progress=False)
    # the command line: training's flag names, on the finished directory (nothing regenerated, no engine started)
    rc = main(["eval", "--model", tiny_model_dir, "--benchmark", f"b1={f1}", "--out_dir", str(tmp_path / "rf"),
               "--preset", "cpu", "--n_samples", "4", "--bootstrap_samples", "200",
               "--reward.remote_url", str(strict), "--reward.num_workers", "1", "--reward.timeout_s", "5"])
    text = capsys.readouterr().out
    assert rc == 0 and f"(judged by --reward.remote_url {strict})" in text and "| b1 | 3 | 4 | 16.7 |" in text, text
