"""The dry-run planner sizes the forward-only phase (old log-probs) with its own token budget,
``--rollout.max_tokens_per_gpu`` (default: ``--train.max_tokens_per_gpu``), and the update with the training one."""

from pathlib import Path

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.planner.plan import PlanOptions, build_plan

REPO = Path(__file__).resolve().parents[2]


def _phases(flags: list[str]) -> dict:
    cfg = load_config(str(REPO / "configs" / "qwen3-4b.yaml"), flags, check_paths=False)
    return {ph.name: ph for ph in build_plan(cfg, PlanOptions(), "configs/qwen3-4b.yaml").gpu_phases}


def _term(phase, name: str) -> int:
    return next(t.bytes for t in phase.terms if t.name == name)


@pytest.mark.parametrize("flags", [[], ["--actor.backend", "deepspeed", "--ds.zero_stage", "3", "--megatron.tensor_model_parallel_size", "1",
                                   "--megatron.sequence_parallel", "false"]])
def test_forward_budget_sizes_the_logprob_phase_only(flags):
    base = _phases(flags + ["--train.max_tokens_per_gpu", "32768"])
    same = _phases(flags + ["--train.max_tokens_per_gpu", "32768", "--rollout.max_tokens_per_gpu", "32768"])
    big = _phases(flags + ["--train.max_tokens_per_gpu", "32768", "--rollout.max_tokens_per_gpu", "131072"])
    assert same["log-probs"].total == base["log-probs"].total  # unset = the training budget
    assert big["update"].total == base["update"].total  # training micro-batches keep theirs
    act = "activations (forward only)"
    assert _term(big["log-probs"], act) == pytest.approx(4 * _term(base["log-probs"], act), rel=1e-6)
    assert big["log-probs"].total > base["log-probs"].total
