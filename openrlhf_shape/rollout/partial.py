"""Partial rollouts (``--train.partial_rollout_enable``): responses that outlive a weight sync continue under the
new weights, every token remembering the policy version that sampled it.

OpenRLHF 0.11's meaning, which this keeps: under asynchronous training the weight broadcast does not wait for the
running generation; it pauses the engines (vLLM's ``pause_generation(mode="keep")``, which with its default
``clear_cache`` preempts the running requests and drops their KV), loads the weights and resumes them, so the
unfinished requests re-prefill their prompt + generated prefix under the new weights and decode on. Where the
broadcast lands is a matter of wall time there, so two runs (or a run and its resume) cut responses differently.

Here the cut is deterministic: a response runs in *rounds* of at most ``chunk_tokens`` new tokens (one request per
round, ``--rollout.partial_chunk_tokens``); a request that reached its round's limit without finishing is
re-submitted in the next round with its prompt + generated prefix as the prompt, which is what the engines do to
a preempted request. Weights change only between rounds (the schedule syncs between windows), so a response's
tokens after a sync come from the new policy on a prefix re-read by it, as in OpenRLHF, and the behaviour
log-prob of every token is the one its own version computed. Every round's request carries its own seed
(:func:`chunk_seed`), so a resumed run redoes the same cuts and samples.

A window (the batch that trains at one step, :meth:`PartialRolloutPool.collect`) runs rounds until ``target``
prompt groups (all ``n`` samples of a prompt) are finished; before each round it admits a new batch of prompts
while fewer than ``max_in_flight`` groups are unfinished. ``max_in_flight`` is ``target`` times the rounds a
full-length response needs, so in steady state the groups in flight sit at staggered depths and one round per
window completes a batch: a window costs at most ``chunk_tokens`` decode steps instead of the longest response's,
and the long tail is decoded beside the next batches. Finished groups leave in admission order; the responses
still running stay in the pool (saved with the checkpoint: :meth:`OneStepOffSchedule.save_pending`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from openrlhf_shape.rollout.engine import Generation, SamplingConfig
from openrlhf_shape.rollout.seeds import ROLLOUT, derive_seed

PARTIAL = "partial"  # the seed stream of partial rollouts (rollout/seeds.py)


def chunk_seed(run_seed: int, admission: int, prompt_index: int, sample_index: int, chunk: int) -> int:
    """The request seed of round ``chunk`` (0, 1, ...) of sample ``sample_index`` of prompt ``prompt_index`` of the
    ``admission``-th prompt batch admitted by the run (``run_seed``: ``--train.seed``)."""
    return derive_seed(run_seed, ROLLOUT, PARTIAL, admission, prompt_index, sample_index, chunk)


@dataclass
class PartialResponse:
    """One sample in flight: its tokens so far, their behaviour log-probs and the policy version of each."""

    sample_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # [len(tokens)] updates held by the weights that sampled it
    chunks: int = 0  # rounds run so far
    finish_reason: str | None = None  # None while running; "stop" or "length" once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PartialGroup:
    """The ``n`` samples of one prompt, admitted together (``admission``: the run's prompt-batch counter)."""

    item: Any  # the prompt item (data/prompts.py:PromptItem)
    admission: int
    prompt_index: int
    responses: list[PartialResponse]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.responses)


