"""Qwen3-MoE on the Megatron backend, CPU/gloo (issue 25): a tiny model (8 experts, 2 routed per token, every
layer sparse) built from a config; log-probs and entropy equal Hugging Face's at world 1, TP2 (+SP) and EP2
(experts as Megatron's SequentialMLP under the local spec, the all-to-all token dispatcher with the CPU patch of
megatron/cpu.py); a few training steps move the model, EP2 with the distributed optimizer follows world 1's
trajectory and resumes exactly from a checkpoint; the HF export (every expert, gathered over EP) reloads into
Hugging Face with the trainer's log-probs; the router losses are flags that reach Megatron and change the
gradient (docs/moe.md)."""

from __future__ import annotations

import pytest

from mg_helpers import hf_logprobs_entropy, max_abs_diff, run_layout
from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from rank_sequence import run_sequence

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARITY_TOL = 1e-4
SAVE_AT = 2
CFG = dict(lr=2e-3, min_lr=2e-4, lr_warmup_steps=2, lr_scheduler="cosine_warmup_with_min_lr", total_steps=3,
           micro_batch_max_tokens=96, max_norm=1.0, entropy_chunk_size=16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2))


@pytest.fixture(scope="module")
def world1(moe_dir, ragged_batch, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_w1")
    res = run_layout(1, cfg=CFG, model_dirs={"moe": moe_dir}, batch=ragged_batch, train_dir=moe_dir, train_steps=3,
                     export_dir=str(root / "hf"))
    return {"res": res, "root": root}


EP2 = {**CFG, "expert_model_parallel_size": 2, "use_distributed_optimizer": True}
# --megatron.expert_tensor_parallel_size 1 with TP2 + SP and EP2 on 2 ranks
ETP1 = {**CFG, "tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1}


@pytest.fixture(scope="module")
def world2(moe_dir, ragged_batch, tmp_path_factory):
    """The world-2 layouts, one after another on the same two ranks (one launch, rank_sequence.py): ``ep2``: EP2 x
    DP2 with the distributed optimizer: parity, 3 steps with a checkpoint after 2, export; the same ranks then
    rebuild with each router loss on. ``tp2``: TP2 + sequence parallel, parity. ``etp1``: TP2 + SP with EP2 over
    the TP ranks and ETP 1: parity and 3 steps."""
    root = tmp_path_factory.mktemp("moe_ep2")
    models = {"moe": moe_dir}
    ep2 = dict(cfg=EP2, model_dirs=models, batch=ragged_batch, train_dir=moe_dir, train_steps=3, save_at=SAVE_AT,
               ckpt_root=str(root / "ckpt"), export_dir=str(root / "hf"),
               # variants apply in order on the same worker: each resets what the previous one set
               variants={"aux": {"moe_aux_loss_coeff": 1.0},
                         "z": {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.1},
                         "uneven": {"moe_z_loss_coeff": 0.0, "micro_batch_max_tokens": 40}})
    # TP2 + sequence parallel (megatron-core's MoE layer trains under TP only with SP)
    tp2 = dict(cfg={**CFG, "tensor_model_parallel_size": 2, "sequence_parallel": True}, model_dirs=models,
               batch=ragged_batch)
    etp1 = dict(cfg=ETP1, model_dirs=models, batch=ragged_batch, train_dir=moe_dir, train_steps=3)
    results = run_sequence(2, [("mg_scenarios:layout_run", kw) for kw in (ep2, tp2, etp1)], timeout=3 * 420)
    return {**dict(zip(("ep2", "tp2", "etp1"), results)), "root": root}


@pytest.fixture(scope="module")
def ep2(world2, moe_dir, ragged_batch):
    """EP2's run of the world-2 launch, and new processes resuming from its checkpoint."""
    root = world2["root"]
    resumed = run_layout(2, cfg=EP2, model_dirs={}, batch=ragged_batch, train_dir=moe_dir, train_steps=3,
                         resume_from=str(root / "ckpt" / f"step_{SAVE_AT}"))
    return {"first": world2["ep2"], "resumed": resumed, "root": root}


def test_qwen3_moe_parity_training_and_export_on_cpu(world1, world2, moe_dir, ragged_batch):
    n = len(ragged_batch["sequences"])
    ref_lp, ref_ent = hf_logprobs_entropy(moe_dir, ragged_batch)
    w1 = world1["res"]
    got = merge_rank_outputs([r["logprobs"]["moe"] for r in w1], n)
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
    assert w1[0]["info"]["model_type"] == "qwen3_moe"
    metrics = w1[0]["metrics"]
    assert len(metrics) == 3 and all(m["skipped"] == 0.0 and m["grad_norm"] > 0 for m in metrics)
    trained = merge_rank_outputs([r["after_train"] for r in w1], n)
    assert max_abs_diff(trained.log_probs, got.log_probs) > 1e-3  # the steps moved the experts and router
    exported_lp, _ = hf_logprobs_entropy(str(world1["root"] / "hf"), ragged_batch)
    assert max_abs_diff(trained.log_probs, exported_lp) <= PARITY_TOL  # every expert came back out under its HF name

    # TP2 + sequence parallel (megatron-core's MoE layer trains under TP only with SP)
    tp2 = world2["tp2"]
    got2 = merge_rank_outputs([r["logprobs"]["moe"] for r in tp2], n)
    assert max_abs_diff(got2.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got2.entropy, ref_ent) <= PARITY_TOL


def test_ep2_parity_and_trajectory_equal_world1_on_cpu(ep2, world1, moe_dir, ragged_batch):
    n = len(ragged_batch["sequences"])
    ref_lp, ref_ent = hf_logprobs_entropy(moe_dir, ragged_batch)
    first = ep2["first"]
    assert all(r["logprobs"]["moe"] for r in first)  # each DP rank scored its own shard
    got = merge_rank_outputs([r["logprobs"]["moe"] for r in first], n)
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
    info = first[0]["info"]
    assert info["dp"] == 2 and info["moe"]["ep"] == 2 and info["moe"]["token_dispatcher"] == "alltoall"
    assert info["num_parameters"] == world1["res"][0]["info"]["num_parameters"]  # experts split, none lost
    assert info["num_parameters_local"] < info["num_parameters"]
    ref = world1["res"][0]["metrics"]
    for rank_res in first:  # identical on both ranks, and equal to world 1's steps on the same data
        ms = rank_res["metrics"]
        assert [m["loss"] for m in ms] == pytest.approx([m["loss"] for m in ref], abs=2e-5)
        assert [m["grad_norm"] for m in ms] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4)
        assert [m["num_tokens"] for m in ms] == [m["num_tokens"] for m in ref]
    a = merge_rank_outputs([r["after_train"] for r in first], n).log_probs
    b = merge_rank_outputs([r["after_train"] for r in world1["res"]], n).log_probs
    assert max_abs_diff(a, b) <= PARITY_TOL


def test_ep2_over_the_tp_ranks_with_whole_experts_etp1_on_cpu(world1, world2, moe_dir, ragged_batch):
    """--megatron.expert_tensor_parallel_size 1 with TP2 + SP and EP2 on 2 ranks (one data-parallel replica): the two
    TP ranks form the expert-parallel group and each holds 4 of the 8 experts whole, which megatron-core lays out
    only with ETP 1 (ETP = TP = 2 would need 4 ranks: refused, test_moe_layout_flags.py). The value reaches
    parallel_state and TransformerConfig; log-probs equal HF's and 3 steps follow world 1's."""
    n = len(ragged_batch["sequences"])
    res = world2["etp1"]
    ref_lp, ref_ent = hf_logprobs_entropy(moe_dir, ragged_batch)
    got = merge_rank_outputs([r["logprobs"]["moe"] for r in res], n)
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
    for r in res:
        info = r["info"]
        assert (info["tp"], info["dp"]) == (2, 1)
        assert info["moe"]["etp"] == 1 and info["moe"]["config_etp"] == 1 and info["moe"]["ep_group"] == 2
        assert info["num_parameters"] == world1["res"][0]["info"]["num_parameters"]  # experts split, none lost
    ref = world1["res"][0]["metrics"]
    for r in res:
        assert [m["loss"] for m in r["metrics"]] == pytest.approx([m["loss"] for m in ref], abs=2e-5)
        assert [m["grad_norm"] for m in r["metrics"]] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4)
    trained = merge_rank_outputs([r["after_train"] for r in res], n).log_probs
    assert max_abs_diff(trained, merge_rank_outputs([r["after_train"] for r in world1["res"]], n).log_probs) <= PARITY_TOL


