"""Context parallelism composed with pipeline and expert parallelism on the Megatron backend, CPU/gloo (issue 36,
item 2: "composes with TP/PP/EP/SP and packing"; TP and SP are in test_context_parallel_on_cpu.py).

- CP2 x PP2 (world 4, tiny dense Qwen3): each pipeline stage splits every sequence over its CP pair; the 1F1B
  schedule sends ``[s/CP, b, h]`` activations between stages (variable lengths: several packed and padded
  micro-batches of different lengths).
- CP2 x EP2 (world 2, tiny Qwen3-MoE): megatron-core lays the expert ranks out without CP (ETP x EP x expert-DP x
  PP), so EP2 on two ranks spans the CP pair: the all-to-all dispatcher trades the two halves of every sequence's
  tokens between the ranks, and each rank's experts see tokens of both halves.

Same weights and tokens as world 1 (the 8 sequences of 33..1900 tokens of the CP test, 3853 in all, one with an empty
response), packed and padded micro-batches: log-probs and entropy within 1e-5, and after one step the loss, token
count, grad norm and every parameter's gradient (full HF-named tensors, gathered over TP/PP/EP by the bridge's export)
within 1e-5 relative. With the MoE router losses on (aux 0.1, z 0.01), CP2 x EP2 and TP2 + SP (world 2) give world
1's gradient on the same micro-batches (megatron/router_loss.py:router_loss_scale; 0.25 relative error before it
scaled by the TP x CP group size).

The launches are long_runs.py's, shared with the other CP, packing and pad-token tests: world 1's reference passes
at 1024 tokens per micro-batch are its ``cp_budget`` variant; CP2 x EP2 and TP2 + SP are layouts of the world-2
launch, CP2 x PP2 one of the world-4 launch.
"""

from __future__ import annotations

import pytest

from long_runs import CP2, batch as long_batch, long_models, shared_world1, shared_world2, shared_world4
from mg_helpers import max_abs_diff
from packing_checks import merged, worst_grad_rel_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CP_TOL = 1e-5  # log-probs / entropy vs world 1
GRAD_RTOL = 1e-5  # per parameter vs world 1
LAYOUTS = {  # name -> (world size, config, arch); 1024 tokens per GPU (long_runs.CP_BUDGET)
    "cp2_pp2": (4, {**CP2, "pipeline_model_parallel_size": 2}, "qwen3"),
    "cp2_ep2": (2, {**CP2, "expert_model_parallel_size": 2}, "qwen3_moe"),
}
CASES = [(name, layout) for name in LAYOUTS for layout in ("packed", "padded")]


@pytest.fixture(scope="module")
def batch() -> dict:
    return long_batch()


@pytest.fixture(scope="module")
def models(shared_results, tiny_models) -> dict[str, str]:
    return long_models(shared_results, tiny_models)


@pytest.fixture(scope="module")
def world1(shared_results, models) -> list[dict]:
    """World 1 at 1024 tokens per micro-batch (``cp_budget``), with the router-loss variant at CP2's 2048: the
    load-balancing loss is per micro-batch, so world 1 runs CP2's micro-batches there."""
    w1 = shared_world1(shared_results, models)["world1"]
    return [{**r, **r["variants"]["cp_budget"]} for r in w1]


@pytest.fixture(scope="module")
def cp2_pp2(shared_results, models) -> list[dict]:
    return shared_world4(shared_results, models)["cp2_pp2"]


@pytest.fixture(scope="module")
def cp2_ep2(shared_results, models) -> list[dict]:
    return shared_world2(shared_results, models)["cp2_ep2"]


@pytest.mark.parametrize("name, layout", CASES)
def test_composed_cp_logprobs_entropy_equal_world1_on_cpu(request, world1, batch, name, layout):
    arch, n = LAYOUTS[name][2], len(batch["sequences"])
    ranks = request.getfixturevalue(name)  # each layout starts its ranks when first asked
    ours, ref = merged(ranks, arch, layout, n), merged(world1, arch, layout, n)
    d_lp, d_en = max_abs_diff(ours.log_probs, ref.log_probs), max_abs_diff(ours.entropy, ref.entropy)
    print(f"{name} {layout}: log-prob {d_lp:.2e}, entropy {d_en:.2e}")  # the record (pytest -s)
    assert d_lp <= CP_TOL
    assert d_en <= CP_TOL
    assert ours.log_probs[6].numel() == 0  # the empty response stays empty, in batch order
    holders = [r for r in ranks if r[arch][layout]["logprobs"]]
    last = LAYOUTS[name][1].get("pipeline_model_parallel_size", 1) - 1
    assert holders and all(r["ranks"]["cp"] == 0 and r["ranks"]["pp"] == last for r in holders)


