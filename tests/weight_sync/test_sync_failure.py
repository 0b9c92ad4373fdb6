"""A weight sync fails loudly instead of hanging: an engine killed in the middle of a sync makes the
driver raise, naming the engine and the step, long before the transport's own timeout; a receiver
that takes nothing, or a sender that sends nothing, times out on every queue. (The trainer-level
case, with a re-run resuming from the last checkpoint, is in test_trainer_cluster_e2e.py.)"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from openrlhf_shape.platform import detect_platform  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.weight_sync import get_or_raise  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync, WeightSyncError  # noqa: E402
from openrlhf_shape.weight_sync.object_store import ObjectStoreSender  # noqa: E402
from support.weight_holder import HolderRanks, TensorHolder  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIMEOUT_S = 120.0  # the sync's own limit: a kill must be reported long before it


@dataclass
class KillsAnEngineMidStream(HolderRanks):
    """A stream of many small buckets (``pause_s`` between them); the ``victim`` engine killed 1 s into it."""

    victim: Any = None

    def start_weight_stream(self, sync_id: str, bucket_bytes: int) -> list:
        refs = super().start_weight_stream(sync_id, bucket_bytes)
        threading.Timer(1.0, ray.kill, args=(self.victim,)).start()
        return refs


@pytest.mark.parametrize("transport", ["collective", "object_store"])
def test_engine_killed_mid_sync_raises_naming_engine_and_step(ray_local, tiny_model_dir, transport) -> None:
    cfg = EngineConfig(model_path=tiny_model_dir, max_model_len=256, kv_cache_gib=0.25, dtype="float32")
    handles = create_ray_engines(2, cfg, num_cpus_per_engine=0.5, platform=detect_platform(engine_tp=cfg.tensor_parallel_size))
    group = EngineGroup(handles)
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(tiny_model_dir)
    sync = EngineWeightSync(handles, engine_tp=1, transport=transport, backend="gloo", timeout_s=TIMEOUT_S)
    try:
        sync.connect(holder)
        ray.get(holder.perturb.remote(1, 0.05))
        sync.sync(HolderRanks(holder), 16 << 10, step=1)  # a healthy sync first

        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            sync.sync(KillsAnEngineMidStream(holder, pause_s=0.2, victim=handles[1]), 16 << 10, step=7)
        waited = time.monotonic() - t0
        msg = str(info.value)
        assert info.value.who == "engine 1" and info.value.step == 7, msg
        assert "after step 7: engine 1 died" in msg and "re-run the same command to resume" in msg, msg
        assert waited < TIMEOUT_S, f"the driver waited for the transport's timeout ({waited:.0f} s)"
    finally:
        sync.close()
        for h in handles:
            ray.kill(h)
        ray.kill(holder)


def test_queues_time_out_instead_of_blocking(ray_local) -> None:
    """A receiver that takes nothing fills its bounded queue: the sender's next put raises, naming
    the receiver; a receiver whose sender sends nothing raises on its get."""
    import torch
    from ray.util.queue import Queue

    q = Queue(maxsize=1, actor_options={"num_cpus": 0})
    try:
        sender = ObjectStoreSender([q], timeout_s=1.0)
        sender.begin()
        sender.send([("w", torch.zeros(4))])  # fills the queue
        with pytest.raises(TimeoutError, match="engine worker 0's queue took nothing for 1 s"):
            sender.send([("w", torch.zeros(4))])
        q.get()
        with pytest.raises(TimeoutError, match="nothing arrived on engine worker 0's queue for 1 s"):
            get_or_raise(q, 1.0, "engine worker 0's queue")
    finally:
        ray.kill(q.actor)
