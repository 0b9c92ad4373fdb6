"""The sync's progress bound, below the engines: the board the driver reads and the reports every side writes
(``weight_sync/progress.py``), the verdict that names who holds a stalled sync up, and the driver's wait
(``driver.get_all_fail_fast``) on real Ray calls that report through real reporters: calls that keep completing
buckets run past the bound, calls that stop completing them fail one bound after their last bucket, naming the
engine, the bucket and the step. The same with vLLM engines on each transport: ``test_sync_progress.py``.

Before issue 37 the driver bounded the whole call: the paced calls here failed at the bound, and no error named
a bucket."""

from __future__ import annotations

import sys
import time

import pytest

from openrlhf_shape.weight_sync import TRANSPORTS, Transport, WeightSender
from openrlhf_shape.weight_sync.driver import POLL_S, WeightSyncError, get_all_fail_fast
from openrlhf_shape.weight_sync.progress import MemberLine, ProgressBoard, ProgressReporter, stall_verdict

MEMBERS = ["sender", "engine 0 worker 0", "engine 1 worker 0"]


def lines(sender: tuple, *workers: tuple) -> list[MemberLine]:
    return [MemberLine("sender", *sender)] + [MemberLine(f"engine {i} worker 0", *w) for i, w in enumerate(workers)]


def test_verdict_names_who_holds_the_sync_up_and_the_bucket() -> None:
    # the object store: engine 1 took 3 buckets, the sender queued 5 and waits for room in its queue
    v = stall_verdict(lines((5, "sending"), (5, "waiting"), (3, "waiting")))
    assert (v.who, v.bucket) == ("engine 1", 3) and "completed 3 bucket(s) while the sender sent 5" in v.detail
    # an engine whose loader holds bucket 4 (it received it; the loader never asked for more)
    v = stall_verdict(lines((5, "sending"), (4, "loading"), (5, "waiting")))
    assert (v.who, v.bucket) == ("engine 0", 4)
    v = stall_verdict(lines((5, "sending"), (5, "waiting"), (5, "loading")))
    assert (v.who, v.bucket) == ("engine 1", 5) and "loading bucket 5" in v.detail
    # the export hangs: everybody took everything sent, the sender is making bucket 7
    v = stall_verdict(lines((7, "producing"), (7, "waiting"), (7, "waiting")))
    assert (v.who, v.bucket) == ("actor rank 0 (the sender)", 7)
    # everybody inside the transport at the same bucket (a collective): the one whose heartbeat stopped is named
    v = stall_verdict(lines((7, "sending", 0.5), (7, "waiting", 0.2), (7, "waiting", 6.0)))
    assert (v.who, v.bucket) == ("engine 1", 7) and "stopped running 6 s ago" in v.detail, v
    v = stall_verdict(lines((7, "producing", 9.0), (7, "waiting"), (7, "waiting")))
    assert (v.who, v.bucket) == ("actor rank 0 (the sender)", 7) and "while producing bucket 7" in v.detail, v
    # a finished side beats no more and is not suspect (the sender and engine 0 are done, engine 1 lags)
    v = stall_verdict(lines((9, "finished", 60.0), (9, "finished", 60.0), (6, "waiting", 0.1)))
    assert (v.who, v.bucket) == ("engine 1", 6) and "completed 6 bucket(s) while the sender sent 9" in v.detail, v
    # with every side running and at the same bucket inside the transport, it cannot tell which member hangs
    v = stall_verdict(lines((7, "sending"), (7, "waiting"), (7, "waiting")))
    assert (v.who, v.bucket) == ("the transport", 7)
    # a worker that never reported this sync, and a sender that never started
    v = stall_verdict(lines((2, "sending"), (2, "waiting"), (None, "not started")))
    assert (v.who, v.bucket) == ("engine 1", 0) and "never started" in v.detail
    v = stall_verdict(lines((None, "not started"), (0, "waiting"), (0, "waiting")))
    assert v.who == "actor rank 0 (the sender)" and "never started" in v.detail


def test_board_reads_what_the_reporters_wrote_and_forgets_it_per_sync() -> None:
    board = ProgressBoard("127.0.0.1", MEMBERS)
    board.begin()
    sender = ProgressReporter(board.address(), "sender")
    worker = ProgressReporter(board.address(), "engine 1 worker 0")
    t0 = board.ticks()
    sender.report(0, "producing")
    sender.completed(1, "producing")
    worker.report(0, "loading")
    worker.completed(1, "waiting")
    assert board.ticks() == t0 + 2  # completions tick, states do not
    assert [(x.member, x.done, x.doing) for x in board.lines()] == [
        ("sender", 1, "producing"), ("engine 0 worker 0", None, "not started"), ("engine 1 worker 0", 1, "waiting")]
    # heartbeats: the worker's beats, the sender's do not; the driver sees the sender silent (0 s: it just began)
    worker.start()
    time.sleep(2.5)
    board.sample()
    time.sleep(1.5)
    beats = {x.member: x.silent_s for x in board.lines()}
    assert beats["engine 1 worker 0"] < 2.5 and beats["sender"] >= 3.5, beats
    worker.stop()
    board.begin()
    assert all(x.done is None for x in board.lines())
    ProgressReporter(None, "sender").completed(3, "producing")  # no board: reports nothing, raises nothing
    assert board.ticks() == t0 + 2


