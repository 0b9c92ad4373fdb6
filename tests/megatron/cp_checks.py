"""The checks of the context-parallel tests (test_context_parallel_on_cpu.py: world 2; test_context_parallel_world4_on_cpu.py:
world 4): a CP layout's ranks against world 1 on the same weights and tokens (long_runs.py's launches)."""

from __future__ import annotations

import pytest

from mg_helpers import max_abs_diff
from packing_checks import merged, worst_grad_rel_diff

CP_TOL = 1e-5  # log-probs / entropy vs world 1
GRAD_RTOL = 1e-5  # per parameter vs world 1
ARCHS = ("qwen3", "qwen3_moe")


def check_logprobs(ranks: list[dict], world1: list[dict], batch: dict, arch: str, layout: str) -> None:
    """Log-probs and entropy of every sample within ``CP_TOL`` of world 1's, in batch order; CP rank 0 of TP rank 0
    reports them."""
    n = len(batch["sequences"])
    ours, ref = merged(ranks, arch, layout, n), merged(world1, arch, layout, n)
    assert max_abs_diff(ours.log_probs, ref.log_probs) <= CP_TOL
    assert max_abs_diff(ours.entropy, ref.entropy) <= CP_TOL
    assert ours.log_probs[6].numel() == 0  # the empty response stays empty, in batch order
    holders = [r for r in ranks if r[arch][layout]["logprobs"]]
    assert holders and all(r["ranks"]["cp"] == 0 and r["ranks"]["tp"] == 0 for r in holders)


def check_gradients(ranks: list[dict], world1: list[dict], arch: str, layout: str) -> None:
    """After one step, on every rank: each HF-named gradient within ``GRAD_RTOL`` relative of world 1's, the same
    loss, token count, grad norm and parameter count."""
    ref = world1[0][arch][layout]
    for rank_res in ranks:
        res = rank_res[arch][layout]
        worst, where = worst_grad_rel_diff(res["grads"], ref["grads"])
        assert worst <= GRAD_RTOL, where
        assert res["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
        assert res["metrics"]["num_tokens"] == ref["metrics"]["num_tokens"]
        assert res["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert res["info"]["num_parameters"] == ref["info"]["num_parameters"]


def check_split(ranks: list[dict], world: int, extra: dict, archs: tuple) -> None:
    """The CP peers of each DP rank hold two disjoint halves of every micro-batch (lengths a multiple of 2 x CP x
    TP); the padded split is megatron-core's ``get_batch_on_this_cp_rank``."""
    tp = extra.get("tensor_model_parallel_size", 1)
    assert all(r["ranks"]["dp_size"] == world // (2 * tp) for r in ranks)
    for layout in ("packed", "padded"):
        by_cp = {}
        for r in ranks:
            if r["ranks"]["tp"] == 0:
                by_cp.setdefault(r["ranks"]["cp"], []).append(r[archs[0]][layout]["split"])
        assert sorted(by_cp) == [0, 1]
        for dp_slot in range(len(by_cp[0])):  # the CP peers of one DP rank
            s0, s1 = by_cp[0][dp_slot], by_cp[1][dp_slot]
            assert s0["global"] == s1["global"] and all(g % (4 * tp) == 0 for g in s0["global"])
            for g, p0, p1 in zip(s0["global"], s0["positions"], s1["positions"]):
                assert len(p0) == len(p1) == g // 2 and sorted(p0 + p1) == list(range(g))
            if layout == "padded":  # megatron-core's get_batch_on_this_cp_rank hands each rank the same tokens
                assert s0["megatron_agrees"] and all(s0["megatron_agrees"] + s1["megatron_agrees"])
