"""The trainer's rollout engines as one group: the Ray actor factory (:class:`RayEngineLauncher`,
:func:`create_ray_engines`, :func:`start_engines`) and :class:`EngineGroup`, which dispatches prompts across engines
(prefix affinity for probes), fans out sleep/wake and replaces an engine actor that dies during a call
(:meth:`EngineGroup.recover`, ``--rollout.max_engine_restarts``). One engine is
:class:`~openrlhf_shape.rollout.engine.VLLMEngine`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from openrlhf_shape.busy_clock import BusyClock
from openrlhf_shape.platform import Platform
from openrlhf_shape.rollout.engine import EngineConfig, Generation, SamplingConfig, TailRun, VLLMEngine
from openrlhf_shape.rollout.standby import Standby
from openrlhf_shape.rollout.watch import EngineStalled, StallWatch

log = logging.getLogger("openrlhf_shape")  # the trainer's logger (its console and train.log)
RESTARTS_FLAG = "--rollout.max_engine_restarts"


# ---------------------------------------------------------------------------------------------------
# Ray actors
# ---------------------------------------------------------------------------------------------------


class RayEngineLauncher:
    """Starts engine ``i``'s Ray actor, the same way every time: its config (seed ``cfg.seed + i``), resources,
    environment and, with a ``placement``, its planned bundle. The group keeps it to replace a dead engine where it
    stood (:meth:`EngineGroup.recover`).

    ``platform`` (the run's profile; a caller without a driver passes
    :func:`~openrlhf_shape.platform.detect_platform` of this Ray cluster) is handed to every engine and decides the actors' resources and environment: on
    CPU VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_CPU_KVCACHE_SPACE (and one core per worker at
    engine TP > 1), fractional ``num_cpus`` (else Ray cannot place a third actor on a small node:
    looks like a hang); on GPU ``platform.gpus_per_engine`` (1 at TP 1; at TP > 1 vLLM places its own
    workers through Ray). ``num_cpus_per_engine`` / ``num_gpus_per_engine`` override the profile.
    ``placement`` (an ``openrlhf_shape.cluster.ray_placement.RayPlacement``) overrides the
    scheduling: engine i on its planned bundles, vLLM's Ray executor told which (see that module).
    """

    def __init__(self, cfg: EngineConfig, num_cpus_per_engine: float | None = None,
                 num_gpus_per_engine: float | None = None, extra_env: dict[str, str] | None = None,
                 placement=None, *, platform: Platform, standby: bool = False):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("create_ray_engines needs ray.init() first")
        self.cfg, self.platform, self.placement = cfg, platform, placement
        self.env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **platform.engine_env(cfg.kv_cache_gib, cfg.tensor_parallel_size)}
        self.env.update(extra_env or {})
        self.num_cpus = platform.cpus_per_engine if num_cpus_per_engine is None else num_cpus_per_engine
        self.num_gpus = platform.gpus_per_engine if num_gpus_per_engine is None else num_gpus_per_engine
        gpu_tp1 = platform.on_gpu and cfg.tensor_parallel_size == 1
        self.standby = Standby(self, gpu_tp1) if standby else None  # --rollout.engine_standby

    def engine_config(self, i: int) -> EngineConfig:
        """Engine ``i``'s config: the group's, with seed ``cfg.seed + i`` (distinct streams for unseeded calls)."""
        return EngineConfig(**{**asdict(self.cfg), "seed": self.cfg.seed + i})

    def start(self, i: int):
        """Engine ``i``'s actor handle (not awaited: ``handle.ready.remote()`` says when its vLLM is up)."""
        import ray

        opts: dict[str, Any] = dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, runtime_env={"env_vars": self.env})
        if self.placement is not None:
            planned = self.placement.engine_options(i, self.num_cpus)
            opts.update(planned["options"])
            opts["runtime_env"] = {"env_vars": {**self.env, **planned["env"]}}
        handle = ray.remote(VLLMEngine).options(**opts).remote(self.engine_config(i), self.platform.to_dict())
        if self.standby is not None:
            self.standby.record(i, handle)
        return handle

    def start_all(self, num_engines: int, wait_ready: bool = True) -> list:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        handles = [self.start(i) for i in range(num_engines)]
        if self.standby is not None:  # after the engines: their bundles are asked for first
            self.standby.start()
        if wait_ready:
            import ray

            ray.get([h.ready.remote() for h in handles])
        return handles

    def same_node(self, i: int, j: int) -> bool:
        """Engines ``i`` and ``j`` are planned on one node (always, without a placement)."""
        if self.placement is None:
            return True
        plan = self.placement.plan
        return plan.bundle_node(plan.engine_workers(i)[0].bundle)[0] == plan.bundle_node(plan.engine_workers(j)[0].bundle)[0]

    def replacement(self, i: int, timeout_s: float) -> tuple[Any, bool]:
        """A new engine ``i``, ready: the standby built as it (True) or else a cold start (False)."""
        import ray

        if self.standby is not None:
            env = self.placement.engine_options(i, self.num_cpus)["env"] if self.placement is not None else {}
            new = self.standby.take(i, self.engine_config(i), env, timeout_s)
            if new is not None:
                return new, True
        new = self.start(i)
        try:
            ray.get(new.ready.remote(), timeout=timeout_s)
        except Exception:
            ray.kill(new, no_restart=True)  # its bundle share back
            raise
        return new, False

    def shutdown(self) -> None:
        if self.standby is not None:
            self.standby.shutdown()


