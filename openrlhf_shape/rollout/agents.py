"""OpenRLHF agent files (``--train.agent_func_path FILE``) run on this trainer's engines, unchanged.

An agent file defines ``AgentExecutor``, a subclass of OpenRLHF's ``openrlhf.utils.agent.AgentExecutorBase``
(usually ``MultiTurnAgentExecutor`` over an ``AgentInstanceBase`` with async ``reset`` / ``step``), built with no
arguments, as OpenRLHF 0.11's rollout loads it. For every prompt the trainer awaits ``n`` executions of
``executor.execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)``, concurrently on one
asyncio loop, exactly the call OpenRLHF's rollout actor makes. ``llm_engine`` is :class:`EpisodeEngine`: its
``generate(prompt_token_ids, sampling_params)`` is the coroutine the executor awaits, and returns a vLLM
``RequestOutput`` of one sample.

The engines here are synchronous and batched (:class:`~openrlhf_shape.rollout.group.EngineGroup`), so the
requests of all episodes are collected and sent as one batch once every running episode waits for its
generation (episodes waiting on their environment's own I/O are not waited for longer than
``max_wait_s``). With environments that do no I/O the batches, and so (with the engines re-seeded each step)
the samples, depend only on the seed, the weights and the prompts: a resumed run repeats them. Requests go
out in episode order, each keyed to the engine that holds its prompt's prefix (the probes of its states later
land there too). What the executors return becomes an :class:`~openrlhf_shape.batch.ExperienceBatch` in
:mod:`openrlhf_shape.rollout.agent_batch`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from openrlhf_shape.rollout.engine import Generation, SamplingConfig
from openrlhf_shape.rollout.seeds import derive_seed, request_seed

FLAG = "--train.agent_func_path"
# SamplingParams fields an agent may not change from vLLM's defaults here: each changes what is sampled
# against what the trainer's log-probs describe (penalties, min-p, logit bias, banned / allowed tokens,
# ignore_eos, min_tokens), or is ours to set (seed: every turn gets its own request seed from the step's stream,
# turn_seed), or cannot run on the engines (prompt log-probs, n > 1 per call: one request is one sample).
_FIXED_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "seed", "ignore_eos",
                 "min_tokens", "prompt_logprobs", "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
                 "bad_words", "structured_outputs")


class AgentError(RuntimeError):
    """An agent file failed to load, returned something OpenRLHF would not accept, or raised."""


def load_agent_executor(path: str):
    """The ``AgentExecutor()`` of an agent file, loaded as OpenRLHF 0.11 loads it (a ``.py`` file whose
    ``AgentExecutor`` subclasses ``openrlhf.utils.agent.AgentExecutorBase``, built with no arguments)."""
    from openrlhf.utils.agent import AgentExecutorBase

    if not str(path).endswith(".py") or not os.path.isfile(path):
        raise AgentError(f"{FLAG} {path!r}: give an existing .py file that defines AgentExecutor")
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise AgentError(f"{FLAG} {path!r}: importing it raised {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, "AgentExecutor", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise AgentError(f"{FLAG} {path!r} must define `class AgentExecutor(MultiTurnAgentExecutor)` (or another "
                         "subclass of openrlhf.utils.agent.AgentExecutorBase), as OpenRLHF's agent files do")
    return cls()


def initial_params(sampling: SamplingConfig):
    """The ``vllm.SamplingParams`` an executor starts from, as OpenRLHF's rollout builds them: the rollout's
    temperature, top-p/top-k and ``max_tokens``, the sampled tokens' log-probs when the trainer needs them,
    special tokens kept in the text (a multi-turn executor then sets ``max_tokens`` per turn)."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_tokens=sampling.max_tokens, logprobs=0 if sampling.logprobs else None,
                          stop=list(sampling.stop or []), stop_token_ids=list(sampling.stop_token_ids or []),
                          skip_special_tokens=False)


