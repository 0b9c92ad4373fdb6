"""Context parallelism on the Megatron backend at world 4, CPU/gloo (issue 36, item 2): CP2 x DP2 (Qwen3) and CP2 x
TP2 with sequence parallel (Qwen3 and Qwen3-MoE) against world 1, as test_context_parallel_on_cpu.py does for CP2
(its docstring: the batch, tolerances and what each check asserts; the checks are cp_checks.py's). A file of its
own so that pytest-xdist's two workers can run the world-2 and world-4 layouts side by side; its launch is
long_runs.py's world-4 one (shared with the CP2 x PP2 test of test_context_parallel_composed_on_cpu.py).
"""

from __future__ import annotations

import pytest

from cp_checks import ARCHS, check_gradients, check_logprobs, check_split
from long_runs import CP2, TP2_SP, batch as long_batch, long_models, shared_world1, shared_world4

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {  # name -> (world size, config, archs)
    "cp2_dp2": (4, CP2, ("qwen3",)),
    "cp2_tp2_sp": (4, {**CP2, **TP2_SP}, ARCHS),
}
CASES = [(name, arch, layout) for name, (_, _, archs) in LAYOUTS.items() for arch in archs
         for layout in ("packed", "padded")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def runs(shared_results, tiny_models) -> dict[str, list[dict]]:
    models = long_models(shared_results, tiny_models)
    world4 = shared_world4(shared_results, models)
    return {"world1": shared_world1(shared_results, models)["world1"], **{name: world4[name] for name in LAYOUTS}}


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_logprobs_entropy_equal_world1_on_cpu(runs, batch, name, arch, layout):
    check_logprobs(runs[name], runs["world1"], batch, arch, layout)


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_gradients_equal_world1_after_one_step_on_cpu(runs, name, arch, layout):
    check_gradients(runs[name], runs["world1"], arch, layout)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_ranks_hold_balanced_halves_of_every_sequence_on_cpu(runs, name):
    check_split(runs[name], *LAYOUTS[name])
