"""The planner sizes mixture-of-experts models (qwen3_moe): total vs active parameters, experts sharded by
EP / expert TP with their optimizer state over expert DP, the engine holding every expert, FLOPs from the
active parameters, the all-to-all term, and refusals that name --megatron.expert_model_parallel_size.

Small cases are computed by hand in the comments; the shipped Qwen3-30B-A3B / 235B-A22B shapes are checked
against Hugging Face's own models built on the meta device."""

from __future__ import annotations

import json

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.cost import decode_weight_bytes, experts_touched, flops_per_token, moe_alltoall
from openrlhf_shape.planner.memory import (
    expert_data_parallel_size,
    layer_activation_elems,
    megatron_memory_stages,
    megatron_update_peak_bytes,
    vllm_memory,
)
from openrlhf_shape.planner.model import MODELS_DIR, ModelShape

# hidden 8, q = 2 heads x 4 = 8, kv = 1 x 4; 4 layers, layer 0 dense (mlp_only_layers), 1..3 sparse;
# 4 experts of width 6, top-2; dense MLP width 10; vocab 16, untied.
TINY = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=8, intermediate_size=10,
            moe_intermediate_size=6, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            vocab_size=16, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[0], norm_topk_prob=True)
# Per layer: attention h (q + 2 kv) + q h = 8 x 16 + 64 = 192; norms 2 h + q/k norms 2 x 4 = 24.
# Dense layer: + MLP 3 x 8 x 10 = 240 -> 456. Sparse layer: + router 4 x 8 = 32 -> 248 non-expert,
# experts 4 x 3 x 8 x 6 = 576. Embedding and output 16 x 8 each, final norm 8.
TINY_TOTAL = 456 + 3 * (248 + 576) + 2 * 128 + 8  # 3192
TINY_ACTIVE = 456 + 3 * (248 + 2 * 144) + 2 * 128 + 8  # 2328: two of the four 144-parameter experts


@pytest.fixture(scope="module")
def tiny() -> ModelShape:
    return ModelShape.from_dict(TINY, name="tiny-moe")


def test_tiny_counts_by_hand(tiny):
    assert tiny.is_moe and tiny.moe_layers == (1, 2, 3)
    assert tiny.total_params() == TINY_TOTAL == 3192
    assert tiny.active_params() == TINY_ACTIVE == 2328
    assert tiny.expert_params() == 3 * 576


def _hf_count(cfg: dict) -> tuple[int, int]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, experts


def test_tiny_counts_equal_hugging_face(tiny):
    # the sparse-layer rule (mlp_only_layers, decoder_sparse_step) is Hugging Face's
    assert _hf_count(TINY) == (TINY_TOTAL, 3 * 576)
    every_other = {**TINY, "mlp_only_layers": [], "decoder_sparse_step": 2}  # layers 1 and 3 sparse
    shape = ModelShape.from_dict(every_other)
    assert shape.moe_layers == (1, 3)
    assert _hf_count(every_other) == (shape.total_params(), shape.expert_params())


@pytest.mark.parametrize("name,total,active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Qwen3-235B-A22B", 235e9, 22e9)])
def test_shipped_shapes_match_hf_and_the_published_names(name, total, active):
    cfg = json.loads((MODELS_DIR / f"{name}.json").read_text())
    shape = ModelShape.from_dict(cfg, name=name)
    assert _hf_count(cfg) == (shape.total_params(), shape.expert_params())
    # Qwen publishes 30.5B total / 3.3B activated and 235B / 22B
    assert shape.total_params() == pytest.approx(total, rel=0.01)
    assert shape.active_params() == pytest.approx(active, rel=0.03)