def sampling_from_params(params) -> SamplingConfig:
    """One request's :class:`SamplingConfig` from the ``vllm.SamplingParams`` an executor passes; refuses the
    fields the engines do not honour (``_FIXED_FIELDS``), naming them."""
    from vllm import SamplingParams

    default = SamplingParams()
    changed = [f for f in _FIXED_FIELDS if getattr(params, f, None) != getattr(default, f, None)]
    if changed:
        raise AgentError(
            f"{FLAG}: the agent's sampling_params set {', '.join(changed)}; this trainer samples with temperature, "
            "top_p, top_k, max_tokens, stop, stop_token_ids, logprobs and skip_special_tokens only (the rest would "
            "sample from another distribution than the policy the trainer scores, or cannot run on the engines)")
    if params.max_tokens is None or params.max_tokens < 1:
        raise AgentError(f"{FLAG}: the agent asked for max_tokens={params.max_tokens}; a generation needs >= 1")
    return SamplingConfig(n=1, temperature=params.temperature, top_p=params.top_p,
                          top_k=-1 if params.top_k in (0, -1, None) else params.top_k, max_tokens=params.max_tokens,
                          logprobs=params.logprobs is not None, stop=list(params.stop or []) or None,
                          stop_token_ids=list(params.stop_token_ids or []) or None,
                          skip_special_tokens=bool(params.skip_special_tokens))


def request_output(prompt_ids: list[int], gen: Generation, request_id: str):
    """A vLLM ``RequestOutput`` of one finished sample (what an executor reads: ``outputs[0].token_ids``,
    ``.text``, ``.finish_reason``, ``.logprobs[i][token_id].logprob``)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    lps = None
    if gen.logprobs is not None:
        lps = [{int(t): Logprob(logprob=float(lp))} for t, lp in zip(gen.token_ids, gen.logprobs)]
    out = CompletionOutput(index=0, text=gen.text, token_ids=list(gen.token_ids),
                           cumulative_logprob=None if gen.logprobs is None else float(sum(gen.logprobs)),
                           logprobs=lps, finish_reason=gen.finish_reason)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_ids), prompt_logprobs=None,
                         outputs=[out], finished=True, num_cached_tokens=gen.num_cached_tokens)


def turn_seed(stream: int, prompt_index: int, sample_index: int, turn: int) -> int:
    """The request seed of one agent turn: the first turn samples as the plain rollout's request of the same
    (prompt, sample) does, so a single-turn agent repeats a plain generate; later turns draw from their own
    stream. Whatever order the episodes reach the engines in, each turn's seed is the same."""
    return request_seed(stream if turn == 0 else derive_seed(stream, "turn", turn), prompt_index, sample_index)


@dataclass
class _Request:
    episode: int
    call: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    key: tuple
    future: asyncio.Future


@dataclass
class BatchStats:
    """What one rollout's batching did: engine calls, requests, batches sent before every episode waited."""

    engine_calls: int = 0
    requests: int = 0
    partial_batches: int = 0
    seconds: float = 0.0