@dataclass
class RoundStats:
    """What :meth:`PartialRolloutPool.collect` did in one window."""

    rounds: int = 0
    requests: int = 0
    tokens: int = 0
    admitted_groups: int = 0
    slots: int = 0  # sum over rounds of requests x the round's longest continuation: the decode slots it held

    @property
    def slot_idle_share(self) -> float:
        """The share of those decode slots that decoded nothing (requests already done while the round's longest ran)."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


class PartialRolloutPool:
    """Responses in flight across weight syncs (module doc). ``chunk_tokens``: the most new tokens a response gains
    per round; ``max_new_tokens``: its whole budget; ``n``: samples per prompt; ``run_seed``: ``--train.seed``."""

    def __init__(self, chunk_tokens: int, max_new_tokens: int, n: int, run_seed: int):
        if not 1 <= chunk_tokens <= max_new_tokens:
            raise ValueError(f"--rollout.partial_chunk_tokens {chunk_tokens}: must lie in [1, --rollout.max_new_tokens "
                             f"{max_new_tokens}]")
        self.chunk_tokens, self.max_new_tokens, self.n, self.run_seed = chunk_tokens, max_new_tokens, n, run_seed
        self.groups: list[PartialGroup] = []
        self.admissions = 0  # prompt batches admitted so far (seeds derive from it)

    # ---- state ------------------------------------------------------------------------------------
    def num_unfinished(self) -> int:
        return sum(not g.finished for g in self.groups)

    def num_finished(self) -> int:
        return sum(g.finished for g in self.groups)

    def state_dict(self) -> dict[str, Any]:
        """Everything in flight (plain data; the checkpoint pickles it)."""
        return {"groups": copy.deepcopy(self.groups), "admissions": self.admissions, "chunk_tokens": self.chunk_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["chunk_tokens"]) != self.chunk_tokens:
            raise ValueError(f"--rollout.partial_chunk_tokens {self.chunk_tokens}: the checkpoint's responses in flight "
                             f"were cut at {state['chunk_tokens']} tokens per round; resume with that value")
        self.groups, self.admissions = copy.deepcopy(list(state["groups"])), int(state["admissions"])

    # ---- the window -------------------------------------------------------------------------------
    def admit(self, items: Sequence[Any]) -> int:
        """Add one prompt batch (``n`` fresh samples per prompt); returns the groups added."""
        for i, item in enumerate(items):
            self.groups.append(PartialGroup(item, self.admissions, i, [PartialResponse(j) for j in range(self.n)]))
        self.admissions += 1
        return len(items)

    def collect(self, engines, sampling: SamplingConfig, version: int, target: int,
                next_prompts: Callable[[], Sequence[Any] | None]) -> tuple[list[PartialGroup], RoundStats]:
        """Rounds under the engines' current weights (``version``: updates they hold) until ``target`` groups are
        finished (or nothing is left to run); those groups leave the pool, oldest admission first.
        ``next_prompts()``: the next prompt batch, or None when the run needs no more prompts."""
        stats = RoundStats()
        max_in_flight = target * math.ceil(self.max_new_tokens / self.chunk_tokens)
        while self.num_finished() < target:
            if self.num_unfinished() < max_in_flight:
                items = next_prompts()
                if items:
                    stats.admitted_groups += self.admit(items)
            if not self.num_unfinished():
                break  # the run needs no more prompts and everything admitted is finished
            self._round(engines, sampling, version, stats)
        done = [g for g in self.groups if g.finished][:target]
        self.groups = [g for g in self.groups if not any(g is d for d in done)]
        return done, stats

    def _round(self, engines, sampling: SamplingConfig, version: int, stats: RoundStats) -> None:
        """One request per unfinished response: at most ``chunk_tokens`` new tokens, its prefix as the prompt."""
        running = [(g, r) for g in self.groups for r in g.responses if not r.finished]
        prompts = [list(g.item.prompt_ids) + r.tokens for g, r in running]
        caps = [min(self.chunk_tokens, self.max_new_tokens - len(r.tokens)) for _, r in running]
        seeds = [chunk_seed(self.run_seed, g.admission, g.prompt_index, r.sample_index, r.chunks) for g, r in running]
        one = dataclasses.replace(sampling, n=1, max_tokens=self.chunk_tokens, logprobs=True, seed=None)
        keys = [tuple(g.item.prompt_ids) for g, _ in running]  # a prompt's samples on one engine (prefix cache)
        gens = engines.generate(prompts, one, affinity_keys=keys, max_tokens=caps, request_seeds=seeds)
        if len(gens) != len(running):
            raise RuntimeError(f"engines returned {len(gens)} continuations for {len(running)} responses in flight")
        for (g, r), gen, cap in zip(running, gens, caps):
            _extend(r, gen, cap, version, self.max_new_tokens)
        stats.rounds += 1
        stats.requests += len(running)
        stats.tokens += sum(len(gen.token_ids) for gen in gens)
        stats.slots += len(gens) * max(len(gen.token_ids) for gen in gens)


def _extend(r: PartialResponse, gen: Generation, cap: int, version: int, max_new_tokens: int) -> None:
    """Append one round's continuation; the response is finished when the engine stopped it (end of sequence or a
    stop token) or its whole budget is spent. A round that stopped at its own cap without either continues."""
    if gen.logprobs is None or len(gen.logprobs) != len(gen.token_ids):
        raise RuntimeError("partial rollouts need the sampled tokens' log-probs from the engines")
    if not gen.token_ids and gen.finish_reason == "length":
        raise RuntimeError("an engine returned no token for a response in flight (max_tokens 0?)")
    r.tokens += list(gen.token_ids)
    r.logprobs += list(gen.logprobs)
    r.versions += [version] * len(gen.token_ids)
    r.chunks += 1
    if gen.finish_reason != "length":
        r.finish_reason = gen.finish_reason  # "stop": EOS or a stop token id
    elif len(r.tokens) >= max_new_tokens:
        r.finish_reason = "length"  # the whole budget: truncated, as an uncut request would be
    elif len(gen.token_ids) < cap:
        raise RuntimeError(f"an engine stopped a response at {len(gen.token_ids)} of its round's {cap} tokens "
                           f"without a stop reason ({gen.finish_reason!r})")


def finished_generations(groups: Sequence[PartialGroup], tokenizer, skip_special_tokens: bool = True
                         ) -> tuple[list[Any], list[Generation], list[list[int]]]:
    """The finished groups as the plain rollout returns them: the sample items, one :class:`Generation` per sample
    (prompt-major; ``prompt_index`` = the group's position here) and each sample's per-token versions. The text is
    decoded from the whole response (a token's text can depend on its neighbours across a round's cut)."""
    items, gens, versions = [], [], []
    for p, g in enumerate(groups):
        for r in g.responses:
            items.append(g.item)
            gens.append(Generation(prompt_index=p, sample_index=r.sample_index, token_ids=list(r.tokens),
                                   text=tokenizer.decode(r.tokens, skip_special_tokens=skip_special_tokens),
                                   finish_reason=str(r.finish_reason), logprobs=list(r.logprobs),
                                   num_prompt_tokens=len(g.item.prompt_ids), num_cached_tokens=0))
            versions.append(list(r.versions))
    return items, gens, versions