def test_rank_params_and_optimizer_shards_by_hand(tiny):
    # TP2 PP2 EP2 (expert TP = TP = 2), world 8: DP 2, expert DP 8 / (2 x 2 x 2) = 1.
    assert expert_data_parallel_size(tp=2, dp=2, ep=2, etp=2) == 1
    s0, s1 = megatron_memory_stages(tiny, tp=2, pp=2, dp=2, ep=2, micro_batch_tokens=16, distributed_optimizer=True)
    # stage 0: layer 0 dense (192 + 240) / 2 + 24 = 240; layer 1 sparse 192 / 2 + 24 + router 32 = 152;
    # embedding 16 x 8 / 2 = 64 -> 456 non-expert; experts 4 / EP 2 x 144 / ETP 2 = 144.
    # stage 1: layers 2, 3: 2 x 152, final norm 8, output layer 64 -> 376; experts 2 x 144 = 288.
    assert tiny.stage_params(2, 2, 0) == 456 and tiny.stage_expert_params(2, 2, 2, 0) == 144
    assert tiny.stage_params(2, 2, 1) == 376 and tiny.stage_expert_params(2, 2, 2, 1) == 288
    terms = {t.name: t.bytes for t in s1.static}
    assert s1.n_local == 664
    assert terms["weights"] == 664 * 2 and terms["grads"] == 664 * 4
    assert terms["optimizer"] == 376 * 12 // 2 + 288 * 12 // 1  # non-expert / DP, experts / expert DP
    assert {t.name: t.bytes for t in s0.static}["optimizer"] == 456 * 12 // 2 + 144 * 12
    # EP 4 x expert TP 2 x PP 2 = 16 ranks do not divide world 8: megatron-core refuses it, so does the planner
    with pytest.raises(ValueError, match="expert_model_parallel_size 4"):
        megatron_memory_stages(tiny, tp=2, pp=2, dp=2, ep=4, micro_batch_tokens=16)
    # the GPU kit's entry point takes the same ep/etp
    got = megatron_update_peak_bytes(TINY, tp=2, pp=2, dp=2, ep=2, micro_batch_tokens=16)
    assert got["weights"] in (s0.n_local * 2, s1.n_local * 2)


def test_sparse_layer_activations_by_hand(tiny):
    # TP2 + sequence parallel: s = 1/2 of the tokens per rank; k 2, E 4, I_e 6, h 8, expert TP 2, te spec.
    e = layer_activation_elems(tiny, tp=2, sp=True, seq_len=16, spec="te", sparse=True, etp=2)
    assert e["router (logits, probs)"] == 2 * 4 * 0.5
    assert e["moe dispatch + combine (k copies of h)"] == 2 * 8 * (2 + 1) * 0.5
    assert e["experts (fc1 out + swiglu)"] == 2 * (2 * 6 + 2 * 6) * 0.5
    assert "mlp (fc1 out + swiglu)" not in e
    hot = layer_activation_elems(tiny, tp=2, sp=True, seq_len=16, spec="te", sparse=True, etp=2, imbalance=1.5)
    assert hot["experts (fc1 out + swiglu)"] == 1.5 * e["experts (fc1 out + swiglu)"]
    assert hot["router (logits, probs)"] == e["router (logits, probs)"]


