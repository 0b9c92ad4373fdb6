"""The generate phase of asynchronous training with partial rollouts (``--train.partial_rollout_enable``): the batch
that trains at a step is the first ``--rollout.batch_size`` prompt groups that the pool of responses in flight
(:class:`~openrlhf_shape.rollout.partial.PartialRolloutPool`) finishes under the engines' current weights; the
responses still running carry over to the next window, and so across the weight sync, with the version of every
token recorded (``ExperienceBatch.token_versions``). The rest of a batch's making (rewards, old log-probs, segments,
probes, advantages) is the plain one, once the response is complete: its probes run on the weights the engines
hold then (``async/probe_version``). Under dynamic filtering the groups it drops are replaced by further finished groups
of the pool (:meth:`PartialRollouts.generate` with the groups still missing), admitting new prompts as it needs."""

from __future__ import annotations

import time
from typing import Any

import torch

from openrlhf_shape.batch import pad_rows
from openrlhf_shape.data.prompts import PromptBatcher
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.partial import PartialRolloutPool, finished_generations
from openrlhf_shape.rollout.protocol import Engines, Tokenizer
from openrlhf_shape.trainer.experience import generated_batch
from openrlhf_shape.trainer.phases import PhaseOutput


class PartialRollouts:
    """``engines``, ``sampling``, ``tokenizer``: the rollout's (the experience maker's: the same sampling and the same
    batch builder, :func:`~openrlhf_shape.trainer.experience.generated_batch`); ``batcher``: the prompt batcher;
    ``chunk_tokens``: ``--rollout.partial_chunk_tokens``; ``run_seed``: ``--train.seed``; ``num_steps``: the run's
    last step (no prompt is admitted that no step would train on)."""

    def __init__(self, engines: Engines, sampling: SamplingConfig, tokenizer: Tokenizer, batcher: PromptBatcher,
                 chunk_tokens: int, run_seed: int, num_steps: int):
        self.engines, self.sampling, self.tokenizer = engines, sampling, tokenizer
        self.batcher, self.num_steps = batcher, num_steps
        self.groups_per_step = batcher.batch_size
        self.pool = PartialRolloutPool(chunk_tokens, sampling.max_tokens, sampling.n, run_seed)

    def generate(self, step: int, version: int, groups: int | None = None) -> PhaseOutput:
        """The batch that trains at ``step`` (no rewards yet): ``groups`` finished prompt groups (default a step's;
        dynamic filtering's refill asks for those still missing), generated with weights of ``version`` updates for
        its tokens sampled now; metrics: the generate phase's plus ``partial/*`` and ``rollout/response_versions``."""
        pool, sampling = self.pool, self.sampling
        groups = self.groups_per_step if groups is None else groups
        needed = (self.num_steps - step) * self.groups_per_step + groups  # groups the rest of the run trains on

        def next_prompts():
            return self.batcher.next_batch() if len(pool.groups) < needed else None

        t0 = time.perf_counter()
        done, stats = pool.collect(self.engines, sampling, version, groups, next_prompts)
        seconds = time.perf_counter() - t0
        if not done:
            raise RuntimeError(f"step {step}: partial rollouts finished no prompt group (the run needs no more prompts)")
        items, gens, versions = finished_generations(done, self.tokenizer, sampling.skip_special_tokens)
        out = generated_batch(items, gens, seconds, sampling.logprobs)
        exp = out.value
        exp.token_versions = pad_rows([torch.tensor(v, dtype=torch.long) for v in versions],
                                      exp.response_mask.shape[1], torch.long).masked_fill(~exp.response_mask, -1)
        exp.policy_version = min(min(v) for v in versions)
        out.metrics.update(version_metrics(versions, version))
        out.metrics.update({"partial/rounds": float(stats.rounds), "partial/requests": float(stats.requests),
                            "partial/round_tokens": float(stats.tokens),
                            "partial/admitted_groups": float(stats.admitted_groups),
                            "rollout/slot_idle_share": stats.slot_idle_share,
                            "partial/groups_in_flight": float(pool.num_unfinished()),
                            "partial/groups_waiting": float(pool.num_finished()),
                            "partial/tokens_in_flight": float(sum(len(r.tokens) for g in pool.groups
                                                                  for r in g.responses))})
        return PhaseOutput(exp, out.metrics)

    def state_dict(self) -> dict[str, Any]:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state)


def version_metrics(versions: list[list[int]], current: int) -> dict[str, Any]:
    """Per response: the policy versions that sampled it (``rollout/response_versions``: sorted distinct versions,
    batch order); the share sampled by more than one, the mean count, and the tokens' mean age in updates at
    generation's end (``current``: the versions the engines hold now)."""
    distinct = [sorted(set(v)) for v in versions]
    tokens = [x for v in versions for x in v]
    return {"rollout/response_versions": distinct,
            "partial/multi_version_share": sum(len(d) > 1 for d in distinct) / len(distinct),
            "partial/versions_per_response/mean": sum(len(d) for d in distinct) / len(distinct),
            "partial/token_age/mean": sum(current - x for x in tokens) / max(len(tokens), 1)}
