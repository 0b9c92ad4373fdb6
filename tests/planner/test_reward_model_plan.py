"""The reward model (``--reward.model_name_or_path``) in the dry-run plan: its memory per phase from its own
config.json (weights = its parameters in bf16 on one TP rank, counted here by Hugging Face's own model of that
config), on GPUs of its own or on the actor's when colocated (on host outside its forward), its ranks in host RAM on
CPU, and its forward in the rewards' place of the step (the probes' sequences too when it judges them; its
weights' trips over PCIe under ``--reward.offload``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import PlanOptions
from openrlhf_shape.planner.memory import GiB
from openrlhf_shape.planner.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
TP1 = ["--megatron.tensor_model_parallel_size", "1", "--megatron.sequence_parallel", "false"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> tuple[str, int]:
    """A tiny Qwen3 reward model's config.json (no weights: the planner reads the shape) and its parameter count as
    Hugging Face builds the causal LM of it (tied embeddings: the planner's count of the policy's shape)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    conf = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("rm_shape") / "rm"
    conf.save_pretrained(path)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_config(conf).parameters())
    return str(path), n


def _plan(preset: str, flags: list[str]):
    return build_plan(load_config(str(REPO / "configs" / preset), flags, check_paths=False), PlanOptions())


def _terms(ph) -> dict[str, int]:
    return {t.name: t.bytes for t in ph.terms}


def test_own_gpus_hold_its_bf16_weights_and_its_forward(rm_dir):
    path, n_params = rm_dir
    flags = ["--train.colocate_all", "false", *TP1, "--algo.advantage.estimator", "group_norm"]
    base = _plan("qwen3-4b.yaml", flags)
    plan = _plan("qwen3-4b.yaml", flags + ["--reward.model_name_or_path", path])
    (ph,) = plan.rm_phases
    assert not base.rm_phases and base.reward_model is None and plan.rm_world == 8
    assert ph.name == "reward model (reward-model GPU)"
    assert _terms(ph)["reward model weights"] == 2 * n_params  # bf16, one TP rank of 1: every parameter
    assert not [t for t in ph.terms if "grads" in t.name or "optimizer" in t.name or "log-prob" in t.name]
    ctx = int(plan.options.cuda_context_gib * GiB) + int(plan.options.nccl_gib * GiB)
    assert ph.total == plan.reward_model.peak + ctx
    assert len(plan.placement.rms) == 8 and not {(s.node, s.gpu) for s in plan.placement.rms} & {
        (s.node, s.gpu) for s in plan.placement.ranks}  # GPUs of its own
    names = [p.name for p in plan.phases]
    assert "rewards" in [p.name for p in base.phases] and "rewards" not in names and "reward model" in names


def test_reward_offload_moves_its_weights_over_pcie_and_keeps_them_in_host_ram(rm_dir):
    path, _ = rm_dir
    flags = ["--train.colocate_all", "false", *TP1, "--algo.advantage.estimator", "group_norm",
             "--reward.model_name_or_path", path]
    plan, off = _plan("qwen3-4b.yaml", flags), _plan("qwen3-4b.yaml", flags + ["--reward.offload"])
    t, t_off = ({p.name: p.seconds for p in x.phases}["reward model"] for x in (plan, off))
    w = plan.reward_model.static_bytes
    assert t_off - t == pytest.approx(2 * w / (plan.options.pcie_gbs * 1e9), rel=1e-9) and t > 0
    assert off.rm_phases[0].total == plan.rm_phases[0].total  # its forward's peak: the whole model comes back
    host = {h.name: h.bytes for h in off.host}
    node0 = off.placement.ranks[0].node
    assert host["reward model weights offloaded"] == w * sum(1 for s in off.placement.rms if s.node == node0)
    assert "reward model weights offloaded" not in {h.name for h in plan.host}


def test_colocated_it_is_on_host_but_for_its_forward_after_the_rollout(rm_dir):
    path, _ = rm_dir
    base = _plan("qwen3-4b.yaml", TP1)
    plan = _plan("qwen3-4b.yaml", TP1 + ["--reward.model_name_or_path", path])
    assert not plan.rm_phases and [p.name for p in plan.gpu_phases] == ["rollout", "reward model"] + [
        p.name for p in base.gpu_phases[1:]]
    proc = int(plan.options.cuda_context_gib * GiB) + int(plan.options.nccl_gib * GiB)
    for ph, b in zip([plan.gpu_phases[0], *plan.gpu_phases[2:]], base.gpu_phases):
        assert _terms(ph)["reward model weights (on host: the colocation lifecycle)"] == 0
        assert ph.total == b.total + proc  # its process's context on the GPU, nothing else
    assert plan.gpu_phases[1].total == plan.gpu_phases[0].total + plan.reward_model.peak


def test_it_scores_the_probes_unless_math_verify_does(rm_dir):
    path, _ = rm_dir
    flags = ["--train.colocate_all", "false", *TP1, "--reward.model_name_or_path", path]
    shape, mv = _plan("qwen3-4b.yaml", flags), _plan("qwen3-4b.yaml", flags + ["--probe.scorer", "math_verify"])
    i = shape.inputs
    probes = i["samples"] * i["probes_per_response"] * (i["prompt_tokens"] + i["response_tokens"] / 2 + i["probe_tokens"])
    t, t_mv = ({p.name: p.seconds for p in x.phases}["reward model"] for x in (shape, mv))
    assert probes > 0 and t / t_mv == pytest.approx((shape.packing.computed + probes) / shape.packing.computed, rel=1e-9)


def test_cpu_config_counts_its_ranks_in_host_ram(rm_dir):
    path, _ = rm_dir
    base = _plan("cpu-smoke.yaml", [])
    plan = _plan("cpu-smoke.yaml", ["--reward.model_name_or_path", path])
    (ph,), (b,) = plan.gpu_phases, base.gpu_phases
    n = plan.rm_world
    added = {k: v for k, v in _terms(ph).items() if "reward-model" in k}
    assert added[f"{n} reward-model rank(s) x reward model weights"] == n * 4 * rm_dir[1]  # fp32 on CPU
    assert ph.total == b.total + sum(added.values())
