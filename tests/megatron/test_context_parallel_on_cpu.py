"""Context parallelism on the Megatron backend, CPU/gloo (issue 36, item 2).

``--megatron.context_parallel_size 2`` splits every sequence (a padded micro-batch's rows; each document of a packed
one, padded to a multiple of 2 x CP) into 4 chunks, rank r holding chunks r and 3 - r (megatron-core's split; the
padded split is checked against its ``get_batch_on_this_cp_rank``); the local attentions all-gather K/V over the CP
group. On the same weights and tokens (8 sequences of 33..1900 tokens, 3853 in all, one with an empty response),
for a tiny Qwen3 and a tiny Qwen3-MoE, packed and padded: CP2 (world 2), CP2 x DP2 (world 4, Qwen3) and CP2 x TP2
with sequence parallel (world 4) give the world-1 log-probs and entropy within 1e-5 and the world-1 gradients after
one step within 1e-5 relative per parameter (full HF-named gradients: the bridge's export run on the gradient
buffers), on Megatron's own local attention and (Qwen3, CP2) on the SDPA core attention with full activation
recompute.

The world-2 layouts are here, the world-4 ones in test_context_parallel_world4_on_cpu.py (the checks are
cp_checks.py's); every launch is one of long_runs.py's, shared with the packing and pad-token tests.
"""

from __future__ import annotations

import pytest

from cp_checks import ARCHS, check_gradients, check_logprobs, check_split
from long_runs import CP2, batch as long_batch, long_models, shared_world1, shared_world2, variant

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {"cp2": (2, CP2, ARCHS)}  # name -> (world size, config, archs)
CASES = [(name, arch, layout) for name, (_, _, archs) in LAYOUTS.items() for arch in archs
         for layout in ("packed", "padded")] + [("cp2_sdpa", "qwen3", layout) for layout in ("packed", "padded")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def runs(shared_results, tiny_models) -> dict[str, list[dict]]:
    """Per layout, every rank's results; ``cp2_sdpa``: the CP2 ranks again with ``--megatron.local_attention sdpa``
    and ``--actor.gradient_checkpointing_enable`` (Megatron's full recompute: the backward reruns the
    all-gathers)."""
    models = long_models(shared_results, tiny_models)
    cp2 = shared_world2(shared_results, models)["cp2"]
    return {"world1": shared_world1(shared_results, models)["world1"], "cp2": cp2, "cp2_sdpa": variant(cp2, "sdpa")}


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_logprobs_entropy_equal_world1_on_cpu(runs, batch, name, arch, layout):
    check_logprobs(runs[name], runs["world1"], batch, arch, layout)


@pytest.mark.parametrize("name, arch, layout", CASES)
def test_cp_gradients_equal_world1_after_one_step_on_cpu(runs, name, arch, layout):
    check_gradients(runs[name], runs["world1"], arch, layout)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_ranks_hold_balanced_halves_of_every_sequence_on_cpu(runs, name):
    check_split(runs[name], *LAYOUTS[name])
