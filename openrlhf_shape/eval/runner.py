"""``evaluate(cfg) -> EvalReport``: the paper's avg@N pass@1 protocol over vLLM engines.

Flow per benchmark: load problems -> skip those already in ``<out_dir>/samples/<name>.jsonl`` ->
generate N samples per problem in chunks of ``chunk_size`` problems -> score every response on the reward path
training judges answers with (``RewardComputer``: Math-Verify, or the ``--reward.remote_url`` reward function or
server, its ``scores`` as ``eval/accuracy``'s) -> append the finished problems -> (after all benchmarks) the report
with bootstrap CIs, which names the scorer.

The generation backend is anything with ``generate(prompt_token_ids: [prompts][tokens],
sampling: SamplingConfig, request_seeds=[seed per prompt]) -> list[Generation]`` (``VLLMEngine`` or
``EngineGroup``); every sample is its own request with a seed from (``--seed``, benchmark, problem, sample index). Engines
are started only when some problem still needs generating, so a fully resumed run never starts vLLM.
"""

from __future__ import annotations

import dataclasses

from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol, Sequence

from openrlhf_shape.eval.config import BenchmarkSpec, EvalConfig, fingerprint
from openrlhf_shape.eval.data import Problem, load_problems
from openrlhf_shape.eval.metrics import ProblemResult
from openrlhf_shape.eval.model import resolve_model_path
from openrlhf_shape.eval.report import EvalReport, build_report, summarize_benchmark
from openrlhf_shape.eval.store import ResultStore


class GenerationBackend(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: Any,
                 request_seeds: Sequence[int] | None = None) -> list[Any]: ...


class Scorer(Protocol):
    """Anything that scores responses against labels alone (a ``MathVerifyScorer``); ``evaluate``'s own scorer is
    training's ``RewardComputer``, which a reward function also gets the queries and prompts for."""

    def score(self, responses: list[str], labels: list[str]) -> list[float]: ...


def build_prompt_ids(tokenizer, question: str, cfg: EvalConfig) -> list[int]:
    """Prompt token ids: the template with the question, inside the chat template when asked."""
    from openrlhf_shape.data.prompts import fill_template

    text = fill_template(cfg.prompt_template, question)
    if cfg.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the model's tokenizer has no chat template; pass --no_chat_template to feed raw prompts"
            )
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if cfg.system_prompt:
        text = cfg.system_prompt + "\n\n" + text
    return list(tokenizer(text)["input_ids"])


def _record(problem: Problem, gens: Sequence[Any], scores: Sequence[float], save_responses: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "problem_id": problem.problem_id,
        "index": problem.index,
        "question": problem.question,
        "answer": problem.answer,
        "difficulty": problem.difficulty,
        "scores": [float(s) for s in scores],
        "num_tokens": [len(g.token_ids) for g in gens],
        "finish_reasons": [str(g.finish_reason) for g in gens],
    }
    if save_responses:
        rec["responses"] = [g.text for g in gens]
    return rec


def problem_seeds(run_seed: int, benchmark: str, problem_id: str, n: int) -> list[int]:
    """The request seeds of a problem's ``n`` samples: from (``--seed``, the benchmark, the problem), so a problem
    samples the same whatever the chunking, the engines, a resume or the problems done before it (an unseeded
    request on vLLM 0.32's GPU runner draws from numpy's global generator: rollout/seeds.py)."""
    from openrlhf_shape.rollout.seeds import EVAL, derive_seed

    return [derive_seed(run_seed, EVAL, benchmark, problem_id, j) for j in range(n)]