def test_ep2_with_unequal_micro_batch_counts_per_rank_on_cpu(ep2, moe_dir, ragged_batch):
    """A 40-token budget plans 3 micro-batches on one DP rank and 4 on the other: the short plan is topped up
    with masked fillers (each MoE layer is an all-to-all over both ranks), nothing else changes."""
    from openrlhf_shape.actor.batching import plan_micro_batches, shard_for_dp

    lengths = [len(s) for s in ragged_batch["sequences"]]
    counts = [len(plan_micro_batches([lengths[i] for i in shard], 40)) for shard in shard_for_dp(lengths, 2)]
    assert counts[0] != counts[1]  # the case this test is about
    n = len(ragged_batch["sequences"])
    ref_lp, _ = hf_logprobs_entropy(moe_dir, ragged_batch)
    var = [r["variants"]["uneven"] for r in ep2["first"]]
    got = merge_rank_outputs([v["logprobs"]["moe"] for v in var], n)
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    ref = ep2["first"][0]["metrics"]
    for v in var:
        assert [m["loss"] for m in v["metrics"]] == pytest.approx([m["loss"] for m in ref], abs=2e-5)
        assert [m["grad_norm"] for m in v["metrics"]] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4)


def test_ep2_resume_equals_uninterrupted_on_cpu(ep2, ragged_batch):
    first, resumed = ep2["first"], ep2["resumed"]
    n = len(ragged_batch["sequences"])
    for r in range(2):
        assert resumed[r]["extra"] == {"step": SAVE_AT, "data_pos": 7}
        ref = first[r]["metrics"][SAVE_AT:]
        got = resumed[r]["metrics"]
        assert len(got) == len(ref) == 1
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in ref], abs=1e-6)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-5)
    a = merge_rank_outputs([r["after_train"] for r in first], n).log_probs
    b = merge_rank_outputs([r["after_train"] for r in resumed], n).log_probs
    assert max_abs_diff(a, b) <= 1e-6


