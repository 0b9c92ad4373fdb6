"""CPU-seconds of starting and stopping vLLM engine actors (Ray local, engine TP 1, a tiny random Qwen3), with the
start-up's garbage collections paused (``openrlhf_shape/startup_gc.py``, what the engines do) and without.

    .venv/bin/python benchmarks/bench_engine_startup.py [--rounds 3] [--engines 2]

Each round starts ``--engines`` engine actors, waits until they are ready, runs one short generate on each and stops
them through ``EngineGroup.shutdown`` (which skips vLLM's teardown for a TP-1 engine it kills next); the variants
alternate round by round. Measured: the machine's busy CPU-seconds over the round (``/proc/stat``: every process,
Ray's included) and its wall seconds; run it on an otherwise idle machine. The "plain" variant builds the engine
without the pause (``collector_paused`` replaced by a no-op in its actor) and stops it with vLLM's teardown (what
``shutdown()`` did before). Last line: ``engine start+stop: paused_cpu_s=A plain_cpu_s=B ratio=A/B`` (medians, per
engine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openrlhf_shape.rollout.engine import EngineConfig, SamplingConfig, VLLMEngine  # noqa: E402


def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


class PlainEngine(VLLMEngine):
    """The engine as it started before the pause: collections on throughout, vLLM's teardown at shutdown."""

    def __init__(self, *args):
        import openrlhf_shape.rollout.engine as engine_module

        @contextlib.contextmanager
        def no_pause():
            yield lambda: None

        engine_module.collector_paused = no_pause
        super().__init__(*args)

    def shutdown(self, process_ends: bool = False) -> None:
        super().shutdown(process_ends=False)


def _round(cls: type, cfg: EngineConfig, engines: int, platform) -> tuple[float, float]:
    import ray

    from openrlhf_shape.rollout.group import EngineGroup

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **platform.engine_env(cfg.kv_cache_gib, 1)}
    actor = ray.remote(cls)
    b0, t0 = _busy_cpu_s(), time.perf_counter()
    handles = [actor.options(num_cpus=0.5, runtime_env={"env_vars": env}).remote(cfg, platform.to_dict())
               for _ in range(engines)]
    ray.get([h.generate.remote([[1, 2, 3, 4]], SamplingConfig(max_tokens=4)) for h in handles])
    EngineGroup(handles).shutdown()
    time.sleep(1.0)  # the killed processes' last CPU ticks
    return _busy_cpu_s() - b0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per variant (alternating)")
    ap.add_argument("--engines", type=int, default=2, help="engine actors per round")
    args = ap.parse_args()
    import ray

    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.testing import make_tiny_model

    model = str(make_tiny_model(tempfile.mkdtemp(prefix="bench_engine_startup_"), arch="qwen3", seed=0))
    cfg = EngineConfig(model_path=model, max_model_len=256, kv_cache_gib=0.25, dtype="float32")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    platform = detect_platform(engine_tp=1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"paused": [], "plain": []}
    for r in range(args.rounds):
        for name, cls in (("paused", VLLMEngine), ("plain", PlainEngine)):
            cpu, wall = _round(cls, cfg, args.engines, platform)
            results[name].append((cpu / args.engines, wall))
            print(f"round {r} {name}: {cpu / args.engines:.2f} CPU-s per engine, {wall:.1f} s wall for the round "
                  f"({args.engines} engines at once)", flush=True)
    ray.shutdown()
    paused = statistics.median(c for c, _ in results["paused"])
    plain = statistics.median(c for c, _ in results["plain"])
    print(f"load average at end: {os.getloadavg()}")
    print(f"engine start+stop: paused_cpu_s={paused:.2f} plain_cpu_s={plain:.2f} ratio={paused / plain:.2f}")


if __name__ == "__main__":
    main()
