"""Check that the GPU image's Python stack resolves, without building anything and without a GPU.

    python scripts/check_gpu_requirements.py [--lock OUT.txt]

1. ``requirements/gpu.txt`` (every entry a binary wheel) is resolved for CPython 3.12 on
   manylinux_2_39 x86_64 (the glibc of the Ubuntu 24.04 base image; vllm 0.32.0's dependency
   llguidance 1.7 has x86_64 wheels for manylinux_2_31 and newer only) by uv's resolver with
   ``--no-build``: every package must come as a wheel, and the pins must not conflict. uv reads
   wheel metadata with HTTP range requests, so nothing big is downloaded (~30 s; pip's
   ``install --dry-run`` downloads every wheel, several GB, when the index serves no PEP 658
   metadata).
2. The resolved set is checked: torch equals vllm's pin and the CPU stack's torch; the libraries
   shared with ``requirements/cpu.txt`` have the same versions; torch's CUDA runtime wheels are
   the CUDA 13 ones (what transformer-engine-cu13 and vllm's cu13 kernels need).
3. Every pin of ``requirements/gpu-source.txt`` (compiled in the image) exists on the index, and
   transformer-engine-torch has the version of the transformer-engine core wheel.
4. The image installs those source pins with their dependencies resolved under the lock (all but
   ``NO_DEPS``), so each of their runtime requirements must be in the lock at a version that satisfies
   it: read from the ``Requires-Dist`` lines of the sdist's ``PKG-INFO`` (streamed: the first ~20 KB of
   the archive). A requirement the lock lacks would be installed unpinned, at whatever version is newest
   on the day of the build. (``PKG-INFO`` is what the sdist was built with; a ``setup.py`` that adds
   requirements at build time is caught in the image by ``docker/check_imports.py --lock``.)

Exit 0: all good; 1: a check failed (printed); 2: the index or uv is unavailable (CI skips the
test with that reason). Index: ``$SHAPE_PYPI_INDEX`` or https://pypi.org/simple.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_REQ = os.path.join(REPO, "requirements", "gpu.txt")
SOURCE_REQ = os.path.join(REPO, "requirements", "gpu-source.txt")
CPU_REQ = os.path.join(REPO, "requirements", "cpu.txt")
PLATFORM = "x86_64-manylinux_2_39"
PYTHON = "3.12"
# Releases published after this instant are ignored (uv --exclude-newer), so the resolution, and the
# committed requirements/gpu.lock.txt, stay reproducible; move it forward when re-pinning.
EXCLUDE_NEWER = "2026-11-23T08:00:00Z"
SHARED = ("torch", "megatron-core", "mbridge", "math-verify", "ray", "transformers", "datasets", "pylatexenc")
# Source pins the image installs with --no-deps, and why (every other source pin's requirements must be in the lock)
NO_DEPS = {"openrlhf": "its own pins (transformers 5.15, ray 2.55, deepspeed 0.19.6, flash-attn 2.8.3) conflict "
                       "with the stack; what openrlhf_shape and reward plug-ins import from it is in requirements/gpu.txt"}
# Requirements a source pin's setup.py adds at build time, which its sdist's PKG-INFO does not list
# (deepspeed 0.19.8 setup.py: nvidia-ml-py when it finds a CUDA torch, as in the image)
BUILD_TIME_REQUIRES = {"deepspeed": ["nvidia-ml-py"]}
# The image's target, for evaluating requirement markers
MARKER_ENV = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(path: str) -> dict[str, str]:
    """``name==version`` lines (extras dropped, names normalised); comments and blanks ignored."""
    pins: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
            if m:
                pins[_norm(m.group(1))] = m.group(3)
    return pins


def _index() -> str:
    return os.environ.get("SHAPE_PYPI_INDEX", "https://pypi.org/simple").rstrip("/")


def _uv() -> list[str] | None:
    try:
        import uv  # noqa: F401

        return [sys.executable, "-m", "uv"]
    except ImportError:
        path = shutil.which("uv")
        return [path] if path else None


def resolve(lock_path: str, constraints: str | None = None) -> tuple[int, str]:
    """``uv pip compile`` of requirements/gpu.txt into ``lock_path``; with ``constraints`` (the committed
    lock) every package it names must keep its pin, as in the image build (docker/Dockerfile)."""
    uv = _uv()
    if uv is None:
        return 2, "uv is not installed (pip install uv; requirements/cpu.txt lists it)"
    cmd = [*uv, "pip", "compile", "--python-version", PYTHON, "--python-platform", PLATFORM, "--no-build",
           "--no-config", "--exclude-newer", EXCLUDE_NEWER, "--index-url", _index(), GPU_REQ, "-o", lock_path,
           "--quiet", "--no-header"]
    if constraints:
        cmd += ["-c", constraints]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        text = proc.stderr + proc.stdout
        offline = any(s in text for s in ("dns error", "Failed to fetch", "error sending request", "Connect"))
        if offline and "No solution found" not in text:
            return 2, f"index {_index()} unreachable:\n{text[-2000:]}"
        return 1, f"resolution failed ({' '.join(cmd)}):\n{text[-6000:]}"
    return 0, ""


def _release_files(name: str, version: str) -> dict[str, str]:
    """File name -> URL of every file of ``name==version`` on the index (empty: no such release)."""
    url = f"{_index()}/{_norm(name)}/"
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310  (fixed https index)
        page = resp.read().decode("utf-8", "replace")
    stem = re.escape(name.replace("-", "_")) + "|" + re.escape(name)
    found = re.findall(rf'(?i)href="([^"#]+)[^"]*"[^>]*>(({stem})-{re.escape(version)}(\.tar\.gz|-[^<]*\.whl))<', page)
    return {fname: urllib.parse.urljoin(url, href) for href, fname, *_ in found}


def sdist_requires(url: str) -> list[str]:
    """The ``Requires-Dist`` lines of an sdist's top-level ``PKG-INFO``, reading the archive as a stream
    (PKG-INFO sits near its start, so a few KB come over the network, not the whole archive)."""
    with urllib.request.urlopen(url, timeout=120) as resp:  # noqa: S310  (fixed https index)
        with tarfile.open(fileobj=resp, mode="r|gz") as tar:
            for member in tar:
                if member.name.count("/") == 1 and member.name.endswith("/PKG-INFO"):
                    text = tar.extractfile(member).read().decode("utf-8", "replace")
                    return [line.split(":", 1)[1].strip() for line in text.splitlines()
                            if line.startswith("Requires-Dist:")]
    raise ValueError(f"{url}: no top-level PKG-INFO in the sdist")


def missing_from_lock(owner: str, requires: list[str], lock: dict[str, str], source: dict[str, str]) -> list[str]:
    """The runtime requirements of ``owner`` (``Requires-Dist`` strings) that neither the lock nor another
    source pin satisfies on the image's platform (extras and other platforms' markers are left out)."""
    from packaging.requirements import Requirement

    problems = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
            continue
        name = _norm(req.name)
        pinned = lock.get(name) or source.get(name)
        if pinned is None:
            problems.append(f"{owner} requires {text}, which requirements/gpu.lock.txt does not pin: the image would "
                            "install it unpinned; add it to requirements/gpu.txt and re-lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{owner} requires {text}, but the lock pins {name}=={pinned}")
    return problems


def check_source_pins(resolved: dict[str, str], source: dict[str, str]) -> list[str]:
    """Each source pin exists on the index; the requirements of those installed with dependencies are in the lock."""
    problems = []
    for name, version in source.items():
        files = _release_files(name, version)
        if not files:
            problems.append(f"{name}=={version} (requirements/gpu-source.txt) not found on {_index()}")
            continue
        if name in NO_DEPS:
            continue
        sdists = [url for fname, url in files.items() if fname.endswith(".tar.gz")]
        if not sdists:
            problems.append(f"{name}=={version}: no sdist on {_index()} to read its requirements from")
            continue
        requires = sdist_requires(sdists[0]) + BUILD_TIME_REQUIRES.get(name, [])
        problems += missing_from_lock(f"{name}=={version}", requires, resolved, source)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", default=None, help="keep the resolved, fully pinned set here")
    ap.add_argument("--constraints", default=None,
                    help="resolve under these pins (CI: requirements/gpu.lock.txt, so a new upstream release of an "
                         "unpinned dependency does not count as a change; a change of gpu.txt that the lock cannot "
                         "satisfy fails)")
    args = ap.parse_args(argv)
    t0 = time.time()
    problems: list[str] = []
    lock = args.lock or os.path.join(tempfile.mkdtemp(prefix="gpu_req_"), "gpu.lock.txt")
    code, msg = resolve(lock, args.constraints)
    if code:
        print(msg)
        return code
    resolved = parse_pins(lock)
    gpu, cpu, source = parse_pins(GPU_REQ), parse_pins(CPU_REQ), parse_pins(SOURCE_REQ)
    print(f"resolved {len(resolved)} packages for CPython {PYTHON} / {PLATFORM} in {time.time() - t0:.1f}s (uv, --no-build)")
    for name, version in gpu.items():
        if resolved.get(name) != version:
            problems.append(f"{name}: pinned {version} in requirements/gpu.txt, resolved {resolved.get(name)}")
    for name in SHARED:
        if name in cpu and resolved.get(name) != cpu[name]:
            problems.append(f"{name}: {resolved.get(name)} on GPU vs {cpu[name]} in requirements/cpu.txt")
    # torch's own CUDA runtime (NCCL, cuDNN) must be the CUDA 13 build
    for lib in ("nvidia-nccl", "nvidia-cudnn"):
        if f"{lib}-cu13" not in resolved or f"{lib}-cu12" in resolved:
            problems.append(f"expected {lib}-cu13 (torch's CUDA 13 runtime) and no {lib}-cu12 in the resolved set")
    if source.get("transformer-engine-torch") != gpu.get("transformer-engine"):
        problems.append("transformer-engine-torch (gpu-source.txt) must equal transformer-engine (gpu.txt)")
    try:
        problems += check_source_pins(resolved, source)
    except (urllib.error.URLError, TimeoutError) as exc:
        print(f"index {_index()} unreachable for the source pins: {exc}")
        return 2
    key = ("torch", "vllm", "transformers", "megatron-core", "mbridge", "transformer-engine-cu13", "ray",
           "nvidia-nccl-cu13", "flashinfer-python", "triton")
    print("  " + ", ".join(f"{k}=={resolved[k]}" for k in key if k in resolved))
    print(f"source-built pins found on the index: {', '.join(f'{k}=={v}' for k, v in source.items())}; the "
          f"requirements of all but {', '.join(NO_DEPS)} checked against the lock")
    print(f"total {time.time() - t0:.1f}s")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
