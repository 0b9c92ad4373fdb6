"""The trainer's rollout engines as one group: the Ray actor factory (:func:`create_ray_engines`,
:func:`start_engines`) and :class:`EngineGroup`, which dispatches prompts across engines (prefix
affinity for probes) and fans out sleep/wake. One engine is :class:`~openrlhf_shape.rollout.engine.VLLMEngine`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict
from typing import Any

from openrlhf_shape.busy_clock import BusyClock
from openrlhf_shape.platform import Platform
from openrlhf_shape.rollout.engine import EngineConfig, Generation, SamplingConfig, VLLMEngine


# ---------------------------------------------------------------------------------------------------
# Ray actors
# ---------------------------------------------------------------------------------------------------


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
    """Start ``num_engines`` Ray actors each holding a :class:`VLLMEngine`; returns the handles.

    ``platform`` (the run's profile; a caller without a driver passes
    :func:`~openrlhf_shape.platform.detect_platform` of this Ray cluster) is handed to every engine and decides the actors' resources and environment: on
    CPU VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_CPU_KVCACHE_SPACE (and one core per worker at
    engine TP > 1), fractional ``num_cpus`` (else Ray cannot place a third actor on a small node:
    looks like a hang); on GPU ``platform.gpus_per_engine`` (1 at TP 1; at TP > 1 vLLM places its own
    workers through Ray). ``num_cpus_per_engine`` / ``num_gpus_per_engine`` override the profile.
    ``placement`` (an ``openrlhf_shape.cluster.ray_placement.RayPlacement``) overrides the
    scheduling: engine i on its planned bundles, vLLM's Ray executor told which (see that module).
    """
    import ray

    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if not ray.is_initialized():
        raise RuntimeError("create_ray_engines needs ray.init() first")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **platform.engine_env(cfg.kv_cache_gib, cfg.tensor_parallel_size)}
    if extra_env:
        env.update(extra_env)
    num_cpus = platform.cpus_per_engine if num_cpus_per_engine is None else num_cpus_per_engine
    num_gpus = platform.gpus_per_engine if num_gpus_per_engine is None else num_gpus_per_engine
    actor_cls = ray.remote(VLLMEngine)
    handles = []
    for i in range(num_engines):
        opts: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": env})
        if placement is not None:
            planned = placement.engine_options(i, num_cpus)
            opts.update(planned["options"])
            opts["runtime_env"] = {"env_vars": {**env, **planned["env"]}}
        engine_cfg = EngineConfig(**{**asdict(cfg), "seed": cfg.seed + i})  # distinct streams for unseeded calls
        handles.append(actor_cls.options(**opts).remote(engine_cfg, platform.to_dict()))
    if wait_ready:
        ray.get([h.ready.remote() for h in handles])
    return handles


def start_engines(
    cfg: EngineConfig,
    num_engines: int = 1,
    *,
    in_process: bool = False,
    platform: Platform,
    **ray_options: Any,
) -> "EngineGroup":
    """The one engine factory: ``num_engines`` engines behind an :class:`EngineGroup`, in this
    process (``in_process=True``: one engine) or as Ray actors (:func:`create_ray_engines`, which
    takes ``ray_options``: ``placement``, ``wait_ready``, resource overrides, ``extra_env``).
    ``platform``: the run's profile (a caller without a driver passes ``detect_platform(...)``)."""
    if in_process:
        if num_engines != 1 or ray_options:
            raise ValueError("an in-process engine group holds exactly one engine and takes no Ray options")
        return EngineGroup([VLLMEngine(cfg, platform)])
    return EngineGroup(create_ray_engines(num_engines, cfg, platform=platform, **ray_options))


# ---------------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------------


def _caps(max_tokens: Sequence[int] | None, idxs: list[int]) -> list[int] | None:
    """One engine's share of a per-prompt list of a call (token limits, request seeds; None: none given)."""
    return None if max_tokens is None else [int(max_tokens[i]) for i in idxs]


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
    """

    def __init__(self, engines: Sequence):
        if len(engines) == 0:
            raise ValueError("EngineGroup needs at least one engine")
        self.engines = list(engines)
        try:
            from ray.actor import ActorHandle

            self.remote = [isinstance(e, ActorHandle) for e in self.engines]
        except Exception:
            self.remote = [False] * len(self.engines)
        if any(self.remote) and not all(self.remote):
            raise ValueError("EngineGroup engines must be all in-process or all Ray actors, not mixed")
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
        least loaded engine by tokens x n."""
        if affinity_keys is None:
            affinity_keys = [tuple(ids) for ids in prompt_token_ids]
        if len(affinity_keys) != len(prompt_token_ids):
            raise ValueError("affinity_keys must have one key per prompt")
        load = [0.0] * len(self.engines)
        key_cost: dict[Hashable, float] = {}
        for key, ids in zip(affinity_keys, prompt_token_ids):
            key_cost[key] = key_cost.get(key, 0.0) + (len(ids) + 1) * n
        for key, cost in key_cost.items():
            if key in self._affinity:
                load[self._affinity[key]] += cost
        for key in sorted((k for k in key_cost if k not in self._affinity), key=lambda k: -key_cost[k]):
            e = min(range(len(load)), key=lambda j: load[j])
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
        assign = self.plan(prompt_token_ids, sampling.n, affinity_keys)
        per_engine: list[list[int]] = [[] for _ in self.engines]
        for i, e in enumerate(assign):
            per_engine[e].append(i)
        results: list[list[Generation] | None] = [None] * len(self.engines)
        if all(self.remote) and len(self.engines) > 0:
            import ray

            refs = {}
            for e, idxs in enumerate(per_engine):
                if idxs:
                    refs[e] = self.engines[e].generate.remote([list(prompt_token_ids[i]) for i in idxs], sampling, idxs,
                                                              _caps(max_tokens, idxs), _caps(request_seeds, idxs))
            for e, out in zip(refs.keys(), ray.get(list(refs.values()))):
                results[e] = out
        else:
            for e, idxs in enumerate(per_engine):
                if idxs:
                    results[e] = self.engines[e].generate([list(prompt_token_ids[i]) for i in idxs], sampling, idxs,
                                                          _caps(max_tokens, idxs), _caps(request_seeds, idxs))
        merged: list[Generation] = []
        for e, idxs in enumerate(per_engine):
            for g in results[e] or []:
                g.prompt_index = idxs[g.prompt_index]
                merged.append(g)
        merged.sort(key=lambda g: (g.prompt_index, g.sample_index))
        return merged

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """What the engines COMPUTE for given sequences: for each, the log-prob (temperature 1) of every token
        after its prefix (``L - 1`` values for ``L`` tokens; :meth:`VLLMEngine.score`). Sequence i goes to engine
        ``i % len(self)``, so a check covers every engine when it sends at least that many sequences."""
        per_engine = [list(range(e, len(token_ids), len(self.engines))) for e in range(len(self.engines))]
        with self.clock.working():
            if all(self.remote):
                import ray

                outs = ray.get([self.engines[e].score.remote([token_ids[i] for i in idxs])
                                for e, idxs in enumerate(per_engine) if idxs])
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
        its prefix cache when it loaded them)."""
        self._affinity.clear()

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
