"""The subprocess rank launcher: ports drawn outside the kernel's and Ray's ranges, and a rendezvous
whose port another process took meanwhile (CI failed on this: EADDRINUSE at rank 0) retried on a new one; the test
session's spawner (ranks forked from a preloading zygote, tests/support/preload.py) against the product's plain
subprocesses."""
from __future__ import annotations

import os
import socket
import time

import pytest

from openrlhf_shape.actor import launch
from support import preload

HERE = os.path.dirname(os.path.abspath(__file__))


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    for _ in range(20):
        port = launch.free_port()
        assert launch._PORT_RANGE[0] <= port <= launch._PORT_RANGE[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", launch.free_port()))
    s.listen(1)
    return s


def test_a_rendezvous_port_taken_meanwhile_is_retried_on_a_new_one(monkeypatch):
    held = _listening_socket()  # another process's server on the port the launcher drew
    drawn = iter([held.getsockname()[1]])
    real_free_port = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(drawn, None) or real_free_port(host))
    try:
        # the session's spawner, as the suite's other launches (the retry does not depend on how ranks start)
        results = launch.run_ranks("launch_targets:rank_sum", 2, timeout=120, extra_pythonpath=[HERE],
                                   spawner=preload.spawn_preloaded)
    finally:
        held.close()
    assert results == [1, 1]


def test_a_port_taken_every_time_fails_with_the_ranks_logs(monkeypatch):
    held = _listening_socket()
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": held.getsockname()[1])
    try:
        with pytest.raises(launch.RankFailure, match="EADDRINUSE"):
            launch.run_ranks("launch_targets:rank_sum", 2, timeout=120, extra_pythonpath=[HERE],
                             spawner=preload.spawn_preloaded)
    finally:
        held.close()


# --- preloaded ranks: forks of a zygote (spawner=spawn_preloaded) against plain subprocesses ----------------------

LIGHT = "torch"  # the zygote's preload here: torch alone (the session's heavy list costs the same checks more time)


@pytest.fixture
def registry(monkeypatch):
    """A registry of zygotes of this test's own, preloading torch; every zygote it started stopped at the end."""
    own = preload._Registry()
    monkeypatch.setattr(preload, "REGISTRY", own)
    monkeypatch.setenv(preload.PRELOAD_ENV, LIGHT)
    yield own
    own.close()


def _forked(*args, **kw):
    """``launch.run_ranks`` with the test session's spawner (forks of a matching zygote, else subprocesses)."""
    return launch.run_ranks(*args, spawner=preload.spawn_preloaded, **kw)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_forked_ranks_all_reduce_as_subprocess_ranks_do(registry):
    forked = _forked("launch_targets:rank_sum", 3, timeout=120, extra_pythonpath=[HERE])
    [zygote] = registry.zygotes
    who = _forked("launch_targets:whoami", 3, timeout=120, extra_pythonpath=[HERE])
    assert [w["ppid"] for w in who] == [zygote.proc.pid] * 3  # forks of the zygote, not subprocesses of pytest
    assert len({w["pid"] for w in who}) == 3
    plain = launch.run_ranks("launch_targets:rank_sum", 3, timeout=120, extra_pythonpath=[HERE])
    assert forked == plain == [3, 3, 3]
    assert _children(zygote.proc.pid) == []  # every rank reaped


def test_a_forked_rank_sees_its_launch_as_a_subprocess_would(registry, monkeypatch, tmp_path):
    """The zygote started for a 1-thread launch from the repository; a later launch with 2 threads, another working
    directory, another PYTHONPATH entry and a variable of its own is forked from it and sees what a subprocess sees."""
    _forked("launch_targets:rank_sum", 1, timeout=120, extra_pythonpath=[HERE])
    [zygote] = registry.zygotes
    monkeypatch.chdir(tmp_path)
    kw = dict(timeout=120, extra_pythonpath=[HERE, str(tmp_path / "extra")], threads_per_rank=2,
              env={"SHAPE_TEST_LAUNCH_FLAG": "on"})
    forked = _forked("launch_targets:whoami", 2, **kw)
    plain = launch.run_ranks("launch_targets:whoami", 2, **kw)
    assert [f["ppid"] for f in forked] == [zygote.proc.pid] * 2 and [p["ppid"] for p in plain] == [os.getpid()] * 2
    for f, p in zip(forked, plain):
        assert f["threads"] == p["threads"] == 2
        assert f["env"] == p["env"] and f["env"]["SHAPE_TEST_LAUNCH_FLAG"] == "on"
        assert f["path"] == p["path"] and str(tmp_path / "extra") in f["path"]
        assert f["cwd"] == p["cwd"] == str(tmp_path)
        assert (f["argv0"], f["target"]) == (p["argv0"], p["target"]) == (launch.__file__, "launch_targets:whoami")
        assert f["fds"] == p["fds"]  # nothing of the zygote's (its socket) leaks into a rank


