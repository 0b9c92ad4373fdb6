"""``openrlhf-shape train --dry_run`` on every preset and on layouts that cannot fit; the generated
sizing doc; the planner's parameter counts against the real Hugging Face models (meta device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.planner.memory import megatron_update_peak_bytes
from openrlhf_shape.planner.model import MODELS_DIR, ModelShape, resolve_model_config
from support.modules import load_file

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def _dry_run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["train", *argv, "--dry_run"])
    except SystemExit as exc:  # config errors
        rc = exc.code if isinstance(exc.code, int) else 1
        return rc, capsys.readouterr().out + str(exc.code)
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_fits_and_prints_map_and_plan(capsys, preset):
    rc, out = _dry_run(capsys, "--config", f"configs/{preset}")
    assert rc == 0, out
    assert "FITS: smallest margin" in out
    assert "memory per GPU by phase" in out and "weights:" in out and "optimizer:" in out
    margin = float(out.split("FITS: smallest margin ")[1].split(" GiB")[0])
    assert margin >= 2.0  # --plan.min_free_gib default
    if not preset.startswith("cpu-"):  # the CPU presets have no GPU map
        # the map: every rank with its coordinates and its engine worker (on the rank's GPU when colocated), node by node
        coords = "tp 0, cp 0, pp 0, dp 0" if " x CP " in out else "tp 0, pp 0, dp 0"  # CP > 1: the CP coordinate too
        assert "node 0:" in out and f"rank   0 ({coords})" in out and "engine 0 worker 0" in out
        colocated = "colocated):" in out
        assert colocated == (f"rank   0 ({coords}) + engine 0 worker 0" in out)
        for phase in ("[rollout]", "[log-probs]", "[update]") if colocated else ("[rollout (engine GPU)]", "[log-probs]", "[update]"):
            assert phase in out
        assert "KV cache:" in out and "step time estimate:" in out and "rollout decode" in out
        assert "mfu=0.35" in out  # assumptions are printed


def test_model_states_that_cannot_fit_are_refused_with_numbers_and_flags(capsys):
    # Qwen3-32B without model parallelism: 65 GB of bf16 weights per GPU before grads and Adam.
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--megatron.tensor_model_parallel_size", "1",
                       "--megatron.pipeline_model_parallel_size", "1", "--megatron.sequence_parallel", "false")
    assert rc == 2, out
    assert "REFUSED:" in out
    refusal = out.split("REFUSED:")[1]
    assert "update phase, node 0 GPU 0 (rank 0: tp 0, pp 0, dp 0): needs" in refusal
    assert "GiB of 79.6 GiB" in refusal and "weights 61.0" in refusal
    assert "--megatron.tensor_model_parallel_size" in refusal and "--megatron.pipeline_model_parallel_size" in refusal


def test_vllm_utilisation_leaving_no_room_is_refused_with_the_value_to_use(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--vllm.gpu_memory_utilization", "0.9")
    assert rc == 2
    refusal = out.split("REFUSED:")[1]
    assert "rollout phase" in refusal and "log-probs phase" in refusal
    suggested = refusal.split("lower --vllm.gpu_memory_utilization to at most ")[1].split()[0]
    assert 0.5 < float(suggested) < 0.9
    # the suggested value is one that fits
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--vllm.gpu_memory_utilization", suggested)
    assert rc == 0, out


def test_too_few_gpus_and_bad_divisibility_are_refused(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-32b.yaml", "--plan.num_nodes", "2")
    assert rc == 2 and "placement: the layout needs 4 nodes" in out and "--plan.num_nodes = 2" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml", "--megatron.tensor_model_parallel_size", "3",
                       "--actor.num_gpus_per_node", "12", "--train.batch_size", "256")
    assert rc == 2 and "--megatron.tensor_model_parallel_size=3 must divide num_attention_heads=32" in out
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-4b.yaml", "--vllm.gpu_memory_utilization", "0.05")
    assert rc == 2 and "leaves no KV cache" in out and "--vllm.tensor_parallel_size" in out


def test_plan_flags_are_validated_and_change_the_plan(capsys):
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml", "--plan.mfu", "0.7")
    fast = float(out.split("step time estimate: ")[1].split(" s")[0])
    rc2, out2 = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml")
    slow = float(out2.split("step time estimate: ")[1].split(" s")[0])
    assert rc == rc2 == 0 and fast < slow
    rc, out = _dry_run(capsys, "--config", "configs/qwen3-8b.yaml", "--plan.mfux", "0.7")
    assert rc != 0 and "unknown option --plan.mfux" in out


def test_console_script_exit_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "train", "--config", "configs/qwen3-14b.yaml",
                         "--dry_run"], cwd=REPO, env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and "FITS" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "openrlhf_shape.cli.main", "train", "--config", "configs/qwen3-14b.yaml",
                          "--dry_run", "--megatron.pipeline_model_parallel_size", "1", "--actor.num_gpus_per_node", "16",
                          "--megatron.tensor_model_parallel_size", "1", "--megatron.sequence_parallel", "false"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "REFUSED" in bad.stdout


def test_sizing_doc_is_generated_from_the_planner():
    script = load_file(REPO / "scripts" / "cluster_sizing.py")
    committed = (REPO / "docs" / "cluster_sizing.md").read_text()
    assert committed == script.generate(), "regenerate: python scripts/cluster_sizing.py > docs/cluster_sizing.md"


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-32B", "DeepSeek-R1-Distill-Qwen-1.5B", "SmolLM2-135M-Instruct"])
def test_parameter_count_equals_the_hf_model(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = MODELS_DIR / f"{name}.json"
    hf_cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    assert ModelShape.from_file(path).total_params() == sum(p.numel() for p in model.parameters())


def test_model_config_rule(tmp_path):
    assert resolve_model_config("/models/Qwen3-32B").name == "Qwen3-32B.json"
    assert resolve_model_config("demo").name == "SmolLM2-135M-Instruct.json"
    (tmp_path / "config.json").write_text(json.dumps(json.loads((MODELS_DIR / "Qwen3-4B.json").read_text())))
    assert resolve_model_config(str(tmp_path)) == tmp_path / "config.json"
    assert resolve_model_config("/models/Qwen3-32B", str(tmp_path)) == tmp_path / "config.json"
    with pytest.raises(FileNotFoundError, match="--plan.model_config"):
        resolve_model_config("/models/NoSuchModel")


def test_update_peak_function_for_the_gpu_kit():
    cfg = json.loads((MODELS_DIR / "Qwen3-1.7B.json").read_text())
    a = megatron_update_peak_bytes(cfg, micro_batch_tokens=8192, recompute="full", dtype="bf16", distributed_optimizer=False)
    b = megatron_update_peak_bytes(cfg, micro_batch_tokens=16384, recompute="full", dtype="bf16", distributed_optimizer=False)
    n = ModelShape.from_dict(cfg).total_params()
    assert a["weights"] == 2 * n and a["grads"] == 4 * n and a["optimizer"] == 12 * n
    assert b["total"] > a["total"] > 18 * n
    lp = megatron_update_peak_bytes(cfg, micro_batch_tokens=8192, forward_only=True)
    assert lp["total"] < a["total"] and "activations (forward only)" in lp


@pytest.mark.parametrize("preset", PRESETS)
def test_the_margin_stated_in_each_preset_is_the_planners(preset):
    from openrlhf_shape.config import load_config
    from openrlhf_shape.planner.assumptions import PlanOptions
    from openrlhf_shape.planner.memory import GiB
    from openrlhf_shape.planner.plan import build_plan

    path = REPO / "configs" / preset
    sizing = next(line for line in path.read_text().splitlines() if line.startswith("# Sizing (`openrlhf-shape train"))
    stated = float(sizing.split(" GiB free")[0].split()[-1])
    plan = build_plan(load_config(str(path), [], check_paths=False), PlanOptions(), f"configs/{preset}")
    assert stated == round(plan.min_free[1] / GiB, 1), f"{preset}: run python scripts/cluster_sizing.py --update-presets"


def test_adam_state_switch_models_a_rank_before_its_first_step():
    cfg = json.loads((MODELS_DIR / "Qwen3-4B.json").read_text())
    n = ModelShape.from_dict(cfg).total_params()
    before = megatron_update_peak_bytes(cfg, micro_batch_tokens=8192, forward_only=True, adam_state=False,
                                        distributed_optimizer=False)
    after = megatron_update_peak_bytes(cfg, micro_batch_tokens=8192, forward_only=True, distributed_optimizer=False)
    assert before["optimizer"] == 4 * n and after["optimizer"] == 12 * n  # bf16: the fp32 master copy exists from the start
    assert after["total"] - before["total"] == 8 * n


def test_forward_only_model_and_attention_choices():
    cfg = json.loads((MODELS_DIR / "Qwen3-8B.json").read_text())
    n = ModelShape.from_dict(cfg).total_params()
    fwd = megatron_update_peak_bytes(cfg, micro_batch_tokens=16384, forward_only=True, train_state=False)
    assert fwd["weights"] == 2 * n and "grads" not in fwd and "optimizer" not in fwd
    kw = dict(micro_batch_tokens=8192, recompute="none", dtype="bf16", spec="local", seq_len=8192)
    unfused = megatron_update_peak_bytes(cfg, **kw, attention="megatron")
    sdpa = megatron_update_peak_bytes(cfg, **kw, attention="sdpa")
    # the unfused path keeps [heads, seq] probabilities per token: 32 x 8192 x 2 B x 36 layers more than SDPA at least
    assert unfused["activations (stored)"] - sdpa["activations (stored)"] > 32 * 8192 * 8192 * 2 * 36
    with pytest.raises(ValueError, match="attention must be one of"):
        megatron_update_peak_bytes(cfg, **kw, attention="xformers")


def test_offloading_megatron_states_makes_room_for_vllm(capsys):
    flags = ["--config", "configs/qwen3-32b.yaml", "--vllm.gpu_memory_utilization", "0.8"]
    rc, out = _dry_run(capsys, *flags)
    assert rc == 2 and "rollout phase" in out.split("REFUSED:")[1]
    rc, out = _dry_run(capsys, *flags, "--plan.megatron_offload", "all")
    assert rc == 0, out
    assert "optimizer (offloaded to host)" in out and "Megatron states offloaded" in out
