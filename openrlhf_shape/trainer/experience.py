"""The SHAPE experience maker: prompts -> a typed batch of experiences, one phase function each.

Phases of one step (docs/architecture.md, "One step"): :meth:`~ShapeExperienceMaker.generate`
(vLLM) -> :meth:`~ShapeExperienceMaker.rewards` (+ optional DAPO group filter, refilled by :meth:`~ShapeExperienceMaker.fill`) ->
:meth:`~ShapeExperienceMaker.logprobs` (old log-probs and entropy, the actor) ->
:meth:`~ShapeExperienceMaker.segment` -> :meth:`~ShapeExperienceMaker.probes` (potentials, vLLM) ->
:meth:`~ShapeExperienceMaker.advantages` (the registered estimator, then TCR). Each returns a
:class:`~openrlhf_shape.trainer.phases.PhaseOutput` (its value and metrics); the trainer's loop runs
them through :class:`~openrlhf_shape.trainer.phases.StepLog` in :meth:`make_experience`, the one phase list
(the trainer's loop and the tests call it alike).

The old log-probs come from a function ``SequenceBatch -> LogProbs`` (:class:`~openrlhf_shape.batch.LogProbs`:
per sample ``[T_i]``, MoE routing optional): in training the rank group's ``compute_logprobs_and_entropy`` run
inside the colocation lifecycle (``Lifecycle.forward``), in light tests and tools a plain Hugging Face forward
(:class:`openrlhf_shape.testing.hf_actor.HFActor`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from openrlhf_shape.algorithms import boundaries_as_lists, compute_token_advantages, get_segmentation, pad_potentials
from openrlhf_shape.algorithms.estimators import AdvantageEstimator
from openrlhf_shape.algorithms.kl import KLPenalty, approx_kl, kl_penalty_returns, kl_token_rewards, masked_sample_mean
from openrlhf_shape.algorithms.length_penalty import RewardShaping, stop_properly_penalty
from openrlhf_shape.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    rollout_correction_weights,
    rollout_mismatch_metrics,
)
from openrlhf_shape.batch import ExperienceBatch, LogProbs, SequenceBatch, length_mask, pad_rows
from openrlhf_shape.rollout.engine import Generation, SamplingConfig
from openrlhf_shape.rollout.probes import AGENT_PROBE_SCORER, ProbeConfig, ProbeSuffixes, estimate_potentials
from openrlhf_shape.rollout.protocol import Engines, Rewards, Tokenizer
from openrlhf_shape.rollout.seeds import PROBES, REFILL, ROLLOUT, derive_seed
from openrlhf_shape.rollout.tail import TailProbes
from openrlhf_shape.trainer.phases import PhaseOutput, StepLog

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.rollout.agents import AgentRunner


# Old log-probs and entropy of a SequenceBatch, per sample (and the MoE routing this pass used, under replay).
LogProbFn = Callable[[SequenceBatch], LogProbs]
# The critic's raw state values of a SequenceBatch: per sample of response R, [R + 1] float32 (j < R: the state
# before response token j).
ValuesFn = Callable[[SequenceBatch], Sequence[torch.Tensor]]
# Dynamic filtering's refill round: (round r >= 1, prompt groups still missing, the round's StepLog) -> the round's
# scored, filtered batch (ShapeExperienceMaker.fill).
RefillRound = Callable[[int, int, StepLog], ExperienceBatch]


class FilteringExhausted(RuntimeError):
    """Dynamic filtering could not fill a step's batch within ``--algo.dynamic_filtering_max_rounds`` refill rounds."""


# How a refill round's generate and rewards metrics join the step's (merge_round_metrics): counts add up, these
# describe the pool after the round; lists join, ".../max" takes the larger; any other is a mean over samples.
_ADDED = ("time/generate", "time/rewards", "rollout/tokens", "rollout/stop_properly_penalized", "rollout/filtered_groups",
          "agent/env_tokens", "agent/engine_calls", "agent/requests", "agent/partial_batches", "partial/rounds",
          "partial/requests", "partial/round_tokens", "partial/admitted_groups")
_LATEST = ("partial/groups_in_flight", "partial/groups_waiting", "partial/tokens_in_flight")


def merge_round_metrics(into: dict[str, Any], new: dict[str, Any], done: int, made: int) -> None:
    """Fold a refill round's metrics ``new`` (over the ``made`` samples it generated) into ``into`` (over the
    ``done`` samples generated before it), so the step's generate/rewards metrics cover every sample generated."""
    for k, v in new.items():
        old = into.get(k)
        if old is None or k in _LATEST:
            into[k] = v
        elif isinstance(v, list):
            into[k] = old + v
        elif k in _ADDED:
            into[k] = old + v
        elif k.endswith("/max"):
            into[k] = max(old, v)
        else:
            into[k] = (old * done + v * made) / max(done + made, 1)
    if "rollout/tokens_per_s" in new:
        into["rollout/tokens_per_s"] = into["rollout/tokens"] / max(into["time/generate"], 1e-9)