def create_ray_engines(
    num_engines: int,
    cfg: EngineConfig,
    num_cpus_per_engine: float | None = None,
    num_gpus_per_engine: float | None = None,
    extra_env: dict[str, str] | None = None,
    wait_ready: bool = True,
    placement=None,
    *,
    platform: Platform,
) -> list:
    """Start ``num_engines`` Ray actors each holding a :class:`VLLMEngine`; returns the handles (the options:
    :class:`RayEngineLauncher`)."""
    launcher = RayEngineLauncher(cfg, num_cpus_per_engine, num_gpus_per_engine, extra_env, placement, platform=platform)
    return launcher.start_all(num_engines, wait_ready)


def start_engines(
    cfg: EngineConfig,
    num_engines: int = 1,
    *,
    in_process: bool = False,
    platform: Platform,
    max_restarts: int = 0,
    stall_timeout_s: float = 0.0,
    **ray_options: Any,
) -> "EngineGroup":
    """The one engine factory: ``num_engines`` engines behind an :class:`EngineGroup`, in this
    process (``in_process=True``: one engine) or as Ray actors (:class:`RayEngineLauncher`, which
    takes ``ray_options``: ``placement``, resource overrides, ``extra_env``; ``wait_ready``: await their start).
    ``platform``: the run's profile (a caller without a driver passes ``detect_platform(...)``).
    ``max_restarts``: how many dead Ray engines the group may replace this run (``--rollout.max_engine_restarts``);
    ``stall_timeout_s``: seconds a Ray engine may go without an engine step during a call before it counts as dead
    (``--rollout.engine_stall_timeout``; 0: not watched)."""
    if in_process:
        if num_engines != 1 or ray_options or max_restarts or stall_timeout_s:
            raise ValueError("an in-process engine group holds exactly one engine and takes no Ray options "
                             "(nor restarts: its engine dies with this process)")
        return EngineGroup([VLLMEngine(cfg, platform)])
    wait_ready = ray_options.pop("wait_ready", True)
    launcher = RayEngineLauncher(cfg, platform=platform, **ray_options)
    return EngineGroup(launcher.start_all(num_engines, wait_ready), launcher=launcher, max_restarts=max_restarts,
                       stall_timeout_s=stall_timeout_s)


# ---------------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------------


class EngineLostError(RuntimeError):
    """An engine actor died or stalled and the group could not replace it (budget spent, no launcher, no way to
    restore the weights nor another engine holding them, or the replacement did not start): names the engine
    (``engine``) and the phase and step (``where``). The run stops; re-running the command resumes from the newest complete checkpoint."""

    def __init__(self, message: str, engine: int, where: str):
        super().__init__(f"{message}. The run stops here; re-run the same command to resume from the newest "
                         "complete checkpoint (--ckpt.output_dir).")
        self.engine, self.where = engine, where


