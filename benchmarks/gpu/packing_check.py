"""Sample packing on a GPU (issue 36): packed vs padded micro-batches, both backends, world 1.

Two parts, one JSON (``OUT/packing_check.json``):

* ``parity``: the CPU packing tests' rank scenarios (tests/megatron/packing_scenarios.py) on the GPU, fp32, a tiny
  Qwen3 and Qwen3-MoE, 8 sequences of 33..1900 tokens: per-sample log-probs / entropy packed vs padded and vs a
  Hugging Face forward of each sequence alone, and the gradients of one step packed vs padded (max relative
  difference over parameters). Megatron with its local attention run per document and with the SDPA core
  attention (torch SDPA per document; flash-attn's varlen kernel when installed), DeepSpeed ZeRO-2 with Hugging
  Face's own attention (packed rows carry position ids that restart per sample).
* ``timing``: Megatron, bf16, the Qwen3-0.6B shape with random weights, 24 sequences with a long-tailed length
  distribution: median seconds of a training step and of a log-prob pass, packed vs padded, and the padded-token
  share of each plan (``actor/batching.py:padding_report``).

    python benchmarks/gpu/packing_check.py OUT [--smoke]     # --smoke: CPU, tiny model for timing too

No tolerance decides anything here: the numbers are recorded with the CPU tests' tolerances beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MEGATRON_TESTS = os.path.join(REPO, "tests", "megatron")
CFG = dict(lr=2e-3, lr_scheduler="constant", total_steps=2, micro_batch_max_tokens=2048, max_norm=0.0,
           entropy_chunk_size=256, bf16=False, layer_spec="local")
CPU_TOLERANCES = {"log_probs_entropy_packed_vs_padded": 1e-5, "grad_rel_packed_vs_padded": 1e-5,
                  "megatron_vs_hf": 1e-4, "deepspeed_vs_hf": 1e-5}


def _lengths(n: int, median: int, cap: int, seed: int) -> list[int]:
    """Long-tailed response lengths: lognormal around ``median`` (sigma 0.9), cut to [64, cap]."""
    rng = random.Random(seed)
    return [max(64, min(cap, int(rng.lognormvariate(0.0, 0.9) * median))) for _ in range(n)]


def timing_run(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model_dir: str,
               batch: dict, repeats: int, profile: bool = False) -> dict:
    """Median seconds of ``train_step`` and ``compute_logprobs_and_entropy``, packed and padded (one warm-up each)."""
    import torch

    from openrlhf_shape.megatron.worker import MegatronRankWorker
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.testing.batches import train_batches
    from openrlhf_shape.testing.rank_configs import megatron_config, replaced

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    worker = MegatronRankWorker(megatron_config(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                                master_port=master_port, platform=detect_platform())
    steps = train_batches(batch, repeats + 1, seed=7)
    out: dict = {}
    for name, pack in (("packed", True), ("padded", False)):
        worker.cfg = replaced(worker.cfg, pack_samples=pack)
        worker.init_model(model_dir)
        times: dict[str, list[float]] = {"train_step": [], "logprobs": []}
        for i, step in enumerate(steps):
            sync()
            t0 = time.perf_counter()
            worker.compute_logprobs_and_entropy(batch)
            sync()
            t1 = time.perf_counter()
            worker.train_step(step)
            sync()
            if i:  # the first round warms up
                times["logprobs"].append(t1 - t0)
                times["train_step"].append(time.perf_counter() - t1)
        out[name] = {k: {"median_s": statistics.median(v), "all_s": v} for k, v in times.items()}
        if profile:
            out[name]["profile"] = _profile_step(worker, steps[0])
        if torch.cuda.is_available():
            out[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
    worker.shutdown()
    return out


def _profile_step(worker, step) -> dict:
    """One training step under torch's profiler: the 30 costliest ops by device time, and the host-device
    synchronisations (``aten::_local_scalar_dense`` = ``.item()``/``.tolist()`` of a device tensor)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        worker.train_step(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    avg = prof.key_averages()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    syncs = {e.key: e.count for e in avg if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize",
                                                        "cudaDeviceSynchronize", "aten::item")}
    return {"table": avg.table(sort_by=sort, row_limit=30, max_name_column_width=60), "sync_counts": syncs}


def _diff(a, b) -> float:
    from mg_helpers import max_abs_diff

    return max_abs_diff(a, b)


def _compare(results: list[dict], arch: str, hf: tuple, n: int) -> dict:
    from packing_checks import merged, worst_grad_rel_diff

    packed, padded = merged(results, arch, "packed", n), merged(results, arch, "padded", n)
    grad_rel, where = worst_grad_rel_diff(results[0][arch]["packed"]["grads"], results[0][arch]["padded"]["grads"])
    return {"log_probs_packed_vs_padded": _diff(packed.log_probs, padded.log_probs),
            "entropy_packed_vs_padded": _diff(packed.entropy, padded.entropy),
            "log_probs_packed_vs_hf": _diff(packed.log_probs, hf[0]),
            "entropy_packed_vs_hf": _diff(packed.entropy, hf[1]),
            "grad_rel_packed_vs_padded": grad_rel, "grad_rel_worst_parameter": where,
            # Megatron's layout pass returns the step's metrics; DeepSpeed's reads gradients before its step
            "loss_packed": results[0][arch]["packed"].get("metrics", {}).get("loss"),
            "loss_padded": results[0][arch]["padded"].get("metrics", {}).get("loss")}


