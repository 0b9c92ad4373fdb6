"""The RL loop: generate -> rewards -> log-probs -> segment -> probes -> advantages -> train -> sync
-> eval -> checkpoint, one named phase call each (``ShapeTrainer.fit``). One code path for CPU and GPU.

Set-up (data, Ray, engines, the actor group, rewards) lives in :mod:`openrlhf_shape.trainer.setup`;
the experience phases in :mod:`openrlhf_shape.trainer.experience`; per-phase timing and metrics in
:class:`~openrlhf_shape.trainer.phases.StepLog`. Per step (docs/architecture.md): the rollout batch
is cut into mini-batches of ``train.batch_size`` samples, each one optimizer step on the
Megatron ranks (loss normalised by the mini-batch's global valid-token count); a short last one is dropped, as
OpenRLHF's replay-buffer loader drops it (``drop_last``); then the new weights stream to the vLLM engines.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from openrlhf_shape.algorithms.kl import KLController
from openrlhf_shape.batch import KLLossTerm
from openrlhf_shape.config import TrainConfig
from openrlhf_shape.trainer.console import RunConsole
from openrlhf_shape.trainer.length_alarm import LengthCollapseAlarm
from openrlhf_shape.trainer.logging_utils import (MetricsLogger, checkpoint_row, code_version, log,
                                                  setup_console_logging)
from openrlhf_shape.trainer.phases import PHASES, PhaseOutput, StepLog
from openrlhf_shape.trainer.report import write_report
from openrlhf_shape.trainer.setup import Run, build_run, resolve_model_dir

__all__ = ["PHASES", "RankLostError", "ShapeTrainer", "resolve_model_dir", "run_training", "step_line", "write_report"]


# An update's per-token means (actor/micro_batch_loss.py step_metrics): over the step they are weighted by each
# update's tokens, as OpenRLHF's ppo_train weights its "token" metrics (policy_loss, kl, ppo_clip_ratio, ...);
# a short last mini-batch then counts for its tokens. The rest (grad norm, LR, counts) are plain means.
TOKEN_MEANS = ("loss", "pg_clipfrac_low", "pg_clipfrac_high", "pg_clipfrac", "approx_kl", "entropy", "kl",
               "logprobs_diff")


def _mean_metrics(rows: list[dict]) -> dict[str, float]:
    """The step's metrics from its updates' ``rows`` (``step_metrics`` dicts, ``num_tokens`` each)."""
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        pairs = [(float(r[key]), float(r.get("num_tokens", 0.0))) for r in rows if isinstance(r.get(key), (int, float))]
        tokens = sum(n for _, n in pairs)
        if key in TOKEN_MEANS and tokens > 0:
            out[key] = sum(v * n for v, n in pairs) / tokens
        elif pairs:
            out[key] = sum(v for v, _ in pairs) / len(pairs)
    return out


def _due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0


class ShapeTrainer:
    """Runs the loop (``fit``) over the components that :func:`build_run` made from a :class:`TrainConfig`."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.ckpt.output_dir)
        self.ckpt_root = checkpoint_root(cfg)
        self.run: Run | None = None
        self._ray_was_up: bool | None = None  # at set-up, before build_run (None: set-up stopped before that)
        self._resume_row: dict | None = None  # the resumed checkpoint's metrics line (MetricsLogger's resume_row)
        # The KL coefficient (with a reference model): updated after each update, saved with each checkpoint,
        # handed to the schedule for the batches it makes (trainer/schedule.py)
        self.kl_controller: KLController | None = None
        self.length_alarm = LengthCollapseAlarm(cfg.shape.length_alarm_fraction, cfg.shape.length_alarm_window)
        self.history: list[dict] = []  # this invocation's steps (the report's)
        # What a stop or a restart needs to know: the step in progress and the last completed one, whether the ranks'
        # weights are past it (between its update and its end), the data position it ended at, and the newest
        # complete checkpoint this run wrote or resumed (and its step)
        self._step, self._done, self._mid_update, self._done_batcher = 0, 0, False, {}
        self._batcher_start: dict = {}  # the data position at step 0 (a restart with no checkpoint starts over there)
        self._own_ckpt: str | None = None
        self._t_start = time.time()
        self._saved_step = -1
        # --train.max_restarts: rank-group restarts so far, the seconds they cost, the last death's time (monotonic)
        self.rank_restarts, self.rank_seconds_lost, self._lost_since = 0, 0.0, None

    def setup(self) -> None:
        check_resume(self.cfg)  # a checkpoint this run cannot continue is refused before Ray and the engines start
        import ray

        self._ray_was_up = ray.is_initialized()
        self.run = build_run(self.cfg)
        self.kl_controller = self.cfg.kl_controller() if self.run.kl is not None else None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train from the checkpoint ``--ckpt.resume`` names to ``--train.num_steps``, then the HF export and the report.

        A rank that dies (an actor or reference rank's Ray actor: :func:`rank_death`) ends the step; up to
        ``--train.max_restarts`` times a run the rank groups start again on their bundles and the loop goes on from the
        newest complete checkpoint this run wrote or resumed (step 0 without one), the engines kept and re-synced
        (:meth:`_restart_ranks`); past the budget :class:`RankLostError`. An engine the rollout cannot replace
        (``EngineLostError``) stops the run after a checkpoint of the last completed step (:meth:`_checkpoint_before_stop`)."""
        from openrlhf_shape.rollout import EngineLostError

        path = resume_checkpoint(self.cfg)
        while True:
            try:
                self._fit_from(path, restarted=self.rank_restarts > 0)
                break
            except Exception as exc:
                if _in_chain(exc, EngineLostError) is not None:
                    self._checkpoint_before_stop()
                    raise
                death = rank_death(exc)
                if death is None:
                    raise
                path = self._restart_ranks(death)
        self._export_hf()
        return write_report(self.run_dir, self.history, self.run.setup_seconds)

    def _fit_from(self, path: str | None, restarted: bool = False) -> None:
        """The steps after checkpoint ``path`` (None: from step 0); each step's metrics go to ``self.history``."""
        cfg, run, schedule = self.cfg, self.run, self.run.schedule  # a restart makes a new schedule and comes back here
        start = self._resume(path, restarted)
        self.history = [h for h in self.history if h["step"] <= start]  # a restart redoes the steps after ``start``
        self._done, self._mid_update = start, False
        logger, steps = self._open_log(start), self._steps(start)
        if start == 0:
            self._val_before_train(logger)
        t_loop, self._busy = time.perf_counter(), self._busy_seconds()
        try:
            for step in steps:
                self._step, rec = step, StepLog()
                self._count_seconds_lost()
                # generate, rewards, logprobs, segment, probes, advantages; async: made ahead, engines start the next
                kl_coef = None if self.kl_controller is None else float(self.kl_controller.value)
                exp = schedule.experience(step, rec, kl_coef)
                self._update(step, exp, rec)
                if _due(step, cfg.eval.steps):
                    rec.phase("eval", self.evaluate, step)
                self.length_alarm.update(step, rec.metrics)  # before the checkpoint, which keeps the line so far
                rec.metrics.update(self.fault_metrics())  # after the eval: a recovery in it counts in this line
                if _due(step, cfg.ckpt.save_steps) or step == cfg.train.num_steps:
                    rec.metrics["checkpoint"] = rec.phase("checkpoint", self.save, step, rec.metrics)
                metrics = rec.finish(**{"data/epoch": float(run.batcher.epoch)})
                eta = (time.perf_counter() - t_loop) / (step - start) * (steps[-1] - step)
                self._report_step(step, metrics, exp.samples, logger, eta)  # adds the idle shares
                self.history.append({"step": step, **metrics})  # after: the report shows what metrics.jsonl holds
                self._done, self._mid_update, self._done_batcher = step, False, dict(run.batcher.state_dict())
        finally:
            logger.close()

    def _update(self, step: int, exp, rec: StepLog) -> None:
        """The step's update and weight sync (none when every group was filtered)."""
        run, cluster, schedule = self.run, self.run.cluster, self.run.schedule
        if len(exp):
            run.gap_guard.check(step, rec.metrics)  # the engines ran the trained policy? (warn or stop)
            self._mid_update = True  # the ranks' weights are past the last completed step until the step ends
            rec.phase("to_update", cluster.lifecycle.before_update)  # colocated: engines sleep, ranks onload
            rec.phase("train", self.train, exp, step)
        schedule.settle(rec, updated=bool(len(exp)))  # async: wait for the engines' side of the step
        if len(exp):
            rec.phase("sync", self.sync, step)
            rec.phase("to_rollout", cluster.lifecycle.after_sync)  # colocated: ranks offload, engines wake
        else:
            log.warning("step %d: every group was filtered (no reward variance); no update", step)
            rec.metrics["actor/updates"] = 0.0

    def fault_metrics(self) -> dict[str, float]:
        """What failures cost this invocation so far, running totals: the engines replaced and the seconds they cost
        (``fault/engine_restarts``, ``fault/seconds_lost``: ``EngineGroup.fault_metrics``), the rank-group restarts
        (``fault/rank_restarts``) and their seconds (``fault/rank_seconds_lost``: from each death to the start of the
        first step after the resume). Read after the step's eval, so that a recovery in any phase is in its line."""
        return {**self.run.cluster.engines.fault_metrics(), "fault/rank_restarts": float(self.rank_restarts),
                "fault/rank_seconds_lost": self.rank_seconds_lost}

    def _count_seconds_lost(self) -> None:
        if self._lost_since is not None:  # the first step after a restart starts: the death's cost ends here
            self.rank_seconds_lost += time.monotonic() - self._lost_since
            self._lost_since = None

    def _restart_ranks(self, death: str) -> str | None:
        """After ``death`` (what died, :func:`rank_death`): refuse past ``--train.max_restarts``
        (:class:`RankLostError`), else start the rank groups again (``cluster/runtime.py:restart_ranks``: same bundles,
        the engines kept, the sync formed again with the new rank 0) with a fresh schedule. Returns the checkpoint
        to resume from: the newest this run wrote or resumed (None: step 0)."""
        from openrlhf_shape.cluster.runtime import restart_ranks
        from openrlhf_shape.trainer.setup import build_schedule

        t_death, budget, step, run = time.monotonic(), self.cfg.train.max_restarts, self._step, self.run
        if self.rank_restarts >= budget:
            raise RankLostError(
                f"{death} at step {step}; --train.max_restarts {budget} spent ({self.rank_restarts} restart(s) this "
                "run): raise it to let the run restart its ranks, or re-run the same command to resume from the "
                "newest complete checkpoint (--ckpt.output_dir)")
        self.rank_restarts += 1
        path = self._newest_own_checkpoint()
        log.warning("%s at step %d: restarting the rank groups on their bundles and resuming from %s (restart %d of "
                    "%d, --train.max_restarts); the engines are kept and re-synced", death, step,
                    path or "step 0 (no complete checkpoint yet)", self.rank_restarts, budget)
        run.schedule.close()  # async: the engines' side of the step ends before the new schedule takes them
        restart_ranks(run.cluster, run.model_dir)
        run.schedule = build_schedule(self.cfg, run.cluster, run.batcher, run.tokenizer, run.reward, run.kl)
        self.length_alarm = LengthCollapseAlarm(self.cfg.shape.length_alarm_fraction, self.cfg.shape.length_alarm_window)
        self._lost_since = self._lost_since if self._lost_since is not None else t_death
        return path

    def _newest_own_checkpoint(self) -> str | None:
        """The newest complete checkpoint this invocation wrote (one completed as its rank died counts) or resumed;
        never another run's left in the folder (``--ckpt.resume none``)."""
        from openrlhf_shape.checkpoint_dir import latest_checkpoint

        newest = latest_checkpoint(self.ckpt_root)
        if newest is not None and (newest == self._own_ckpt or os.path.getmtime(newest) >= self._t_start):
            return newest
        return self._own_ckpt

    def _checkpoint_before_stop(self) -> None:
        """An engine is lost for good (``EngineLostError``): the ranks are alive, so the last completed step gets a
        checkpoint if it has none yet (what was in flight for the step after it is dropped: a resume redoes it, from
        the data position that step ended at). Not when the ranks are past that step (the engine died after their
        update: eval) or under the asynchronous schedule (its batches in flight went with the engine)."""
        step = self._done
        if step == 0 or step == self._saved_step:
            return
        if self._mid_update or self.cfg.train.async_enable:
            log.warning("an engine is lost: step %d is not checkpointed (%s); the run resumes from %s", step,
                        "the ranks were past it" if self._mid_update else "the asynchronous schedule's batches in "
                        "flight went with the engine", self._own_ckpt or "step 0")
            return
        self.run.batcher.load_state_dict(self._done_batcher)  # the position step ``step`` ended at
        path = self.save(step, self.history[-1] if self.history else None).value
        log.warning("an engine is lost: checkpointed step %d before stopping (%s)", step, path)

    def _export_hf(self) -> None:
        """``--ckpt.save_hf``: the trained policy to ``<run_dir>/hf``; ``--critic.save_value_network``: the trained critic
        in OpenRLHF's value-model format (loadable as ``--critic.model_name_or_path``) to ``<ckpt.output_dir>_critic``,
        where OpenRLHF's ``save_model`` puts it. Each once the run reached ``--train.num_steps``, also by a rerun that
        resumed at the last step and trained nothing when no export is there (a kill during the export). The rank
        workers write them atomically (``actor/hf_dir.py``: a ``.tmp`` directory renamed), so one that exists is whole."""
        if self._done != self.cfg.train.num_steps:
            return
        cluster = self.run.cluster
        for wanted, out, group, critic in (
                (self.cfg.ckpt.save_hf, os.path.join(self.run_dir, "hf"), cluster.ranks, False),
                (cluster.critics is not None and self.cfg.critic.save_value_network, self.run_dir + "_critic",
                 cluster.critics, True)):
            if not wanted or (os.path.isdir(out) and not any(h["step"] == self._done for h in self.history)):
                continue  # not asked for, or this invocation did not train the last step and the export is whole
            cluster.lifecycle.around_checkpoint(group.export_hf, out, critic=critic)
            log.info("exported the trained %s to %s", "critic" if critic else "policy", out)

    # ------------------------------------------------------------------ phases of the loop
    def train(self, exp, step: int) -> PhaseOutput:
        """Mini-batch updates over the rollout batch (``train.max_epochs`` passes, shuffled per pass): ``n //
        train.batch_size`` per pass, the ``n % train.batch_size`` samples left over dropped (OpenRLHF's ``drop_last``;
        ``actor/dropped_samples``, per pass), so the run takes exactly ``TrainConfig.total_optimizer_steps`` updates.
        With a critic (gae) its updates come first, over the same mini-batches (:meth:`_train_critic`); under
        ``--critic.freezing_steps N`` the actor takes none in steps 1..N+1 (``actor/updates`` 0).

        ``data/trained_prompts``: the prompt groups this update trained, in the batch's order (dynamic filtering's
        refills and, asynchronously, the batch made in an earlier window included), as their rows in
        ``--data.prompt_dataset`` (``PromptItem.index``, stable across shuffles and resumes): what shows that a
        resumed run lost or repeated no prompt. A metrics key rather than a file beside ``metrics.jsonl``: it goes
        where the step's line goes, so a resume's truncation and the line a checkpoint keeps carry it with no
        bookkeeping of their own (``rollout.batch_size`` integers a step)."""
        cfg = self.cfg
        n, mb = len(exp), cfg.train.batch_size
        if n < mb:
            raise RuntimeError(f"step {step}: {n} samples do not fill one mini-batch of --train.batch_size {mb}")
        gen = torch.Generator().manual_seed(cfg.train.seed * 100003 + step)
        kl, rows = self.run.kl, []
        # the coefficient the batch carries (read once when it was made: trainer/experience.py ref_logprobs)
        term = KLLossTerm(exp.kl_coef, kl.estimator, kl.unbiased_gradient) if kl is not None and kl.in_loss else None
        batches = [order[start : start + mb] for order in (torch.randperm(n, generator=gen).tolist()
                                                           for _epoch in range(cfg.train.max_epochs))
                   for start in range(0, n - mb + 1, mb)]  # full mini-batches only (drop_last)
        out = self._train_critic(exp, batches) if self.run.cluster.critics is not None else {}
        if step - 1 > cfg.critic.freezing_steps:  # OpenRLHF: the actor trains once global_steps (from 0) > N
            rows = [self.run.cluster.ranks.train_step(exp.train_batch(b, cfg.rollout.temperature, kl_loss=term))
                    for b in batches]
        out.update({f"actor/{k}": v for k, v in _mean_metrics(rows).items()})
        out["actor/updates"] = float(len(rows))
        out["actor/samples"], out["actor/dropped_samples"] = float(n), float(n % mb)
        out["data/trained_prompts"] = [exp.items[i].index for i in range(0, n, cfg.rollout.n_samples_per_prompt)]
        out["actor/skipped_updates"] = float(sum(r.get("skipped", 0.0) for r in rows))
        if kl is not None and rows:
            if term is not None:  # OpenRLHF's kl in the loss: the updates' token-mean KL to the reference
                out["kl"], out["logprobs_diff"] = out["actor/kl"], out["actor/logprobs_diff"]
            # the coefficient for the next step (adaptive: from this step's kl over the step's samples, as OpenRLHF)
            samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
            self.kl_controller.update(out.get("kl", exp.metrics.get("kl", 0.0)), samples)
        return PhaseOutput(None, out)

    def _train_critic(self, exp, batches: list[list[int]]) -> dict[str, float]:
        """gae: one critic update per mini-batch ``batches`` (the actor's, in its order), before the actor's (as
        OpenRLHF's ppo_train); its metrics under OpenRLHF's names as ``critic/*`` (``critic_loss``, ``values``,
        ``critic_lr``, ``critic_grad_norm``: means over the updates), ``critic/updates``."""
        critics, temperature = self.run.cluster.critics, self.cfg.rollout.temperature
        rows = self.run.cluster.lifecycle.critic_update(
            lambda: [critics.train_values(exp.value_batch(b, temperature)) for b in batches])
        out = {f"critic/{k}": v for k, v in _mean_metrics(rows).items()}
        out["critic/updates"] = float(len(rows))
        return out

    def sync(self, step: int) -> PhaseOutput:
        """Stream the new weights of ``step`` to the engines; the lifecycle (openrlhf_shape/cluster/lifecycle.py)
        wakes colocated engines' weights first. A receiver that dies, or holds the sync up past
        ``--rollout.weight_sync_timeout``, is replaced and the sync done again (``--rollout.max_engine_restarts``), else
        the run stops naming it."""
        return PhaseOutput(None, self.run.cluster.lifecycle.sync_weights(step))

    def evaluate(self, step: int) -> PhaseOutput:
        """Held-out avg@N pass@1 and mean response length with 95% CIs (openrlhf_shape/trainer/heldout.py),
        at ``--eval.temperature`` (0: greedy, one sample) with ``--eval.n_samples_per_prompt`` samples;
        per-problem results go to ``<run_dir>/evals/step_XXXXXX.jsonl`` (for pooling seeds).
        Every request's seed derives from ``--train.seed`` alone (``rollout/seeds.py``), so the same weights always
        give the same numbers, whatever the step, the engine count or a resume. The responses are judged by the
        training answers' reward path (``--reward.remote_url``, else Math-Verify), with OpenRLHF's arguments:
        ``eval/accuracy`` from its ``scores`` (as ``rollout/accuracy``), ``eval/reward/mean`` its ``rewards``
        (what OpenRLHF's eval reports as pass1)."""
        from openrlhf_shape.rollout.engine import SamplingConfig
        from openrlhf_shape.rollout.seeds import EVAL, derive_seed
        from openrlhf_shape.eval.pooling import write_problem_results
        from openrlhf_shape.trainer.heldout import group_results, heldout_metrics

        items = self.run.eval_items or []
        if not items:
            return PhaseOutput(None, {})
        e, seed = self.cfg.eval, self.cfg.train.seed
        n = 1 if e.temperature == 0 else e.n_samples_per_prompt
        sampling = SamplingConfig(n=n, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                                  max_tokens=self.cfg.rollout.max_new_tokens, seed=derive_seed(seed, EVAL))
        log.info("held-out eval: %d problems x %d samples at T %.2f (up to %d tokens each)", len(items), n,
                 e.temperature, sampling.max_tokens)
        with self.run.cluster.engines.during("eval", step):  # a dead or stalled engine is replaced, named so
            gens = self.run.cluster.engines.generate([list(it.prompt_ids) for it in items], sampling)
        tok = self.run.tokenizer
        judged = self.run.reward.compute(
            queries=[tok.decode(list(items[g.prompt_index].prompt_ids) + list(g.token_ids), skip_special_tokens=False)
                     for g in gens],
            prompts=[items[g.prompt_index].prompt for g in gens], labels=[items[g.prompt_index].label for g in gens],
            responses=[g.text for g in gens],
            sequences=[list(items[g.prompt_index].prompt_ids) + list(g.token_ids) for g in gens])
        problems = group_results([g.prompt_index for g in gens], judged["scores"].tolist(),
                                 [len(g.token_ids) for g in gens], [g.finish_reason for g in gens])
        metrics = heldout_metrics(problems, seed=seed)
        metrics["eval/reward/mean"] = float(judged["rewards"].mean())
        write_problem_results(self.run_dir, step, problems)
        log.info("held-out accuracy %.3f [%.3f, %.3f], length %.1f (%d problems x %d)", metrics["eval/accuracy"],
                 metrics["eval/accuracy_ci_low"], metrics["eval/accuracy_ci_high"],
                 metrics["eval/response_length/mean"], len(items), n)
        return PhaseOutput(None, metrics)

    def _val_before_train(self, logger: MetricsLogger) -> None:
        """Step 0: the base policy's held-out metrics, before any update (``--eval.val_before_train``)."""
        if not (self.cfg.eval.val_before_train and self.run.eval_items):
            return
        t0 = time.perf_counter()
        metrics = self.evaluate(0).metrics
        metrics["time/eval"] = time.perf_counter() - t0
        logger.log(0, metrics)

    def save(self, step: int, step_metrics: dict | None = None) -> PhaseOutput:
        """Checkpoint actor + data position (and ``step_metrics``, the step's metrics line so far: a run stopped
        before it writes the line gets it on resume); keep the newest ``ckpt.max_num`` complete ones. The critic's
        (gae) goes to ``<step dir>/critic``: written whole first as ``<step dir>.critic.tmp`` (a name the resume's
        search skips), moved in once the actor's is complete (:func:`critic_checkpoint` finds it either way)."""
        path = os.path.join(self.ckpt_root, f"step_{step:06d}")
        extra = {"step": step, "batcher": self.run.batcher.state_dict(), "time": time.time(),
                 **self.run.schedule.save_pending(self.ckpt_root, step)}  # async: the batches in flight
        if step_metrics is not None:
            extra["metrics_row"] = checkpoint_row({**step_metrics, "checkpoint": path,
                                                   "data/epoch": float(self.run.batcher.epoch)})
        if self.kl_controller is not None:  # the adaptive KL coefficient moves every step
            extra["kl_controller"] = self.kl_controller.state_dict()
        cluster = self.run.cluster
        if cluster.critics is not None:  # complete beside the step's directory first, moved into it once that is
            cluster.lifecycle.around_checkpoint(cluster.critics.save_checkpoint, path + CRITIC_STAGE, {"step": step},
                                                critic=True)
        cluster.lifecycle.around_checkpoint(cluster.ranks.save_checkpoint, path, extra)
        if cluster.critics is not None:
            os.replace(path + CRITIC_STAGE, os.path.join(path, "critic"))
        done = sorted(d for d in os.listdir(self.ckpt_root) if d.startswith("step_") and "." not in d)
        for old in done[: -self.cfg.ckpt.max_num]:
            shutil.rmtree(os.path.join(self.ckpt_root, old), ignore_errors=True)
        self._own_ckpt, self._saved_step = path, step  # what a rank-group restart resumes from
        return PhaseOutput(path, {})

    # ------------------------------------------------------------------ around the loop
    def _resume(self, path: str | None, restarted: bool = False) -> int:
        """Load checkpoint ``path`` (None: start at step 0) into the ranks, the data position, the schedule's batches
        in flight and the KL coefficient, and hand the engines its weights. ``restarted``: after a rank-group restart
        (``--train.max_restarts``): from step 0 the data and the KL coefficient start over and the engines, which
        hold a later step's weights, get the fresh ranks' initial ones."""
        lifecycle = self.run.cluster.lifecycle
        self._resume_row = None
        if not path:
            if self.cfg.ckpt.resume == "auto" and not restarted:
                log.info("no complete checkpoint under %s: starting from step 0", self.ckpt_root)
            if not restarted:
                lifecycle.start()
                self._done_batcher = self._batcher_start = dict(self.run.batcher.state_dict())
                return 0
            self.run.batcher.load_state_dict(self._batcher_start)  # the data's start (steps may have completed since)
            self.kl_controller = self.cfg.kl_controller() if self.run.kl is not None else None
            step = 0
        else:
            step = self._load(path)
        lifecycle.resumed()  # the side groups to host where they live there, as start() leaves them
        lifecycle.sync_weights(step)  # engines get the resumed weights
        lifecycle.after_sync()  # and the run is in the rollout phase
        return step

    def _load(self, path: str) -> int:
        """Checkpoint ``path`` into the ranks and the driver's state; returns its step."""
        extra = self.run.cluster.ranks.load_checkpoint(path)
        if self.run.cluster.critics is not None:
            self.run.cluster.critics.load_checkpoint(critic_checkpoint(path))
        self.run.batcher.load_state_dict(extra["batcher"])
        self.run.schedule.load_pending(extra, self.ckpt_root)
        if self.kl_controller is not None and "kl_controller" in extra:
            self.kl_controller.load_state_dict(extra["kl_controller"])
        step = int(extra["step"])
        self._resume_row = extra.get("metrics_row")  # the step's line, if the run stopped before writing it
        self._own_ckpt, self._saved_step, self._done_batcher = path, step, dict(self.run.batcher.state_dict())
        log.info("resumed from %s at step %d (data epoch %d, position %d)", path, step,
                 self.run.batcher.epoch, self.run.batcher.position)
        return step

    def _open_log(self, start_step: int) -> MetricsLogger:
        cfg = self.cfg
        run_info = {"estimator": cfg.algo.advantage.estimator, "name": os.path.basename(self.run_dir),
                    "model": self.run.model_dir, "config": cfg.to_dict(),
                    "code": [{"from_step": start_step, **(code_version() or {"commit": None})}]}
        lg, wb = cfg.logger, cfg.logger.wandb
        logger = MetricsLogger(self.run_dir, run_info, lg.use_tensorboard or bool(lg.tensorboard_dir), wb.project,
                               resume_step=start_step if start_step > 0 else None, tensorboard_dir=lg.tensorboard_dir,
                               resume_row=self._resume_row,
                               wandb_kwargs={"entity": wb.org, "group": wb.group, "name": wb.run_name})
        self.length_alarm.restore(logger.resumed_rows)  # the alarm's windows span a resume
        return logger

    def _steps(self, start_step: int) -> list[int]:
        t = self.cfg.train
        last = min(t.num_steps, start_step + (t.stop_after_steps or t.num_steps))
        return list(range(start_step + 1, last + 1))

    def _busy_seconds(self) -> tuple[float, float]:
        """Seconds the engines and the ranks have worked so far (their groups' clocks)."""
        return self.run.cluster.engines.clock.seconds(), self.run.cluster.ranks.clock.seconds()

    def _idle_shares(self, metrics: dict) -> None:
        """``time/engine_idle_share`` and ``time/rank_idle_share`` of the step: 1 - (each side's busy seconds + the
        weight sync, which occupies both) / the step's seconds."""
        (eng0, rank0), self._busy = self._busy, self._busy_seconds()
        step_s, sync = max(metrics.get("time/step", 0.0), 1e-9), metrics.get("time/sync", 0.0)
        metrics["time/engine_idle_share"] = max(0.0, 1.0 - (self._busy[0] - eng0 + sync) / step_s)
        metrics["time/rank_idle_share"] = max(0.0, 1.0 - (self._busy[1] - rank0 + sync) / step_s)

    def _report_step(self, step: int, metrics: dict, samples: list[dict], logger: MetricsLogger, eta_s: float) -> None:
        self._idle_shares(metrics)
        logger.log(step, metrics)
        log.info(step_line(step, self.cfg.train.num_steps, metrics, eta_s))
        for s in samples[: self.cfg.logger.log_samples]:  # the run's log file; the console with --logger.verbose
            log.debug("  sample (R=%.0f, label %s): %s", s["reward"], s["label"], s["response"][-300:].replace("\n", " "))

    def shutdown(self) -> None:
        """Stop what set-up started; a Ray this trainer did not start (a notebook's, a test's) is left running,
        also when set-up stopped early (a refused resume, a refused configuration)."""
        run = self.run
        if run is not None:
            run.schedule.close()
            run.reward.close()
            run.cluster.engines.shutdown()
            run.cluster.ranks.shutdown()
            for group in (run.cluster.refs, run.cluster.rms, run.cluster.critics):  # the side groups' ranks
                if group is not None:
                    group.shutdown()
            run.cluster.shutdown()
        # without a Run, set-up failed: it started Ray only if Ray was down when it reached build_run
        own_ray = run.own_ray if run is not None else (self._ray_was_up is False and not self.cfg.train.ray_address)
        if own_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()


class RankLostError(RuntimeError):
    """A rank died and ``--train.max_restarts`` is spent: names the rank, the step and the flag (``cli/train.py``
    ends the command with the message alone)."""


def _in_chain(exc: BaseException | None, kind: type) -> BaseException | None:
    """``exc`` or the exception it came from (``__cause__`` / ``__context__``, transitively) that is a ``kind``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def rank_death(exc: BaseException) -> str | None:
    """What died when ``exc`` comes from a rank's death, e.g. ``actor rank 0 died during train_step
    (ActorDiedError)``: a call into a rank group (``cluster/rank_group.py:RankDiedError``) or a weight sync whose
    sender rank's actor died (``WeightSyncError``); None for anything else."""
    import ray

    from openrlhf_shape.cluster.rank_group import RankDiedError
    from openrlhf_shape.weight_sync.driver import WeightSyncError

    if (died := _in_chain(exc, RankDiedError)) is not None:
        return str(died)
    sync = _in_chain(exc, WeightSyncError)
    if sync is not None and sync.who.startswith("actor rank") and isinstance(sync.__cause__, ray.exceptions.RayActorError):
        return f"{sync.who.split(' (')[0]} died during the weight sync ({type(sync.__cause__).__name__})"
    return None


CRITIC_STAGE = ".critic.tmp"  # beside a step's directory: its critic, before it moves in (ShapeTrainer.save)


def critic_checkpoint(path: str) -> str:
    """The critic's checkpoint of step directory ``path``: ``<path>/critic``, or, when the run stopped between the
    actor's publish and the move, ``<path>.critic.tmp``; ``FileNotFoundError`` naming both when neither is complete."""
    from openrlhf_shape.checkpoint_dir import COMPLETE_MARKER

    for cand in (os.path.join(path, "critic"), path + CRITIC_STAGE):
        if os.path.isfile(os.path.join(cand, COMPLETE_MARKER)):
            return cand
    raise FileNotFoundError(f"{path} holds no complete critic checkpoint (critic/ or {os.path.basename(path)}"
                            f"{CRITIC_STAGE}): it was written by a run without a critic; resume it with its own "
                            "--algo.advantage.estimator, or start over (--ckpt.resume none)")


def checkpoint_root(cfg: TrainConfig) -> str:
    """Where the run's checkpoints are: ``--ckpt.path``, else ``<ckpt.output_dir>/checkpoints``."""
    return os.path.abspath(cfg.ckpt.path) if cfg.ckpt.path else os.path.join(os.path.abspath(cfg.ckpt.output_dir),
                                                                               "checkpoints")


def resume_checkpoint(cfg: TrainConfig) -> str | None:
    """The checkpoint directory ``--ckpt.resume`` names: ``auto``, the newest complete one under
    :func:`checkpoint_root` (None if there is none); ``none``, None; else the directory given."""
    from openrlhf_shape.checkpoint_dir import latest_checkpoint

    mode = cfg.ckpt.resume
    if mode == "auto":
        return latest_checkpoint(checkpoint_root(cfg))
    return None if mode == "none" else mode


def check_resume(cfg: TrainConfig) -> None:
    """Refuse, before anything starts, a resume this run cannot do: a checkpoint that is not complete
    (``FileNotFoundError``), or one whose batches in flight do not fit ``--train.async_enable`` /
    ``--train.max_staleness`` (``ValueError`` naming the flag, :func:`~openrlhf_shape.trainer.schedule.check_resumable`).
    Only ``meta.json`` is read: on a real cluster the refusal comes in seconds, not after the engines and the
    ranks have started (minutes)."""
    from openrlhf_shape.checkpoint_dir import read_complete_meta
    from openrlhf_shape.trainer.schedule import check_resumable

    path = resume_checkpoint(cfg)
    if path:
        _, meta = read_complete_meta(path)
        check_resumable(meta.get("extra") or {}, cfg.train.async_enable, cfg.train.max_staleness,
                        cfg.partial_chunk_in_effect())


def step_line(step: int, num_steps: int, metrics: dict[str, Any], eta_s: float | None = None) -> str:
    """The one console line of a step: accuracy, length, dynamic filtering's pass rate and refill rounds (when on),
    SHAPE segments / drop rate, loss, the rollout/trainer log-prob mismatch (mean/max |dlogp|), the generate phase's
    tail share and the probe tokens hidden in it (``--shape.entropy_source engine``), step time by phase, time left
    in this run."""

    def get(key: str, fmt: str) -> str:
        v = metrics.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    phases = ", ".join(f"{p} {metrics['time/' + p]:.1f}s" for p in PHASES if f"time/{p}" in metrics)
    gap = (f"|dlogp| {get('rollout/mismatch/abs_log_ratio/mean', '.1e')}/{get('rollout/mismatch/abs_log_ratio/max', '.1e')}"
           if "rollout/fidelity/abs_log_ratio/mean" not in metrics else  # async: the engines re-scored, and the drift
           f"|dlogp| {get('rollout/fidelity/abs_log_ratio/mean', '.1e')}/{get('rollout/fidelity/abs_log_ratio/max', '.1e')}"
           f" (stale {get('async/staleness', '.0f')}: {get('rollout/mismatch/abs_log_ratio/mean', '.1e')})")
    eta = f", {eta_s / 60:.1f} min left" if eta_s is not None and eta_s > 0 else ""
    if metrics.get("rollout/response_versions"):  # partial rollouts: which weights sampled the batch, and probed it
        seen = sorted({v for vs in metrics["rollout/response_versions"] for v in vs})
        gap += (f", tokens of v{seen[0]}..v{seen[-1]} ({get('partial/multi_version_share', '.0%')} of responses span "
                f"syncs), probes on v{get('async/probe_version', '.0f')}")
    if "rollout/tail_share" in metrics:  # --shape.entropy_source engine: the generate phase's tail, probes hidden in it
        hidden = metrics.get("probe/overlapped_tokens", 0.0) / max(metrics.get("probe/tokens", 0.0), 1.0)
        gap += f", tail {get('rollout/tail_share', '.0%')}, probe tokens hidden {hidden:.0%}"
    refill = (f", filter pass {get('rollout/filter_pass_rate', '.2f')} ({get('rollout/refill_rounds', '.0f')} refills)"
              if "rollout/refill_rounds" in metrics else "")
    return (
        f"step {step}/{num_steps}: acc {get('rollout/accuracy', '.3f')}, len {get('rollout/response_length/mean', '.0f')}{refill}, "
        f"segments {get('shape/segments_per_response/mean', '.2f')}, drop {get('shape/potential_drop_rate', '.2f')}, "
        f"loss {get('actor/loss', '.4f')}, {gap}, {get('time/step', '.1f')} s ({phases}){eta}"
    )


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Set up, train, shut down. The console shows one line per step and the warnings that matter;
    everything (engine and worker output included) goes to ``<ckpt.output_dir>/train.log``."""
    verbose = bool(cfg.logger.verbose)
    setup_console_logging(verbose=verbose)
    console = RunConsole(os.path.abspath(cfg.ckpt.output_dir), verbose=verbose).start()
    trainer = ShapeTrainer(cfg)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        try:
            trainer.shutdown()
        finally:
            console.stop()
            log.info("full log: %s", console.path)