def _loss(cause: BaseException) -> tuple[str, str]:
    """How an engine was lost and the detail, for the console and :class:`EngineLostError`: ``("died",
    "ActorDiedError")``, ``("stopped making progress", "no engine step for 30 s (--rollout.engine_stall_timeout
    30 s)")``, or from a weight sync's error its own verdict (died, or stalled at a bucket)."""
    if isinstance(cause, EngineStalled):
        return "stopped making progress", str(cause)
    if getattr(cause, "bucket", None) is not None:  # a weight sync's stall verdict (weight_sync/driver.py)
        return "stalled", f"held the sync up at bucket {cause.bucket} past --rollout.weight_sync_timeout"
    inner = cause.__cause__ if cause.__cause__ is not None else cause
    return "died", type(inner).__name__


def _caps(max_tokens: Sequence[int] | None, idxs: list[int]) -> list[int] | None:
    """One engine's share of a per-prompt list of a call (token limits, request seeds; None: none given)."""
    return None if max_tokens is None else [int(max_tokens[i]) for i in idxs]


def _merged(per_engine: list[list[int]], results: list) -> list[Generation]:
    """The engines' samples of one call, prompt indices mapped back to the call's and ordered by (prompt, sample)."""
    merged: list[Generation] = []
    for idxs, gens in zip(per_engine, results):
        for g in gens or []:
            g.prompt_index = idxs[g.prompt_index]
            merged.append(g)
    merged.sort(key=lambda g: (g.prompt_index, g.sample_index))
    return merged