@pytest.mark.parametrize("preloaded", [False, True], ids=["subprocess", "forked"])
def test_a_failing_rank_raises_rank_failure_with_its_log(registry, preloaded):
    spawner = preload.spawn_preloaded if preloaded else launch.spawn_subprocess
    with pytest.raises(launch.RankFailure) as info:
        launch.run_ranks("launch_targets:fail_on_rank_one", 2, timeout=120, extra_pythonpath=[HERE], spawner=spawner)
    msg = str(info.value)
    assert "rank(s) [1] exited non-zero" in msg
    assert "rank 1 is about to fail" in msg and "ValueError: boom from rank 1" in msg
    assert len(registry.zygotes) == int(preloaded)


def test_a_hung_forked_rank_is_killed_at_the_timeout(registry, tmp_path):
    with pytest.raises(launch.RankFailure, match="timed out after 5s"):
        _forked("launch_targets:hang", 2, kwargs={"pid_dir": str(tmp_path)}, timeout=5, extra_pythonpath=[HERE])
    ranks = [tuple(map(int, (tmp_path / f"rank{r}").read_text().split())) for r in range(2)]
    assert {ppid for _, ppid in ranks} == {registry.zygotes[0].proc.pid}
    assert not any(_alive(pid) for pid, _ in ranks)  # killed, and reaped (no zombie left)
    assert _children(registry.zygotes[0].proc.pid) == []


@pytest.mark.parametrize("preloaded", [False, True], ids=["subprocess", "forked"])
def test_a_ranks_own_child_processes_end_with_it(registry, tmp_path, preloaded):
    """A rank that leaves a multiprocessing Manager running (Megatron's checkpoint writer does) has it stopped
    at its exit, as an interpreter's exit does: no orphan."""
    spawner = preload.spawn_preloaded if preloaded else launch.spawn_subprocess
    [parent] = launch.run_ranks("launch_targets:start_a_manager", 1, kwargs={"pid_dir": str(tmp_path)}, timeout=120,
                                extra_pythonpath=[HERE], spawner=spawner)
    assert (parent != os.getpid()) == preloaded
    manager = int((tmp_path / "manager0").read_text())
    deadline = time.monotonic() + 30
    while _alive(manager):
        assert time.monotonic() < deadline, "the rank's Manager outlived it"
        time.sleep(0.2)


READS_ENV = """
import os

FLAG = os.environ.get("SHAPE_TEST_IMPORT_FLAG", "unset")  # read once, at import


def flag(rank, world_size, master_addr, master_port):
    return FLAG, os.environ.get("SHAPE_TEST_IMPORT_FLAG", "unset"), os.getppid()
"""


def test_a_launch_changing_what_the_preloaded_imports_read_gets_its_own_zygote_then_subprocesses(
        registry, monkeypatch, tmp_path):
    """A preloaded module keeps what it read at import: a launch that sets it otherwise is forked from a zygote
    started with its value, or (``MAX_ZYGOTES`` reached) runs as subprocesses; each sees its own value."""
    (tmp_path / "reads_env.py").write_text(READS_ENV)
    monkeypatch.setenv(preload.PRELOAD_ENV, f"{LIGHT},reads_env")
    monkeypatch.setattr(preload, "MAX_ZYGOTES", 2)
    run = lambda env=None: _forked("reads_env:flag", 1, timeout=120, env=env,  # noqa: E731
                                   extra_pythonpath=[str(tmp_path)])[0]
    first, second = run(), run({"SHAPE_TEST_IMPORT_FLAG": "a"})
    assert [z.proc.pid for z in registry.zygotes] == [first[2], second[2]]
    assert "SHAPE_TEST_IMPORT_FLAG" in registry.zygotes[0].ready["env_reads"]["reads_env"]
    assert first[:2] == ("unset", "unset") and second[:2] == ("a", "a")
    assert run({"SHAPE_TEST_IMPORT_FLAG": "a"})[2] == second[2]  # the same value: the same zygote
    third = run({"SHAPE_TEST_IMPORT_FLAG": "b"})
    assert third == ("b", "b", os.getpid())


