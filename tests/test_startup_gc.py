"""The collector paused for a process's start-up (openrlhf_shape/startup_gc.py): no automatic collection inside the
block, what existed before and what the block kept frozen after it, the cycles the block dropped freed (not frozen),
the collector's own on/off state restored. Run in a fresh interpreter each: the test session's heap is frozen
(tests/conftest.py) and pytest's own collections must not interfere."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_block_runs_without_automatic_collections_and_its_survivors_end_frozen() -> None:
    out = _run("""
        import gc, weakref
        from openrlhf_shape.startup_gc import collector_paused

        class Node:
            pass

        before = Node()
        runs = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
        with collector_paused():
            assert not gc.isenabled()
            assert gc.is_tracked(before) and before not in gc.get_objects()  # frozen at the block's start
            kept = [Node() for _ in range(50_000)]  # enough allocations for many automatic collections
            for a, b in zip(kept, kept[1:]):
                a.next, b.prev = b, a
            dropped = Node()
            dropped.self = dropped  # a cycle the block leaves behind
            gone = weakref.ref(dropped)
            del dropped
            inside = list(runs)
        assert inside == [], inside  # no automatic collection in the block
        assert gc.isenabled()
        assert gone() is None  # the block's garbage cycle was collected at its end, not frozen
        assert kept[0] not in gc.get_objects() and kept[-1] not in gc.get_objects()  # the survivors: frozen
        assert gc.get_freeze_count() > 50_000
        print("ok")
    """)
    assert out.strip() == "ok"


def test_freeze_now_takes_the_imports_out_of_the_blocks_explicit_collections() -> None:
    out = _run("""
        import gc
        from openrlhf_shape.startup_gc import collector_paused

        with collector_paused() as freeze_now:
            imported = [object.__new__(type(f"C{i}", (), {})) for i in range(2000)]  # classes: tracked, in cycles
            assert imported[0] in gc.get_objects()
            freeze_now()
            assert imported[0] not in gc.get_objects()  # out of the collect() calls that follow in the block
            gc.collect()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_disabled_collector_stays_disabled() -> None:
    out = _run("""
        import gc
        from openrlhf_shape.startup_gc import collector_paused

        gc.disable()
        with collector_paused():
            pass
        print(gc.isenabled())
    """)
    assert out.strip() == "False"
