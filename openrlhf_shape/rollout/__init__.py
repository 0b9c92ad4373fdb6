"""vLLM rollout engines (in-process or Ray actors), balanced dispatch, weight receive, the
SHAPE potential probes and OpenRLHF agent files (``agents.py``, ``agent_batch.py``; README.md).
vLLM itself is imported only when an engine starts."""

from openrlhf_shape.rollout.engine import EngineConfig, Generation, SamplingConfig, VLLMEngine
from openrlhf_shape.rollout.group import EngineGroup, EngineLostError, create_ray_engines, start_engines
from openrlhf_shape.rollout.probes import (
    PotentialResult,
    ProbeConfig,
    ProbeSuffixes,
    build_probe_prompt,
    estimate_potentials,
)

__all__ = [
    "EngineConfig",
    "EngineGroup",
    "EngineLostError",
    "Generation",
    "PotentialResult",
    "ProbeConfig",
    "ProbeSuffixes",
    "SamplingConfig",
    "VLLMEngine",
    "build_probe_prompt",
    "create_ray_engines",
    "estimate_potentials",
    "start_engines",
]
