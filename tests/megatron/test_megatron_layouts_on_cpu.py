"""Megatron actor on CPU/gloo: HF parity, layout-invariant training, resume, export, SDPA attention.

Each layout is one subprocess run (world 1 or 2) that checks several things at once; the
assertions here compare its results against Hugging Face and against the other layouts. The world-2 layouts
(TP2, PP2, DP2 with the distributed optimizer) run one after another in one launch (rank_sequence.py). The world-1
and world-2 launches are shared with the DeepSpeed cross-checks (tests/zero) through ``mg_helpers``.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mg_helpers import (SAVE_AT, TRAIN_CFG, TRAIN_STEPS, hf_logprobs_entropy, max_abs_diff, run_layout,
                        shared_world1, shared_world2, transformers_lrs)
from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from openrlhf_shape.batch import LogProbs
from openrlhf_shape.checkpoint_dir import latest_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARITY_TOL = 1e-4
ALL_LAYOUTS = ["tp2", "pp2", "tp2_sp"]  # tp2_sp runs inside the tp2 processes (SP is a config switch)


@pytest.fixture(scope="module")
def hf_refs(tiny_models, ragged_batch):
    return {arch: hf_logprobs_entropy(path, ragged_batch) for arch, path in tiny_models.items()}


@pytest.fixture(scope="module")
def world1(shared_results, tiny_models, ragged_batch):
    return shared_world1(shared_results, tiny_models, ragged_batch)


@pytest.fixture(scope="module")
def layouts(shared_results, tiny_models, ragged_batch):
    world2 = shared_world2(shared_results, tiny_models, ragged_batch)
    out = {"tp2": world2["tp2"], "pp2": world2["pp2"]}
    out["tp2_sp"] = [r["variants"]["sp"] for r in out["tp2"]]
    return out


@pytest.fixture(scope="module")
def dp2_distopt(shared_results, tiny_models, ragged_batch):
    """DP2 with the distributed optimizer: the world-2 launch's 5 updates (checkpoint after ``SAVE_AT``), and new
    processes resuming from that checkpoint (the shared checkpoint is only read)."""
    world2 = shared_world2(shared_results, tiny_models, ragged_batch)
    ckpt = os.path.join(world2["root"], "ckpt", f"step_{SAVE_AT}")
    resumed = run_layout(2, cfg={**TRAIN_CFG, "use_distributed_optimizer": True}, model_dirs={}, batch=ragged_batch,
                         train_dir=tiny_models["qwen3"], train_steps=TRAIN_STEPS, resume_from=ckpt,
                         single_sequence_check=True)
    return {"first": world2["dp2_distopt"], "resumed": resumed}


def _merged(results: list[dict], key: str, n: int, arch: str | None = None) -> LogProbs:
    outs = [r[key][arch] if arch else r[key] for r in results]
    return merge_rank_outputs(outs, n)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_world1_logprob_entropy_parity_with_hf_on_cpu(world1, hf_refs, ragged_batch, arch):
    n = len(ragged_batch["sequences"])
    got = _merged(world1["res"], "logprobs", n, arch)
    ref_lp, ref_ent = hf_refs[arch]
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
    assert got.log_probs[3].numel() == 0  # empty response stays empty, in batch order


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_parallel_logprob_entropy_parity_with_hf_on_cpu(layouts, hf_refs, ragged_batch, layout, arch):
    n = len(ragged_batch["sequences"])
    got = _merged(layouts[layout], "logprobs", n, arch)
    ref_lp, ref_ent = hf_refs[arch]
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
    # only the last PP stage / TP rank 0 returns results
    assert sum(bool(r["logprobs"][arch]) for r in layouts[layout]) == 1


REF_TOL = 1e-5  # the reference model's log-probs vs HF's on the initial weights (fp32)
REF_ARCH = {"world1": "llama", "tp2": "qwen3", "pp2": "qwen2"}  # llama: a tied head; each after 5 updates of qwen3


@pytest.mark.parametrize("layout", ["world1", "tp2", "pp2"])
def test_reference_model_equals_hf_on_the_initial_weights_on_cpu(world1, layouts, hf_refs, ragged_batch, layout):
    """``init_reference`` on ranks that just trained: the HF weights again (not the trained ones), in the actor's
    layout, forward only: log-probs equal HF's within 1e-5; it holds no gradient buffers or optimizer state (their
    offload moves 0 bytes), its parameters offload and come back exactly; ``train_step`` is refused."""
    runs = world1["res"] if layout == "world1" else layouts[layout]
    refs = [r["reference"] for r in runs]
    n = len(ragged_batch["sequences"])
    got = merge_rank_outputs([r["logprobs"] for r in refs], n)
    assert max_abs_diff(got.log_probs, hf_refs[REF_ARCH[layout]][0]) <= REF_TOL
    assert got.log_probs[3].numel() == 0
    trained = _merged(runs, "after_train", n)  # the same ranks' policy after its updates: far from HF(qwen3)
    if REF_ARCH[layout] == "qwen3":
        assert max_abs_diff(trained.log_probs, got.log_probs) > 100 * REF_TOL
    for r in refs:
        assert r["info"]["reference"] is True and r["info"]["tp"] * r["info"]["pp"] == len(runs)
        assert r["offload_grads_optimizer"]["offloaded_bytes"] == 0 and r["offload"]["offloaded_bytes"] > 0
        assert r["onload"]["onloaded_bytes"] == r["offload"]["offloaded_bytes"] and r["onload"]["offloaded"] == []
        assert "init_model(hf_dir, train=True)" in r["train_refused"]
    again = merge_rank_outputs([r["after_onload"] for r in refs], n)
    assert max_abs_diff(again.log_probs, got.log_probs) == 0.0


def test_wrong_qkv_layout_is_caught_by_parity_on_cpu(world1, hf_refs, ragged_batch):
    n = len(ragged_batch["sequences"])
    wrong = merge_rank_outputs([r["wrong_qkv"] for r in world1["res"]], n)
    assert max_abs_diff(wrong.log_probs, hf_refs["qwen3"][0]) > 100 * PARITY_TOL


def _losses(results: list[dict]) -> list[float]:
    return [m["loss"] for m in results[0]["metrics"]]


def test_training_trajectory_is_layout_invariant_on_cpu(world1, layouts, dp2_distopt):
    ref = world1["res"][0]["metrics"]
    assert len(ref) == TRAIN_STEPS and all(m["skipped"] == 0.0 for m in ref)
    ref_losses = [m["loss"] for m in ref]
    # the model moves: the same-data loss trajectory is not flat (the comparison can fail)
    assert max(ref_losses) - min(ref_losses) > 1e-3
    runs = {**layouts, "dp2_distopt": dp2_distopt["first"],
            "world1_recompute": [r["variants"]["recompute"] for r in world1["res"]]}
    for name, res in runs.items():
        for rank_res in res:  # metrics are identical on every rank
            got = rank_res["metrics"]
            assert [m["loss"] for m in got] == pytest.approx(ref_losses, abs=2e-5), name
            assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4), name
            assert [m["num_tokens"] for m in got] == [m["num_tokens"] for m in ref], name
            assert [m["lr"] for m in got] == pytest.approx([m["lr"] for m in ref], rel=1e-9), name
    # the LR each update ran with is transformers' schedule of that name, exactly (warm-up, then cosine to min_lr)
    lrs = [m["lr"] for m in ref]
    assert lrs == transformers_lrs(TRAIN_CFG, TRAIN_STEPS)
    assert lrs[0] == pytest.approx(TRAIN_CFG["lr"] / 2) and lrs[1] == pytest.approx(TRAIN_CFG["lr"])
    assert lrs[1] > lrs[2] > lrs[3] > lrs[4] >= TRAIN_CFG["min_lr"]


def test_metrics_are_sane_on_cpu(world1, ragged_batch):
    m = world1["res"][0]["metrics"][0]
    for key in ("loss", "pg_clipfrac_low", "pg_clipfrac_high", "approx_kl", "entropy", "grad_norm", "lr", "num_tokens", "skipped"):
        assert isinstance(m[key], float), key
    assert 0 < m["entropy"] <= torch.log(torch.tensor(1024.0)).item()
    assert 0 <= m["pg_clipfrac_low"] <= 1 and 0 <= m["pg_clipfrac_high"] <= 1
    assert m["grad_norm"] > 0


def test_nonfinite_loss_skips_the_update_on_cpu(world1, ragged_batch):
    res = world1["res"][0]
    assert res["nan_metrics"]["skipped"] == 1.0
    n = len(ragged_batch["sequences"])
    before = merge_rank_outputs([res["after_train"]], n).log_probs
    after = merge_rank_outputs([res["after_nan"]], n).log_probs
    assert max_abs_diff(before, after) == 0.0


def test_resume_equals_uninterrupted_world1_on_cpu(world1, tiny_models, ragged_batch, tmp_path):
    ckpt_root = tmp_path / "ckpt"  # a copy: the world-1 run is shared
    shutil.copytree(world1["root"] / "ckpt", ckpt_root)
    # a half-written checkpoint and a directory without the marker are ignored
    (ckpt_root / "step_9.tmp" / "dist").mkdir(parents=True)
    (ckpt_root / "step_8").mkdir()
    found = latest_checkpoint(str(ckpt_root))
    assert found is not None and os.path.basename(found) == f"step_{SAVE_AT}"
    resumed = run_layout(1, cfg=TRAIN_CFG, model_dirs={}, batch=ragged_batch, train_dir=tiny_models["qwen3"],
                         train_steps=TRAIN_STEPS, resume_from=found)
    assert resumed[0]["extra"] == {"step": SAVE_AT, "data_pos": 7}
    # the save left no process behind it (megatron-core's spawned multiprocessing Manager, 2-7 s a run, is not started)
    assert world1["res"][0]["children_after_save"] == []
    ref = [m["loss"] for m in world1["res"][0]["metrics"][SAVE_AT:]]
    got = [m["loss"] for m in resumed[0]["metrics"]]
    assert got == pytest.approx(ref, abs=1e-6)
    n = len(ragged_batch["sequences"])
    a = merge_rank_outputs([world1["res"][0]["after_train"]], n).log_probs
    b = merge_rank_outputs([resumed[0]["after_train"]], n).log_probs
    assert max_abs_diff(a, b) <= 1e-6


def test_resume_equals_uninterrupted_dp2_distributed_optimizer_on_cpu(dp2_distopt):
    first, resumed = dp2_distopt["first"], dp2_distopt["resumed"]
    assert [first[r]["children_after_save"] for r in range(2)] == [[], []]
    for r in range(2):
        ref = [m["loss"] for m in first[r]["metrics"][SAVE_AT:]]
        got = [m["loss"] for m in resumed[r]["metrics"]]
        assert got == pytest.approx(ref, abs=1e-6)
        assert [m["grad_norm"] for m in resumed[r]["metrics"]] == pytest.approx(
            [m["grad_norm"] for m in first[r]["metrics"][SAVE_AT:]], rel=1e-5)


def test_fewer_sequences_than_dp_ranks_on_cpu(dp2_distopt, ragged_batch):
    resumed = dp2_distopt["resumed"]
    merged = merge_rank_outputs([r["single_logprobs"] for r in resumed], 1)
    assert merged.log_probs[0].numel() == len(ragged_batch["sequences"][0]) - ragged_batch["prompt_lens"][0]
    assert sum(bool(r["single_logprobs"]) for r in resumed) == 1
    for r in resumed:
        m = r["single_metrics"]
        assert m["skipped"] == 0.0 and 0 < m["num_tokens"] <= merged.log_probs[0].numel()
    assert resumed[0]["single_metrics"] == resumed[1]["single_metrics"]


def test_export_loads_in_transformers_with_same_logprobs_on_cpu(world1, ragged_batch):
    export_dir = world1["root"] / "hf"
    assert not (world1["root"] / "hf.tmp").exists()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        assert (export_dir / name).is_file(), name
    n = len(ragged_batch["sequences"])
    trained = merge_rank_outputs([world1["res"][0]["after_train"]], n)
    ref_lp, ref_ent = hf_logprobs_entropy(str(export_dir), ragged_batch)
    assert max_abs_diff(trained.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(trained.entropy, ref_ent) <= PARITY_TOL
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export_dir))
    assert tok.convert_tokens_to_ids("</think>") != tok.unk_token_id


def test_iter_hf_weights_buckets_match_export_on_cpu(world1):
    from safetensors import safe_open

    buckets = world1["res"][0]["buckets"]
    export_dir = world1["root"] / "hf"
    saved = {}
    for f in export_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                saved[k] = fh.get_tensor(k)
    names = [n for b in buckets for n, *_ in b]
    assert sorted(names) == sorted(saved) and len(names) == len(set(names))
    assert len(buckets) > 1
    for b in buckets:
        size = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for _, shape, dt, _ in b)
        assert size <= 200_000 or len(b) == 1
        for name, shape, _, total in b:
            assert tuple(saved[name].shape) == tuple(shape)
            assert total == pytest.approx(float(saved[name].double().sum()), rel=1e-9, abs=1e-9)


@pytest.mark.vllm
def test_export_loads_in_vllm_with_same_logprobs_on_cpu(world1, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    export_dir = str(world1["root"] / "hf")
    prompt = [11, 12, 13, 14, 15]
    llm = LLM(model=export_dir, enforce_eager=True, block_size=32, dtype="float32", max_model_len=256, seed=0)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1))[0].outputs[0]
    finally:
        del llm
        gc.collect()
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + list(out.token_ids)])).logits[0].float(), -1)
    for j, tok in enumerate(out.token_ids):
        assert out.logprobs[j][tok].logprob == pytest.approx(logp[len(prompt) - 1 + j, tok].item(), abs=1e-4)


# ---- SDPA core attention (``local_attention='sdpa'``) against Megatron's DotProductAttention and Hugging Face:
# same log-probs, entropies and training steps. SDPA is what lets 8k/16k-token micro-batches fit without
# transformer-engine (Megatron's local attention keeps [batch*heads, s, s] scores); on GPU the GPU kit
# (scripts/gpu_check.sh) measures the memory. Here the arithmetic is checked: same model, same batch, both
# attentions, as variants of the world-1 and TP2 launches.


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_sdpa_matches_megatron_attention_and_hf_on_cpu(world1, hf_refs, ragged_batch, arch):
    n = len(ragged_batch["sequences"])
    res = world1["res"][0]
    base = merge_rank_outputs([res["logprobs"][arch]], n)
    sdpa = merge_rank_outputs([res["variants"]["sdpa"]["logprobs"][arch]], n)
    ref_lp, ref_ent = hf_refs[arch]
    assert max_abs_diff(sdpa.log_probs, base.log_probs) <= 1e-5
    assert max_abs_diff(sdpa.entropy, base.entropy) <= 1e-5
    assert max_abs_diff(sdpa.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(sdpa.entropy, ref_ent) <= PARITY_TOL


def test_sdpa_training_steps_match_megatron_attention_on_cpu(world1, layouts):
    res = world1["res"][0]
    ref = [m["loss"] for m in res["metrics"]]
    assert max(ref) - min(ref) > 1e-3  # the model moves, so equal trajectories mean something
    runs = [("world1_sdpa", res["variants"]["sdpa"]["metrics"])]
    for variant in ("sdpa", "sdpa_sp"):
        runs += [(f"tp2_{variant}_rank{r}", rr["variants"][variant]["metrics"]) for r, rr in enumerate(layouts["tp2"])]
    for name, metrics in runs:
        assert [m["loss"] for m in metrics] == pytest.approx(ref, abs=2e-5), name
        assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in res["metrics"]], rel=1e-4), name


@pytest.mark.parametrize("variant", ["sdpa", "sdpa_sp"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_sdpa_tp2_parity_with_hf_on_cpu(layouts, hf_refs, ragged_batch, variant, arch):
    n = len(ragged_batch["sequences"])
    got = merge_rank_outputs([r["variants"][variant]["logprobs"][arch] for r in layouts["tp2"]], n)
    ref_lp, ref_ent = hf_refs[arch]
    assert max_abs_diff(got.log_probs, ref_lp) <= PARITY_TOL
    assert max_abs_diff(got.entropy, ref_ent) <= PARITY_TOL
