"""The GPU verification kit's CPU smoke: ``bash scripts/gpu_check.sh OUT --smoke`` runs every section
(parity with a negative control, PPO steps with the distributed optimizer + resume in a new process,
bucketed HF export, a tiny throughput case, the Qwen3-MoE case) on CPU/gloo, so the kit cannot rot between GPU runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _numbers(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of the kit for the module. Two sections at a time (``--jobs 2``; each still in its own rank
    processes, which run one thread each in smoke mode, forked as the suite's other ranks: ``--preload_ranks``).
    DeepSpeed's JIT ops build into a fresh TORCH_EXTENSIONS_DIR, so a test can see that none was compiled. Ray, vLLM
    and transformer-engine cannot be imported in it (``gpu_machine_standin/``), as on the lent GPU machine."""
    out = tmp_path_factory.mktemp("gpu_kit_smoke")
    extensions = tmp_path_factory.mktemp("torch_extensions")
    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_machine_standin")
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_EXTENSIONS_DIR": str(extensions),
           "PYTHONPATH": os.pathsep.join(p for p in (standin, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), str(out), "--smoke", "--timeout", "420",
                           "--jobs", "2", "--preload_ranks"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=2400)
    path = out / "gpu_kit.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"proc": proc, "res": json.loads(path.read_text()), "md": (out / "gpu_kit.md").read_text(),
            "extensions": extensions}


def test_every_section_passes(smoke):
    res = smoke["res"]
    assert res["mode"] == "smoke"
    assert set(res["sections"]) == {"parity", "train_resume", "export", "throughput", "offload", "cuda_ipc", "zero2",
                                    "te_spec", "moe"}
    failed = {k: v.get("error", "") for k, v in res["sections"].items() if not v.get("passed") and "skip_reason" not in v}
    assert not failed, failed
    # what cannot run on CPU says so (and only that): CUDA IPC needs CUDA, TE its wheel
    assert "needs a GPU" in res["sections"]["cuda_ipc"]["skip_reason"]
    assert set(k for k, v in res["sections"].items() if "skip_reason" in v) <= {"cuda_ipc", "te_spec"}
    assert smoke["proc"].returncode == 0, smoke["proc"].stdout[-2000:]
    # reported in the kit's order, whichever section finished first
    assert list(res["sections"]) == ["parity", "train_resume", "export", "throughput", "offload", "cuda_ipc", "zero2",
                                     "te_spec", "moe"]
    # the ZeRO-2 section compiles no DeepSpeed op (its shared-memory all-reduce serves inference only)
    assert not [p.name for p in smoke["extensions"].rglob("*.so")], sorted(smoke["extensions"].rglob("*"))


def test_numbers_are_finite_and_meaningful(smoke):
    sec = smoke["res"]["sections"]
    for name in ("parity", "train_resume", "export"):
        assert all(math.isfinite(x) for x in _numbers(sec[name])), name
    for att in ("megatron", "sdpa"):
        assert sec["parity"]["attention"][att]["log_probs"]["megatron_vs_hf_fp32"]["max"] <= 1e-4
    # the negative control lands far outside the tolerance, so the parity check can fail
    assert sec["parity"]["negative_control_wrong_qkv"]["caught"]
    # colocation: states really offloaded, host buffers reused, nothing changed by the round trips
    off = sec["offload"]
    assert off["offloaded_bytes"] > 0 and off["host_bytes_first_round"] == off["host_bytes_second_round"] > 0
    assert off["logprobs_max_abs_change"] == 0.0
    z = sec["zero2"]  # one ZeRO-2 step against one Megatron step from the same weights (fp32 on CPU)
    assert abs(z["loss"]["megatron"] - z["loss"]["deepspeed"]) <= 1e-4 and z["logprobs_after_step"]["mean_abs"] <= 1e-4
    assert sec["parity"]["negative_control_wrong_qkv"]["log_probs_vs_hf_fp32"]["max"] > 1e-2
    tr = sec["train_resume"]
    assert len(tr["losses"]) == 2 and tr["losses"][1] < tr["losses"][0]
    assert tr["resumed_losses"] == pytest.approx(tr["uninterrupted_losses"], abs=1e-6)
    ex = sec["export"]
    assert ex["export_max_abs_diff_vs_buckets"] == 0.0 and ex["num_buckets"] > 1
    cases = sec["throughput"]["cases"]
    assert {c["case"]["mode"] for c in cases} == {"update", "logprob"}
    for c in cases:
        assert c["tokens_per_second"] > 0 and math.isfinite(c["mfu"])
        pi = c["planner_inputs"]
        for key in ("model_config", "tp", "pp", "dp", "micro_batch_tokens", "recompute", "sequence_parallel",
                    "dtype", "optimizer", "logprob_chunk_size", "measured_peak_bytes"):
            assert key in pi, key
    assert "| throughput | yes |" in smoke["md"]


def test_moe_section(smoke):
    """Qwen3-MoE (8 experts, 2 routed) at world 1: Megatron's log-probs and entropy equal HF's in float32, the
    experts swapped pairwise land far outside the tolerance, and both throughput modes run with the planner's
    MoE estimate next to them."""
    moe = smoke["res"]["sections"]["moe"]
    assert moe["passed"], moe.get("error")
    assert moe["parity"]["log_probs"]["megatron_vs_hf_fp32"]["max"] <= 1e-4
    assert moe["parity"]["entropy"]["megatron_vs_hf_fp32"]["max"] <= 1e-4
    neg = moe["negative_control_swapped_experts"]
    assert neg["caught"] and neg["swapped_tensors"] > 0 and neg["log_probs_vs_hf_fp32"]["max"] > 1e-2
    cases = moe["throughput"]["cases"]
    assert {c["case"]["mode"] for c in cases} == {"update", "logprob"}
    assert all(c["tokens_per_second"] > 0 and math.isfinite(c["mfu"]) for c in cases)
    # the planner's parameter count of this shape is the Megatron model's (router whole, experts, embeddings)
    from openrlhf_shape.planner.model import MODELS_DIR, ModelShape

    cfg = json.loads((MODELS_DIR / f"{moe['model']['config']}.json").read_text())
    cfg.update(moe["model"]["overrides"])
    assert moe["num_parameters"] == ModelShape.from_dict(cfg).total_params()
    preds = moe["throughput"]["planner"]["predictions"]
    assert preds and all(p.get("predicted_peak_bytes", 0) > 0 for p in preds), preds
    assert "| moe | yes |" in smoke["md"]
