"""Fast in-process tests of the Megatron backend's pure parts (no torch.distributed)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch, plan_micro_batches, shard_for_dp, validate_batch
from openrlhf_shape.checkpoint_dir import COMPLETE_MARKER, latest_checkpoint
from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.actor.logprobs import vocab_parallel_logprobs_entropy
from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from openrlhf_shape.platform import cpu_platform, gpu_platform


# ---------------------------------------------------------------- config
def test_config_defaults_on_cpu():
    cfg = MegatronConfig()
    assert cfg.bf16 is None  # auto: decided by the rank's handed profile, never re-detected by the config
    with pytest.raises(ValueError, match="for_platform"):
        cfg.params_dtype
    on_cpu = cfg.for_platform(cpu_platform())
    assert on_cpu.use_bf16 is False and on_cpu.params_dtype == torch.float32
    assert cfg.for_platform(gpu_platform()).params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bf16"):
        MegatronConfig(bf16=True).check_device(cpu_platform())
    assert cfg.optim.eps_clip_low_high == (0.2, 0.2)  # OpenRLHF's --actor.eps_clip 0.2 on both sides


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"expert_model_parallel_size": 0}, "expert_model_parallel_size"),
        ({"dist_optimizer_ckpt_format": "torch"}, "dist_optimizer_ckpt_format"),
        ({"layer_spec": "transformer_engine"}, "layer_spec"),
        ({"local_attention": "flash"}, "local_attention"),
        ({"layer_spec": "te", "local_attention": "sdpa"}, "local_attention"),
    ],
)
def test_config_errors_name_the_field_on_cpu(kwargs, field):
    """The layout and switches; the optimiser's refusals are tests/actor/test_optim.py's."""
    with pytest.raises(ValueError, match=rf"MegatronConfig\.{field}"):
        MegatronConfig(**kwargs)


def test_layer_spec_resolution_on_cpu():
    cpu = cpu_platform()
    assert MegatronConfig().layer_spec == "auto" and MegatronConfig().layer_spec_on(cpu) == "local"
    assert MegatronConfig().layer_spec_on(gpu_platform()) == "te"
    assert MegatronConfig(layer_spec="local").layer_spec_on(cpu) == "local"
    MegatronConfig(layer_spec="local", local_attention="sdpa").check_device(cpu)
    with pytest.raises(ValueError, match="layer_spec='te' needs a GPU"):
        MegatronConfig(layer_spec="te").check_device(cpu)


def test_validate_against_model_on_cpu():
    hf = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=1024)
    MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).validate_against_model(hf, 8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        MegatronConfig(tensor_model_parallel_size=4).validate_against_model(hf, 4)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        MegatronConfig(pipeline_model_parallel_size=4).validate_against_model(hf, 4)
    with pytest.raises(ValueError, match="world size"):
        MegatronConfig(tensor_model_parallel_size=2).validate_against_model(hf, 3)


# ---------------------------------------------------------------- batching
def test_dp_shards_are_balanced_deterministic_and_complete_on_cpu():
    lengths = [50, 10, 40, 30, 20, 60, 5]
    shards = shard_for_dp(lengths, 2)
    assert shards == shard_for_dp(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert shard_for_dp([3], 2) == [[0], []]


def test_micro_batches_respect_the_padded_token_budget_on_cpu():
    lengths = [50, 10, 40, 30, 20, 60, 5, 33]
    plan = plan_micro_batches(lengths, 100)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert len(mb) == 1 or max(lengths[i] for i in mb) * len(mb) <= 100
    # sorted by length: padding stays small compared with arrival order
    padded = sum(max(lengths[i] for i in mb) * len(mb) for mb in plan)
    assert padded <= 1.35 * sum(lengths)
    # a sequence over the budget still gets a micro-batch of its own
    assert plan_micro_batches([500, 3], 100) == [[0], [1]]


def test_build_micro_batch_indexes_response_positions_on_cpu():
    seqs = [[1, 2, 3, 4, 5], [7, 8, 9]]
    mb = build_micro_batch(seqs, [2, 3], [0, 1], pad_id=0, pad_multiple=4)
    assert mb.input_ids.shape == (2, 8)
    assert mb.resp_pos.tolist() == [1, 2, 3]  # positions predicting tokens 3, 4, 5 of row 0
    assert mb.resp_targets.tolist() == [3, 4, 5]
    assert mb.resp_offsets == [(0, 3), (3, 3)]


def test_validate_batch_errors_on_cpu():
    with pytest.raises(ValueError, match="prompt_lens"):
        validate_batch({"sequences": [[1, 2]], "prompt_lens": [0]})
    with pytest.raises(KeyError, match="prompt_lens"):
        validate_batch({"sequences": [[1, 2]]})


# ---------------------------------------------------------------- log-probs / entropy
def _naive(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_entropy_match_naive_with_grad_on_cpu(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)
    lp, ent = vocab_parallel_logprobs_entropy(hidden, weight, targets, vocab_start=0, temperature=0.6, chunk_size=chunk)
    ref_lp, ref_ent = _naive(hidden, weight, targets, 0.6)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    assert not ent.requires_grad
    (gh, gw) = torch.autograd.grad(lp.sum(), [hidden, weight])
    (rh, rw) = torch.autograd.grad(ref_lp.sum(), [hidden, weight])
    assert torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


# ---------------------------------------------------------------- checkpoints / merge
def _fake_ckpt(root, name, step, complete=True):
    d = root / name
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step}))
    if complete:
        (d / COMPLETE_MARKER).write_text("ok")
    return d


def test_latest_checkpoint_ignores_incomplete_on_cpu(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    _fake_ckpt(tmp_path, "step_2", 2)
    best = _fake_ckpt(tmp_path, "step_10", 10)
    _fake_ckpt(tmp_path, "step_12", 12, complete=False)
    _fake_ckpt(tmp_path, "step_14.tmp", 14)
    assert latest_checkpoint(str(tmp_path)) == str(best)


def test_merge_rank_outputs_orders_and_checks_on_cpu():
    a = {"indices": [2, 0], "log_probs": [torch.tensor([2.0]), torch.tensor([0.0])], "entropy": [torch.tensor([2.0]), torch.tensor([0.0])]}
    b = {"indices": [1], "log_probs": [torch.tensor([1.0])], "entropy": [torch.tensor([1.0])]}
    out = merge_rank_outputs([a, {}, b], 3)
    assert [float(x) for x in out.log_probs] == [0.0, 1.0, 2.0]
    assert [float(x) for x in out.entropy] == [0.0, 1.0, 2.0] and out.routed_experts is None  # no MoE replay
    lp, ent = out.padded(2)  # [B, T] for the experience maker, 0 past each response
    assert lp.tolist() == [[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]] and ent.shape == (3, 2)
    routed = [torch.full((2, 1, 1), i) for i in range(3)]
    with_routing = merge_rank_outputs([{**a, "routed_experts": [routed[2], routed[0]]}, {**b, "routed_experts": [routed[1]]}], 3)
    assert [int(r[0, 0, 0]) for r in with_routing.routed_experts] == [0, 1, 2]  # routing in batch order too
    with pytest.raises(ValueError, match="indices"):
        merge_rank_outputs([a], 3)


# ---------------------------------------------------------------- compatibility patches
def test_moe_router_gating_runs_without_transformer_engine_under_a_gpu_profile():
    """megatron-core 0.16.1 binds ``moe_utils.te_general_gemm`` only when transformer-engine imports, so every
    Qwen3-MoE forward on a GPU without TE raised NameError (the GPU kit's moe section on an H200, 2026-11-26).
    The worker applies the patch under every profile; a GPU profile gets only that one. Run in a fresh process:
    the patches are process-wide and another test may have applied them here already."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "from openrlhf_shape.megatron import cpu\n"
        "from openrlhf_shape.platform import gpu_platform\n"
        "assert not hasattr(moe_utils, 'te_general_gemm')\n"
        "assert cpu.apply_cpu_patches(gpu_platform()) is False\n"
        "assert torch.cuda.synchronize is not None and not cpu._APPLIED\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(5, 8, generator=g), torch.randn(4, 8, generator=g)\n"
        "out = moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
        "print(float((out - x @ w.T).abs().max()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-6


# ---------------------------------------------------------------- packed (THD) micro-batches
def test_packed_seq_params_describe_the_documents_on_cpu():
    from openrlhf_shape.megatron.attention import _documents, packed_seq_params

    p = packed_seq_params([0, 4, 7, 8], device=torch.device("cpu"))
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q.tolist() == [0, 4, 7, 8]
    assert p.cu_seqlens_kv is p.cu_seqlens_q and p.max_seqlen_q == p.max_seqlen_kv == 4  # RoPE's table length
    assert _documents(p) == [(0, 4), (4, 7), (7, 8)] and p.varlen_kernel == "torch"
    for bad in ([0], [1, 3], [0, 3, 3]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            packed_seq_params(bad, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="varlen kernel"):
        packed_seq_params([0, 2], device=torch.device("cpu"), kernel="ring")


def test_local_attentions_refuse_packs_they_would_get_wrong_on_cpu():
    from megatron.core.packed_seq_params import PackedSeqParams

    from openrlhf_shape.megatron.attention import _documents, packed_seq_params

    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    assert _documents(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="THD"):
        _documents(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    # padded bounds other than the documents' own (TE's THD padding: real lengths inside padded slots) would be
    # attended as the real ones: refused
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        _documents(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   cu_seqlens_q_padded=torch.tensor([0, 4, 8], dtype=torch.int32)))
    # context parallelism's layout (packed_seq_params: each document padded inside its slot, the padded bounds its
    # bounds): each CP rank holds 1/CP of every document
    params = packed_seq_params([0, 4, 12], device=torch.device("cpu"), context_parallel=2)
    assert params.cu_seqlens_q_padded is params.cu_seqlens_q
    assert _documents(params, 2) == [(0, 2), (2, 6)]
    with pytest.raises(ValueError, match="multiple of 4"):
        packed_seq_params([0, 4, 10], device=torch.device("cpu"), context_parallel=2)


def test_varlen_kernel_follows_the_platform_profile_on_cpu():
    import importlib.util

    from openrlhf_shape.megatron.attention import varlen_kernel

    assert varlen_kernel(cpu_platform()) == "torch"  # the CPU twin: torch SDPA per document
    has_flash = importlib.util.find_spec("flash_attn") is not None
    assert varlen_kernel(gpu_platform()) == ("flash_attn" if has_flash else "torch")
