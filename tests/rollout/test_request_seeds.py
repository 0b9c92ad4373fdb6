"""Per-request seeds (openrlhf_shape/rollout/seeds.py) and how a seeded call becomes vLLM requests
(rollout/engine.py:_request_params). That the engines then sample the same on one or two engines and in any order:
tests/rollout/test_ray_engines.py; what vLLM does with the seeds: tests/contracts/test_vllm_seed_contract.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from openrlhf_shape.rollout.engine import SamplingConfig
from openrlhf_shape.rollout.seeds import EVAL, PROBES, ROLLOUT, derive_seed, request_seed, step_seed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_seeds_are_stable_across_processes_and_releases():
    """A resumed run repeats its rollouts only if it derives the seeds the interrupted run did: the derivation may
    not depend on the process (Python's ``hash`` is salted per process) and may not change between releases (these
    values are what every run so far drew with; changing them breaks the resume of existing checkpoints)."""
    here = [step_seed(42, 1), derive_seed(step_seed(42, 1), ROLLOUT), request_seed(5, 0, 1)]
    code = ("from openrlhf_shape.rollout.seeds import *; "
            "print(step_seed(42, 1), derive_seed(step_seed(42, 1), ROLLOUT), request_seed(5, 0, 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT})
    assert [int(x) for x in out.stdout.split()] == here
    assert here[0] == 3880318729568279171 and here[2] == 2275966377204101314


def test_seeds_differ_by_every_part_and_fit_vllm():
    seeds = {request_seed(derive_seed(step_seed(s, t), ROLLOUT), i, j)
             for s in (0, 1) for t in (1, 2) for i in range(32) for j in range(16)}
    assert len(seeds) == 2 * 2 * 32 * 16  # no two requests of two runs x two steps share a seed
    assert all(0 <= x < 2**63 for x in seeds)  # vLLM V2 keeps int64 seeds, torch generators uint64
    assert len({derive_seed(7, p) for p in (ROLLOUT, PROBES, EVAL)}) == 3
    assert len({derive_seed(1, 2), derive_seed(12), derive_seed("1", 2), derive_seed(2, 1), derive_seed(1, "2")}) == 5
    assert derive_seed(np.int64(3), 4) == derive_seed(3, 4)  # a numpy step number derives the same seed


@pytest.mark.parametrize("bad", [1.0, None, True, b"x"])
def test_seed_parts_are_integers_or_strings(bad):
    with pytest.raises(TypeError, match="integers or strings"):
        derive_seed(1, bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_sampling_seed_is_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="SamplingConfig.seed"):
        SamplingConfig(seed=bad)


def test_a_seeded_call_gives_every_request_its_own_seed():
    """One vLLM request per sample, prompt-major; request (i, j) of a call with stream s: request_seed(s, i, j) with
    i the prompt's index in the WHOLE call (an engine gets a share of the prompts and their indices)."""
    pytest.importorskip("vllm")
    from openrlhf_shape.rollout.engine import _request_params

    sampling = SamplingConfig(n=3, temperature=0.7, top_p=0.9, max_tokens=5, logprobs=True, seed=99)
    params = _request_params(sampling, [4, 1], 2)
    assert [p.seed for p in params] == [request_seed(99, i, j) for i in (4, 1) for j in range(3)]
    assert all((p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs) == (1, 0.7, 0.9, 5, 0) for p in params)
    unseeded = _request_params(SamplingConfig(n=3), [0, 1], 2)  # one shared request template, vLLM's own generators
    assert unseeded.seed is None and unseeded.n == 1
    with pytest.raises(ValueError, match="prompt_indices has 1 entries for 2 prompts"):
        _request_params(sampling, [0], 2)