def parity(workdir: str, timeout: float) -> dict:
    from mg_helpers import hf_logprobs_entropy

    from openrlhf_shape.actor.launch import run_ranks
    from openrlhf_shape.testing import make_tiny_model
    from openrlhf_shape.testing.batches import long_batch

    models = {"qwen3": str(make_tiny_model(os.path.join(workdir, "qwen3"), arch="qwen3", seed=0, vocab_size=1024)),
              "qwen3_moe": str(make_tiny_model(os.path.join(workdir, "qwen3_moe"), arch="qwen3_moe", seed=3,
                                               num_layers=2, vocab_size=1024))}
    batch = long_batch(seed=0, vocab_size=1024)
    n = len(batch["sequences"])
    hf = {arch: hf_logprobs_entropy(path, batch) for arch, path in models.items()}
    out: dict = {"sequence_lengths": [len(s) for s in batch["sequences"]], "cpu_tolerances": CPU_TOLERANCES}
    t0 = time.time()
    mg = run_ranks("packing_scenarios:megatron_packing_run", 1, timeout=timeout, extra_pythonpath=[MEGATRON_TESTS],
                   kwargs=dict(cfg=CFG, model_dirs=models, batch=batch,
                               variants={"sdpa": ({"local_attention": "sdpa"}, ["qwen3"])}))
    out["megatron"] = {arch: _compare(mg, arch, hf[arch], n) for arch in models}
    out["megatron"]["sdpa_qwen3"] = _compare([r["variants"]["sdpa"] for r in mg], "qwen3", hf["qwen3"], n)
    out["megatron"]["seconds"] = time.time() - t0
    t0 = time.time()
    try:
        import torch

        env = None if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}
        ds = run_ranks("packing_scenarios:zero_packing_run", 1, timeout=timeout, extra_pythonpath=[MEGATRON_TESTS],
                       env=env,
                       kwargs=dict(cfg={k: v for k, v in CFG.items() if k not in ("bf16", "layer_spec")},
                                   zero={"zero_stage": 2, "param_dtype": "fp32"}, model_dirs=models, batch=batch))
        out["deepspeed"] = {arch: _compare(ds, arch, hf[arch], n) for arch in models}
    except Exception as exc:  # noqa: BLE001  (recorded; timing still runs)
        out["deepspeed"] = {"error": f"{type(exc).__name__}: {str(exc)[-3000:]}"}
    out["deepspeed"]["seconds"] = time.time() - t0
    return out


def timing(workdir: str, timeout: float, smoke: bool, profile: bool = False) -> dict:
    import torch

    from kit_models import random_hf_model_dir

    from openrlhf_shape.actor.batching import padding_report
    from openrlhf_shape.actor.launch import run_ranks

    gpu = torch.cuda.is_available() and not smoke
    overrides = {} if gpu else {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024}
    model_dir = random_hf_model_dir("Qwen3-0.6B", os.path.join(workdir, "qwen3_06b"), seed=5,
                                    dtype="bfloat16" if gpu else "float32", device="cuda" if gpu else "cpu",
                                    **overrides)
    vocab = 151936 if gpu else 1024
    n, median, cap, mb_tokens = (24, 1024, 8192, 16384) if gpu else (8, 64, 256, 512)
    rng = random.Random(1)
    resp = _lengths(n, median, cap, seed=2)
    plens = [rng.randint(64, 256) if gpu else rng.randint(4, 16) for _ in range(n)]
    batch = {"sequences": [[rng.randint(10, vocab - 1) for _ in range(p + r)] for p, r in zip(plens, resp)],
             "prompt_lens": plens, "temperature": 1.0}
    cfg = {**CFG, "bf16": gpu, "local_attention": "sdpa", "micro_batch_max_tokens": mb_tokens,
           "entropy_chunk_size": 1024 if gpu else 64, "lr": 1e-6, "use_distributed_optimizer": True}
    res = run_ranks(f"{os.path.splitext(os.path.basename(__file__))[0]}:timing_run", 1, timeout=timeout,
                    extra_pythonpath=[HERE, MEGATRON_TESTS], threads_per_rank=8 if gpu else 1,
                    kwargs=dict(cfg=cfg, model_dir=model_dir, batch=batch, repeats=3 if gpu else 1,
                                profile=profile))[0]
    res["plan"] = padding_report([len(s) for s in batch["sequences"]], mb_tokens)
    res["sequence_lengths"] = [len(s) for s in batch["sequences"]]
    res["model"] = {"config": "Qwen3-0.6B", "overrides": overrides, "dtype": "bf16" if gpu else "fp32"}
    res["ratio_padded_over_packed"] = {k: res["padded"][k]["median_s"] / res["packed"][k]["median_s"]
                                       for k in ("train_step", "logprobs")}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--parts", default="parity,timing")
    ap.add_argument("--profile", action="store_true", help="timing: one step of each layout under torch's profiler")
    args = ap.parse_args()
    sys.path[:0] = [HERE, MEGATRON_TESTS]
    os.makedirs(args.out, exist_ok=True)
    workdir = os.path.join(args.out, "work") if args.smoke else "/tmp/packing_check"
    os.makedirs(workdir, exist_ok=True)
    result: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    for part in args.parts.split(","):
        t0 = time.time()
        try:
            result[part] = parity(workdir, args.timeout) if part == "parity" else timing(workdir, args.timeout, args.smoke, args.profile)
        except Exception as exc:  # noqa: BLE001  (recorded; the next part still runs)
            result[part] = {"error": f"{type(exc).__name__}: {str(exc)[-4000:]}"}
        result[part]["wall_seconds"] = time.time() - t0
        print(f"[packing_check] {part}: {json.dumps(result[part], default=str)[:3000]}", flush=True)
        with open(os.path.join(args.out, "packing_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