def test_every_transport_reports_through_the_shared_wrappers() -> None:
    """The progress reports live in ``Transport.make_sender`` / ``open_receiver`` / ``stream`` and
    ``WeightSender.send`` / ``finish``; a transport that overrode one would sync without reporting (cuda_ipc
    included: its two sides cannot run here)."""
    import inspect

    assert TRANSPORTS  # the package's own register at import; a plug-in's too (test_transport_in_one_file.py)
    for cls in TRANSPORTS.values():
        for name in ("connect", "make_sender", "open_receiver", "stream"):
            assert name not in vars(cls), (cls.name, name)
        for name in ("sender_for", "receiver_for", "buckets", "parts"):
            assert name in vars(cls), (cls.name, name)
    import openrlhf_shape.weight_sync.collective as c
    import openrlhf_shape.weight_sync.cuda_ipc as ci
    import openrlhf_shape.weight_sync.object_store as o

    senders = {v for cls in TRANSPORTS.values() for v in vars(sys.modules[cls.__module__]).values()
               if isinstance(v, type) and issubclass(v, WeightSender) and v is not WeightSender}
    assert senders >= {c.CollectiveSender, ci.CudaIpcSender, o.ObjectStoreSender}
    for sender in senders:
        assert "send" not in vars(sender) and "_send" in vars(sender) and "_end" in vars(sender), sender
        assert "begin" not in vars(sender), sender
    assert "finish" not in vars(c.CollectiveSender) and "finish" not in vars(ci.CudaIpcSender)
    assert "super().finish()" in inspect.getsource(o.ObjectStoreSender.finish)


# ---- the driver's wait, on real Ray calls that report as a sync's sides do ------------------------------------


def _member_fn():
    """The side a Ray task plays (defined inside a function: Ray ships it by value, the test module is not
    importable in its workers)."""

    def member(address: dict, member: str, buckets: int, pause_s: float, stall_at: int | None = None,
               stall_s: float = 0.0) -> int:
        """A side of a sync: completes ``buckets`` buckets ``pause_s`` apart, stopping ``stall_s`` before bucket
        ``stall_at`` (its line then says it waits for it)."""
        rep = ProgressReporter(address, member)
        rep.report(0, "waiting")
        rep.start()  # a running side beats (the stalled one too: it waits, it does not hang)
        for k in range(buckets):
            if k == stall_at:
                time.sleep(stall_s)
            time.sleep(pause_s)
            rep.completed(k + 1, "waiting" if member != "sender" else "producing")
        rep.completed(buckets, "finished")
        rep.stop()
        return buckets

    return member


def _members_cls():
    """The sides of a sync in one actor, one thread per call (defined inside a function, as ``_member_fn``)."""
    member = _member_fn()

    class Members:
        def ready(self) -> bool:
            return True

        def run(self, *args, **kwargs) -> int:
            return member(*args, **kwargs)

    return Members


@pytest.fixture
def remote_member(ray_local):
    """The remote sides: calls of one Ray actor that runs each call on its own thread, started before the test's
    clock does (a process's start-up on a loaded machine exceeds the bound). Warm task workers were not enough: Ray
    stops idle workers beyond its soft limit (the CPU count, 2) after about a second, so the third call could wait
    for a new worker and never start within the bound (seen in a reversed-order run with coverage on). The actor
    goes with the test, a stalled call with it."""
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=len(MEMBERS))(_members_cls()).remote()
    ray.get(actor.ready.remote())
    yield actor.run
    ray.kill(actor)


def test_calls_that_keep_completing_buckets_outlive_the_bound(remote_member) -> None:
    board = ProgressBoard("127.0.0.1", MEMBERS)
    board.begin()
    a = board.address()
    t0 = time.monotonic()
    refs = [remote_member.remote(a, m, buckets=10, pause_s=0.4) for m in MEMBERS]
    assert get_all_fail_fast(refs, 2.0, ["sender", "engine 0", "engine 1"], step=3, progress=board) == [10, 10, 10]
    assert time.monotonic() - t0 > 2 * 2.0, "the calls did not outlast the bound: the test shows nothing"


def test_calls_that_stop_completing_buckets_fail_one_bound_later_naming_engine_bucket_and_step(remote_member) -> None:
    board = ProgressBoard("127.0.0.1", MEMBERS)
    board.begin()
    a = board.address()
    bound = 2.0
    refs = [remote_member.remote(a, "sender", 8, 0.2), remote_member.remote(a, "engine 0 worker 0", 8, 0.2),
            remote_member.remote(a, "engine 1 worker 0", 8, 0.2, stall_at=3, stall_s=60.0)]
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        get_all_fail_fast(refs, bound, ["sender", "engine 0", "engine 1"], step=7, progress=board)
    waited = time.monotonic() - t0
    e = info.value
    assert (e.who, e.bucket, e.step) == ("engine 1", 3, 7), str(e)
    assert "after step 7: stalled at bucket 3" in str(e) and "engine 1 worker 0 completed 3 bucket(s)" in str(e), str(e)
    # one bound (+ at most a poll) after the last completed bucket or call; the stalled call would run 60 s more
    assert bound <= e.idle_s <= bound + POLL_S + 0.5, e.idle_s
    assert waited < 15.0, waited  # the stalled call ends with the fixture's actor