def test_a_launch_changing_a_variable_read_at_process_start_runs_as_subprocesses(registry):
    """MALLOC_ARENA_MAX is read by the C allocator when the process starts, which a fork cannot redo."""
    forked = _forked("launch_targets:whoami", 1, timeout=120, extra_pythonpath=[HERE])[0]
    plain = _forked("launch_targets:whoami", 1, timeout=120, extra_pythonpath=[HERE], env={"MALLOC_ARENA_MAX": "2"})[0]
    assert forked["ppid"] == registry.zygotes[0].proc.pid and len(registry.zygotes) == 1
    assert plain["ppid"] == os.getpid() and plain["env"]["MALLOC_ARENA_MAX"] == "2"
    zygote, why = registry.zygote_for(launch._rank_env(1, [HERE], {"MALLOC_ARENA_MAX": "2"}), os.getcwd())
    assert zygote is None and "MALLOC_ARENA_MAX" in why


def test_a_zygote_killed_mid_launch_fails_that_launch_and_the_next_gets_a_new_one(registry, tmp_path):
    with pytest.raises(launch.RankFailure, match="exited non-zero"):
        _forked("launch_targets:kill_my_parent", 1, kwargs={"pid_dir": str(tmp_path)}, timeout=300,
                extra_pythonpath=[HERE])
    rank = int((tmp_path / "rank0").read_text().split()[0])
    deadline = time.monotonic() + 30
    while _alive(rank):  # the rank dies with its zygote (no orphan sleeping on)
        assert time.monotonic() < deadline, "a rank outlived its zygote"
        time.sleep(0.2)
    assert _forked("launch_targets:rank_sum", 2, timeout=120, extra_pythonpath=[HERE]) == [1, 1]
    assert len(registry.zygotes) == 1 and not registry.zygotes[0].dead


PARENT = """
import sys
from openrlhf_shape.actor import launch
from support.preload import spawn_preloaded
launch.run_ranks("launch_targets:hang", 2, kwargs={"pid_dir": sys.argv[1]}, timeout=3600,
                 extra_pythonpath=[sys.argv[2]], spawner=spawn_preloaded)
"""


def test_the_zygote_and_its_ranks_die_with_the_launching_process(tmp_path):
    import signal
    import subprocess
    import sys

    env = {**os.environ, preload.PRELOAD_ENV: LIGHT}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), HERE], env=env)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.2)
        ranks = [tuple(map(int, (tmp_path / f"rank{r}").read_text().split())) for r in range(2)]
        zygote = ranks[0][1]
        assert {ppid for _, ppid in ranks} == {zygote} and zygote != parent.pid and _alive(zygote)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in (zygote, *(pid for pid, _ in ranks))):
            assert time.monotonic() < deadline, "the zygote or a rank outlived the launching process"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


THREAD_AT_IMPORT = {
    "a Python thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n",
    "an OpenMP pool": "import torch\ntorch.set_num_threads(2)\ntorch.ones(512, 512) @ torch.ones(512, 512)\n",
}


@pytest.mark.parametrize("source", list(THREAD_AT_IMPORT), ids=["python_thread", "openmp_pool"])
def test_a_zygote_whose_imports_start_threads_refuses_and_ranks_start_as_subprocesses(registry, monkeypatch,
                                                                                      tmp_path, source):
    (tmp_path / "starts_threads.py").write_text(THREAD_AT_IMPORT[source])
    monkeypatch.setenv(preload.PRELOAD_ENV, f"{LIGHT},starts_threads")
    with pytest.warns(UserWarning, match="started threads"):
        who = _forked("launch_targets:whoami", 1, timeout=120, extra_pythonpath=[HERE, str(tmp_path)])
    assert who[0]["ppid"] == os.getpid() and registry.zygotes == []
    assert _forked("launch_targets:whoami", 1, timeout=120, extra_pythonpath=[HERE])[0]["ppid"] == os.getpid()


def test_the_sessions_preload_gives_a_single_threaded_zygote():
    """What tests/conftest.py preloads (torch, transformers, megatron-core, DeepSpeed, our workers) imports without
    starting a thread (seen from outside, in /proc); what walks the whole environment is known (by its prefixes); a
    launch with other thread counts and test folders is forked from it."""
    modules = preload.preload_modules() or list(preload.DEFAULT_MODULES)
    zygote = preload.Zygote(modules, launch._rank_env(1, [HERE], None), os.getcwd())
    try:
        assert os.listdir(f"/proc/{zygote.proc.pid}/task") == [str(zygote.proc.pid)]
        assert set(zygote.ready["env_scans"]) <= set(preload.KNOWN_ENV_SCANS)
        assert zygote.mismatch(modules, launch._rank_env(4, [HERE, "/elsewhere"], None), os.getcwd()) is None
    finally:
        zygote.close()
