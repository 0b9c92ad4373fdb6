"""When a step's experience is made, relative to the update that trains on it.

:class:`SyncSchedule` (the default): the six experience phases, then the update, then the weight sync; the
engines idle while the ranks train and the ranks idle while the engines generate and probe.

:class:`OneStepOffSchedule` (``--train.async_enable``, a disaggregated layout): the engines make the next batch
while the ranks train on this one. Window ``t`` (E = engines, R = ranks; the weight sync ends the window and
needs both sides idle, so the schedule waits for the engines' side first, :meth:`settle`):

* ``--train.max_staleness 1`` (one step off): R computes batch t's old log-probs and entropy, E re-scores a few
  of its sequences (the fidelity check) and runs its probes, then {R: update(t)} || {E: generate and score batch
  t+1}. Batch t+1 comes from the weights of update t-1 and trains from those of update t.
  The probes cannot hide at this staleness: SHAPE's segmentation needs the trainer's entropy of the batch, which
  exists only after the previous update. With ``--shape.entropy_source engine`` it needs only the engines' entropies,
  and each response's first probe round runs inside the generate call beside the update (``rollout/tail.py``); the
  credit stage then scores it (docs/architecture.md, "Probes in the rollout's tail").
* ``--train.max_staleness 2``: R computes batch t+1's old log-probs and entropy first, then {R: update(t)} ||
  {E: batch t+1's probes, then generate and score batch t+2}. Batch t+2 comes from the weights of update t-1
  and trains from those of update t+1; its old log-probs come from update t (one behind its update's start).

Which policy each quantity comes from (the docs/architecture.md table): samples and the engines' log-probs from
the engines' weights (``policy_version``); old log-probs and entropy, hence the segments, from the ranks'
weights when they ran (``logprob_version``); probes from the engines' weights at that time, equal to the ranks'
(``max_staleness`` 1: after the sync of update t-1; 2: the same weights as the old log-probs), or under
``--shape.entropy_source engine`` (their first round) from the weights that sampled the batch. The gap between
the engines' and the trainer's log-probs is then the policy's drift (``rollout/mismatch/*``, corrected by
``--algo.advantage.is_correction_level``); whether the engines compute the trained policy is checked on a few
re-scored sequences instead (``rollout/fidelity/*``, the gap guard's metric in this mode).

The KL coefficient (``--algo.kl.*`` with a reference model; adaptive with ``--algo.kl.target``) belongs to the
trainer, which updates its controller after each step's update and hands the value to :meth:`experience`; every
batch whose ranks' side (its reference pass, ``ShapeExperienceMaker.ref_logprobs``) runs in that call takes it
(``ExperienceBatch.kl_coef``) and carries it into its advantages (KL in the reward), its update (KL in the loss)
and the logged ``kl_coef``; the engines' thread never sees it. So batch t applies the controller's value after
step t-1 in synchronous training and at staleness 1 (its ranks' side runs in window t), and after step t-2 at
staleness 2 (its ranks' side runs in window t-1; the first batch of a run, made serially, after step t-1). A
resumed run applies the same values: the controller is saved with each checkpoint, the batches in flight with
their coefficients.

Every request a batch makes carries its own seed, derived from the step that trains on the batch
(``rollout/seeds.py:step_seed``, in both schedules), so a batch's content depends only on (seed, step, weights),
whatever the engines' count or state. A
checkpoint stores the batches in flight (:meth:`OneStepOffSchedule.save_pending`): a resumed run continues
with them and repeats the uninterrupted run step for step (the weights that generated them are gone).

Dynamic filtering's refill rounds (``--algo.dynamic_filtering_enable``, :meth:`ShapeExperienceMaker.fill`) are part of
a batch's generate and rewards: on the engines' side of the window in the asynchronous schedule, so they overlap the
update as the rest of the generation does; the batcher's position then includes the prompts they took.

With ``--train.partial_rollout_enable`` the engines' generate is :class:`~openrlhf_shape.trainer.partial.PartialRollouts`:
the batch is the first prompt groups that the responses in flight finish, whose tokens may come from several
versions (``ExperienceBatch.token_versions``; ``policy_version`` is the oldest); the responses still running are
saved with the batches in flight. The probes run when the batch's credit does (``probe_version``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from openrlhf_shape.batch import ExperienceBatch, SequenceBatch
from openrlhf_shape.data.prompts import PromptBatcher
from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.protocol import Engines, Tokenizer
from openrlhf_shape.rollout.seeds import step_seed
from openrlhf_shape.trainer.experience import LogProbFn, ShapeExperienceMaker
from openrlhf_shape.trainer.partial import PartialRollouts
from openrlhf_shape.trainer.phases import StepLog

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf_shape.config import TrainConfig

PENDING_DIR = "async_pending"  # beside the step_XXXXXX checkpoints: the batches in flight when each was written
FIDELITY_ROWS = 2  # sequences per engine that the engines re-score each step (asynchronous training)


def check_resumable(extra: dict, async_enable: bool, staleness: int, partial_chunk: int = 0) -> None:
    """Refuse (``ValueError`` naming the flag to change) a checkpoint whose batches in flight this schedule cannot
    continue. ``extra``: what the trainer stored with the checkpoint (``meta.json``'s ``extra``);
    ``async_enable`` / ``staleness``: ``--train.async_enable`` / ``--train.max_staleness`` of the resuming run;
    ``partial_chunk``: its ``--rollout.partial_chunk_tokens`` under ``--train.partial_rollout_enable``, else 0.
    The trainer calls it before starting anything (:func:`openrlhf_shape.trainer.ppo_trainer.check_resume`)
    and again when it loads the batches (:meth:`SyncSchedule.load_pending`)."""
    if not async_enable:
        if extra.get("async_pending"):
            raise ValueError("this checkpoint was written by an asynchronous run (--train.async_enable) and holds the "
                             "batches it had in flight; resume it with --train.async_enable and the same "
                             f"--train.max_staleness ({extra.get('async_staleness')})")
        return
    if not extra.get("async_pending"):
        raise ValueError("--train.async_enable: this checkpoint was written by a synchronous run, which keeps no "
                         "batches in flight; resume it without --train.async_enable")
    if int(extra.get("async_staleness", 0)) != staleness:
        raise ValueError(f"--train.max_staleness {staleness}: the checkpoint was written with "
                         f"{extra.get('async_staleness')}, whose batches in flight are of another depth; use that")
    written = int(extra.get("partial_rollout", 0))
    if written != partial_chunk:
        raise ValueError(
            "--train.partial_rollout_enable: the checkpoint was written "
            + (f"with partial rollouts cut every {written} tokens (--rollout.partial_chunk_tokens); resume with "
               "--train.partial_rollout_enable and that value" if written else
               "without partial rollouts, so it holds no responses in flight; resume without --train.partial_rollout_enable"))


class SyncSchedule:
    """The six experience phases of the step's own batch, with the weights of the previous update, on the maker's
    ``engines`` (handed, as the maker's users read nothing of it: they name the step of a dead engine)."""

    def __init__(self, maker: ShapeExperienceMaker, batcher: PromptBatcher, seed: int, engines: Engines):
        self.maker, self.batcher, self.seed, self.engines = maker, batcher, seed, engines

    def experience(self, step: int, rec: StepLog, kl_coef: float | None = None) -> ExperienceBatch:
        """The batch that trains at ``step``, complete. ``kl_coef``: the trainer's KL coefficient now (with a
        reference model), which the batches whose reference pass runs in this call apply (module doc)."""
        items = self.batcher.next_batch()
        # Sampling depends only on (seed, step, weights, prompts): a resumed run redoes a step exactly.
        # generate, rewards (dynamic filtering: refills from the batcher), logprobs, segment, probes, advantages
        with self.engines.during(step=step):  # a dead engine is named with the step (EngineGroup.recover)
            return self.maker.make_experience(items, rec, seed=step_seed(self.seed, step),
                                              more_prompts=self.batcher.next_batch, kl_coef=kl_coef)

    def settle(self, rec: StepLog, updated: bool) -> None:
        """Nothing runs beside the update."""

    def save_pending(self, ckpt_root: str, step: int) -> dict:
        return {}

    def load_pending(self, extra: dict, ckpt_root: str) -> None:
        check_resumable(extra, async_enable=False, staleness=0)

    def close(self) -> None:
        pass


class OneStepOffSchedule(SyncSchedule):
    """Asynchronous schedule (module doc). ``engines``, ``sampling``, ``tokenizer``: the rollout's, the maker's too
    (the fidelity check, partial rollouts); ``logprobs_fn``: the old log-probs' (ranks, through the lifecycle);
    ``num_steps``: the run's last step (nothing is generated past it); ``partial_chunk``: partial rollouts' cut
    (0: off)."""

    def __init__(self, maker: ShapeExperienceMaker, batcher: PromptBatcher, seed: int, staleness: int, num_steps: int,
                 engines: Engines, sampling: SamplingConfig, tokenizer: Tokenizer, logprobs_fn: LogProbFn,
                 partial_chunk: int = 0):
        super().__init__(maker, batcher, seed, engines)
        if staleness not in (1, 2):
            raise ValueError(f"--train.max_staleness {staleness}: 1 or 2")
        self.staleness, self.num_steps = staleness, num_steps
        self.temperature, self.logprobs_fn = sampling.temperature, logprobs_fn
        # --train.partial_rollout_enable: the responses in flight across syncs (trainer/partial.py); None: off
        self.partial = (PartialRollouts(engines, sampling, tokenizer, batcher, partial_chunk, seed, num_steps)
                        if partial_chunk else None)
        self.updates = 0  # optimizer updates the ranks have applied (= the engines', after each sync)
        self.generated: ExperienceBatch | None = None  # generated and scored: the next step's (staleness 1) or the one after
        self.ready: ExperienceBatch | None = None  # staleness 2: advantages done, for the next step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engines")
        self._work: Future | None = None
        self._work_seconds = 0.0
        self._step, self._update_since = 0, 0.0
        # (what, step of the batch, start, end) in perf_counter seconds: "generate", "old_policy", "credit" (the
        # batch's stages), "update" (from experience() returning to settle(): the ranks' update of that step),
        # "wait" (settle waiting for the engines). Tests read the overlap order from it.
        self.events: list[tuple[str, int, float, float]] = []

    # ---- the step --------------------------------------------------------------------------------
    def experience(self, step: int, rec: StepLog, kl_coef: float | None = None) -> ExperienceBatch:
        """The batch that trains at ``step``, complete; the engines' share of the window starts before returning.
        ``kl_coef``: as :meth:`SyncSchedule.experience`."""
        if self.staleness == 1:
            exp = self.generated if self.generated is not None else self._generate(step)  # first step: serial
            self.generated = None
            exp = self._engine_side(self._rank_side(exp, step, kl_coef), step)

            def engines_work() -> None:
                self.generated = self._generate(step + 1)

            if step + 1 <= self.num_steps:
                self._start(engines_work)
        else:
            if self.ready is None:  # first step of a run: batch `step` serially, then batch step + 1 generated
                self.ready = self._engine_side(self._rank_side(self._generate(step), step, kl_coef), step)
            if self.generated is None and step + 1 <= self.num_steps:
                self.generated = self._generate(step + 1)
            exp, nxt = self.ready, self.generated
            self.ready = self.generated = None
            if nxt is not None:
                # its old log-probs and entropy, before the update changes the weights
                nxt = self._rank_side(nxt, step + 1, kl_coef)

                def engines_work() -> None:
                    self.ready = self._engine_side(nxt, step + 1)
                    if step + 2 <= self.num_steps:
                        self.generated = self._generate(step + 2)

                self._start(engines_work)
        rec.metrics.update(exp.metrics)
        rec.metrics["async/staleness"] = float(self.updates - exp.policy_version)
        rec.metrics["async/logprob_staleness"] = float(self.updates - exp.logprob_version)
        # which weights made the batch, in updates applied: its samples' (oldest token), its probes', and under
        # partial rollouts its tokens' mean and largest distance to the update that trains on them
        rec.metrics["async/policy_version"] = float(exp.policy_version)
        if exp.probe_version is not None:
            rec.metrics["async/probe_version"] = float(exp.probe_version)
        if exp.token_versions is not None and len(exp):
            age = (self.updates - exp.token_versions[exp.token_versions >= 0]).float()
            rec.metrics["async/token_staleness/mean"], rec.metrics["async/token_staleness/max"] = float(age.mean()), float(age.max())
        self._step, self._update_since = step, time.perf_counter()
        return exp

    def settle(self, rec: StepLog, updated: bool) -> None:
        """Wait for the engines' side of the window (a weight sync may not run under a request); count the update."""
        t0 = time.perf_counter()
        self.events.append(("update", self._step, self._update_since, t0))
        if self._work is not None:
            work, self._work = self._work, None
            work.result()  # re-raises what failed in the engines' thread
        self.events.append(("wait", self._step, t0, time.perf_counter()))
        rec.metrics["async/wait_seconds"] = time.perf_counter() - t0  # ranks idle, waiting for the engines
        rec.metrics["async/overlap_seconds"] = min(self._work_seconds, rec.metrics.get("time/train", 0.0))
        self._work_seconds = 0.0
        if updated:
            self.updates += 1

    # ---- the two sides ---------------------------------------------------------------------------
    def _start(self, fn: Callable[[], Any]) -> None:
        def timed() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                self._work_seconds = time.perf_counter() - t0

        self._work = self._pool.submit(timed)

    def _generate(self, step: int) -> ExperienceBatch:
        """Engines: generate and score the batch that trains at ``step``, with the weights they hold now."""
        t0, log = time.perf_counter(), StepLog()
        with self.engines.during("generate", step):  # a dead engine is named with the step (EngineGroup.recover)
            if self.partial is not None:  # the first groups the responses in flight finish, tokens of several versions
                exp = log.phase("generate", self.partial.generate, step, self.updates)
                exp = log.phase("rewards", self.maker.rewards, exp)

                def refill(r: int, missing: int, sub: StepLog) -> ExperienceBatch:  # further finished groups of the pool
                    return sub.phase("rewards", self.maker.rewards,
                                     sub.phase("generate", self.partial.generate, step, self.updates, missing))

                exp = self.maker.fill(exp, self.batcher.batch_size, log, refill)  # dynamic filtering's refills
                log.metrics.update(self.engines.fault_metrics())
            else:  # dynamic filtering refills from the batcher here, on the engines' side
                exp = self.maker.rollout(self.batcher.next_batch(), log, seed=step_seed(self.seed, step),
                                         more_prompts=self.batcher.next_batch)
                exp.policy_version = self.updates
                if exp.tail_probes is not None:  # the first probe round ran in the generate call, on these weights
                    exp.probe_version = self.updates
        exp.metrics = log.metrics
        self.events.append(("generate", step, t0, time.perf_counter()))
        return exp

    def _rank_side(self, exp: ExperienceBatch, step: int, kl_coef: float | None) -> ExperienceBatch:
        """Ranks: old log-probs and entropy with the weights they hold now (the engines hold the same: the
        fidelity check re-scores a few sequences on the engines and compares); with a reference model its
        log-probs and the batch's KL coefficient ``kl_coef`` (module doc). Runs on the thread that calls
        :meth:`experience`."""
        if not len(exp):
            return exp
        t0 = time.perf_counter()
        exp = self.maker.old_policy(exp, _log_into(exp.metrics), kl_coef)
        exp.logprob_version = self.updates
        exp.metrics.update(self._fidelity(exp))
        self.events.append(("old_policy", step, t0, time.perf_counter()))
        return exp

    def _engine_side(self, exp: ExperienceBatch, step: int) -> ExperienceBatch:
        """Segments from the entropy, the probes (engines, seeded by the batch's step), the advantages."""
        if not len(exp):
            return exp
        t0 = time.perf_counter()
        if exp.probe_version is None:  # the engines' weights now: the probes' (the response is complete)
            exp.probe_version = self.updates
        with self.engines.during(step=step):
            exp = self.maker.credit(exp, _log_into(exp.metrics), seed=step_seed(self.seed, step))
        self.events.append(("credit", step, t0, time.perf_counter()))
        return exp

    def _fidelity(self, exp: ExperienceBatch) -> dict[str, float]:
        """``rollout/fidelity/abs_log_ratio/{mean,max}``: |engine - trainer| log-prob (temperature 1) of the response
        tokens of the first sequences, ``FIDELITY_ROWS`` per engine, re-scored by the engines now; the trainer's side
        is the batch's old log-probs (at temperature 1) or one more forward of those rows."""
        rows = list(range(min(len(exp), FIDELITY_ROWS * len(self.engines))))
        seqs, plens = [exp.sequences[i] for i in rows], [exp.prompt_lens[i] for i in rows]
        engine_lp = self.engines.score(seqs)
        if self.temperature == 1.0:
            trainer_lp = exp.old_log_probs[rows]
        else:
            trainer_lp = self.logprobs_fn(SequenceBatch(sequences=seqs, prompt_lens=plens, temperature=1.0)).log_probs
        gaps = []
        for j, (seq, p) in enumerate(zip(seqs, plens)):
            n = len(seq) - p
            gaps.append((torch.tensor(engine_lp[j][p - 1 : p - 1 + n]) - trainer_lp[j][:n].float()).abs())
        gap = torch.cat(gaps)
        return {"rollout/fidelity/abs_log_ratio/mean": float(gap.mean()),
                "rollout/fidelity/abs_log_ratio/max": float(gap.max()), "rollout/fidelity/tokens": float(gap.numel())}

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_pending(self, ckpt_root: str, step: int) -> dict:
        """Write the batches in flight after ``step`` (atomically, before the checkpoint that names them)."""
        assert self._work is None, "save_pending runs after settle()"
        folder = os.path.join(ckpt_root, PENDING_DIR)
        os.makedirs(folder, exist_ok=True)
        name = f"step_{step:06d}.pt"
        tmp = os.path.join(folder, name + ".tmp")
        torch.save({"ready": self.ready, "generated": self.generated, "updates": self.updates,
                    "partial": None if self.partial is None else self.partial.state_dict()}, tmp)
        os.replace(tmp, os.path.join(folder, name))
        kept = {d for d in os.listdir(ckpt_root) if d.startswith("step_")} | {f"step_{step:06d}"}
        for old in os.listdir(folder):  # batches of checkpoints that are gone
            if old.endswith(".pt") and old[: -len(".pt")] not in kept:
                os.remove(os.path.join(folder, old))
        return {"async_pending": name, "async_staleness": self.staleness,
                "partial_rollout": 0 if self.partial is None else self.partial.pool.chunk_tokens}

    def load_pending(self, extra: dict, ckpt_root: str) -> None:
        check_resumable(extra, async_enable=True, staleness=self.staleness,
                        partial_chunk=0 if self.partial is None else self.partial.pool.chunk_tokens)
        state = torch.load(os.path.join(ckpt_root, PENDING_DIR, extra["async_pending"]), weights_only=False)
        self.ready, self.generated, self.updates = state["ready"], state["generated"], int(state["updates"])
        if self.partial is not None:  # the responses in flight: they continue where the checkpoint left them
            self.partial.load_state_dict(state["partial"])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _log_into(metrics: dict) -> StepLog:
    """A :class:`StepLog` whose phases record into ``metrics`` (a batch's own metrics, made over two windows)."""
    log = StepLog()
    log.metrics = metrics
    return log


def make_schedule(cfg: TrainConfig, maker: ShapeExperienceMaker, batcher: PromptBatcher, engines: Engines,
                  sampling: SamplingConfig, tokenizer: Tokenizer, logprobs_fn: LogProbFn) -> SyncSchedule:
    """``--train.async_enable``: :class:`OneStepOffSchedule` at ``--train.max_staleness`` (with partial rollouts under
    ``--train.partial_rollout_enable``) over the rollout's ``engines``, ``sampling`` and ``tokenizer`` (the maker's)
    and the old log-probs' ``logprobs_fn``; else :class:`SyncSchedule`."""
    t = cfg.train
    if t.async_enable:
        return OneStepOffSchedule(maker, batcher, t.seed, t.max_staleness, t.num_steps, engines, sampling, tokenizer,
                                  logprobs_fn, partial_chunk=cfg.partial_chunk_in_effect())
    return SyncSchedule(maker, batcher, t.seed, engines)
