"""A standby engine: a spare engine process that has paid its imports, so that replacing a dead engine costs the
engine's build (vLLM's model load and KV cache) instead of a whole process start (``--rollout.engine_standby``).

Measured on the 2-core CPU machine (tiny Qwen3): an engine actor's start is ~4 s importing torch and this package,
~10-15 s importing vLLM, ~3 s building ``LLM``; a standby makes a replacement the last part only. On GPU the build
(weights, KV profiling, CUDA graphs) is the larger part, the imports (~15-20 s) are still saved.

The spare holds no resources (0 CPU, 0 GPU: the dead engine's bundle share is what the promoted spare then stands
in for) and sits on engine 0's bundle's node; a dead engine on another node gets a cold start. On GPU at engine TP 1
it sees the node's GPUs (Ray sets no ``CUDA_VISIBLE_DEVICES`` for 0 GPUs) and is pointed at the dead engine's GPUs
before anything touches CUDA; a spare whose imports initialised CUDA is not promoted (cold start instead).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from openrlhf_shape.platform import Platform
from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine
from openrlhf_shape.startup_gc import collector_paused

log = logging.getLogger("openrlhf_shape")


class StandbyUnusable(RuntimeError):
    """The spare cannot become this engine (it initialised CUDA before it knew which GPUs); start one cold."""


class StandbyEngine(VLLMEngine):
    """A :class:`VLLMEngine` actor built in two steps: imports at creation, the engine at :meth:`promote`. Once
    promoted it is an engine like any other (the group calls the same methods on its handle)."""

    def __init__(self) -> None:  # the engine's own __init__ runs in promote
        with collector_paused() as freeze_now:  # as the engine's build does (openrlhf_shape/startup_gc.py)
            from vllm import LLM  # noqa: F401  the import this spare exists to pay ahead

            freeze_now()

    def promote(self, cfg: EngineConfig, platform: Platform | dict, env: dict[str, str]) -> float:
        """Become engine ``cfg`` (its seed, its bundle's ``env``: vLLM's Ray-executor bundles, the GPUs at engine
        TP 1 on GPU) and build it; returns the build's seconds (what :meth:`ready` returns)."""
        import torch

        if "CUDA_VISIBLE_DEVICES" in env and torch.cuda.is_initialized():
            raise StandbyUnusable("the standby engine initialised CUDA while importing; it cannot be pointed at "
                                  f"GPUs {env['CUDA_VISIBLE_DEVICES']}")
        os.environ.update(env)
        VLLMEngine.__init__(self, cfg, platform)
        return self.start_time_s


def visible_devices() -> str | None:
    """This process's ``CUDA_VISIBLE_DEVICES`` (what a standby must see to stand in for it)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


class Standby:
    """One spare engine actor for a launcher: started with the engines (not awaited), taken by a recovery, started
    again after (not awaited: the next failure finds it ready or still importing, and waits for it then)."""

    def __init__(self, launcher: Any, gpu_tp1: bool):
        self.launcher, self.gpu_tp1 = launcher, gpu_tp1
        self.spare: Any = None
        self.devices: dict[int, Any] = {}  # engine -> object ref of its CUDA_VISIBLE_DEVICES (GPU, engine TP 1)

    def start(self) -> None:
        import ray

        opts: dict[str, Any] = dict(num_cpus=0, num_gpus=0, runtime_env={"env_vars": dict(self.launcher.env)})
        if self.launcher.placement is not None:
            opts["scheduling_strategy"] = self.launcher.placement.engine_options(0, 0)["options"]["scheduling_strategy"]
        self.spare = ray.remote(StandbyEngine).options(**opts).remote()

    def record(self, e: int, handle: Any) -> None:
        """Keep where engine ``e`` runs (its GPUs), asked now and read after its death (a returned value outlives
        the actor that made it)."""
        if self.gpu_tp1:
            self.devices[e] = handle.__ray_call__.remote(lambda engine: visible_devices())

    def take(self, e: int, cfg: EngineConfig, env: dict[str, str], timeout_s: float) -> Any | None:
        """The spare built as engine ``e`` (awaited), or None where it cannot be (another node, CUDA initialised,
        it died): the caller starts one cold. A new spare starts either way."""
        import ray

        spare, self.spare = self.spare, None
        try:
            if spare is None or not self.launcher.same_node(e, 0):
                return None
            if self.gpu_tp1:
                env = {**env, "CUDA_VISIBLE_DEVICES": ray.get(self.devices[e], timeout=timeout_s)}
            ray.get(spare.promote.remote(cfg, self.launcher.platform.to_dict(), env), timeout=timeout_s)
            self.record(e, spare)
            taken, spare = spare, None
            return taken
        except Exception as err:  # any failure of the spare: the caller's cold start is the answer
            log.warning("engine %d: the standby engine could not stand in (%s: %s); starting one cold", e,
                        type(err).__name__, err)
            return None
        finally:
            if spare is not None:
                ray.kill(spare, no_restart=True)
            self.start()

    def shutdown(self) -> None:
        import ray

        if self.spare is not None:
            ray.kill(self.spare, no_restart=True)
            self.spare = None