def run_benchmark_chunk(
    backend: GenerationBackend,
    scorer: Scorer,
    problems: Sequence[Problem],
    prompt_ids: Sequence[list[int]],
    sampling: Any,
    save_responses: bool = True,
    seeds: Sequence[Sequence[int]] | None = None,
    tokenizer=None,
) -> list[dict[str, Any]]:
    """Generate ``sampling.n`` samples for each problem, score them, return one record per problem.
    ``seeds``: per problem, its samples' request seeds (:func:`problem_seeds`); each sample is then its own
    request (n = 1) with its own seed. ``scorer``: a :class:`Scorer`, or a ``RewardComputer`` (:func:`_judge`;
    with a reward function it needs ``tokenizer``)."""
    n = sampling.n
    if seeds is None:
        gens = backend.generate([list(p) for p in prompt_ids], sampling)
        keyed = [(g.prompt_index, g.sample_index, g) for g in gens]
    else:
        if len(seeds) != len(problems) or any(len(s) != n for s in seeds):
            raise ValueError(f"seeds: {n} per problem for {len(problems)} problems expected")
        one = dataclasses.replace(sampling, n=1)
        gens = backend.generate([list(p) for p in prompt_ids for _ in range(n)], one,
                                request_seeds=[s for per in seeds for s in per])
        keyed = [(g.prompt_index // n, g.prompt_index % n, g) for g in gens]
    by_prompt: dict[int, list[tuple[int, Any]]] = defaultdict(list)
    for i, j, g in keyed:
        by_prompt[i].append((j, g))
    for i, p in enumerate(problems):
        got = len(by_prompt.get(i, []))
        if got != n:
            raise RuntimeError(f"problem {p.problem_id!r}: the engine returned {got} samples, expected {n}")
    ordered = [[g for _, g in sorted(by_prompt[i], key=lambda x: x[0])] for i in range(len(problems))]
    texts = [g.text for gs in ordered for g in gs]
    labels = [p.answer for p, gs in zip(problems, ordered) for _ in gs]
    scores = _judge(scorer, ordered, prompt_ids, texts, labels, tokenizer)
    if len(scores) != len(texts):
        raise RuntimeError(f"scorer returned {len(scores)} scores for {len(texts)} responses")
    out, k = [], 0
    for p, gs in zip(problems, ordered):
        out.append(_record(p, gs, scores[k : k + len(gs)], save_responses))
        k += len(gs)
    return out


def _judge(scorer: Any, ordered: list[list[Any]], prompt_ids: Sequence[list[int]], texts: list[str], labels: list[str],
           tokenizer) -> list[float]:
    """One score per response (``texts``, problem-major as ``ordered``). A ``RewardComputer`` judges as it judges
    training's held-out answers: a reward function gets OpenRLHF's arguments (the query is prompt + response
    decoded with special tokens kept, the prompt as rendered) and its ``scores`` count; Math-Verify scores the
    response text."""
    from openrlhf_shape.rewards.computer import RewardComputer

    if not isinstance(scorer, RewardComputer):
        return scorer.score(texts, labels)
    if scorer.plugin is None:
        return scorer.compute(queries=texts, prompts=[""] * len(texts), labels=labels, responses=texts)["scores"].tolist()
    if tokenizer is None:
        raise ValueError("run_benchmark_chunk: a reward function judges prompt + response; pass tokenizer=")
    queries, prompts = [], []
    for ids, gs in zip(prompt_ids, ordered):
        prompt = tokenizer.decode(list(ids), skip_special_tokens=False)
        prompts += [prompt] * len(gs)
        queries += [tokenizer.decode(list(ids) + list(g.token_ids), skip_special_tokens=False) for g in gs]
    return scorer.compute(queries=queries, prompts=prompts, labels=labels, responses=texts)["scores"].tolist()


def _problem_result(rec: dict[str, Any]) -> ProblemResult:
    return ProblemResult(
        problem_id=str(rec["problem_id"]),
        scores=list(rec["scores"]),
        num_tokens=list(rec["num_tokens"]),
        finish_reasons=list(rec.get("finish_reasons", [])),
        difficulty=rec.get("difficulty"),
    )


def _make_engines(cfg: EvalConfig, hf_dir: str, max_model_len: int, stack: ExitStack | None = None):
    """One in-process VLLMEngine, or ``num_engines`` Ray engine actors in an EngineGroup (Ray is
    started here when needed, and shut down by ``stack`` when this call started it)."""
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.rollout.group import start_engines

    ecfg = dataclasses.replace(cfg.engine, model_path=hf_dir, max_model_len=max_model_len)
    if cfg.num_engines == 1:  # eval has no driver handing a profile: it decides for its own process
        return start_engines(ecfg, in_process=True, platform=detect_platform(engine_tp=ecfg.tensor_parallel_size))
    import ray

    if not ray.is_initialized():
        ray.init()
        if stack is not None:
            stack.callback(ray.shutdown)
    return start_engines(ecfg, cfg.num_engines, platform=detect_platform(engine_tp=ecfg.tensor_parallel_size))


def _make_scorer(cfg: EvalConfig):
    """Training's answer reward path (``--reward.*``): Math-Verify unless ``--reward.remote_url`` is given."""
    from openrlhf_shape.rewards.computer import RewardComputer

    return RewardComputer(cfg.scorer)


def evaluate(
    cfg: EvalConfig,
    *,
    backend: GenerationBackend | None = None,
    scorer: Scorer | None = None,
    tokenizer=None,
    progress: bool = True,
) -> EvalReport:
    """Run (or resume) the evaluation described by ``cfg``; writes ``report.json`` / ``report.md``
    into ``cfg.out_dir`` and returns the report.

    ``backend`` / ``scorer`` / ``tokenizer`` default to vLLM engines on the resolved model, the reward path of
    ``cfg.scorer`` (a ``RewardComputer``: Math-Verify unless ``--reward.remote_url``) and the model's tokenizer;
    pass your own to share engines with a trainer.
    """
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sv = cfg.sampling_values()
    with ExitStack() as stack:
        need_hf = backend is None or tokenizer is None
        hf_dir = resolve_model_path(cfg.model_path, out_dir / "exported_hf") if need_hf else cfg.model_path
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        plan = _load_benchmarks(cfg, out_dir, tokenizer)  # errors in data surface before any engine starts
        n_todo = sum(len(t) for _, _, _, t, _ in plan)
        if n_todo and backend is None:
            backend = _start_backend(cfg, hf_dir, plan, sv["max_new_tokens"], stack)
        if n_todo and scorer is None:
            scorer = _make_scorer(cfg)
            if hasattr(scorer, "close"):
                stack.callback(scorer.close)
        _generate(cfg, plan, backend, scorer, sv, n_todo, progress, tokenizer)
    report = _build_report(cfg, plan, sv, n_todo)
    report.save(out_dir)
    return report


# Per benchmark: (spec, its problems, its result store, the problems still to generate, their prompt ids).
_BenchmarkWork = tuple[BenchmarkSpec, list[Problem], ResultStore, list[Problem], list[list[int]]]


def _load_benchmarks(cfg: EvalConfig, out_dir: Path, tokenizer) -> list[_BenchmarkWork]:
    """Every benchmark's problems, what its store already holds, and the prompt ids of the rest."""
    plan: list[_BenchmarkWork] = []
    for bench in cfg.benchmarks:
        problems = load_problems(bench, cfg.limit)
        store = ResultStore(out_dir, bench.name, fingerprint(cfg, bench), overwrite=cfg.overwrite)
        todo = [p for p in problems if p.problem_id not in store.done]
        ids = [build_prompt_ids(tokenizer, p.question, cfg) for p in todo]
        plan.append((bench, problems, store, todo, ids))
    return plan


def _start_backend(cfg: EvalConfig, hf_dir: str, plan: list[_BenchmarkWork], max_new_tokens: int, stack: ExitStack):
    """vLLM engines whose max_model_len holds the longest prompt plus ``max_new_tokens``; ``stack`` shuts them down."""
    longest = max(len(x) for *_, ids in plan for x in ids)
    max_len = cfg.engine.max_model_len or longest + max_new_tokens
    if max_len < longest + max_new_tokens:
        raise ValueError(
            f"--max_model_len {max_len} < longest prompt ({longest} tokens) + --max_new_tokens "
            f"({max_new_tokens}): responses would be cut short; raise --max_model_len or leave it unset"
        )
    group = _make_engines(cfg, hf_dir, max_len, stack)
    stack.callback(group.shutdown)
    return group


def _generate(cfg: EvalConfig, plan: list[_BenchmarkWork], backend: GenerationBackend, scorer: Scorer,
              sv: dict[str, Any], n_todo: int, progress: bool, tokenizer=None) -> None:
    """Generate and score the problems still to do, chunk by chunk, appending each chunk to its store."""
    from tqdm.auto import tqdm

    from openrlhf_shape.rollout.engine import SamplingConfig

    bar = tqdm(total=n_todo, desc="eval problems", unit="prob", disable=not progress or n_todo == 0)
    for bench, problems, store, todo, ids in plan:
        sampling = SamplingConfig(
            n=cfg.n_for(bench),
            temperature=sv["temperature"],
            top_p=sv["top_p"],
            top_k=sv["top_k"],
            max_tokens=sv["max_new_tokens"],
        )
        step = cfg.chunk_for(bench)
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            bar.set_postfix_str(bench.name)
            seeds = [problem_seeds(cfg.engine.seed, bench.name, p.problem_id, sampling.n) for p in chunk]
            records = run_benchmark_chunk(
                backend, scorer, chunk, ids[start : start + step], sampling, cfg.save_responses, seeds, tokenizer
            )
            store.append(records)
            bar.update(len(chunk))
    bar.close()


def _build_report(cfg: EvalConfig, plan: list[_BenchmarkWork], sv: dict[str, Any], n_todo: int) -> EvalReport:
    """Every benchmark's summary (bootstrap CIs) over all its stored problems, and the report of them."""
    results = []
    for bench, problems, store, _, _ in plan:
        probs = [_problem_result(store.done[p.problem_id]) for p in problems]
        results.append(
            summarize_benchmark(
                bench.name,
                probs,
                max_new_tokens=sv["max_new_tokens"],
                n_boot=cfg.bootstrap_samples,
                confidence=cfg.confidence,
                seed=cfg.bootstrap_seed,
            )
        )
    return build_report(
        cfg.model_path,
        results,
        n_boot=cfg.bootstrap_samples,
        confidence=cfg.confidence,
        seed=cfg.bootstrap_seed,
        config={**cfg.to_dict(), **sv,
                "judged_by": f"--reward.remote_url {cfg.scorer.remote_url}" if cfg.scorer.remote_url else "Math-Verify"},
        generated_problems=n_todo,
    )