def test_engine_holds_every_expert_and_decode_reads_the_touched_ones(tiny):
    v = vllm_memory(tiny, engine_tp=2, gpu_bytes=10**6, utilization=0.5, max_num_batched_tokens=4, max_num_seqs=1,
                    cuda_graph_bytes=0, context_bytes=0)
    assert v.weights.bytes == TINY_TOTAL * 2 // 2
    # profiling peak: 4 tokens x 2 B x (4 h + k (3 I_e / etp + h)) + 1 seq x V x 4 B x 2
    assert v.activations.bytes == 4 * 2 * (4 * 8 + 2 * (3 * 6 // 2 + 8)) + 16 * 4 * 2
    # uniform top-2 of 4: one token touches 1/2 of the experts, two tokens 1 - (1/2)^2 = 3/4
    assert experts_touched(tiny, 1) == 0.5 and experts_touched(tiny, 2) == 0.75
    non_expert = TINY_TOTAL - 3 * 576
    assert decode_weight_bytes(tiny, 1) == (non_expert + 3 * 576 * 0.5) * 2 == TINY_ACTIVE * 2
    assert decode_weight_bytes(tiny, 10**6) == pytest.approx(TINY_TOTAL * 2)
    # FLOPs count the active parameters only
    assert flops_per_token(tiny, 0, backward=False, recompute=False) == 2 * TINY_ACTIVE


def test_alltoall_by_hand(tiny):
    opt = PlanOptions(nvlink_gbs=100.0, ib_gbs=10.0, a2a_efficiency=1.0).validate()
    kw = dict(tokens_per_dp=1000, tp=1, pp=1, sp=False, etp=1, opt=opt)
    # k copies of h in bf16: 2 x 8 x 2 = 32 B per token; dispatch + combine send 2 x 32 B x (EP-1)/EP.
    # EP 4 on nodes of 2 GPUs: 1 peer on the node (2 x 32 x 1/4 = 16 B over NVLink), 2 on others (32 B over IB),
    # concurrent: max(16 / 100e9, 32 / 10e9) = 3.2 ns per token and layer; 2 passes x 1000 tokens x 3 sparse layers.
    t, how = moe_alltoall(tiny, passes=2, ep=4, gpus_per_node=2, **kw)
    assert t == pytest.approx(2 * 1000 * 3 * 32 / 10e9)
    assert "InfiniBand" in how
    # the same EP group inside one node of 8: 2 x 32 x 3/4 = 48 B over NVLink
    t, how = moe_alltoall(tiny, passes=2, ep=4, gpus_per_node=8, **kw)
    assert t == pytest.approx(2 * 1000 * 3 * 48 / 100e9) and "NVLink" in how
    # TP2 + SP: 500 tokens per rank; EP 2 x expert TP 2 in a node: 2 x 32 x 1/2 = 32 B, plus the expert-TP
    # all-gather and reduce-scatter 2 x 32 x (2 - 1) = 64 B, both over NVLink
    t, _ = moe_alltoall(tiny, passes=1, **{**kw, "tp": 2, "sp": True, "etp": 2}, ep=2, gpus_per_node=8)
    assert t == pytest.approx(500 * 3 * (32 + 64) / 100e9)
    dense = ModelShape.from_file(MODELS_DIR / "Qwen3-0.6B.json")
    assert moe_alltoall(dense, passes=1, ep=1, gpus_per_node=8, **kw)[0] == 0.0


def _dry_run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["train", *argv, "--dry_run"])
    except SystemExit as exc:
        return (exc.code if isinstance(exc.code, int) else 1), capsys.readouterr().out + str(exc.code)
    return rc, capsys.readouterr().out


def test_moe_presets_print_the_expert_layout_and_alltoall(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml")
    assert rc == 0, out
    assert "mixture of experts: 3.35B active params per token of 30.53B" in out
    assert "experts: EP 8 x expert TP 2 x PP 1 x expert DP 1" in out
    assert "params (all experts) x 2 B / engine TP 4" in out
    assert "MoE all-to-all:" in out and "SHAPE/GRPO" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-235b-a22b.yaml")
    assert rc == 0, out
    assert "experts: EP 16 x expert TP 4 x PP 2 x expert DP 1" in out and "disaggregated" in out


def test_layouts_that_cannot_hold_the_experts_are_refused_naming_the_flag(capsys):
    # 235B-A22B without expert parallelism: 28.4B expert params per rank
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-235b-a22b.yaml", "--megatron.expert_model_parallel_size", "1")
    assert rc == 2, out
    refusal = out.split("REFUSED:")[1]
    assert "update phase" in refusal and "raise --megatron.expert_model_parallel_size (now 1" in refusal
    # ... and on one node: no room for the layout at all
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-235b-a22b.yaml", "--megatron.expert_model_parallel_size", "1",
                       "--plan.num_nodes", "1")
    assert rc == 2 and "--megatron.expert_model_parallel_size" in out and "placement:" in out
    # EP must divide the 128 experts, and EP x expert TP x PP the world
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_model_parallel_size", "3")
    assert rc == 2 and "--megatron.expert_model_parallel_size=3 must divide num_experts=128" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_model_parallel_size", "16")
    assert rc == 2 and "x expert TP 2 x --megatron.pipeline_model_parallel_size=1 = 32 must divide --actor.num_nodes x --actor.num_gpus_per_node=16" in out
    # a colocated 30B-A3B at EP 1 holds every expert on every rank: refused
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_model_parallel_size", "1")
    assert rc == 2 and "--megatron.expert_model_parallel_size" in out.split("REFUSED:")[1]


def test_expert_parallel_on_a_dense_model_is_noted(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml", "--megatron.expert_model_parallel_size", "2")
    assert rc == 0 and "has no effect on a dense model" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml", "--megatron.expert_tensor_parallel_size", "1")
    assert rc == 0 and "--megatron.expert_tensor_parallel_size=1 has no effect on a dense model" in out


def _update_terms(plan) -> dict[str, int]:
    return {t.name: t.bytes for t in next(ph for ph in plan.gpu_phases if ph.name == "update").terms}


def _alltoall_seconds(plan) -> float:
    return sum(ph.seconds for ph in plan.phases if ph.name == "MoE all-to-all")


def test_the_plan_follows_expert_tensor_parallel_size():
    """The 30B-A3B preset (16 GPUs, TP 2, EP 8) with --megatron.expert_tensor_parallel_size 1 instead of the default (the
    TP size): each rank holds its 16 experts per layer whole instead of halved, so twice the expert parameters; their
    bf16 weights and fp32 grads grow with them, their fp32 master + Adam state does not (expert DP doubles,
    16 / (1 x 8) = 2, and the distributed optimizer shards it over that); the EP group (ETP x EP = 8 ranks) fits one
    node, so the all-to-all runs over NVLink and has no expert-TP all-gather."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.planner.plan import build_plan

    def plan(*flags: str):
        cfg = load_config(str(MODELS_DIR.parent / "qwen3-30b-a3b.yaml"), list(flags), check_paths=False)
        return build_plan(cfg, PlanOptions(), "configs/qwen3-30b-a3b.yaml")

    base, one = plan(), plan("--megatron.expert_tensor_parallel_size", "1")
    explicit = plan("--megatron.expert_tensor_parallel_size", "2")
    assert (base.ep, base.etp, base.edp) == (8, 2, 1) and (one.ep, one.etp, one.edp) == (8, 1, 2)
    per_ep_rank = 48 * (128 // 8) * 3 * 2048 * 768  # sparse layers x experts per EP rank x SwiGLU 3 h I_e
    assert one.megatron.n_local - base.megatron.n_local == per_ep_rank // 2
    b, o = _update_terms(base), _update_terms(one)
    assert o["weights"] - b["weights"] == 2 * per_ep_rank // 2  # bf16
    assert o["grads"] - b["grads"] == 4 * per_ep_rank // 2  # fp32 grad buffer, not sharded
    assert o["optimizer"] == b["optimizer"]  # 12 B/param over expert DP 2 instead of 1
    assert _alltoall_seconds(one) < _alltoall_seconds(base) / 3
    assert _update_terms(explicit) == b and explicit.step_seconds == base.step_seconds  # 2 = TP: the default


def test_expert_tensor_parallel_sizes_megatron_cannot_lay_out_are_refused_naming_the_flag(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_tensor_parallel_size", "3")
    assert rc == 2, out
    assert ("--megatron.expert_model_parallel_size=8 x expert TP 3 x --megatron.pipeline_model_parallel_size=1 = 24 "
            "must divide --actor.num_nodes x --actor.num_gpus_per_node=16") in out
    assert "change --megatron.expert_model_parallel_size, --megatron.expert_tensor_parallel_size or" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_tensor_parallel_size", "5")
    assert rc == 2 and "expert TP 5 (--megatron.expert_tensor_parallel_size, unset = TP) must divide each expert's " \
                       "moe_intermediate_size=768" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_tensor_parallel_size", "1",
                       "--megatron.expert_model_parallel_size", "1")
    assert rc == 2 and ("expert TP 1 (--megatron.expert_tensor_parallel_size) differs from "
                        "--megatron.tensor_model_parallel_size=2 with --megatron.expert_model_parallel_size=1") in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-30b-a3b.yaml", "--megatron.expert_tensor_parallel_size", "0")
    assert rc != 0 and "--megatron.expert_tensor_parallel_size must be an integer >= 1 or None" in out


def test_other_moe_architectures_are_refused_not_sized():
    with pytest.raises(NotImplementedError, match="qwen3_moe only"):
        ModelShape.from_dict({**TINY, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 16})
    with pytest.raises(NotImplementedError, match="qwen3_moe only"):
        ModelShape.from_dict({**TINY, "model_type": "mixtral", "num_local_experts": 4})
