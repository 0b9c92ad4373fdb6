"""Qwen3-MoE on the Megatron backend, CPU/gloo (issue 25, first part): a tiny model (8 experts, 2 routed per
token, every layer sparse) built from a config; log-probs and entropy equal Hugging Face's at world 1 and TP2
(experts as Megatron's SequentialMLP under the local spec, the all-gather token dispatcher); a few training
steps move the model and the HF export of the trained experts reloads into Hugging Face with the trainer's
log-probs. Expert parallelism (EP2) is not covered yet: the all-gather dispatcher needs equal token counts
on every EP rank and the all-to-all dispatcher creates CUDA streams (docs/moe.md)."""

from __future__ import annotations

import pytest

from mg_helpers import hf_logprobs_entropy, max_abs_diff, run_layout
from openrlhf_shape.cluster.rank_group import merge_rank_outputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARITY_TOL = 1e-4
CFG = dict(lr=2e-3, min_lr=2e-4, lr_warmup_steps=1, lr_decay_style="cosine", total_steps=3,
           micro_batch_max_tokens=96, clip_grad=1.0, entropy_chunk_size=16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from openrlhf_shape.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", seed=3, num_layers=2))


def test_qwen3_moe_parity_training_and_export_on_cpu(moe_dir, ragged_batch, tmp_path):
    n = len(ragged_batch["sequences"])
    ref_lp, ref_ent = hf_logprobs_entropy(moe_dir, ragged_batch)
    w1 = run_layout(1, cfg=CFG, model_dirs={"moe": moe_dir}, batch=ragged_batch, train_dir=moe_dir, train_steps=3,
                    export_dir=str(tmp_path / "hf"))
    got = merge_rank_outputs([r["logprobs"]["moe"] for r in w1], n)
    assert max_abs_diff(got["log_probs"], ref_lp) <= PARITY_TOL
    assert max_abs_diff(got["entropy"], ref_ent) <= PARITY_TOL
    assert w1[0]["info"]["model_type"] == "qwen3_moe"
    metrics = w1[0]["metrics"]
    assert len(metrics) == 3 and all(m["skipped"] == 0.0 and m["grad_norm"] > 0 for m in metrics)
    trained = merge_rank_outputs([r["after_train"] for r in w1], n)
    assert max_abs_diff(trained["log_probs"], got["log_probs"]) > 1e-3  # the steps moved the experts and router
    exported_lp, _ = hf_logprobs_entropy(str(tmp_path / "hf"), ragged_batch)
    assert max_abs_diff(trained["log_probs"], exported_lp) <= PARITY_TOL  # every expert came back out under its HF name

    tp2 = run_layout(2, cfg={**CFG, "tensor_model_parallel_size": 2}, model_dirs={"moe": moe_dir}, batch=ragged_batch)
    got2 = merge_rank_outputs([r["logprobs"]["moe"] for r in tp2], n)
    assert max_abs_diff(got2["log_probs"], ref_lp) <= PARITY_TOL
    assert max_abs_diff(got2["entropy"], ref_ent) <= PARITY_TOL


def test_what_does_not_run_yet_is_refused_with_the_reason(moe_dir):
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.planner.model import ModelShape
    from openrlhf_shape.platform import cpu_platform, gpu_platform

    with pytest.raises(ValueError, match="expert_model_parallel_size=2 does not run on CPU yet"):
        MegatronConfig(expert_model_parallel_size=2).check_device(cpu_platform())
    MegatronConfig(expert_model_parallel_size=2, layer_spec="local").check_device(gpu_platform())  # GPU: allowed
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        ModelShape.from_file(f"{moe_dir}/config.json")  # the planner sizes dense models only, says so


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
