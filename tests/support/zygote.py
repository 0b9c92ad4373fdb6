"""The preloading zygote behind the test session's rank spawner (``SHAPE_RANKS_PRELOAD``; the client side is
:mod:`support.preload`).

A rank started as ``python -m openrlhf_shape.actor.launch`` spends 4-6 s importing torch, transformers,
megatron-core and DeepSpeed before its first line of work. The zygote is one fresh interpreter that imports them
once and then forks each rank on request: the fork starts with the modules loaded, takes the launch's
environment, working directory, ``sys.path``, ``sys.argv`` and thread count, and runs the same rank body as the
subprocess (:func:`launch.run_rank`), writing the same result and log files.

What a fork must not inherit, and how it is kept out:

* threads: the zygote starts none and checks after its imports that it is still single-threaded at the OS level
  (``/proc/self/task``: this counts OpenMP's pool too, which a torch op would start); otherwise it refuses to
  serve and the launcher uses plain subprocesses. A CUDA/ROCm build of torch is refused too: a fork after the
  driver's initialisation (which a device probe at import may do) leaves the child's GPU unusable.
* file descriptors: the control socket is closed in the child and its stdout/stderr point at its log file.
* exit: the child ends with ``os._exit`` after its own ``atexit`` work and the standard library's exit duties
  (multiprocessing's: the rank's child processes stopped), never returning into the serving loop; the zygote's
  own exit handlers are dropped at the fork.
* orphans: the zygote exits (killing its live ranks) when its parent closes the socket or dies; each rank gets
  ``SIGKILL`` if the zygote dies (``PR_SET_PDEATHSIG``). The zygote reaps every rank and reports its exit status.
* process groups and signal handlers: the zygote keeps its parent's process group and Python's default handlers,
  so a rank sees what a subprocess rank sees.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import os
import select
import signal
import sys
import threading
import traceback
from importlib.machinery import PathFinder
from multiprocessing.connection import Connection
from typing import Any, Iterator, Optional

_PR_SET_PDEATHSIG = 1


class _EnvReads:
    """Records which environment variables Python code reads while the preloaded modules import (those a fork
    cannot change afterwards), by the package that reads them (the innermost caller outside the standard
    library), and which packages walk the whole environment (``scans``: tqdm, say, looks for its ``TQDM_*``)."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {}
        self.scans: set[str] = set()

    def __enter__(self) -> "_EnvReads":
        cls = type(os.environ)
        self._saved = (cls.__getitem__, cls.__iter__)
        getitem, iterate = self._saved

        def recording_getitem(env: Any, key: str) -> str:
            self.names.setdefault(_caller_package(), set()).add(key)
            return getitem(env, key)

        def recording_iter(env: Any) -> Iterator[str]:
            self.scans.add(_caller_package())
            return iterate(env)

        cls.__getitem__, cls.__iter__ = recording_getitem, recording_iter
        return self

    def __exit__(self, *exc: Any) -> None:
        cls = type(os.environ)
        cls.__getitem__, cls.__iter__ = self._saved


def _caller_package() -> str:
    """The top-level package of the innermost caller outside the standard library ("stdlib" if none)."""
    frame = sys._getframe(2)
    while frame is not None:
        top = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if top and top not in sys.stdlib_module_names and top != "__main__" and not top.startswith("_frozen"):
            return top
        frame = frame.f_back
    return "stdlib"


def _fork_hazards() -> str | None:
    """Why forking this process would not give clean ranks, or None."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1 or threading.active_count() != 1:
        names = []
        for tid in tasks:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        return f"the preloaded imports started threads ({names}; Python threads: {threading.active_count()})"
    torch = sys.modules.get("torch")
    if torch is not None and (torch.version.cuda or torch.version.hip):
        return f"torch {torch.__version__} is a GPU build: a fork after the driver's initialisation breaks CUDA"
    return None


def _origins(modules: list[str], path_tail: list[str]) -> dict[str, tuple[str, Optional[str]]]:
    """Top-level package -> (the file it was loaded from, the file ``path_tail`` alone would give): the launcher
    checks that a launch's own path would load the same one."""
    out = {}
    for name in modules:
        top = name.split(".", 1)[0]
        mod = sys.modules.get(top)
        if mod is not None and getattr(mod, "__file__", None):
            spec = PathFinder.find_spec(top, path_tail)
            out[top] = (mod.__file__, spec.origin if spec else None)
    return out