def slot_idle_share(lengths: Sequence[int]) -> float:
    """Of the decode slots one generate call holds (its requests x its longest response, all decoding together),
    the share that decodes nothing: requests already finished while the longest still runs (the long tail's cost)."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths)) if lengths and max(lengths) else 0.0


def tail_metrics(run: Any, seconds: float) -> dict[str, float]:
    """The generate phase's engine record (``TailRun``, ``--shape.entropy_source engine``): ``rollout/tail_share``
    (of the engines' rollout step seconds, those with fewer than half of their slots decoding) and
    ``time/generate_engine_busy_share`` (those step seconds over engines x the phase's ``seconds``)."""
    decode, engines = run.decode_seconds(), max(len(run.slots), 1)
    return {"rollout/tail_share": run.tail_seconds() / decode if decode > 0 else 0.0,
            "time/generate_engine_busy_share": min(1.0, decode / (engines * seconds)) if seconds > 0 else 0.0}


def generated_batch(sample_items: Sequence, gens: Sequence[Generation], seconds: float,
                    with_logprobs: bool) -> PhaseOutput:
    """One :class:`ExperienceBatch` (no rewards yet) of the engines' samples ``gens`` (prompt-major) and their prompt
    items, with the generate phase's metrics (``seconds``: the engines' time); ``with_logprobs``: the samples carry
    the engines' log-probs of their tokens (``SamplingConfig.logprobs``). The maker's generate phase and the
    responses that partial rollouts finished (trainer/partial.py) make their batches here."""
    empty = [i for i, g in enumerate(gens) if not g.token_ids]
    if empty:
        raise RuntimeError(f"vLLM returned empty responses for samples {empty[:5]}: check --rollout.max_new_tokens")
    lengths = torch.tensor([len(g.token_ids) for g in gens])
    width = int(lengths.max())
    rollout_lp = None
    if with_logprobs:
        rollout_lp = pad_rows([torch.tensor(g.logprobs, dtype=torch.float32) for g in gens], width)
    # --shape.entropy_source engine: the engines' entropies of the sampled tokens (the logprobs phase keeps them)
    entropy = (pad_rows([torch.tensor(g.entropies, dtype=torch.float32) for g in gens], width)
               if all(g.entropies is not None for g in gens) else None)
    exp = ExperienceBatch(
        items=list(sample_items), sequences=[list(it.prompt_ids) + list(g.token_ids) for it, g in zip(sample_items, gens)],
        prompt_lens=[len(it.prompt_ids) for it in sample_items], texts=[g.text for g in gens],
        response_mask=length_mask(lengths, width), rollout_log_probs=rollout_lp,
        truncated=torch.tensor([g.finish_reason == "length" for g in gens], dtype=torch.bool),
        routed_experts=[g.routed_experts for g in gens] if all(g.routed_experts is not None for g in gens) else None,
        entropy=entropy,
    )
    lf = lengths.float()
    return PhaseOutput(exp, {
        "rollout/response_length/mean": float(lf.mean()),
        "rollout/response_length/max": float(lf.max()),
        "rollout/response_lengths": [int(x) for x in lengths.tolist()],
        "rollout/truncated_rate": sum(g.finish_reason == "length" for g in gens) / len(gens),
        "rollout/tokens": float(lf.sum()),
        "rollout/tokens_per_s": float(lf.sum()) / max(seconds, 1e-9),
    })


def _tail_by_sample(probes: dict[tuple[int, int], Any], prompts: Sequence[tuple[int, ...]]) -> list[dict[int, Any]]:
    """``ExperienceBatch.tail_probes`` from the engines' ``(response, boundary) -> samples`` (the prompt-alone state
    named by its prompt's first response): per sample, its states by boundary, the prompt alone (0) at each."""
    first: dict[tuple[int, ...], int] = {}
    for i, key in enumerate(prompts):
        first.setdefault(key, i)
    out: list[dict[int, Any]] = [{} for _ in prompts]
    for (i, b), value in probes.items():
        out[i][b] = value
    for i, key in enumerate(prompts):
        out[i][0] = out[first[key]][0]
    return out


class ShapeExperienceMaker:
    """Phase functions that turn a batch of prompt items into an :class:`ExperienceBatch`.

    Args:
        estimator: the advantage estimator (``--algo.advantage.estimator``) bound to its settings (``--shape.*``):
            :func:`~openrlhf_shape.algorithms.estimators.get_estimator`.
        sampling: rollout sampling (``--rollout.*``, ``TrainConfig.rollout.sampling_config()``; ``n`` samples per
            prompt). With ``sampling.logprobs`` the engines return the sampled tokens' log-probs and every step logs
            the rollout/trainer mismatch (``rollout/mismatch/*``).
        probe: ``--probe.*`` (m, the probe length, adaptive rounds).
        engines: the engine group (rollouts and probes; :class:`~openrlhf_shape.rollout.protocol.Engines`).
        logprobs_fn: old log-probs and entropy of a batch (see module doc).
        reward: the reward path (:class:`~openrlhf_shape.rollout.protocol.Rewards`: outcomes and probe scores; the
            probes take the answer's reward path, or Math-Verify under ``probe.scorer == "math_verify"``).
        tokenizer: the policy's tokenizer (probe suffixes; a segmentation mode that reads token ids; agents' episodes).
        shaping: the rewards phase's switches (:class:`~openrlhf_shape.algorithms.length_penalty.RewardShaping`):
            DAPO's group filter, refilled by :meth:`fill` given a prompt source; the truncation penalty; the clip.
        rollout_correction: the rollout/trainer mismatch correction (``--algo.advantage.is_correction_*``).
        agent: the :class:`~openrlhf_shape.rollout.agents.AgentRunner` of ``--train.agent_func_path``: the
            samples are its episodes, their rewards its own (the reward function scores the episodes it leaves
            without one). Credit (segments, probes, advantages), the loss and the KL then cover only the
            policy's turns (``ExperienceBatch.action_mask``), never the environment's replies.
        ref_logprobs_fn: the reference model's log-probs of a batch (the reference ranks, through the lifecycle);
            None without a reference model (``--algo.kl.init_coef 0``).
        kl: the KL settings (``--algo.kl.*``, algorithms/kl.py); needed with ``ref_logprobs_fn``. The coefficient
            comes with each batch (:meth:`make_experience`'s ``kl_coef``): the trainer owns its controller.
        values_fn: the critic's state values of a batch (the critic's ranks, through the lifecycle); needed by an
            estimator with a critic (``--algo.advantage.estimator gae``), refused without one.
    """

    def __init__(self, estimator: AdvantageEstimator, sampling: SamplingConfig, probe: ProbeConfig,
                 engines: Engines, logprobs_fn: LogProbFn, reward: Rewards, tokenizer: Tokenizer, *,
                 shaping: RewardShaping | None = None, rollout_correction: RolloutCorrectionConfig | None = None,
                 agent: AgentRunner | None = None, ref_logprobs_fn: LogProbFn | None = None,
                 kl: KLPenalty | None = None, values_fn: ValuesFn | None = None):
        if (ref_logprobs_fn is None) != (kl is None):
            raise ValueError("the KL to the reference model needs both the reference's log-probs and the KL settings")
        if (values_fn is None) == estimator.needs_critic:
            raise ValueError(f"--algo.advantage.estimator {estimator.name} "
                             + ("needs the critic's values (values_fn)" if estimator.needs_critic else
                                "reads no critic: values_fn must be None"))
        self.values_fn = values_fn
        self.ref_logprobs_fn, self.kl = ref_logprobs_fn, kl
        self.correction = (rollout_correction or RolloutCorrectionConfig()).validate()
        if self.correction.level != "off" and not (sampling.top_p >= 1.0 and sampling.top_k in (-1, 0)):
            raise ValueError(
                "--algo.advantage.is_correction_level needs --rollout.top_p 1 and --rollout.top_k -1: under "
                "top-p/top-k vLLM's log-probs are of the truncated, renormalised distribution, so every importance "
                f"weight would carry the truncation mass (got top_p {sampling.top_p}, top_k {sampling.top_k})"
            )
        self.shaping = shaping or RewardShaping()
        self.estimator, self.shape, self.sampling, self.probe_cfg = estimator, estimator.cfg, sampling, probe
        self.engines, self.logprobs_fn, self.reward, self.tokenizer = engines, logprobs_fn, reward, tokenizer
        self.agent = agent
        if agent is not None and self.estimator.needs_segments and probe.scorer == "auto":
            raise ValueError(AGENT_PROBE_SCORER)
        self.suffixes = ProbeSuffixes.from_tokenizer(tokenizer, probe) if self.estimator.needs_segments else None
        self.segmentation = get_segmentation(self.shape, tokenizer)  # --shape.segmentation, bound once per run
        # --shape.entropy_source engine: each response's first probe round runs as it finishes, in the generate call
        # (rollout/tail.py). Not under dynamic filtering: a probe's seed names its response's place in the batch,
        # which the filter and its refills change after the generate call.
        self.probes_in_tail = (self.shape.entropy_source == "engine" and self.estimator.needs_segments
                               and agent is None and not self.shaping.dynamic_filtering_enable)

    def make_experience(self, items: Sequence, log: StepLog | None = None, seed: int | None = None,
                        more_prompts: Callable[[int], Sequence] | None = None,
                        kl_coef: float | None = None) -> ExperienceBatch:
        """All experience phases for ``items`` (prompt items with index, prompt, prompt_ids, label), timed
        into ``log`` (the step's :class:`StepLog`; a fresh one when None). ``exp.metrics`` is the log's metrics
        so far. ``seed``: the step's seed (``rollout/seeds.py:step_seed``), from which every rollout and probe
        request's seed derives (None: the engines' own generators). ``more_prompts(k)``: k further prompt items
        (the batcher), for dynamic filtering's refill (:meth:`rollout`); without it the filter only drops, and the
        batch may be empty (every group filtered): then only generate and rewards ran. ``kl_coef``: the KL
        coefficient this batch applies (with a reference model; :meth:`ref_logprobs`)."""
        log = log if log is not None else StepLog()
        exp = self.rollout(items, log, seed, more_prompts)
        if len(exp):
            exp = self.credit(self.old_policy(exp, log, kl_coef), log, seed)
        exp.metrics = log.metrics
        return exp

    # The three stages of make_experience, by the side of the cluster that does the work (the asynchronous
    # schedule, trainer/schedule.py, runs them in other windows and threads; the phases stay in one list).
    def rollout(self, items: Sequence, log: StepLog, seed: int | None = None,
                more_prompts: Callable[[int], Sequence] | None = None) -> ExperienceBatch:
        """Engines (and the reward pool): ``generate``, ``rewards`` (``seed``, ``more_prompts``: see
        :meth:`make_experience`); with dynamic filtering, refill rounds of ``more_prompts`` until ``len(items)``
        groups passed (:meth:`fill`), round r sampling with its own seed stream (``rollout/seeds.py``)."""
        exp = log.phase("generate", self.generate, items, seed)
        exp = log.phase("rewards", self.rewards, exp)
        refill = None if more_prompts is None else functools.partial(self.refill_round, more_prompts, seed)
        exp = self.fill(exp, len(items), log, refill)
        log.metrics.update(self.engines.fault_metrics())  # engines replaced this run so far, seconds it cost
        return exp

    def refill_round(self, more_prompts: Callable[[int], Sequence], seed: int | None, r: int, missing: int,
                     log: StepLog) -> ExperienceBatch:
        """Refill round ``r`` of :meth:`fill`: ``generate`` and ``rewards`` (with the filter) of ``missing`` new
        prompts, sampled with the round's own seed stream."""
        exp = log.phase("generate", self.generate, more_prompts(missing), seed, r)
        return log.phase("rewards", self.rewards, exp)

    def fill(self, exp: ExperienceBatch, target: int, log: StepLog, next_round: RefillRound | None) -> ExperienceBatch:
        """Dynamic filtering's refill, as OpenRLHF's: every filtered prompt group is replaced by a new prompt until
        ``target`` groups passed. ``exp``: the first round's scored, filtered batch (its metrics in ``log``); round
        r = 1, 2, ... is ``next_round(r, missing, round_log)``, a scored, filtered batch of at most the ``missing``
        groups (new prompts, or under partial rollouts further finished groups of the pool: nothing over-fills),
        whose metrics fold into ``log`` (:func:`merge_round_metrics`). Logs ``rollout/refill_rounds``,
        ``rollout/prompts_consumed`` (groups generated and judged, refills included) and ``rollout/filter_pass_rate``
        (the share of them that passed). Past ``dynamic_filtering_max_rounds`` rounds: :class:`FilteringExhausted`.
        ``next_round`` None (no prompt source: tests, tools): no refill, the batch keeps what passed. Without
        dynamic filtering: ``exp`` as it is."""
        if not self.shaping.dynamic_filtering_enable:
            return exp
        n, parts, rounds, limit = self.sampling.n, [exp], 0, self.shaping.dynamic_filtering_max_rounds
        generated = len(exp) + n * int(log.metrics["rollout/filtered_groups"])  # samples judged so far
        while next_round is not None and (have := sum(map(len, parts)) // n) < target:
            if rounds == limit:
                lo, hi = self.shaping.dynamic_filtering_range
                raise FilteringExhausted(
                    f"--algo.dynamic_filtering_enable: after {rounds} refill rounds (--algo.dynamic_filtering_max_rounds "
                    f"{limit}) only {have} of the step's {target} prompt groups have a mean score "
                    f"inside --algo.dynamic_filtering_range ({lo}, {hi}), of {generated // n} tried: the data cannot fill "
                    "a batch at this policy (every group all right or all wrong?). Raise --algo.dynamic_filtering_max_rounds, "
                    "widen --algo.dynamic_filtering_range, change the prompts, or turn --algo.dynamic_filtering_enable off")
            rounds += 1
            sub = StepLog()
            part = next_round(rounds, target - have, sub)
            made = len(part) + n * int(sub.metrics["rollout/filtered_groups"])
            merge_round_metrics(log.metrics, sub.metrics, generated, made)
            parts.append(part)
            generated += made
        consumed = generated // n
        log.metrics.update({"rollout/refill_rounds": float(rounds), "rollout/prompts_consumed": float(consumed),
                            "rollout/filter_pass_rate": sum(map(len, parts)) // n / max(consumed, 1)})
        return exp if len(parts) == 1 else ExperienceBatch.concat(parts)

    def old_policy(self, exp: ExperienceBatch, log: StepLog, kl_coef: float | None = None) -> ExperienceBatch:
        """Ranks: ``logprobs`` (old log-probs and entropy), then ``ref_logprobs`` with a reference model, which
        gives the batch its KL coefficient ``kl_coef``, then ``values`` with a critic."""
        exp = log.phase("logprobs", self.logprobs, exp)
        if self.ref_logprobs_fn is not None:
            exp = log.phase("ref_logprobs", self.ref_logprobs, exp, kl_coef)
        if self.values_fn is not None:
            exp = log.phase("values", self.values, exp)
        return exp

    def credit(self, exp: ExperienceBatch, log: StepLog, seed: int | None = None) -> ExperienceBatch:
        """Engines (probes) and the driver: ``segment``, ``probes``, ``advantages`` (``seed``: the step's, as the
        batch's :meth:`rollout` had)."""
        boundaries = log.phase("segment", self.segment, exp)
        potentials = log.phase("probes", self.probes, exp, boundaries, seed)
        exp = log.phase("advantages", self.advantages, exp, boundaries, potentials)
        log.metrics.update(self.engines.fault_metrics())
        return exp

    # ------------------------------------------------------------------ phases
    def generate(self, items: Sequence, seed: int | None = None, refill_round: int = 0) -> PhaseOutput:
        """n samples per prompt from the engines -> an :class:`ExperienceBatch` (no rewards yet); sample j of
        prompt i samples with ``request_seed(derive_seed(seed, ROLLOUT), i, j)`` when ``seed`` is given, in dynamic
        filtering's refill round r >= 1 with ``request_seed(derive_seed(seed, ROLLOUT, REFILL, r), i, j)``."""
        if not items:
            raise RuntimeError("the prompt source gave no prompts to generate from")
        sampling = self.sampling
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=derive_seed(seed, ROLLOUT, REFILL, refill_round) if refill_round
                                           else derive_seed(seed, ROLLOUT))
        with self.engines.during("generate"):  # named if an engine dies (EngineGroup.recover)
            if self.agent is not None:
                return self._generate_episodes(items, sampling)
            n = self.sampling.n
            t0 = time.perf_counter()
            if self.probes_in_tail and not refill_round:
                tail = TailProbes.of(self.segmentation, self.suffixes, self.probe_cfg,
                                     None if seed is None else derive_seed(seed, PROBES))
                run = self.engines.generate_with_probes([list(it.prompt_ids) for it in items], sampling, tail)
                gens = run.gens
            else:
                run, gens = None, self.engines.generate([list(it.prompt_ids) for it in items], sampling)
            seconds = time.perf_counter() - t0
        if len(gens) != len(items) * n:
            raise RuntimeError(f"engines returned {len(gens)} samples for {len(items)} prompts x n={n}")
        out = generated_batch([items[g.prompt_index] for g in gens], gens, seconds, sampling.logprobs)
        out.metrics["rollout/slot_idle_share"] = slot_idle_share([len(g.token_ids) for g in gens])
        if run is not None:
            out.value.tail_probes = _tail_by_sample(run.probes, [tuple(it.prompt_ids) for it in out.value.items])
            out.metrics.update(tail_metrics(run, seconds))
        return out

    def _generate_episodes(self, items: Sequence, sampling: SamplingConfig) -> PhaseOutput:
        """The agent's episodes (``--train.agent_func_path``), n per prompt, as an :class:`ExperienceBatch`
        with its ``action_mask`` and, when the agent gave them, rewards and scores."""
        from openrlhf_shape.rollout.agent_batch import agent_metrics, episodes_to_batch, parse_episode

        run = self.agent.run(self.engines, items, sampling)  # sampling.seed: the step's stream (episode turns)
        n = self.sampling.n
        episodes = [parse_episode(out, items[e // n], self.agent.max_length, e) for e, out in enumerate(run.outputs)]
        return PhaseOutput(episodes_to_batch(episodes, self.tokenizer), agent_metrics(episodes, run.stats))

    def _outcomes(self, exp: ExperienceBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(rewards [B], scores [B], extra-log metrics)``: an agent's own, else the reward function's."""
        if exp.rewards is not None:  # the agent's (rollout/agent_batch.py); its extra logs came with generate
            return exp.rewards, exp.scores, {}
        # OpenRLHF hands reward_func the decoded prompt + response tokens, special tokens kept.
        out = self.reward.compute(
            queries=[self.tokenizer.decode(seq, skip_special_tokens=False) for seq in exp.sequences],
            prompts=[it.prompt for it in exp.items],
            labels=[it.label for it in exp.items],
            responses=exp.texts,
            sequences=exp.sequences,  # a reward model scores the sampled ids, eos included
        )
        return out["rewards"], out["scores"], dict(out.get("extra_logs", {}))

    def rewards(self, exp: ExperienceBatch) -> PhaseOutput:
        """Outcome rewards and scores ``[B]``; then DAPO filtering when on (may leave 0 samples)."""
        rewards, scores, metrics = self._outcomes(exp)
        rewards = rewards.float()
        shaping = self.shaping
        if shaping.stop_properly_penalty_coef is not None:  # OpenRLHF: on the raw rewards, before clip and baseline
            if exp.truncated is None:
                raise RuntimeError("--reward.stop_properly_penalty_coef: this batch carries no truncation flags "
                                   "(ExperienceBatch.truncated); whoever made it must record the finish reasons")
            rewards = stop_properly_penalty(rewards, exp.truncated, shaping.stop_properly_penalty_coef)
            metrics["rollout/stop_properly_penalized"] = float(exp.truncated.sum())
        # SHAPE/MRT: R is the last potential, clipped as it comes; the outcome estimators clip their baselined
        # outcome instead (OpenRLHF's order), in the advantages phase.
        exp.rewards = rewards.clamp(*shaping.clip_range) if self.estimator.needs_segments else rewards
        exp.scores = scores.float()
        if self.estimator.needs_segments and ((exp.rewards < 0) | (exp.rewards > 1)).any():
            raise ValueError(
                "SHAPE/MRT use the outcome as the final potential, so rewards must lie in [0, 1]; the reward "
                "function (--reward.remote_url) or the agent (--train.agent_func_path) returned values outside it. "
                "Rescale it, or use --algo.advantage.estimator group_norm (GRPO)"
            )
        grouped = exp.rewards.view(-1, self.sampling.n)
        metrics["rollout/accuracy"] = float(exp.scores.mean())
        metrics["rollout/reward/mean"] = float(exp.rewards.mean())
        metrics["rollout/group_all_correct_rate"] = float((grouped.min(-1).values >= 1).float().mean())
        metrics["rollout/group_all_wrong_rate"] = float((grouped.max(-1).values <= 0).float().mean())
        exp.samples = [{"prompt": exp.items[i].prompt, "response": exp.texts[i], "label": exp.items[i].label,
                        "reward": float(exp.rewards[i])} for i in range(min(len(exp), 4))]
        if shaping.dynamic_filtering_enable:  # as OpenRLHF: a group stays when its mean score is strictly inside
            # the range (the maker's fill() then replaces the groups dropped here)
            lo, hi = shaping.dynamic_filtering_range
            # in float64, as OpenRLHF's Python floats: a float32 score of 0.2 is above a range end of 0.2 there
            mean_score = exp.scores.double().view(-1, self.sampling.n).mean(-1)
            keep = (mean_score > lo) & (mean_score < hi)  # [prompts]
            metrics["rollout/filtered_groups"] = float((~keep).sum())
            exp = exp.select(torch.nonzero(keep.repeat_interleave(self.sampling.n)).flatten().tolist())
        return PhaseOutput(exp, metrics)

    def logprobs(self, exp: ExperienceBatch) -> PhaseOutput:
        """Old-policy log-probs and entropy ``[B, T]`` at the sampling temperature (the actor)."""
        out = self.logprobs_fn(exp.sequence_batch(self.sampling.temperature))
        if out.routed_experts is not None:  # MoE routing replay: the routing this pass recorded (R2) or replayed
            exp.routed_experts = list(out.routed_experts)
        mask = exp.response_mask
        got = [(int(lp.numel()), int(en.numel())) for lp, en in zip(out.log_probs, out.entropy)]
        want = [(n, n) for n in mask.sum(-1).tolist()]
        if got != want:
            raise RuntimeError(f"actor returned (log-probs, entropy) lengths {got[:8]} for responses of {want[:8]} "
                               f"tokens ({len(got)} vs {len(want)} samples)")
        lp, ent = out.padded(mask.shape[1])
        exp.old_log_probs = torch.where(mask, lp.float(), torch.zeros_like(lp, dtype=torch.float32))
        ent = torch.where(mask, ent.float(), torch.zeros_like(ent, dtype=torch.float32))
        mask = exp.loss_mask()  # the policy's tokens: an agent's environment replies carry no sampled log-prob
        metrics: dict[str, Any] = {"actor/old_entropy/mean": float(ent[mask].mean())}
        if self.shape.entropy_source == "trainer":
            exp.entropy = ent
        elif exp.entropy is None:
            raise RuntimeError("--shape.entropy_source engine: the samples came without the engines' entropies "
                               "(SamplingConfig.entropies off, or engines built without EngineConfig.sampled_entropy)")
        else:  # the engines' (generated_batch) stay; how far the trainer's are from them, in nats
            metrics["rollout/mismatch/entropy_abs_diff"] = float((exp.entropy - ent)[mask].abs().mean())
        if exp.rollout_log_probs is None and self.correction.level != "off":
            raise ValueError("--algo.advantage.is_correction_level needs the engines' log-probs of every sampled "
                             "token; the samples came without them (SamplingConfig.logprobs off, or an agent's "
                             "sampling_params dropped logprobs)")
        if exp.rollout_log_probs is not None:  # vLLM's vs the trainer's log-probs of the sampled tokens
            for k, v in rollout_mismatch_metrics(exp.old_log_probs, exp.rollout_log_probs, mask).items():
                metrics[f"rollout/mismatch/{k}"] = v
            if self.correction.level != "off":
                exp.is_weights, wm = rollout_correction_weights(exp.old_log_probs, exp.rollout_log_probs, mask,
                                                                self.correction)
                metrics.update({f"rollout/correction/{k}": v for k, v in wm.items()})
        return PhaseOutput(exp, metrics)

    def ref_logprobs(self, exp: ExperienceBatch, kl_coef: float | None) -> PhaseOutput:
        """The reference model's log-probs ``[B, T]`` of the sampled tokens (same temperature, free MoE routing) and
        the per-token KL estimate of the old policy against it (``--algo.kl.estimator``), 0 at an agent's
        environment replies: only the policy's own tokens are penalised (OpenRLHF's action mask). Metrics with
        OpenRLHF's names, over the policy's tokens: ``kl`` (KL in the reward: the mean over samples of each sample's
        token-mean KL; in the loss the trainer logs the updates'), ``logprobs_diff`` (the same mean of
        log pi_old - log pi_ref; in the loss ``ref/logprobs_diff``, and the trainer logs the updates', as OpenRLHF).
        The batch takes its KL coefficient here (``exp.kl_coef = kl_coef``), once: the trainer's controller value
        when the batch's ranks' side ran (trainer/schedule.py)."""
        if kl_coef is None:
            raise ValueError("the KL to the reference model needs the batch's coefficient (kl_coef): the trainer "
                             "hands its KL controller's value to make_experience / old_policy")
        mask = exp.response_mask
        out = self.ref_logprobs_fn(SequenceBatch(sequences=exp.sequences, prompt_lens=exp.prompt_lens,
                                                 temperature=self.sampling.temperature))
        got, want = [int(lp.numel()) for lp in out.log_probs], mask.sum(-1).tolist()
        if got != want:
            raise RuntimeError(f"reference returned log-probs of {got[:8]} tokens for responses of {want[:8]}")
        ref, _ = out.padded(mask.shape[1])
        exp.ref_log_probs = torch.where(mask, ref.float(), torch.zeros_like(ref, dtype=torch.float32))
        # The batch carries the coefficient from here into its advantages, its update and the logged kl_coef.
        exp.kl_coef = float(kl_coef)
        policy = exp.loss_mask()  # environment replies: the policy did not sample them, no KL is charged there
        kl = approx_kl(exp.old_log_probs, exp.ref_log_probs, self.kl.estimator)
        exp.kl = torch.where(policy, kl, torch.zeros_like(kl))
        per_sample = masked_sample_mean(exp.kl, policy)
        metrics = {"ref/kl/mean": float(per_sample.mean()),
                   "ref/kl/max": float(exp.kl[policy].max()) if bool(policy.any()) else 0.0,
                   "logprobs_diff": float(masked_sample_mean(exp.old_log_probs - exp.ref_log_probs, policy).mean())}
        if self.kl.in_loss:  # the update logs OpenRLHF's: at the policy it trains (trainer/ppo_trainer.py)
            metrics["ref/logprobs_diff"] = metrics.pop("logprobs_diff")
        else:
            metrics["kl"] = metrics["ref/kl/mean"]
        return PhaseOutput(exp, metrics)

    def values(self, exp: ExperienceBatch) -> PhaseOutput:
        """The critic's values ``[B, T]`` float32 of each response token's state (prompt + the response before it:
        OpenRLHF's action values), 0 at padding and at an agent's environment replies (GAE's mask); logs
        ``critic/old_values/mean`` over the policy's tokens."""
        mask, policy = exp.response_mask, exp.loss_mask()
        out = self.values_fn(SequenceBatch(sequences=exp.sequences, prompt_lens=exp.prompt_lens,
                                           temperature=self.sampling.temperature))
        got, want = [int(v.numel()) - 1 for v in out], mask.sum(-1).tolist()
        if got != want:
            raise RuntimeError(f"critic returned values of {got[:8]} states for responses of {want[:8]} tokens")
        rows = pad_rows([v[:-1].float() for v in out], mask.shape[1])
        exp.values = torch.where(policy, rows, torch.zeros_like(rows))
        return PhaseOutput(exp, {"critic/old_values/mean": float(exp.values[policy].mean()) if bool(policy.any()) else 0.0})

    def segment(self, exp: ExperienceBatch) -> PhaseOutput:
        """Segment boundaries ``[B, K-1]`` (-1 padded); None for sequence-level estimators."""
        if not self.estimator.needs_segments:
            return PhaseOutput(None, {})
        cols = exp.action_columns()  # boundaries counted in the policy's tokens (an agent's replies left out)
        ids = cols.gather(exp.response_ids()) if self.segmentation.needs_token_ids else None
        return PhaseOutput(self.segmentation(cols.gather(exp.entropy), cols.mask, ids), {})

    def probes(self, exp: ExperienceBatch, boundaries: torch.Tensor | None, seed: int | None = None) -> PhaseOutput:
        """Potentials ``[B, K+1]`` (Phi_0..Phi_n probed, Phi_n = R) from m probes per state; ``boundaries``
        are counted in the policy's tokens (:meth:`segment`), the states are prompt + response up to them (seed
        stream ``derive_seed(seed, PROBES)`` when the step's ``seed`` is given). The probes' forced answers are
        judged on the answer's reward path (a reward function gets each as OpenRLHF's query, with the response's
        prompt and label), or by Math-Verify under ``--probe.scorer math_verify``."""
        if boundaries is None:
            return PhaseOutput(None, {})
        policy = exp.loss_mask()
        scorer = self.reward.score if self.probe_cfg.scorer == "math_verify" else self.reward
        busy0, t0 = self.engines.clock.seconds(), time.perf_counter()
        with self.engines.during("probes"):  # named if an engine dies (EngineGroup.recover)
            pot = estimate_potentials(
                self.engines, [s[:p] for s, p in zip(exp.sequences, exp.prompt_lens)], exp.responses,
                boundaries_as_lists(exp.action_columns().to_response(boundaries)), [it.label for it in exp.items],
                [float(x) for x in exp.rewards], scorer, self.probe_cfg, suffixes=self.suffixes,
                policy_tokens=None if exp.action_mask is None else [row[:len(r)].tolist() for row, r in
                                                                    zip(policy, exp.responses)],
                seed=None if seed is None else derive_seed(seed, PROBES),
                prompts=[it.prompt for it in exp.items], tokenizer=self.tokenizer,
                tail=None if exp.tail_probes is None else {(i, b): v for i, by_b in enumerate(exp.tail_probes)
                                                           for b, v in by_b.items()},
            )
        metrics = dict(pot.stats)  # probe/* under their logged names (rollout/probes.py)
        # engines at work (any call in flight, an async schedule's other stage included) against the driver scoring
        metrics["time/probes_engine_busy_share"] = min(1.0, (self.engines.clock.seconds() - busy0)
                                                       / max(time.perf_counter() - t0, 1e-9))
        metrics["probe/prefill_per_response_token"] = (metrics["probe/computed_prompt_tokens"]
                                                       / max(float(exp.response_mask.sum()), 1.0))
        return PhaseOutput(pad_potentials(pot.potentials, self.shape.num_segments), metrics)

    def advantages(self, exp: ExperienceBatch, boundaries: torch.Tensor | None,
                   potentials: torch.Tensor | None) -> PhaseOutput:
        """Token advantages ``[B, T]`` from the registered estimator (and TCR); 0 at an agent's environment replies.
        SHAPE/MRT work on the policy's tokens only (segment lengths, TCR statistics); the outcome estimators on
        the response with the policy's tokens as their mask (OpenRLHF's action mask: a discount still steps over
        a reply's positions, as there).

        KL in the reward (a reference model, ``--algo.kl.use_loss`` off): the outcome estimators get
        ``-coef * kl_t`` as a reward on every policy token before their returns, discount and whitening (OpenRLHF's
        order: ``compute_reward``, then the returns, then REINFORCE++'s whitening); SHAPE/MRT, which have no
        token returns, add the undiscounted KL still to come, ``-coef * sum_{s >= t} kl_s``, to each token's
        advantage after TCR. ``adv/kl_return/mean`` is that KL-to-go's mean over policy tokens (for the outcome
        estimators: their return's KL part before discount and whitening)."""
        policy = exp.loss_mask()
        if self.kl is not None and exp.kl_coef is None:
            raise RuntimeError("the batch carries no KL coefficient: its ref_logprobs phase reads it (once per batch)")
        in_reward = self.kl is not None and not self.kl.in_loss
        kl_returns = kl_penalty_returns(exp.kl, policy, exp.kl_coef) if in_reward else None
        token_rewards = None
        if self.estimator.needs_segments:
            cols = exp.action_columns()
            mask, entropy = cols.mask, cols.gather(exp.entropy)
        else:
            cols, mask, entropy = None, policy, exp.entropy
            if in_reward:
                token_rewards = kl_token_rewards(exp.kl, policy, exp.kl_coef)
        res = compute_token_advantages(
            self.estimator, mask, exp.rewards,
            self.sampling.n,  # filtering drops whole groups, so groups still hold n samples
            max_response_len=self.sampling.max_tokens, entropy=entropy, boundaries=boundaries,
            potentials=potentials, token_rewards=token_rewards, reward_clip_range=self.shaping.clip_range,
            values=exp.values,
        )
        exp.advantages = res.token_advantages if cols is None else cols.scatter(res.token_advantages)
        exp.returns = res.returns  # gae: the critic's targets
        metrics = dict(res.metrics)
        if self.kl is not None:
            metrics["kl_coef"] = exp.kl_coef  # the batch's own, which its update applies too
        if kl_returns is not None:
            if self.estimator.needs_segments:
                exp.advantages = exp.advantages + kl_returns
            metrics["adv/kl_return/mean"] = float(kl_returns[policy].mean())
        metrics["adv/token/mean"] = float(exp.advantages[policy].mean())
        return PhaseOutput(exp, metrics)
