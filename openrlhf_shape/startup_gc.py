"""A long-lived process's start-up (importing vLLM or Megatron, building an engine or a model) with Python's
cyclic garbage collector paused, and what it built frozen afterwards.

Why: while a process imports a large library its heap grows by hundreds of thousands of objects, and the collector
runs a full collection each time the long-lived objects grow by a quarter, each pass traversing the whole heap;
vLLM's model loader also calls ``gc.collect()`` itself while it builds an engine. Measured on this repository's CPU
machine (Python 3.11, tiny Qwen3): an engine's ``from vllm import LLM`` plus ``LLM(...)`` spent 2.3 s of its
~7.5 CPU-seconds in collections (9 full passes over 200k-640k objects). Nothing those passes could free is garbage
for long: the modules, the model and the engine live as long as the process. Paused, the collections happen once
(vLLM's own explicit calls, over the objects made since the pause only), and the heap is frozen after, as vLLM itself
freezes it at the end of an engine's start-up (``vllm/utils/gc_utils.py:freeze_gc_heap``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[Callable[[], None]]:
    """Run the block with automatic collections off and the objects that exist at its start frozen (out of every
    collection); at its end, one collection of what the block left (cycles it dropped are freed, not frozen), the
    survivors frozen, and automatic collections on again if they were. Explicit ``gc.collect()`` calls in the block
    still run, over the objects made in the block only.

    Yields ``freeze_now``: freeze what exists at that point, for a block whose imports are followed by code that
    collects explicitly (vLLM's loader), so those collections skip the modules. Import leaves little garbage: after
    ``from vllm import LLM`` 18k of 994k objects were unreachable; they stay frozen with the modules."""
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield gc.freeze
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()
