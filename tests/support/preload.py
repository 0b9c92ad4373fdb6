"""The test session's rank spawner for ``launch.run_ranks``: forks of a preloading zygote (:mod:`support.zygote`)
instead of fresh interpreters, 4-6 s of imports less per rank. The product never imports this (``run_ranks`` keeps
its plain subprocess spawner); tests pass ``spawner=spawn_preloaded``.

On by ``SHAPE_RANKS_PRELOAD`` (``1``: torch, transformers, megatron.core and deepspeed; or a comma-separated module
list; unset or ``0``: every rank is a plain subprocess). tests/conftest.py sets it. A fork cannot change what was read
before it, so:

* a launch whose ``env`` changes a variable read when a process starts (by the interpreter, the C allocator,
  OpenMP, the CUDA runtime, torch's C++ side: ``_READ_AT_PROCESS_START``), say ``CUDA_VISIBLE_DEVICES`` or
  ``MALLOC_ARENA_MAX``, runs as plain subprocesses;
* each calling process starts at most ``MAX_ZYGOTES`` zygotes, lazily, one per distinct value set of the variables
  the preloaded imports read from Python (the zygote records them: DeepSpeed's ``DS_ACCELERATOR``, for one); a
  launch that none matches when no new one may start runs as plain subprocesses;
* once a zygote failed to start (it refuses to serve when its imports started a thread or torch is a GPU build),
  every launch of the process does (the warning says why).

Forked ranks share the zygote's string-hash seed (``PYTHONHASHSEED``): unlike subprocess ranks, they iterate a
set of strings in the same order.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from importlib.machinery import PathFinder
from multiprocessing.connection import Connection
from typing import Optional

from openrlhf_shape.actor import launch
from support.zygote import pythonpath_entries

PRELOAD_ENV = "SHAPE_RANKS_PRELOAD"
DEFAULT_MODULES = ("torch", "transformers", "megatron.core", "deepspeed")
MAX_ZYGOTES = 2
READY_TIMEOUT_S = 600.0

# Read before any Python code runs (the interpreter, site, .pth files) or by C code at start-up or library load
# (the allocator, OpenMP, MKL, the CUDA runtime, torch's C++ side): the zygote cannot record these reads.
_READ_AT_PROCESS_START = ("PYTHON", "LD_", "MALLOC_", "LC_", "LANG", "HOME", "TMPDIR", "TZ", "COVERAGE_", "OMP_",
                        "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "CUDA_", "NCCL_", "NVIDIA_", "NVTE_",
                        "TORCH", "PYTORCH_", "HIP_", "ROCR_")
# Applied in the fork: PYTHONPATH becomes the fork's sys.path, the thread counts torch.set_num_threads (both when
# equal). Compared all the same when the imports read them from Python.
_APPLIED_IN_FORK = {"PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
# Packages that walk the whole environment at import, and the prefixes of what they take from it.
KNOWN_ENV_SCANS = {"tqdm": ("TQDM_",), "networkx": ("NETWORKX_", "_NETWORKX_"), "fsspec": ("FSSPEC_",)}


def startup_changes(env: dict) -> list[str]:
    """The variables read at a process's start that a launch's ``env`` sets differently from this process (the
    launcher's own ``PYTHONUNBUFFERED=1`` and the ones applied in the fork aside)."""
    names = {k for k in set(env) | set(os.environ) if k.startswith(_READ_AT_PROCESS_START)}
    names -= _APPLIED_IN_FORK | {"PYTHONUNBUFFERED"}
    return sorted(k for k in names if env.get(k) != os.environ.get(k))


def preload_modules() -> Optional[list[str]]:
    """The modules ``SHAPE_RANKS_PRELOAD`` asks to preload; None when ranks are plain subprocesses."""
    value = os.environ.get(PRELOAD_ENV, "").strip()
    if value in ("", "0"):
        return None
    if value == "1":
        return list(DEFAULT_MODULES)
    return [m.strip() for m in value.split(",") if m.strip()]


class ZygoteUnavailable(launch.RankFailure):
    """The zygote could not start or refused to serve (the message says why)."""


class Zygote:
    """One preloading zygote process and its control socket (thread-safe)."""

    def __init__(self, modules: list[str], env: dict, cwd: str) -> None:
        import socket

        self.modules = list(modules)
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="shape_zygote_"), "zygote.log")
        ours, theirs = socket.socketpair()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "support.zygote", str(theirs.fileno()), ",".join(modules)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()
        self.exited: dict[int, int] = {}
        self.spawned: dict[int, int] = {}
        self.next_id = 0
        self.dead = False
        self.ready = self._wait_ready()
        self.env = self.ready["env"]

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise ZygoteUnavailable(f"the zygote did not start (exit {self.proc.returncode}):\n{self.log_tail()}")
        ready = self.conn.recv()
        if not ready["ready"]:
            self.close()
            raise ZygoteUnavailable(ready["why"])
        return ready

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def mismatch(self, modules: list[str], env: dict, cwd: str) -> Optional[str]:
        """Why a launch with ``env`` in ``cwd`` cannot be a fork of this zygote; None if it can."""
        if modules != self.modules:
            return f"preloads {self.modules}, not {modules}"
        names = self._import_time_names(env)
        differ = sorted(k for k in names if env.get(k) != self.env.get(k))
        if differ:
            return f"import-time variables differ: {differ}"
        if env.get("OMP_NUM_THREADS") != env.get("MKL_NUM_THREADS"):
            return "OMP_NUM_THREADS != MKL_NUM_THREADS (a fork sets both with torch.set_num_threads)"
        front = [cwd, *pythonpath_entries(env.get("PYTHONPATH"), cwd)]
        for top, (loaded, from_tail) in self.ready["origins"].items():
            spec = PathFinder.find_spec(top, front)
            if (spec.origin if spec else from_tail) != loaded:
                return f"this launch's path would import {top} from elsewhere than {loaded}"
        return None

    def _import_time_names(self, env: dict) -> set[str]:
        """The variables a launch must set as this zygote's were: those read when a process starts, those its imports
        read from Python, and every one when a package of unknown taste walked the whole environment."""
        every = set(env) | set(self.env)
        scans = self.ready["env_scans"]
        if any(pkg not in KNOWN_ENV_SCANS for pkg in scans):
            return every
        prefixes = _READ_AT_PROCESS_START + tuple(p for pkg in scans for p in KNOWN_ENV_SCANS[pkg])
        names = {k for k in every if k.startswith(prefixes)} - _APPLIED_IN_FORK
        for pkg, read in self.ready["env_reads"].items():
            if pkg not in scans:  # a scanner's reads are its walk's: its prefixes hold what it takes
                names |= set(read)
        return names

    def spawn(self, argv: list[str], env: dict, cwd: str, log: str) -> "ForkedRank":
        """Fork a rank running ``launch.run_rank(argv)`` with ``env`` in ``cwd``, its output into ``log``."""
        with self.lock:
            if self.dead:
                raise ZygoteUnavailable("the zygote died")
            self.next_id += 1
            rid = self.next_id
            try:
                self.conn.send({"op": "spawn", "id": rid, "argv": argv, "env": env, "cwd": cwd, "log": log,
                                "main_file": launch.__file__})
            except OSError:
                self.dead = True
        while True:
            with self.lock:
                self._pump(0.05)
                if rid in self.spawned:
                    return ForkedRank(self, self.spawned.pop(rid))
                if self.dead:
                    raise ZygoteUnavailable(f"the zygote died:\n{self.log_tail()}")

    def _pump(self, timeout: float) -> None:
        """Read what the zygote said (caller holds the lock); a closed socket marks it dead."""
        try:
            while self.conn.poll(timeout):
                timeout = 0
                msg = self.conn.recv()
                if "exited" in msg:
                    self.exited[msg["exited"]] = msg["code"]
                else:
                    self.spawned[msg["spawned"]] = msg["pid"]
        except (EOFError, OSError):
            self.dead = True

    def returncode(self, pid: int) -> Optional[int]:
        with self.lock:
            self._pump(0)
            if pid in self.exited:
                return self.exited[pid]
            return -9 if self.dead else None  # its ranks die with it (PR_SET_PDEATHSIG)

    def kill(self, pid: int) -> None:
        with self.lock:
            if not self.dead:
                try:
                    self.conn.send({"op": "kill", "pid": pid})
                except OSError:
                    self.dead = True

    def close(self) -> None:
        """Stop the zygote (its live ranks with it) and wait for it."""
        self.dead = True
        self.conn.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedRank:
    """A forked rank, answering the ``subprocess.Popen`` calls the launcher makes (``poll``, ``kill``, ``wait``)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self.zygote.kill(self.pid)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


class _Registry:
    """This process's zygotes (a forked copy of this process starts with none: the sockets are the parent's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.zygotes: list[Zygote] = []
        self.broken: Optional[str] = None  # why a zygote failed to start: plain subprocesses from then on
        self.owner = os.getpid()

    def zygote_for(self, env: dict, cwd: str) -> tuple[Optional[Zygote], str]:
        """The zygote to fork a launch with ``env`` in ``cwd`` from (started if needed), or None and why not."""
        modules = preload_modules()
        if modules is None:
            return None, f"{PRELOAD_ENV} is not set"
        with self.lock:
            if self.owner != os.getpid():
                self.reset()
            if self.broken:
                return None, self.broken
            changed = startup_changes(env)
            if changed:
                return None, f"the launch sets {changed}, read when a process starts: plain subprocesses"
            for zygote in [z for z in self.zygotes if z.dead]:
                zygote.close()
                self.zygotes.remove(zygote)
            why = []
            for zygote in self.zygotes:
                reason = zygote.mismatch(modules, env, cwd)
                if reason is None:
                    return zygote, "forked"
                why.append(reason)
            if len(self.zygotes) >= MAX_ZYGOTES:
                return None, f"{MAX_ZYGOTES} zygotes already, none matches: {'; '.join(why)}"
            try:
                zygote = Zygote(modules, env, cwd)
            except ZygoteUnavailable as e:
                self.broken = f"the zygote failed to start: {e}"
                warnings.warn(f"{self.broken}\nranks start as plain subprocesses from now on")
                return None, self.broken
            self.zygotes.append(zygote)
            reason = zygote.mismatch(modules, env, cwd)  # e.g. the imports read a variable the launch sets
            return (zygote, "forked") if reason is None else (None, f"its own zygote does not match: {reason}")

    def close(self) -> None:
        """Stop this process's zygotes (at exit; tests that want fresh ones)."""
        with self.lock:
            if self.owner == os.getpid():
                for zygote in self.zygotes:
                    zygote.close()
            self.reset()

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork
        self.reset()


REGISTRY = _Registry()
atexit.register(REGISTRY.close)
os.register_at_fork(after_in_child=REGISTRY.after_fork)


def spawn_preloaded(argv: list[str], env: dict, log_path: str) -> "ForkedRank | subprocess.Popen":
    """``run_ranks``' spawner for tests: a fork of the zygote that matches this launch (started if needed), else a
    plain subprocess (:func:`launch.spawn_subprocess`)."""
    zygote, _ = REGISTRY.zygote_for(env, os.getcwd())
    if zygote is None:
        return launch.spawn_subprocess(argv, env, log_path)
    open(log_path, "w").close()  # the fork appends to it
    return zygote.spawn(argv, env, os.getcwd(), log_path)