class EngineGroup:
    """1..N engines (in-process :class:`VLLMEngine` or Ray actor handles) behind one ``generate``.

    Dispatch is balanced by prompt tokens x n. Prompts that share an ``affinity_key`` go to one
    engine, and the group remembers key -> engine across calls, so a prompt's samples and later the
    probes of its responses (same key) land on the engine that holds their prefixes in its cache.
    The default key of a prompt is its full token tuple. The map is cleared on new weights (the
    caches are reset then anyway).

    The group knows when it is working (``busy``: a ``generate`` or ``score`` in flight, from any thread)
    and for how long it has worked (``clock.seconds()``): the colocation lifecycle refuses a weight sync
    while the engines generate, and the trainer reports the engines' idle time per step.

    Ray engines made with a ``launcher`` survive the death of an actor during ``generate`` or ``score``, and with
    ``stall_timeout_s`` > 0 an actor that makes no engine step for that long during one (``rollout/watch.py``): the
    group kills it, starts a new one on the same bundle and re-sends the lost share of the call, each request with
    its own seed, so a seeded call returns what it would have without the failure (:meth:`recover`; at most
    ``max_restarts`` times a run, ``--rollout.max_engine_restarts``). The replacement gets the current weights
    (``restore_weights``) or, where nothing can hand them over (the asynchronous schedules after a sync), stays out
    of service (``serving``) until the next weight sync reaches it, and the share goes to an engine that holds them.
    """

    def __init__(self, engines: Sequence, launcher: RayEngineLauncher | None = None, max_restarts: int = 0,
                 restore_weights: Callable[[int, Any], None] | None = None, stall_timeout_s: float = 0.0):
        if len(engines) == 0:
            raise ValueError("EngineGroup needs at least one engine")
        if max_restarts < 0:
            raise ValueError(f"{RESTARTS_FLAG} must be >= 0, got {max_restarts}")
        self.engines = list(engines)
        # Recovery of dead engine actors (:meth:`recover`): how to start one, the run's budget, how to hand a
        # replacement the weights the others hold once a sync changed them, and what recoveries cost so far.
        self.launcher, self.max_restarts, self.restore_weights = launcher, int(max_restarts), restore_weights
        self.weights_from_directory = True  # False once new weights arrived (forget_affinity)
        self.restarts, self.seconds_lost = 0, 0.0
        self.standby_used = False  # the last replacement was the standby engine built (--rollout.engine_standby)
        self.start_timeout_s = 1800.0  # the longest a replacement may take to start (a GPU engine compiles)
        self._where = threading.local()  # (phase, step) of the calls this thread makes: :meth:`during`
        self._recovering = threading.Lock()  # the asynchronous schedule calls from two threads
        self.serving = [True] * len(self.engines)  # False: a replacement waiting for the next sync's weights
        try:
            from ray.actor import ActorHandle

            self.remote = [isinstance(e, ActorHandle) for e in self.engines]
        except Exception:
            self.remote = [False] * len(self.engines)
        if any(self.remote) and not all(self.remote):
            raise ValueError("EngineGroup engines must be all in-process or all Ray actors, not mixed")
        self.watch: StallWatch | None = None  # engines' progress during calls (--rollout.engine_stall_timeout)
        if stall_timeout_s and all(self.remote):
            import ray

            self.watch = StallWatch(ray.util.get_node_ip_address(), stall_timeout_s)
            for e, handle in enumerate(self.engines):
                self.watch.watch(e, handle)
        self._affinity: dict[Hashable, int] = {}
        self._tokenizer = None
        self.clock = BusyClock()  # engines at work: a generate or score in flight

    @property
    def busy(self) -> bool:
        """A request batch (``generate`` / ``score``) is in flight on some engine."""
        return self.clock.busy

    def __len__(self) -> int:
        return len(self.engines)

    # ---- dispatch ---------------------------------------------------------------------------------
    def plan(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, affinity_keys: Sequence[Hashable] | None = None
    ) -> list[int]:
        """Engine index per prompt: known keys keep their engine; new keys (largest first) go to the
        least loaded engine by tokens x n. Only engines in service (:attr:`serving`) get prompts."""
        if affinity_keys is None:
            affinity_keys = [tuple(ids) for ids in prompt_token_ids]
        if len(affinity_keys) != len(prompt_token_ids):
            raise ValueError("affinity_keys must have one key per prompt")
        load = [0.0] * len(self.engines)
        key_cost: dict[Hashable, float] = {}
        for key, ids in zip(affinity_keys, prompt_token_ids):
            key_cost[key] = key_cost.get(key, 0.0) + (len(ids) + 1) * n
        live = [e for e in range(len(self.engines)) if self.serving[e]]
        for key in [k for k in key_cost if k in self._affinity and not self.serving[self._affinity[k]]]:
            del self._affinity[key]  # its engine is out of service until the next sync
        for key, cost in key_cost.items():
            if key in self._affinity:
                load[self._affinity[key]] += cost
        for key in sorted((k for k in key_cost if k not in self._affinity), key=lambda k: -key_cost[k]):
            e = min(live, key=lambda j: load[j])
            self._affinity[key] = e
            load[e] += key_cost[key]
        return [self._affinity[k] for k in affinity_keys]

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        affinity_keys: Sequence[Hashable] | None = None,
        max_tokens: Sequence[int] | None = None,
        request_seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Same contract as :meth:`VLLMEngine.generate` (prompt_index refers to this call's list; ``max_tokens``:
        an optional limit per prompt; ``request_seeds``: an optional seed per prompt). A seeded call (``sampling.seed``) samples the same whatever the number of
        engines and the dispatch: each engine is told its prompts' indices in this call, from which every
        request's seed derives."""
        if not prompt_token_ids:
            return []
        with self.clock.working():
            return self._generate(prompt_token_ids, sampling, affinity_keys, max_tokens, request_seeds)

    def _generate(self, prompt_token_ids, sampling, affinity_keys, max_tokens=None, request_seeds=None) -> list[Generation]:
        per_engine, results = self._dispatch(prompt_token_ids, sampling.n, affinity_keys, "generate", lambda idxs: (
            sampling, idxs, _caps(max_tokens, idxs), _caps(request_seeds, idxs)))
        return _merged(per_engine, results)

    def generate_with_probes(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, tail: Any) -> TailRun:
        """:meth:`generate` (its dispatch, seeds and recovery) where each engine sends every finished response's first
        probe round at once, while the rest of its share decodes (:meth:`VLLMEngine.generate_with_probes`, ``tail``:
        a :class:`~openrlhf_shape.rollout.tail.TailProbes`). A state's probes run on its response's engine, where the
        probes of the ordered path go too (the prompt's affinity). ``events``: each engine's, engine after engine."""
        if not prompt_token_ids:
            return TailRun([], {}, [])
        with self.clock.working():
            per_engine, results = self._dispatch(prompt_token_ids, sampling.n, None, "generate_with_probes",
                                                 lambda idxs: (sampling, idxs, tail))
        run = TailRun(_merged(per_engine, [None if r is None else r.gens for r in results]), {}, [])
        for r in results:
            if r is not None:
                run.probes.update(r.probes)
                run.events.extend(r.events)
                run.occupancy.extend(r.occupancy)
                run.step_seconds.extend(r.step_seconds)
                run.slots.extend(r.slots)
        return run

    def _dispatch(self, prompt_token_ids, n: int, affinity_keys, method: str,
                  args: Callable[[list[int]], tuple]) -> tuple[list[list[int]], list]:
        """Each engine's share of the prompts (indices into the call) and what its ``method(share's prompts,
        *args(share))`` returned (None: no share)."""
        assign = self.plan(prompt_token_ids, n, affinity_keys)
        per_engine: list[list[int]] = [[] for _ in self.engines]
        for i, e in enumerate(assign):
            per_engine[e].append(i)
        results: list = [None] * len(self.engines)
        if all(self.remote) and len(self.engines) > 0:
            results = self._call_shares(per_engine, lambda h, idxs: getattr(h, method).remote(
                [list(prompt_token_ids[i]) for i in idxs], *args(idxs)))
        else:
            for e, idxs in enumerate(per_engine):
                if idxs:
                    results[e] = getattr(self.engines[e], method)([list(prompt_token_ids[i]) for i in idxs], *args(idxs))
        return per_engine, results

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """What the engines COMPUTE for given sequences: for each, the log-prob (temperature 1) of every token
        after its prefix (``L - 1`` values for ``L`` tokens; :meth:`VLLMEngine.score`). Sequence i goes to the
        ``i % n``-th of the ``n`` engines in service, so a check covers every one when it sends at least n sequences."""
        live = [e for e in range(len(self.engines)) if self.serving[e]]
        per_engine: list[list[int]] = [[] for _ in self.engines]
        for i in range(len(token_ids)):
            per_engine[live[i % len(live)]].append(i)
        with self.clock.working():
            if all(self.remote):
                done = self._call_shares(per_engine, lambda h, idxs: h.score.remote([token_ids[i] for i in idxs]))
                outs = [done[e] for e, idxs in enumerate(per_engine) if idxs]
            else:
                outs = [self.engines[e].score([token_ids[i] for i in idxs]) for e, idxs in enumerate(per_engine) if idxs]
        result: list[list[float]] = [[] for _ in token_ids]
        for idxs, out in zip([i for i in per_engine if i], outs):
            for i, row in zip(idxs, out):
                result[i] = row
        return result

    # ---- weights ----------------------------------------------------------------------------------
    def forget_affinity(self) -> None:
        """New weights: which engine caches which prompt prefix no longer matters (each engine reset
        its prefix cache when it loaded them), and an engine started from the model directory would not hold
        them (a replacement needs ``restore_weights``: :meth:`recover`). Every engine holds them now: a replacement
        that waited out of service for them (:attr:`serving`) is back in."""
        self._affinity.clear()
        self.weights_from_directory = False
        self.serving = [True] * len(self.engines)

    # ---- recovery ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def during(self, phase: str | None = None, step: int | None = None) -> Iterator[None]:
        """Name the calls this thread makes inside the block (``phase``, ``step``; an outer block's when None) in
        the console line of a recovery and in :class:`EngineLostError`."""
        outer = getattr(self._where, "value", (None, None))
        self._where.value = (phase or outer[0], outer[1] if step is None else step)
        try:
            yield
        finally:
            self._where.value = outer

    def where(self, call: str) -> str:
        """``probes at step 3``: the phase and step of this thread's calls (:meth:`during`), else the call."""
        phase, step = getattr(self._where, "value", (None, None))
        return f"{phase or call}" + (f" at step {step}" if step is not None else "")

    def fault_metrics(self) -> dict[str, float]:
        """The run's recoveries so far: ``fault/engine_restarts`` (engines replaced) and ``fault/seconds_lost``
        (seconds from sending each dead engine its share to sending it again to the replacement)."""
        return {"fault/engine_restarts": float(self.restarts), "fault/seconds_lost": self.seconds_lost}

    def _call_shares(self, per_engine: list[list[int]], call: Callable[[Any, list[int]], Any]) -> list:
        """``call(handle, idxs)`` (a Ray ref) for every engine's non-empty share, awaited; a share whose engine
        actor died, or stalled (:attr:`watch`), goes again to its replacement or, when that waits for the next
        sync's weights, to an engine in service (:meth:`recover`). Each share's result by its engine (None: none)."""
        import ray

        results: list = [None] * len(self.engines)
        pending: dict = {}  # ref -> (share, engine running it, its handle, monotonic seconds sent)

        def send(share: int, k: int) -> None:
            pending[call(self.engines[k], per_engine[share])] = (share, k, self.engines[k], time.monotonic())
            if self.watch is not None:
                self.watch.sent(k)

        for e, idxs in enumerate(per_engine):
            if idxs:
                send(e, e)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=None if self.watch is None else self.watch.poll_s())
            for ref, cause in self._lost(done, pending, results):
                share, k, handle, sent = pending.pop(ref)
                self.recover(k, handle, cause, sent, len(per_engine[share]))
                send(share, self._target(share, pending, per_engine))
        return results

    def _lost(self, done: list, pending: dict, results: list) -> list:
        """The calls lost with their engine: ``(ref, cause)`` for a finished ref whose actor died (the others' results
        go into ``results`` by share) or, when none finished, for every call of an engine the watch finds stalled."""
        import ray

        lost = []
        for ref in done:
            try:
                results[pending[ref][0]] = ray.get(ref)
                pending.pop(ref)
            except ray.exceptions.ActorDiedError as err:
                lost.append((ref, err))
        if not done and self.watch is not None:
            stalled = self.watch.stalled({k for _, k, _, _ in pending.values()})
            lost += [(ref, EngineStalled(k, stalled[k], self.watch.timeout_s))
                     for ref, (_, k, _, _) in pending.items() if k in stalled]
        return lost

    def _target(self, share: int, pending: dict, per_engine: list[list[int]]) -> int:
        """Where a lost share goes again: its engine's replacement, or (out of service until the next sync) the engine
        in service with the fewest prompts in flight; the same request seeds give the same tokens on any engine."""
        if self.serving[share]:
            return share
        load = {k: 0 for k in range(len(self.engines)) if self.serving[k]}
        for s, k, _, _ in pending.values():
            load[k] = load.get(k, 0) + len(per_engine[s])
        return min(load, key=lambda k: load[k])

    def recover(self, e: int, dead: Any, cause: BaseException, sent: float, requests: int,
                weights_follow: bool = False) -> None:
        """Replace engine ``e``, whose actor ``dead`` died or stalled (``cause``) on a call sent at ``sent`` (monotonic
        seconds) with ``requests`` prompts or sequences: a new actor on its bundle (``launcher``) holding the weights
        the others hold (from the model directory; ``restore_weights`` after a sync; else out of service until the
        next sync, :attr:`serving`). ``weights_follow``: a weight sync lost it and brings them (``Lifecycle``). One
        console line; :class:`EngineLostError` past the budget, when nothing can give the replacement the weights
        nor take its share, or when it cannot start. Another thread's call that saw the same loss finds it
        replaced already."""
        with self._recovering:
            if self.engines[e] is not dead:
                return
            self._recover(e, cause, sent, requests, weights_follow)

    def _recover(self, e: int, cause: BaseException, sent: float, requests: int, weights_follow: bool) -> None:
        where = self.where("a call")
        verb, detail = _loss(cause)
        what = f"engine {e} {verb} during {where} ({detail})"
        if self.launcher is None:
            raise EngineLostError(f"{what}; this engine group was made from actor handles, without a launcher to "
                                  "start a replacement (start_engines makes one)", e, where) from cause
        if self.restarts >= self.max_restarts:
            raise EngineLostError(f"{what}; {RESTARTS_FLAG} {self.max_restarts} spent ({self.restarts} replaced "
                                  f"this run): raise it to let the run replace more engines", e, where) from cause
        how = self._weights_for(e, what, where, cause, weights_follow)
        t0 = time.monotonic()
        self.engines[e], started = self._replacement(e, what, where, cause, restore=how == "ranks")
        self.serving[e] = how != "survivors"
        now = time.monotonic()
        self.restarts += 1
        self.seconds_lost += now - sent
        then = {"sync": "the weight sync starts again with it in its group",
                "survivors": f"its share of the call ({requests} prompts or sequences) sent to the engines that hold "
                             "the current weights (same request seeds), the replacement joins at the next weight sync"
                }.get(how, f"its share of the call ({requests} prompts or sequences) sent again")
        log.warning("%s: replaced on its bundle in %.1f s (%.1f s to start it%s, %.1f s for its weights and watch), %s "
                    "(restart %d of %d, %s); %.1f s lost", what, now - t0, started,
                    " from the standby engine" if self.standby_used else "", now - t0 - started, then,
                    self.restarts, self.max_restarts, RESTARTS_FLAG, now - sent)

    def _weights_for(self, e: int, what: str, where: str, cause: BaseException, weights_follow: bool) -> str:
        """How engine ``e``'s replacement comes to hold the weights the others hold: ``directory`` (no sync yet),
        ``sync`` (the sync that lost it brings them), ``ranks`` (``restore_weights``: the synchronous schedule's ranks
        stream them) or ``survivors`` (nothing can: it waits for the next sync while the engines in service take its
        share). :class:`EngineLostError` when none applies."""
        if weights_follow:
            return "sync"
        if self.weights_from_directory:
            return "directory"
        if self.restore_weights is not None:
            return "ranks"
        if any(self.serving[k] for k in range(len(self.engines)) if k != e):
            return "survivors"
        raise EngineLostError(
            f"{what}; no other engine holds the synced weights to take its share, and nothing can hand them to a "
            "replacement (the asynchronous schedule's ranks are ahead of the engines): run more engines "
            "(--vllm.num_engines > 1, so that the others take a dead engine's share until the next sync) or the "
            "synchronous schedule (without --train.async_enable, whose ranks stream the weights to a replacement)",
            e, where) from cause

    def _replacement(self, e: int, what: str, where: str, cause: BaseException, restore: bool) -> tuple[Any, float]:
        """A started actor for engine ``e`` (given the group's weights with ``restore``), the lost one killed (its
        bundle freed; a stalled one stops holding it), reporting its progress to :attr:`watch`; and the seconds its
        start took (from the kill to its vLLM ready: the part of a recovery an engine start bounds)."""
        import ray

        t0 = time.monotonic()
        ray.kill(self.engines[e], no_restart=True)
        new = None
        try:
            new, self.standby_used = self.launcher.replacement(e, self.start_timeout_s)
            started = time.monotonic() - t0
            if restore:
                self.restore_weights(e, new)
        except Exception as err:
            if new is not None:
                ray.kill(new, no_restart=True)  # its bundle share back
            raise EngineLostError(f"{what}; its replacement could not start ({type(err).__name__}: {err}); "
                                  f"{RESTARTS_FLAG} cannot help here", e, where) from cause
        if self.watch is not None:
            self.watch.watch(e, new)
        return new, started

    # ---- fan-out helpers ----------------------------------------------------------------------------
    def _call_all(self, method: str, *args) -> list:
        if all(self.remote):
            import ray

            return ray.get([getattr(e, method).remote(*args) for e in self.engines])
        return [getattr(e, method)(*args) for e in self.engines]

    def get_block_size(self) -> int:
        return int(self._call_all("get_block_size")[0])

    def reset_prefix_cache(self) -> None:
        self._affinity.clear()
        self._call_all("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_all("wake_up", tags)

    def states(self) -> list[dict[str, bool]]:
        return self._call_all("state")

    def get_tokenizer(self):
        """The tokenizer of engine 0 (loaded here from the model path for Ray engines)."""
        if self._tokenizer is None:
            if all(self.remote):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._call_all("get_model_path")[0])
            else:
                self._tokenizer = self.engines[0].get_tokenizer()
        return self._tokenizer

    def shutdown(self) -> None:
        if self.launcher is not None:
            self.launcher.shutdown()
        if all(self.remote):
            import ray

            try:
                ray.get([e.shutdown.remote(process_ends=True) for e in self.engines], timeout=60)
            except Exception:
                pass
            for e in self.engines:
                ray.kill(e)
        else:
            for e in self.engines:
                e.shutdown()
        self.engines = []