def preload(modules: list[str]) -> dict:
    """Import ``modules``; the ready message the launcher reads (or why not)."""
    start_env = dict(os.environ)
    start_path = list(sys.path)
    try:
        with _EnvReads() as reads:
            for name in modules:
                importlib.import_module(name)
    except Exception:
        return {"ready": False, "why": f"importing {modules}:\n{traceback.format_exc()}"}
    hazard = _fork_hazards()
    if hazard:
        return {"ready": False, "why": hazard}
    front = 1 + len(pythonpath_entries(start_env.get("PYTHONPATH"), os.getcwd()))  # the cwd, then PYTHONPATH's
    if sys.path[:front] != start_path[:front]:
        return {"ready": False, "why": f"the imports changed the front of sys.path: {sys.path[:front + 2]}"}
    env_after = dict(os.environ)
    return {
        "ready": True,
        "pid": os.getpid(),
        "env": start_env,
        "env_reads": {pkg: sorted(names) for pkg, names in reads.names.items()},
        "env_scans": sorted(reads.scans),
        "origins": _origins(modules, sys.path[front:]),
        # what the imports did to the environment and the path: a subprocess rank's imports do the same
        "env_set": {k: v for k, v in env_after.items() if start_env.get(k) != v},
        "env_removed": sorted(set(start_env) - set(env_after)),
        "path_tail": sys.path[front:],
    }


def pythonpath_entries(pythonpath: str | None, cwd: str) -> list[str]:
    """The ``sys.path`` entries Python makes of ``PYTHONPATH`` in a process started in ``cwd``: each made absolute
    (an empty one means ``cwd``), the first of duplicates kept (``site`` drops the others)."""
    if not pythonpath:
        return []
    return _first_of_each([os.path.normpath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep)])


def _first_of_each(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(paths))


def main(argv: list[str]) -> None:
    """``python -m support.zygote FD MODULES``: serve forks on the socket ``FD`` after importing the
    comma-separated ``MODULES``."""
    conn = Connection(int(argv[0]))
    parent = os.getppid()
    ready = preload([m for m in argv[1].split(",") if m])
    conn.send(ready)
    if not ready["ready"]:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the imported objects stay in the shared pages of every fork (no copy on the next collection)
    _Server(conn, parent, ready).serve()


class _Server:
    """The serving loop: spawn and kill requests in, spawn answers and exit statuses out."""

    def __init__(self, conn: Connection, parent: int, ready: dict) -> None:
        self.conn, self.parent, self.ready = conn, parent, ready
        self.live: set[int] = set()

    def serve(self) -> None:
        try:
            while os.getppid() == self.parent:
                readable, _, _ = select.select([self.conn], [], [], 0.05)
                if readable:
                    try:
                        request = self.conn.recv()
                    except (EOFError, OSError):
                        return  # the launcher closed its end or died
                    self.handle(request)
                self.reap()
        finally:
            for pid in self.live:
                _kill(pid)
            for pid in list(self.live):
                os.waitpid(pid, 0)

    def handle(self, request: dict) -> None:
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(self.conn, request, self.ready)  # never returns
            self.live.add(pid)
            self.conn.send({"spawned": request["id"], "pid": pid})
        elif request["op"] == "kill" and request["pid"] in self.live:  # not reaped: the pid is still this rank's
            _kill(request["pid"])

    def reap(self) -> None:
        for pid in list(self.live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.live.discard(pid)
                self.conn.send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child(conn: Connection, request: dict, ready: dict) -> None:
    """The forked rank: detach from the zygote, take the launch's setting, run the rank body, ``os._exit``."""
    code = 1
    try:
        _detach(conn, request["log"], ready["pid"])
        _apply_launch(request, ready)
        from openrlhf_shape.actor.launch import run_rank

        run_rank(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """End as an interpreter would, then ``os._exit``: non-daemon threads joined, the exit handlers the rank
    registered run, then the standard library's exit duties whose handlers the zygote's imports registered (and
    the fork dropped with the zygote's others): multiprocessing's, which stops the rank's own child processes (a
    Megatron checkpoint's ``Manager``, say) and runs its finalizers (each runs only in the process that made
    it), and logging's flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util._exit_function()
        logging = sys.modules.get("logging")
        if logging is not None:
            logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _detach(conn: Connection, log: str, zygote_pid: int) -> None:
    """Die with the zygote; drop its socket and exit handlers; stdout and stderr into ``log``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote_pid:  # the zygote died before the death signal was armed
        os._exit(1)
    conn.close()
    atexit._clear()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _apply_launch(request: dict, ready: dict) -> None:
    """The launch's environment, working directory, path, argv and thread count, as a fresh process has them."""
    env = dict(request["env"])
    env.update(ready["env_set"])
    for name in ready["env_removed"]:
        env.pop(name, None)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    entries = pythonpath_entries(request["env"].get("PYTHONPATH"), request["cwd"])
    # ``site`` keeps the first of duplicate entries; ``-m`` then puts the working directory first
    sys.path[:] = [request["cwd"], *_first_of_each([*entries, *ready["path_tail"]])]
    importlib.invalidate_caches()
    sys.argv = [request["main_file"], *request["argv"]]
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # what the OpenMP runtime took from it at its start
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process seeds numpy's global generator from the OS; forks would share one


if __name__ == "__main__":
    main(sys.argv[1:])
