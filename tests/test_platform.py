"""The platform profile (openrlhf_shape/platform.py): CPU/GPU decided once by the driver, handed to
the ranks.

* On this machine (no CUDA, no Ray GPUs) the profile is the CPU twin's, shaped by the config.
* On a simulated cluster whose nodes declare 8 GPUs (``ray.cluster_utils.Cluster``) the driver's
  profile is the GPU path's, and a Megatron rank actor placed on a GPU bundle runs under the profile
  it was handed, although ``torch.cuda.is_available()`` is False in its process: checked on the
  simulated cluster of test_simulated_cluster.py (one cluster start for both modules' checks).
* Only platform.py decides: no other module of the package asks torch, vLLM or Ray whether there
  are GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from openrlhf_shape.platform import Platform, detect_platform, gpu_platform
from openrlhf_shape.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _cfg(**flags: str):
    args: list[str] = []
    for k, v in flags.items():
        args += [f"--{k}", v]
    return load_config(None, ["--actor.model_name_or_path", "demo", *args], check_paths=False)


def test_cpu_profile_on_this_machine() -> None:
    import ray
    import torch

    assert not torch.cuda.is_available()
    cfg = _cfg(**{"actor.num_gpus_per_node": "2", "actor.num_cpus_per_rank": "0.25", "vllm.num_cpus_per_engine": "0.75"})
    p = detect_platform(cfg)
    assert (p.device, p.on_gpu, p.cluster_gpus) == ("cpu", False, 0.0)
    assert p.source == ("ray" if ray.is_initialized() else "local")  # a local Ray here declares no GPUs
    assert (p.trainer_dtype, p.collective_backend, p.layer_spec) == ("float32", "gloo", "local")
    assert (p.engine_dtype, p.engine_block_size, p.engine_enforce_eager, p.engine_sleep_mode) == ("float32", 32, True, False)
    assert p.engine_tp_executor == "mp" and not p.pin_memory
    assert (p.gpus_per_bundle, p.gpus_per_engine, p.cpus_per_rank, p.cpus_per_engine) == (0.0, 0.0, 0.25, 0.75)
    assert p.threads_per_rank == max(1, (os.cpu_count() or 1) // 2)
    assert p.threads_per_engine == os.cpu_count()  # one engine at TP 1: all cores while it generates
    env = p.engine_env(kv_cache_gib=1.6, tensor_parallel_size=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2  # one core per engine TP worker
    assert "OMP_NUM_THREADS" not in env  # bound cores instead
    assert "VLLM_CPU_OMP_THREADS_BIND" not in p.engine_env(1.0, 1)
    assert p.engine_env(1.0, 1)["OMP_NUM_THREADS"] == str(os.cpu_count())
    two = detect_platform(_cfg(**{"vllm.num_engines": "2"}))
    assert two.threads_per_engine == max(1, (os.cpu_count() or 1) // 2)
    assert detect_platform(_cfg(**{"vllm.tensor_parallel_size": "2"})).threads_per_engine is None
    # Megatron's "auto" settings follow the profile
    from openrlhf_shape.megatron.config import MegatronConfig

    m = MegatronConfig()
    assert m.for_platform(p).bf16 is False and m.layer_spec_on(p) == "local"
    assert m.for_platform(gpu_platform()).bf16 is True and m.layer_spec_on(gpu_platform()) == "te"
    assert MegatronConfig(layer_spec="local").layer_spec_on(gpu_platform()) == "local"
    with pytest.raises(ValueError, match="bf16=True needs a GPU"):
        MegatronConfig(bf16=True).check_device(p)


def test_cpu_async_splits_the_cores_between_ranks_and_engines() -> None:
    """Synchronous: ranks and engines take turns, each side gets every core while it works. Asynchronous
    (--train.async_enable): both work at once, so one rank and one engine share the cores; whole CPU shares
    (--actor.num_cpus_per_rank 1) are the thread counts in either mode. Expectations follow os.cpu_count()."""
    cores = os.cpu_count() or 1
    one = {"actor.num_gpus_per_node": "1", "vllm.num_engines": "1"}
    sync = detect_platform(_cfg(**one))
    assert (sync.threads_per_rank, sync.threads_per_engine) == (cores, cores)
    both = detect_platform(_cfg(**one, **{"train.async_enable": "true"}))
    assert (both.threads_per_rank, both.threads_per_engine) == (max(1, cores // 2), max(1, cores // 2))
    if cores >= 2:  # on this 2-core machine: 1 and 1 in async, 2 and 2 in sync
        assert both.threads_per_rank + both.threads_per_engine <= cores < sync.threads_per_rank + sync.threads_per_engine
    whole = detect_platform(_cfg(**one, **{"actor.num_cpus_per_rank": "1", "vllm.num_cpus_per_engine": "1"}))
    assert (whole.threads_per_rank, whole.threads_per_engine) == (1, 1)
    two_ranks = detect_platform(_cfg(**{"actor.num_gpus_per_node": "2", "vllm.num_engines": "1", "train.async_enable": "true"}))
    assert (two_ranks.threads_per_rank, two_ranks.threads_per_engine) == (max(1, cores // 3), max(1, cores // 3))


def test_profile_round_trips_as_handed() -> None:
    p = gpu_platform(cpus_per_rank=1.5, cluster_gpus=16.0, source="ray")
    assert Platform.from_dict(p.to_dict()) == p and Platform.from_dict(p) is p
    with pytest.raises(ValueError, match="unknown fields"):
        Platform.from_dict({**p.to_dict(), "colour": "blue"})
    with pytest.raises(ValueError, match="collective_backend"):
        dataclasses.replace(p, collective_backend="mpi")
    assert gpu_platform().engine_env(4.0, 2) == {}  # vLLM's GPU platform needs neither variable
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.device = "cpu"  # type: ignore[misc]


# Modules that may ask torch/vLLM/Ray about devices for something other than the CPU/GPU decision.
ALLOWED = {
    "openrlhf_shape/platform.py": "the decision itself",
    "openrlhf_shape/weight_sync/cuda_ipc.py": "CudaIpcSender refuses the cuda_ipc transport where CUDA is absent "
                                               "(a capability check of the transport, not the run's platform)",
}
DECISION_CALLS = re.compile(r"torch\.cuda\.is_available\(|current_platform\.is_cpu\(|current_platform\.is_cuda\("
                            r"|cluster_resources\(|\bon_cpu\(\)")


def test_only_platform_py_decides_cpu_or_gpu() -> None:
    offenders = {}
    files = list((REPO / "openrlhf_shape").rglob("*.py"))
    files += [f for f in (REPO / "benchmarks").rglob("*.py") if "gpu" not in f.relative_to(REPO / "benchmarks").parts]
    assert len(files) > 50
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        code = "\n".join(line.split("#", 1)[0] for line in f.read_text().splitlines())  # comments do not count
        hits = [m.group(0) for m in DECISION_CALLS.finditer(code)]
        if hits and rel not in ALLOWED:
            offenders[rel] = hits
    assert not offenders, f"CPU/GPU decided outside openrlhf_shape/platform.py: {offenders}"
    # the allow-list is not stale
    for rel in ALLOWED:
        assert DECISION_CALLS.search((REPO / rel).read_text()), rel


# Who may ask for the profile: the driver (it decides once and hands the profile down) and the entry points
# that run without a driver. Everything else takes the profile as a required argument: no
# "platform or detect_platform()" fallback gives a consumer a second way in.
PROFILE_SOURCES = {
    "openrlhf_shape/trainer/setup.py": "the training driver: THE decision of the run",
    "openrlhf_shape/cli/doctor.py": "the doctor's driver",
    "openrlhf_shape/eval/runner.py": "eval has no driver: its engines run in this process or its own Ray",
    "openrlhf_shape/megatron/convert.py": "convert's subprocess ranks have no driver",
}


def test_the_profile_is_handed_not_looked_up() -> None:
    import ast

    callers = set()
    for f in (REPO / "openrlhf_shape").rglob("*.py"):
        rel = f.relative_to(REPO).as_posix()
        calls = [n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) == "detect_platform"]
        if calls and rel != "openrlhf_shape/platform.py":
            callers.add(rel)
    assert callers == set(PROFILE_SOURCES), f"detect_platform() called outside the driverless entry points: {sorted(callers - set(PROFILE_SOURCES))}"
    import inspect

    from openrlhf_shape.megatron.worker import MegatronRankWorker
    from openrlhf_shape.rollout.engine import VLLMEngine
    from openrlhf_shape.rollout.group import create_ray_engines, start_engines
    from openrlhf_shape.zero.worker import ZeroRankWorker

    for fn in (MegatronRankWorker.__init__, ZeroRankWorker.__init__, VLLMEngine.__init__, create_ray_engines, start_engines):
        assert inspect.signature(fn).parameters["platform"].default is inspect.Parameter.empty, fn.__qualname__


AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl"


def test_the_isa_key_follows_the_cpus_feature_flags(monkeypatch) -> None:
    """JIT builds (DeepSpeed's cpu_adam: -march=native) are cached per instruction set: an AVX2-only CPU and an
    AVX-512 one never share a cache, two CPUs with the same flags (in any order) do."""
    from openrlhf_shape.platform import cpu_isa_key, torch_extensions_dir

    avx2 = cpu_isa_key(f"processor\t: 0\nflags\t\t: {AVX2_FLAGS}\n")
    avx512 = cpu_isa_key(f"processor\t: 0\nflags\t\t: {AVX512_FLAGS}\n")
    assert avx2 != avx512
    assert avx2 == cpu_isa_key("flags : " + " ".join(reversed(AVX2_FLAGS.split())) + "\nflags : avx512f\n")
    assert cpu_isa_key("") == cpu_isa_key("model name : x\n")  # no flags line: the processor name decides
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    print(f"this CPU: {'AVX-512' if 'avx512f' in flags else 'AVX2-only' if 'avx2' in flags else 'no AVX2'}, "
          f"key {cpu_isa_key()}")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    own = torch_extensions_dir("venv-x")
    assert cpu_isa_key() in own and own.endswith("_venv-x") and own != torch_extensions_dir("venv-y")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert torch_extensions_dir() == "/somewhere/else"  # a user's own choice wins


def test_the_suite_caches_its_builds_per_instruction_set() -> None:
    """tests/conftest.py puts torch's extension cache under this CPU's key (unless the caller chose one)."""
    from openrlhf_shape.platform import cpu_isa_key

    chosen = os.environ["TORCH_EXTENSIONS_DIR"]
    if "_venv-" not in chosen:
        pytest.skip(f"TORCH_EXTENSIONS_DIR was given to the test run: {chosen}")
    assert cpu_isa_key() in chosen
