"""Rank-side sections of the GPU verification kit (run by ``gpu_kit.py`` through ``launch.run_ranks``).

Each function runs in a fresh process at world 1 (GPU: NCCL, bf16; ``--smoke``: CPU, gloo,
float32), drives the real :class:`MegatronRankWorker` and returns plain numbers/tensors. The
driver (``gpu_kit.py``) turns them into pass/fail verdicts, the JSON and the markdown table.
"""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

import torch

import kit_models
from openrlhf_shape.platform import detect_platform
from openrlhf_shape.batch import TrainBatch
from openrlhf_shape.testing.rank_configs import megatron_config
from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
from openrlhf_shape.batch import LogProbs
from openrlhf_shape.megatron.worker import MegatronRankWorker
from openrlhf_shape.testing.negative_controls import flat_qkv_conversion


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _worker(cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int) -> MegatronRankWorker:
    return MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size,
                              master_addr=master_addr, master_port=master_port, platform=detect_platform())


def ragged_batch(n: int, min_len: int, max_len: int, vocab: int, *, seed: int, temperature: float) -> dict:
    """``n`` random sequences (token ids 10..vocab-1), lengths in [min_len, max_len], prompts 1/8..1/2."""
    rng = random.Random(seed)
    seqs, plens = [], []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        seqs.append([rng.randint(10, vocab - 1) for _ in range(length)])
        plens.append(rng.randint(max(1, length // 8), max(1, length // 2)))
    return {"sequences": seqs, "prompt_lens": plens, "temperature": temperature}


def hf_logprobs_entropy(model_dir: str, batch: dict, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """HF forward in ``dtype`` on this process's device; float32 log-softmax of logits / T."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if _cuda() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    lps, ents = [], []
    with torch.no_grad():
        for seq, p in zip(batch["sequences"], batch["prompt_lens"]):
            logits = model(torch.tensor([seq], device=device)).logits[0, p - 1 : len(seq) - 1].float()
            logp = torch.log_softmax(logits / batch["temperature"], dim=-1)
            target = torch.tensor(seq[p:], dtype=torch.long, device=device)
            lps.append(logp.gather(-1, target[:, None])[:, 0].cpu())
            ents.append(-(logp.exp() * logp).sum(-1).cpu())
            del logits, logp
    del model
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()
    return lps, ents


def _megatron_logprobs(worker: MegatronRankWorker, batch: dict) -> LogProbs:
    return merge_rank_outputs([worker.compute_logprobs_and_entropy(batch)], len(batch["sequences"]))


def _hf_refs(model_dir: str, batch: dict) -> dict:
    refs = {"float32": hf_logprobs_entropy(model_dir, batch, torch.float32)}
    if _cuda():
        refs["bfloat16"] = hf_logprobs_entropy(model_dir, batch, torch.bfloat16)
    return {k: LogProbs(log_probs=v[0], entropy=v[1]) for k, v in refs.items()}


# ---------------------------------------------------------------------------------------- parity
def parity(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: dict,
           batch: dict, workdir: str, attentions: list[str]) -> dict:
    """Megatron log-probs + entropy (one run per local attention) vs HF (float32 and, on GPU, bf16)."""
    import dataclasses

    t0 = time.time()
    model_dir = _make_model(model, os.path.join(workdir, "parity_model"))
    worker = _worker(cfg, rank, world_size, master_addr, master_port)
    mg = {}
    for attention in attentions:
        worker.cfg = dataclasses.replace(worker.cfg, local_attention=attention)
        info = worker.init_model(model_dir, train=False)
        mg[attention] = _megatron_logprobs(worker, batch)
        if attention == attentions[-1]:
            negative = _wrong_qkv_logprobs(worker, model_dir, batch)
        worker.state.model = worker.state.bridge = worker.state.tconfig = None
        gc.collect()
    worker.shutdown()
    del worker
    gc.collect()
    refs = _hf_refs(model_dir, batch)
    return {"info": info, "megatron": mg, "negative_control": negative, "hf": refs, "seconds": time.time() - t0}


def moe_parity(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: dict,
               batch: dict, workdir: str) -> dict:
    """A random-weight qwen3_moe (configs/models name + overrides): Megatron log-probs + entropy vs HF, and a
    negative control with the experts of every sparse layer swapped pairwise (0 <-> 1, 2 <-> 3, ...)."""
    t0 = time.time()
    model_dir = _make_model(model, os.path.join(workdir, "moe_model"))
    worker = _worker(cfg, rank, world_size, master_addr, master_port)
    info = worker.init_model(model_dir, train=False)
    mg = _megatron_logprobs(worker, batch)
    swapped = swap_experts_pairwise(worker.state.gpt)
    negative = _megatron_logprobs(worker, batch)
    worker.shutdown()
    del worker
    gc.collect()
    refs = _hf_refs(model_dir, batch)
    return {"info": info, "megatron": mg, "negative_control": negative, "swapped_tensors": swapped, "hf": refs,
            "seconds": time.time() - t0}


def swap_experts_pairwise(gpt: torch.nn.Module) -> int:
    """Exchange the weights of experts 2j and 2j+1 in every sparse layer, in place; returns how many tensors
    moved. Names: ``...experts.local_experts.E.linear_fcN.weight`` (SequentialMLP, the local spec) or
    ``...experts.linear_fcN.weightE`` (grouped GEMM). A mapping bug of that kind must land outside the tolerance."""
    import re

    params = dict(gpt.named_parameters())
    pat = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$|^(.*\.experts\.linear_fc\d\.weight)(\d+)$")
    moved = 0
    with torch.no_grad():
        for name, p in params.items():
            m = pat.match(name)
            if not m:
                continue
            idx = int(m.group(2) if m.group(2) is not None else m.group(5))
            if idx % 2:
                continue
            other = (f"{m.group(1)}{idx + 1}{m.group(3)}" if m.group(2) is not None else f"{m.group(4)}{idx + 1}")
            if other in params:
                tmp = p.detach().clone()
                p.copy_(params[other])
                params[other].copy_(tmp)
                moved += 2
    if not moved:
        raise AssertionError("no expert weights found to swap (is this a MoE model?)")
    return moved


def _wrong_qkv_logprobs(worker: MegatronRankWorker, model_dir: str, batch: dict) -> LogProbs:
    """Negative control: q/k/v loaded flat-concatenated (no per-KV-group interleave), same batch.

    Shows the parity tolerance is not vacuous: a real conversion bug must land far outside it.
    """
    with flat_qkv_conversion(worker.state.bridge):
        worker.state.bridge.load_weights([worker.state.gpt], model_dir)
    return _megatron_logprobs(worker, batch)


def _make_model(model: dict, out_dir: str) -> str:
    """``model``: {"config": configs/models name, "overrides": {...}, "seed": int} -> random HF dir."""
    device = "cuda" if _cuda() else "cpu"
    dtype = "bfloat16" if _cuda() else "float32"
    return kit_models.random_hf_model_dir(model["config"], out_dir, seed=model.get("seed", 0), dtype=dtype,
                                          device=device, **model.get("overrides", {}))


# ------------------------------------------------------------------------------ train and resume
def _train_batch(batch: dict, old_log_probs: list[torch.Tensor], seed: int) -> TrainBatch:
    """Fixed PPO batch: on-policy old log-probs, one advantage (+1 / -1) per sequence (GRPO-like)."""
    g = torch.Generator().manual_seed(seed)
    adv, mask = [], []
    for k, lp in enumerate(old_log_probs):
        sign = 1.0 if k % 2 == 0 else -1.0
        adv.append(torch.full_like(lp, sign))
        mask.append(torch.rand(lp.numel(), generator=g) > 0.1)
    return TrainBatch.from_ragged(batch["sequences"], batch["prompt_lens"], [x.float() for x in old_log_probs], adv,
                                  mask, temperature=batch["temperature"])


def train_first(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: dict,
                batch: dict, steps: int, save_at: int, workdir: str) -> dict:
    """Uninterrupted run: ``steps`` PPO/DAPO steps on a fixed batch, checkpoint after ``save_at``."""
    t0 = time.time()
    model_dir = _make_model(model, os.path.join(workdir, "train_model"))
    worker = _worker(cfg, rank, world_size, master_addr, master_port)
    info = worker.init_model(model_dir)
    old = _megatron_logprobs(worker, batch).log_probs
    tb = _train_batch(batch, old, seed=7)
    metrics, step_s = [], []
    ckpt = os.path.join(workdir, "ckpt", f"step_{save_at}")
    for step in range(steps):
        _sync()
        ts = time.time()
        metrics.append(worker.train_step(tb))
        _sync()
        step_s.append(time.time() - ts)
        if step + 1 == save_at:
            ts = time.time()
            worker.save_checkpoint(ckpt, extra={"step": save_at})
            save_s = time.time() - ts
    final = _megatron_logprobs(worker, batch)
    worker.shutdown()
    return {"info": info, "model_dir": model_dir, "train_batch": tb, "metrics": metrics, "step_seconds": step_s,
            "ckpt": ckpt, "save_seconds": save_s, "final": final, "seconds": time.time() - t0}


def train_resumed(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model_dir: str,
                  ckpt: str, train_batch: dict, steps: int, batch: dict, workdir: str, bucket_bytes: int) -> dict:
    """New process: load the checkpoint, run the remaining steps, then the bucketed HF export check."""
    t0 = time.time()
    worker = _worker(cfg, rank, world_size, master_addr, master_port)
    worker.init_model(model_dir)
    ts = time.time()
    extra = worker.load_checkpoint(ckpt)
    load_s = time.time() - ts
    metrics = [worker.train_step(train_batch) for _ in range(int(extra["step"]), steps)]
    final = _megatron_logprobs(worker, batch)
    out: dict[str, Any] = {"extra": extra, "load_seconds": load_s, "metrics": metrics, "final": final}
    # --- export: buckets straight from the (GPU) model, then the HF directory writer
    ts = time.time()
    buckets = []
    for bucket in worker.iter_hf_weights(bucket_bytes):
        buckets.append([(name, t) for name, t in bucket])
    out["bucket_seconds"] = time.time() - ts
    out["bucket_bytes"] = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    out["bucket_counts"] = [len(b) for b in buckets]
    out["bucket_max_tensor_bytes"] = [max(t.numel() * t.element_size() for _, t in b) for b in buckets]
    export_dir = os.path.join(workdir, "export_hf")
    ts = time.time()
    worker.export_hf(export_dir)
    out["export_seconds"] = time.time() - ts
    worker.shutdown()
    del worker
    gc.collect()
    # exported files == bucket tensors, bit for bit
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for fname in sorted(os.listdir(export_dir)):
        if fname.endswith(".safetensors"):
            exported.update(load_file(os.path.join(export_dir, fname)))
    flat = {name: t for b in buckets for name, t in b}
    out["export_names_equal"] = sorted(flat) == sorted(exported)
    out["export_max_abs_diff_vs_buckets"] = max(
        (float((flat[n].float() - exported[n].float()).abs().max()) for n in flat if n in exported), default=float("nan")
    )
    out["export_num_tensors"] = len(exported)
    out["export_dtype"] = str(next(iter(exported.values())).dtype) if exported else None
    out["hf_after_export"] = _hf_refs(export_dir, batch)
    out["seconds"] = time.time() - t0
    return out


# ------------------------------------------------------------------------------------ throughput
def throughput(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: str,
               cases: list[dict], workdir: str, warmup: int, iters: int, overrides: dict | None = None) -> dict:
    """Time the update (``mode="update"``) or the log-prob + entropy pass (``mode="logprob"``) of
    random-weight ``model`` (configs/models name) for each case; peak CUDA memory per case."""
    import json

    model_dir = kit_models.config_only_dir(model, os.path.join(workdir, f"cfg_{model}"), **(overrides or {}))
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    worker = _worker(cfg, rank, world_size, master_addr, master_port)
    results = []
    for case in cases:
        res: dict[str, Any] = {"case": case}
        try:
            res.update(_throughput_case(worker, model_dir, hf_cfg, case, warmup, iters))
        except Exception as exc:  # noqa: BLE001  (recorded; the next case still runs)
            import traceback

            res["error"] = f"{type(exc).__name__}: {exc}"
            res["traceback"] = traceback.format_exc()[-3000:]
            if _cuda():
                res["peak_bytes_at_error"] = int(torch.cuda.max_memory_allocated())
        # the TransformerConfig (held by the bridge) references the DDP model through no_sync_func
        st = worker.state
        st.model = st.optimizer = st.bridge = st.tconfig = None
        gc.collect()
        if _cuda():
            torch.cuda.empty_cache()
        results.append(res)
    worker.shutdown()
    return {"model": model, "hf_config": hf_cfg, "cases": results}


def _throughput_case(worker: MegatronRankWorker, model_dir: str, hf_cfg: dict, case: dict, warmup: int, iters: int) -> dict:
    import dataclasses

    tokens, n_mb, update = int(case["micro_batch_tokens"]), int(case["num_micro_batches"]), case["mode"] == "update"
    worker.cfg = dataclasses.replace(worker.cfg, optim=dataclasses.replace(worker.cfg.optim, micro_batch_max_tokens=tokens),
                                     local_attention=case.get("attention", worker.cfg.local_attention))
    if _cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ts = time.time()
    info = worker.init_model(model_dir, load_weights=False, train=update)
    init_s = time.time() - ts
    prompt = max(1, tokens // 8)
    rng = random.Random(0)
    vocab = int(hf_cfg["vocab_size"])
    # one sequence of exactly `tokens` per micro-batch (two would exceed the budget): no padding
    seqs = [[rng.randint(10, vocab - 1) for _ in range(tokens)] for _ in range(n_mb)]
    batch = {"sequences": seqs, "prompt_lens": [prompt] * n_mb, "temperature": 1.0}
    resp = [tokens - prompt] * n_mb
    if update:
        g = torch.Generator().manual_seed(0)
        old = [(-float(torch.log(torch.tensor(float(vocab)))) + 0.1 * torch.randn(t, generator=g)) for t in resp]
        adv = [torch.randn(t, generator=g) for t in resp]
        train_batch = TrainBatch.from_ragged(seqs, [prompt] * n_mb, old, adv, temperature=1.0)

        def run():
            return worker.train_step(train_batch)
    else:

        def run():
            return worker.compute_logprobs_and_entropy(batch)

    times, outs = [], []
    for i in range(warmup + iters):
        _sync()
        t0 = time.time()
        outs.append(run())
        _sync()
        if i >= warmup:
            times.append(time.time() - t0)
    sec = sum(times) / len(times)
    fl = kit_models.step_flops(hf_cfg, [tokens] * n_mb, resp, update=update, recompute=bool(worker.cfg.optim.gradient_checkpointing_enable))
    peak = int(torch.cuda.max_memory_allocated()) if _cuda() else None
    res: dict[str, Any] = {
        "num_parameters": info["num_parameters"],
        "init_seconds": init_s,
        "seconds_per_step": sec,
        "step_seconds": times,
        "tokens_per_step": tokens * n_mb,
        "tokens_per_second": tokens * n_mb / sec,
        "model_tflops_per_step": fl["model_flops"] / 1e12,
        "hardware_tflops_per_step": fl["hardware_flops"] / 1e12,
        "achieved_model_tflops": fl["model_flops"] / sec / 1e12,
        "mfu": fl["model_flops"] / sec / kit_models.H100_BF16_DENSE_PEAK,
        "hfu": fl["hardware_flops"] / sec / kit_models.H100_BF16_DENSE_PEAK,
        "flops_split_forward": fl["forward"],
        "peak_bytes": peak,
        "peak_gib": peak / 2**30 if peak is not None else None,
    }
    if update:
        res["losses"] = [o["loss"] for o in outs]
        res["skipped"] = [o["skipped"] for o in outs]
    else:
        res["mean_entropy"] = float(torch.cat(outs[-1]["entropy"]).mean()) if outs[-1] else None
    return res
