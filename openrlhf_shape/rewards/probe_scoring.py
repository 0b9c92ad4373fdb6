"""Probe scoring that scales: each distinct (extracted answer, label) scored once, simple rationals
without Math-Verify, the rest through the process pool; and :class:`ProbeAnswers`, a round of probe samples
as each verifier reads them (Math-Verify: the forced answer; a reward function: OpenRLHF's query).

This module is the Math-Verify side. When the answer's reward is a reward function (``--reward.remote_url``) the
probes go to it instead (:meth:`~openrlhf_shape.rewards.computer.RewardComputer.score_probes`, ``--probe.scorer``),
so a potential and the outcome come from one verifier.

Probe answers are short and repeat heavily (m samples of one state, K states of one response, n
responses of one prompt all aim at the same few answers). :func:`verify_one` in the pool decides a
(response, label) pair from the extracted answer alone whenever extraction finds one, so

- key ``("answer", extracted answer, label)`` when :func:`extract_answer` finds an answer: every
  response with that key gets the same verdict from Math-Verify;
- key ``("text", response, label)`` otherwise (Math-Verify searches the whole text then).

Both keys see the response exactly as the pool would (capped to its last ``max_chars``). The
verdict of a key comes from :func:`~openrlhf_shape.rewards.fast_path.fast_verdict` when it is
exactly known (integers, reduced fractions, non-integer decimals against integers: see that
module), else from one pool verification of a representative response. A batch whose keys are all
decided that way never touches the pool. A cache dict passed by the caller carries verdicts across
calls (the rounds of one step).

Where the time goes (``benchmarks/bench_rewards.py --probes``, profiled): key building and the
shortcuts cost microseconds per completion; what remains is Math-Verify on the answers no exact rule
covers (malformed text such as ``11+21*282=11\times(2`` or ``answer``), about two thirds in its
LaTeX parser (ANTLR) and one third in sympy comparison, 10-300 ms each on a loaded 2-core machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, MutableMapping
from dataclasses import dataclass, field

from openrlhf_shape.rewards.extract import extract_answer
from openrlhf_shape.rewards.fast_path import fast_verdict
from openrlhf_shape.rewards.math_verify_pool import MathVerifyScorer

ScoreKey = tuple[str, str, str]


@dataclass
class ProbeScoreStats:
    """Counters of one or more ``score`` calls: texts scored, distinct keys, keys decided by the
    exact shortcuts, keys sent to the pool, keys found in the caller's cache, seconds spent in all
    and in the pool (the rest is extraction, keys and shortcuts)."""

    texts: int = 0
    unique: int = 0
    fast: int = 0
    pool: int = 0
    cached: int = 0
    seconds: float = 0.0
    pool_seconds: float = 0.0

    def add(self, other: "ProbeScoreStats") -> None:
        for name in ("texts", "unique", "fast", "pool", "cached", "seconds", "pool_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def score_key(response: str, label: str, max_chars: int) -> tuple[ScoreKey, str | None]:
    """(key, extracted answer or None) of one pair, seeing the response as the pool does."""
    if len(response) > max_chars:
        response = response[-max_chars:]
    answer, _ = extract_answer(response)
    if answer is None:
        return ("text", response, label), None
    return ("answer", answer, label), answer


@dataclass
class ProbeAnswers:
    """One round of probe samples as the verifiers read them (lists of [samples]).

    texts: ``\\boxed{`` + the sample's text, the forced answer Math-Verify judges against ``labels``.
    prompts: the prompt text of the sample's response (a reward function's ``prompts``); None when unknown.
    keys: samples with equal keys have equal queries (the same state and tokens): a reward function judges one.
    query: sample index -> OpenRLHF's query of the sample, the decoded prompt + response prefix + forced-answer
        suffix + the sample's tokens, special tokens kept (rollout/probes.py); built only for what is sent.
    sequence: sample index -> the same as token ids (probe prompt + sample tokens): what a reward model scores.
    """

    texts: list[str]
    labels: list[str]
    prompts: list[str] | None = None
    keys: list[Hashable] | None = None
    query: Callable[[int], str] | None = None
    sequence: Callable[[int], list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.texts)
        if len(self.labels) != n or any(x is not None and len(x) != n for x in (self.prompts, self.keys)):
            raise ValueError(f"ProbeAnswers: texts, labels, prompts and keys need one entry per sample ({n})")


@dataclass
class DedupProbeScorer:
    """``score(texts, labels)`` -> [1.0 | 0.0], equal to ``pool.score`` on the same pairs (see module
    doc) at a fraction of the Math-Verify calls. ``fast_path=False`` keeps deduplication only."""

    pool: MathVerifyScorer
    fast_path: bool = True
    last: ProbeScoreStats = field(default_factory=ProbeScoreStats)
    total: ProbeScoreStats = field(default_factory=ProbeScoreStats)

    def score(
        self, texts: list[str], labels: list[str], cache: MutableMapping[ScoreKey, float] | None = None
    ) -> list[float]:
        if len(texts) != len(labels):
            raise ValueError(f"score: {len(texts)} texts but {len(labels)} labels")
        t0 = time.perf_counter()
        st = ProbeScoreStats(texts=len(texts))
        cache = {} if cache is None else cache
        keys: list[ScoreKey] = []
        todo: dict[ScoreKey, str] = {}  # key -> a representative response for the pool
        seen: set[ScoreKey] = set()
        for text, label in zip(texts, labels):
            text = "" if text is None else str(text)
            label = "" if label is None else str(label)
            key, answer = score_key(text, label, self.pool.max_chars)
            keys.append(key)
            if key in seen:
                continue
            seen.add(key)
            if key in cache:
                st.cached += 1
                continue
            verdict = fast_verdict(answer, label) if self.fast_path else None
            if verdict is not None:
                cache[key] = verdict
                st.fast += 1
            else:
                todo[key] = text
        st.unique = len(seen)
        if todo:
            todo_keys = list(todo)
            t1 = time.perf_counter()
            verdicts = self.pool.score([todo[k] for k in todo_keys], [k[2] for k in todo_keys])
            st.pool_seconds = time.perf_counter() - t1
            for k, v in zip(todo_keys, verdicts):
                cache[k] = float(v)
            st.pool = len(todo_keys)
        st.seconds = time.perf_counter() - t0
        self.last = st
        self.total.add(st)
        return [cache[k] for k in keys]