def test_ep2_export_gathers_every_expert_under_its_hf_name_on_cpu(ep2, world1, ragged_batch):
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
        return out

    ep_hf, w1_hf = tensors(ep2["root"] / "hf"), tensors(world1["root"] / "hf")
    assert sorted(ep_hf) == sorted(w1_hf)
    experts = [k for k in ep_hf if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    for k in experts:  # the same expert (EP offset right) after the same three steps, not a neighbour's
        assert float((ep_hf[k] - w1_hf[k]).abs().max()) <= 1e-4, k
    n = len(ragged_batch["sequences"])
    trained = merge_rank_outputs([r["after_train"] for r in ep2["first"]], n)
    exported_lp, _ = hf_logprobs_entropy(str(ep2["root"] / "hf"), ragged_batch)
    assert max_abs_diff(trained.log_probs, exported_lp) <= PARITY_TOL


def test_router_losses_reach_megatron_and_change_the_gradient_on_cpu(ep2):
    base = ep2["first"][0]
    assert base["info"]["moe"]["load_balancing"] == "none" and base["info"]["moe"]["z_loss_coeff"] is None
    aux, z = base["variants"]["aux"], base["variants"]["z"]
    assert aux["info"]["moe"]["load_balancing"] == "aux_loss" and aux["info"]["moe"]["aux_loss_coeff"] == 1.0
    assert z["info"]["moe"]["z_loss_coeff"] == 0.1 and z["info"]["moe"]["load_balancing"] == "none"
    ref = base["metrics"]
    for var in (aux, z):
        ms = var["metrics"]
        # the router losses do not enter the policy loss's forward value, only the backward
        assert ms[0]["loss"] == pytest.approx(ref[0]["loss"], abs=1e-6)
        assert abs(ms[0]["grad_norm"] - ref[0]["grad_norm"]) > 1e-4 * ref[0]["grad_norm"]
        # ... and so the next steps, which start from different weights
        assert abs(ms[1]["loss"] - ref[1]["loss"]) > 1e-6


def test_what_does_not_run_is_refused_with_the_reason(moe_dir, tiny_models):
    from transformers import AutoConfig

    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.planner.model import ModelShape

    moe = AutoConfig.from_pretrained(moe_dir)
    dense = AutoConfig.from_pretrained(tiny_models["qwen3"])
    MegatronConfig(expert_model_parallel_size=2).validate_against_model(moe, 2)  # EP2 inside DP2: fine
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        MegatronConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True).validate_against_model(moe, 2)
    with pytest.raises(ValueError, match="must divide num_experts=8"):
        MegatronConfig(expert_model_parallel_size=3).validate_against_model(moe, 3)
    with pytest.raises(ValueError, match="--megatron.sequence_parallel"):
        MegatronConfig(tensor_model_parallel_size=2).validate_against_model(moe, 2)
    with pytest.raises(ValueError, match="no routed experts"):
        MegatronConfig(moe_aux_loss_coeff=0.01).validate_against_model(dense, 1)
    with pytest.raises(ValueError, match="moe_z_loss_coeff must be a number >= 0"):
        MegatronConfig(moe_z_loss_coeff=-1.0)
    # The planner sizes the config transformers 5 writes (num_local_experts, not the published num_experts):
    # every parameter of the HF model counted, the active ones two experts of eight per layer.
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_file(f"{moe_dir}/config.json")
    hf = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert shape.num_experts == 8 and shape.total_params() == sum(p.numel() for p in hf.parameters())


def test_the_trainer_takes_a_moe_policy_on_megatron_only(moe_dir):
    """A MoE policy trains on the Megatron backend (tests/trainer/test_train_e2e_moe.py runs SHAPE steps on it,
    colocated and disaggregated); the DeepSpeed backend is refused before anything starts, naming the flag:
    it exports transformers 5's fused expert tensors, which the engine's per-expert checkpoint does not have."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.setup import build_run

    from pathlib import Path

    preset = Path(__file__).resolve().parents[2] / "configs" / "cpu-smoke.yaml"
    cfg = load_config(str(preset), ["--actor.model_name_or_path", moe_dir, "--actor.backend", "deepspeed"])
    with pytest.raises(ValueError, match="mixture-of-experts model .*--actor.backend megatron"):
        build_run(cfg)
