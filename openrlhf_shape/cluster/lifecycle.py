"""The one place that orders GPU sharing between Megatron ranks and vLLM engines, and the weight
sync between them. Every transition goes through :class:`Lifecycle` and is recorded in
``events`` (tests read the order).

Colocated (one rank and one engine worker per GPU), per step:

1. rollout: engines awake (weights + KV), Megatron fully offloaded to host;
2. old log-probs / entropy (``forward``): Megatron's parameters come back, grads and optimizer
   states stay on host; engines stay awake so the probes that follow still hit the prefix cache
   of the rollout; the parameters go back to host afterwards;
3. update (``before_update``, the loop's ``to_update`` phase): engines sleep at **level 2** (weights and KV discarded, not copied
   to host: the full new weights arrive by the sync right after the update anyway, so level 1's
   host copy of the old weights would cost host RAM and two copies for nothing), then Megatron
   onloads everything;
4. sync (``sync_weights``): Megatron offloads grads + optimizer states (the bulk: ~16 of 18
   bytes/parameter), engines wake their weights, the new weights stream in (Megatron's
   parameters must still be on the GPU: the export gathers them there; every engine resets its
   prefix cache when it loads them);
5. back to rollout (``after_sync``, the loop's ``to_rollout`` phase, the mirror of 3): Megatron
   offloads its parameters, engines wake the KV cache, the group forgets its prefix affinity.

Not colocated: Megatron and the engines never share memory, so only the sync (and the cache
resets) happen; the same calls are made with no sleep/offload.

The reference model (``refs``, with ``--algo.kl.init_coef`` > 0) has parameters only. Colocated it is offloaded
at the start and onloaded only around its own forward in phase 2 (``ref_logprobs``, right after the actor's
parameters went back to host), so it is in host memory while the engines generate and probe, during the update
and the sync; not colocated it stays on its own GPUs unless ``--ref.offload`` keeps it on host there too, onloaded
around its forward alone. The reward model (``rms``, with ``--reward.model_name_or_path``) is handled the same way
around its own forward (``reward_values``, in the rewards phase, while the engines are awake), ``--reward.offload``
its flag. The critic (``critics``, with ``--algo.advantage.estimator gae``) trains, so it has parameters, gradients
and optimizer states: colocated, all of them are on host except its parameters around its values pass
(``critic_values``, next to the reference's) and every state around its update (``critic_update``, in the update
phase, before the actor's states come back: the two models' optimizer states never share the device) and a
checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from openrlhf_shape.weight_sync.driver import WeightSyncError, lost_engine

ALL_STATES = ("params", "grads", "optimizer")
SLEEP_LEVEL = 2


class Lifecycle:
    """Args:
        ranks: the ``RankGroup`` (offload_states / onload_states / start_weight_stream).
        engines: the trainer's ``EngineGroup``.
        sync: ``weight_sync.driver.EngineWeightSync`` over those engines (connected); ``actor`` is its
            ``SendingRanks``.
        bucket_bytes: weight-sync bucket size.
        colocate: engines share the ranks' GPUs.
        refs: the reference model's ``RankGroup`` (forward only; on the ranks' GPUs when colocated), or None.
        rms: the reward model's ``RankGroup`` (forward only, the same), or None.
        critics: the critic's ``RankGroup`` (trained; on the ranks' GPUs when colocated), or None.
        ref_offload, rm_offload: ``--ref.offload`` / ``--reward.offload``: that group's parameters stay in host memory
            except during its own forward even when not colocated (colocated they always do).
    """

    def __init__(self, ranks, engines, sync, bucket_bytes: int, colocate: bool, refs=None, rms=None, critics=None,
                 ref_offload: bool = False, rm_offload: bool = False):
        self.ranks = ranks
        self.refs = refs  # the reference model's RankGroup (None without KL)
        self.rms = rms  # the reward model's RankGroup (None without --reward.model_name_or_path)
        self.critics = critics  # the critic's RankGroup (None without --algo.advantage.estimator gae)
        self.engines = engines
        self.sync = sync
        self.bucket_bytes = int(bucket_bytes)
        self.colocate = bool(colocate)
        # forward-only groups kept on host outside their forward, by name in events
        self.on_host = {"reference": self.colocate or bool(ref_offload), "reward": self.colocate or bool(rm_offload),
                        "critic": self.colocate}
        self.events: list[str] = []
        self.phase = "init"

    def _do(self, event: str, fn, *args) -> Any:
        self.events.append(event)
        return fn(*args)

    def start(self) -> None:
        """After start-up: engines loaded the initial weights themselves; Megatron to host (colocated), and the
        forward-only groups kept on host (:attr:`on_host`)."""
        if self.colocate:
            self._do("megatron.offload(all)", self.ranks.offload_states, ALL_STATES)
        self.resumed()
        self.phase = "rollout"

    # ---- forward for old log-probs ----------------------------------------------------------------
    def forward(self, fn, *args) -> Any:
        """Run a Megatron forward (``fn(*args)``) inside the rollout phase."""
        if self.colocate:
            self._do("megatron.onload(params)", self.ranks.onload_states, ("params",))
        try:
            return self._do("megatron.forward", fn, *args)
        finally:
            if self.colocate:
                self._do("megatron.offload(params)", self.ranks.offload_states, ("params",))

    def logprobs(self, batch) -> Any:
        """The rank group's old log-probs and entropy of ``batch`` (a :class:`~openrlhf_shape.batch.LogProbs`),
        inside :meth:`forward` (the experience maker's ``logprobs_fn``)."""
        return self.forward(self.ranks.compute_logprobs_and_entropy, batch)

    def ref_logprobs(self, batch) -> Any:
        """The reference model's log-probs of ``batch`` (a :class:`~openrlhf_shape.batch.LogProbs`; the maker's
        ``ref_logprobs_fn``); colocated or with ``--ref.offload``, its parameters are on the device only for this
        forward."""
        if self.refs is None:
            raise RuntimeError("no reference model runs (--algo.kl.init_coef 0)")
        return self._forward_only("reference", self.refs, self.refs.compute_logprobs_and_entropy, batch)

    def reward_values(self, batch) -> Any:
        """The reward model's state values of ``batch`` (a :class:`~openrlhf_shape.batch.SequenceBatch`; per sample
        ``[R + 1]``, the last its score); colocated or with ``--reward.offload``, its parameters are on the device only
        for this forward."""
        if self.rms is None:
            raise RuntimeError("no reward model runs (--reward.model_name_or_path unset)")
        return self._forward_only("reward", self.rms, self.rms.compute_values, batch)

    def critic_values(self, batch) -> Any:
        """The critic's raw state values of ``batch`` (a :class:`~openrlhf_shape.batch.SequenceBatch`; per sample
        ``[R + 1]``; the maker's ``values_fn``); colocated, its parameters are on the device only for this forward."""
        if self.critics is None:
            raise RuntimeError("no critic runs (--algo.advantage.estimator is not gae)")
        return self._forward_only("critic", self.critics, self.critics.compute_values, batch)

    def resumed(self) -> None:
        """After a resume or a restart (no :meth:`start`; :meth:`start` ends with it): the side groups, built or loaded
        on the device, go to host where :attr:`on_host` keeps them: the critic's every state, the forward-only
        groups' parameters."""
        if self.critics is not None and self.on_host["critic"]:
            self._do("critic.offload(all)", self.critics.offload_states, ALL_STATES)
        for who, group in (("reference", self.refs), ("reward", self.rms)):
            if group is not None and self.on_host[who]:
                self._do(f"{who}.offload(params)", group.offload_states, ("params",))

    def critic_update(self, fn, *args) -> Any:
        """``fn(*args)``: the critic's updates of a step (its ``train_values`` calls), after :meth:`before_update` and
        before the actor's. Colocated, every state of the critic is on the device only for them, and the actor's come
        back after them (:meth:`before_update` leaves them on host with a critic): the two models' optimizer states
        never share the device."""
        if self.colocate:
            self._do("critic.onload(all)", self.critics.onload_states, ALL_STATES)
        try:
            return self._do("critic.update", fn, *args)
        finally:
            if self.colocate:
                self._do("critic.offload(all)", self.critics.offload_states, ALL_STATES)
                self._do("megatron.onload(all)", self.ranks.onload_states, ALL_STATES)

    def _forward_only(self, who: str, group, fn, batch) -> Any:
        """``fn(batch)`` on a forward-only group (``who``: its name in :attr:`events`), onloaded around it when it is
        kept on host (:attr:`on_host`)."""
        if self.on_host[who]:
            self._do(f"{who}.onload(params)", group.onload_states, ("params",))
        try:
            return self._do(f"{who}.forward", fn, batch)
        finally:
            if self.on_host[who]:
                self._do(f"{who}.offload(params)", group.offload_states, ("params",))

    # ---- update -------------------------------------------------------------------------------------
    def before_update(self) -> None:
        """Rollout -> update: colocated engines sleep, the ranks bring every state back (with a critic, after its
        update: :meth:`critic_update`)."""
        if self.colocate:
            self._do(f"engines.sleep({SLEEP_LEVEL})", self.engines.sleep, SLEEP_LEVEL)
            if self.critics is None:
                self._do("megatron.onload(all)", self.ranks.onload_states, ALL_STATES)
        self.phase = "update"

    def sync_weights(self, step: int | None = None) -> dict[str, float]:
        """After the update of ``step`` (named if the sync fails): new weights into every engine. Refused while
        the engines work on a request batch (asynchronous training overlaps generation with the update):
        weights stream in between batches, never under a running request. An engine that dies or holds the sync
        up past ``--rollout.weight_sync_timeout`` is replaced (``EngineGroup.recover``, within
        ``--rollout.max_engine_restarts``), the group re-formed with it and the sync done again from its start."""
        if self.engines.busy:
            raise RuntimeError(f"weight sync after step {step} requested while the engines are generating; the "
                               "asynchronous schedule must wait for the engines' side of the step first")
        if self.colocate:
            self._do("megatron.offload(grads,optimizer)", self.ranks.offload_states, ("grads", "optimizer"))
            self._do("engines.wake(weights)", self.engines.wake_up, ["weights"])
        with self.engines.during("weight sync", step):
            while True:
                t0 = time.monotonic()
                try:
                    if self.sync.engines != self.engines.engines:  # an engine was replaced since the group formed
                        self._do("sync.reconnect", self.sync.reconnect, self.engines.engines)
                    metrics = self._do("sync", self.sync.sync, self.ranks, self.bucket_bytes, step)
                    return {**metrics, **self.engines.fault_metrics()}  # the step's line counts a loss in its sync
                except WeightSyncError as err:
                    self._replace_lost(err, t0)

    def _replace_lost(self, err: WeightSyncError, t0: float) -> None:
        """The engine a failed sync (``err``, started at monotonic ``t0``) lost is killed, the sync's other calls
        awaited (``EngineWeightSync.abort``) and the engine replaced (its weights come with the sync that follows);
        ``err`` itself when the failure lies elsewhere (the sender, the transport, an engine's own error)."""
        e = lost_engine(err)
        if e is None or getattr(self.engines, "launcher", None) is None:
            raise err
        dead = self.sync.engines[e]
        self._do(f"sync.abort(engine {e})", self.sync.abort, e)
        self._do(f"engines.recover({e})", self.engines.recover, e, dead, err, t0, 0, True)

    def restore_engine(self, e: int, handle) -> None:
        """Engine ``e``'s replacement (``EngineGroup.recover``, mid-rollout) gets the weights the other engines
        hold, streamed from the ranks to it alone: under the synchronous schedule the ranks hold exactly those until
        the step's update (the asynchronous schedules' ranks are ahead: not for them). Colocated, the ranks'
        parameters come to the device for the stream, as for a forward."""
        one = self.sync.for_engines([handle], [e])
        try:
            self._do(f"sync.connect(engine {e} alone)", one.connect, self.sync.sender)
            if self.colocate:
                self._do("megatron.onload(params)", self.ranks.onload_states, ("params",))
            try:
                self._do(f"sync(engine {e} alone)", one.sync, self.ranks, self.bucket_bytes)
            finally:
                if self.colocate:
                    self._do("megatron.offload(params)", self.ranks.offload_states, ("params",))
        finally:
            one.close()

    def after_sync(self) -> None:
        """Update -> rollout, the mirror of :meth:`before_update`: colocated ranks put their parameters
        back on host, engines wake their KV cache; the group forgets its prefix affinity (every engine
        reset its prefix cache when it loaded the weights)."""
        if self.colocate:
            self._do("megatron.offload(params)", self.ranks.offload_states, ("params",))
            self._do("engines.wake(kv_cache)", self.engines.wake_up, ["kv_cache"])
        self.engines.forget_affinity()
        self.phase = "rollout"

    def around_checkpoint(self, fn, *args, critic: bool = False) -> Any:
        """Checkpoints need every state on the device (the distributed checkpoint writes from it). ``critic``: ``fn``
        is the critic's save, load or export (its group comes to the device), else the actor ranks'."""
        who, group = ("critic", self.critics) if critic else ("megatron", self.ranks)
        if self.colocate and self.phase == "rollout":
            self._do(f"{who}.onload(all)", group.onload_states, ALL_STATES)
            try:
                return self._do(f"{who}.checkpoint", fn, *args)
            finally:
                self._do(f"{who}.offload(all)", group.offload_states, ALL_STATES)
        return self._do(f"{who}.checkpoint", fn, *args)