@pytest.mark.parametrize("name, layout", CASES)
def test_composed_cp_gradients_equal_world1_after_one_step_on_cpu(request, world1, name, layout):
    arch = LAYOUTS[name][2]
    ref = world1[0][arch][layout]
    for rank_res in request.getfixturevalue(name):
        res = rank_res[arch][layout]
        worst, where = worst_grad_rel_diff(res["grads"], ref["grads"])
        print(f"{name} {layout}: worst gradient {worst:.2e} relative ({where})")
        assert worst <= GRAD_RTOL, where
        assert res["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
        assert res["metrics"]["num_tokens"] == ref["metrics"]["num_tokens"]
        assert res["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert res["info"]["num_parameters"] == ref["info"]["num_parameters"]


def test_cp2_pp2_stages_split_several_micro_batches_over_their_cp_pair_on_cpu(request):
    """Both stages run the same micro-batches (more than one, of unequal lengths), each stage's CP pair holding
    the two disjoint halves of every sequence; the CP pairs are {0,1} and {2,3} (megatron-core's tp-cp-ep-dp-pp)."""
    ranks = request.getfixturevalue("cp2_pp2")
    assert [r["ranks"]["pp"] for r in ranks] == [0, 0, 1, 1]
    assert [r["ranks"]["cp_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for layout in ("packed", "padded"):
        splits = [r["qwen3"][layout]["split"] for r in ranks]
        assert len(splits[0]["global"]) >= 2 and len(set(splits[0]["global"])) >= 2
        assert all(s["global"] == splits[0]["global"] for s in splits)
        for s0, s1 in ((splits[0], splits[1]), (splits[2], splits[3])):
            for g, p0, p1 in zip(s0["global"], s0["positions"], s1["positions"]):
                assert g % 4 == 0 and len(p0) == len(p1) == g // 2 and sorted(p0 + p1) == list(range(g))
        assert splits[0]["positions"] == splits[2]["positions"]  # CP rank 0 of each stage holds the same chunks


def test_cp2_ep2_expert_group_spans_the_cp_pair_on_cpu(request):
    """At world 2 the expert-parallel group is the CP group: each rank holds half the experts and half of every
    sequence, and the gradients above came through the all-to-all between the two halves."""
    ranks = request.getfixturevalue("cp2_ep2")
    for r in ranks:
        assert r["ranks"]["cp_group"] == r["ranks"]["ep_group"] == [0, 1]
        moe = r["qwen3_moe"]["packed"]["info"]["moe"]
        assert moe["ep_group"] == 2 and moe["num_experts"] == 8
        assert r["qwen3_moe"]["packed"]["info"]["num_parameters_local"] < r["qwen3_moe"]["packed"]["info"]["num_parameters"]


@pytest.fixture(scope="module")
def tp2_sp(shared_results, models) -> list[dict]:
    """TP2 + sequence parallel (world 2, 2048 tokens per micro-batch): each TP rank routes half of every
    micro-batch, as under CP."""
    return shared_world2(shared_results, models)["tp2_sp"]


@pytest.mark.parametrize("name", ["cp2_ep2", "tp2_sp"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_sp_cp_router_losses_give_the_world1_gradient_on_cpu(request, world1, name, layout):
    """--megatron.moe_aux_loss_coeff 0.1 and --megatron.moe_z_loss_coeff 0.01 at CP2 x EP2 and TP2 + SP: every parameter's
    gradient after one step equals world 1's (the router losses are partial sums over the CP ranks, each to be
    weighted by the micro-batch's token count, not the rank's: megatron/router_loss.py:router_loss_scale); and the losses
    do move the gradient (against the run without them)."""
    ref = world1[0]["variants"]["router_losses"]["qwen3_moe"][layout]
    plain = world1[0]["qwen3_moe"][layout]
    assert worst_grad_rel_diff(ref["grads"], plain["grads"])[0] > 1e-3
    for rank_res in request.getfixturevalue(name):
        res = rank_res["variants"]["router_losses"]["qwen3_moe"][layout]
        worst, where = worst_grad_rel_diff(res["grads"], ref["grads"])
        print(f"{name} router losses {layout}: worst gradient {worst:.2e} relative ({where})")
        assert worst <= GRAD_RTOL, where
        assert res["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert res["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