class RequestBatcher:
    """Collects the generation requests of ``live`` concurrent episodes and sends them to ``engines`` in
    batches (see the module doc); :meth:`drive` runs beside the episodes on their loop."""

    def __init__(self, engines, live: int, max_wait_s: float, seed: int | None = None, n: int = 1):
        self.engines, self.live, self.max_wait_s = engines, live, max_wait_s
        self.seed, self.n = seed, n  # the step's rollout seed stream and samples per prompt (see turn_seed)
        self.pending: list[_Request] = []
        self.changed = asyncio.Event()
        self.stats = BatchStats()

    def submit(self, req: _Request) -> None:
        self.pending.append(req)
        self.changed.set()

    def finished(self) -> None:
        """An episode ended (returned or raised)."""
        self.live -= 1
        self.changed.set()

    async def drive(self) -> None:
        while self.live > 0:
            if self.pending and len(self.pending) >= self.live:
                self._flush()
                continue
            self.changed.clear()
            try:  # some episodes are at their environment: wait for them, a while, when others wait for us
                await asyncio.wait_for(self.changed.wait(), self.max_wait_s if self.pending else None)
            except asyncio.TimeoutError:
                self.stats.partial_batches += 1
                self._flush()

    def _flush(self) -> None:
        """Send the pending requests: one engine call per distinct sampling setting (each request keeps its own
        token limit: a multi-turn executor gives every turn the episode's remaining budget), in episode order. A
        failure reaches every episode of the call (never a future left waiting: the episodes would hang)."""
        batch = sorted(self.pending, key=lambda r: (r.episode, r.call))
        self.pending = []
        groups: dict[str, list[_Request]] = {}
        for r in batch:
            groups.setdefault(repr(dataclasses.replace(r.sampling, max_tokens=1)), []).append(r)
        for reqs in groups.values():
            try:
                self._send(reqs)
            except Exception as exc:
                err = AgentError(f"{FLAG}: the engines failed on the agents' requests: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                for r in reqs:
                    if not r.future.done():
                        r.future.set_exception(err)

    def _send(self, reqs: list[_Request]) -> None:
        t0 = time.perf_counter()
        gens = self.engines.generate([r.prompt_ids for r in reqs], reqs[0].sampling, affinity_keys=[r.key for r in reqs],
                                     max_tokens=[r.sampling.max_tokens for r in reqs],
                                     request_seeds=None if self.seed is None else
                                     [turn_seed(self.seed, r.episode // self.n, r.episode % self.n, r.call)
                                      for r in reqs])
        if len(gens) != len(reqs):
            raise RuntimeError(f"{len(gens)} generations for {len(reqs)} requests")
        self.stats.seconds += time.perf_counter() - t0
        self.stats.engine_calls += 1
        self.stats.requests += len(reqs)
        for r, g in zip(reqs, gens):
            r.future.set_result(request_output(r.prompt_ids, g, f"agent-{r.episode}-{r.call}"))


class EpisodeEngine:
    """The ``llm_engine`` one episode's executor awaits: ``generate`` as OpenRLHF's rollout actor offers it."""

    def __init__(self, batcher: RequestBatcher, episode: int, key: tuple):
        self.batcher, self.episode, self.key, self.calls = batcher, episode, key, 0

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params, multi_modal_data=None):
        if multi_modal_data:
            raise AgentError(f"{FLAG}: the agent sent multi-modal data; this trainer is text-only")
        req = _Request(self.episode, self.calls, [int(t) for t in prompt_token_ids],
                       sampling_from_params(sampling_params), self.key, asyncio.get_running_loop().create_future())
        self.calls += 1
        self.batcher.submit(req)
        return await req.future


@dataclass
class AgentRollout:
    """The executors' outputs in episode order (prompt-major: the n episodes of a prompt together)."""

    outputs: list[dict[str, Any]]
    stats: BatchStats = field(default_factory=BatchStats)


class AgentRunner:
    """Runs an agent file's executor for every (prompt, sample) of a step on an engine group.

    ``max_length``: prompt + response tokens of an episode (OpenRLHF's ``--data.max_len``; here
    ``--data.max_prompt_len`` + ``--rollout.max_new_tokens``), handed to ``execute``.
    """

    def __init__(self, path: str, tokenizer, max_length: int, max_wait_s: float = 0.05):
        if max_length < 2:
            raise AgentError(f"{FLAG}: max_length {max_length} leaves no room for a prompt and a response")
        self.path, self.tokenizer, self.max_length, self.max_wait_s = path, tokenizer, int(max_length), max_wait_s
        self.executor = load_agent_executor(path)

    def run(self, engines, items: Sequence, sampling: SamplingConfig) -> AgentRollout:
        """``sampling.n`` episodes per item (items: ``prompt``, ``prompt_ids``, ``label``)."""
        coro = self._run(engines, list(items), sampling)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with ThreadPoolExecutor(1) as pool:  # called from inside a running loop: give the episodes their own
            return pool.submit(asyncio.run, coro).result()

    async def _run(self, engines, items: list, sampling: SamplingConfig) -> AgentRollout:
        n = sampling.n
        batcher = RequestBatcher(engines, len(items) * n, self.max_wait_s, seed=sampling.seed, n=n)
        driver = asyncio.create_task(batcher.drive())
        episodes = [self._episode(batcher, e, items[e // n], sampling) for e in range(len(items) * n)]
        try:
            outputs = await asyncio.gather(*episodes)
        finally:
            driver.cancel()
        return AgentRollout(list(outputs), batcher.stats)

    async def _episode(self, batcher: RequestBatcher, episode: int, item, sampling: SamplingConfig) -> dict:
        engine = EpisodeEngine(batcher, episode, tuple(item.prompt_ids))
        try:
            out = await self.executor.execute(prompt=item.prompt, label=item.label,
                                              sampling_params=initial_params(sampling), max_length=self.max_length,
                                              hf_tokenizer=self.tokenizer, llm_engine=engine)
        except AgentError:
            raise
        except Exception as exc:
            raise AgentError(f"{FLAG} {self.path}: the agent raised {type(exc).__name__}: {exc} (episode {episode}, "
                             f"prompt {str(item.prompt)[:120]!r})") from exc
        finally:
            batcher.finished()
        if not isinstance(out, dict):
            raise AgentError(f"{FLAG} {self.path}: execute() returned {type(out).__name__}, not OpenRLHF's dict")
        return out
