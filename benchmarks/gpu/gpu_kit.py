"""GPU verification kit: Megatron on one GPU (world 1), bf16, local layer spec. Run it through
``bash scripts/gpu_check.sh OUTDIR [--smoke]`` (which installs carried wheels first).

Sections (each in fresh processes through ``launch.run_ranks``; a failing section is recorded
in the JSON and the next one still runs):

* ``parity``: log-probs + entropy of a random Qwen3-0.6B-shaped model (28 layers), Megatron
  (Megatron's and SDPA core attention) vs Hugging Face in float32 and bf16 on the same GPU.
* ``train``: 12 PPO/DAPO steps, distributed optimizer, fixed batch (loss finite and decreasing),
  checkpoint after step 10, a NEW process loads it and runs steps 11-12 (must equal the
  uninterrupted run); then ``export``: bucketed ``iter_hf_weights`` + ``export_hf`` from the GPU
  model, files equal the buckets bit for bit, transformers reloads them with the same log-probs.
* ``throughput``: tokens/s, MFU/HFU (formula in ``kit_models.py``) and peak
  ``torch.cuda.max_memory_allocated`` of the update (Qwen3-0.6B/1.7B) and of the log-prob +
  entropy pass (Qwen3-4B/8B) at 8k and 16k tokens per micro-batch, activation recompute on,
  random weights; every case records the inputs a memory planner needs.

* ``moe``: a random-weight Qwen3-MoE with Qwen3-30B-A3B's layers (4 layers; 2 for the update): parity with HF
  and a negative control (experts swapped pairwise), update and log-prob throughput with MFU from the active
  parameters and the planner's predicted peak next to the measured one.

``--smoke`` runs the same code on CPU (gloo, float32, tiny model, two training steps, a tiny
throughput case) so the kit cannot rot between GPU runs (tests/gpu_kit/); ``--jobs N`` (smoke only) runs N
sections at a time, each in its own fresh processes as always; ``--preload_ranks`` (smoke only, the test suite's)
forks those processes from one that imported torch, Megatron and DeepSpeed once (``tests/support/preload.py``).

Writes ``OUTDIR/gpu_kit.json`` (after every section) and ``OUTDIR/gpu_kit.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kit_models  # noqa: E402

# ------------------------------------------------------------------------------------ tolerances
# float32 (smoke, CPU): Megatron and HF differ only by summation order: 1e-4 as in tests/megatron.
FP32_TOL = 1e-4
# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 0.2%): every matmul output, norm and residual
# add is rounded, and a logit of size ~5 moves by ~0.01 per rounding, accumulated over 28 layers.
# Two correct bf16 implementations therefore differ from the float32 truth (HF in float32 on the
# same bf16 weights) by about the same amount, and from each other by up to about twice that.
# Rule: Megatron-bf16's error vs HF-float32 may be at most BF16_FACTOR x HF-bf16's own error vs
# HF-float32 (+ a small floor), separately for the max and the mean over all response tokens.
BF16_FACTOR = 2.0
BF16_MAX_FLOOR = 0.02
BF16_MEAN_FLOOR = 2e-3
# Resume: the resumed steps re-run the same kernels on the same restored state. On CPU exact to
# 1e-6 (tests/megatron); on GPU the embedding/index backward kernels accumulate with atomics
# (non-deterministic order), so a resumed step may differ in the last bits of bf16/fp32 sums.
RESUME_TOL = {"cpu": 1e-6, "gpu": 1e-3}

TRAIN_STEPS = {"cpu": 2, "gpu": 12}
SAVE_AT = {"cpu": 1, "gpu": 10}
SMOKE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=1024, initializer_range=0.05)

GPU_CASES = [
    {"model": "Qwen3-0.6B", "mode": "update", "micro_batch_tokens": 8192},
    {"model": "Qwen3-0.6B", "mode": "update", "micro_batch_tokens": 16384},
    # Megatron's own local attention ([b*heads, s, s] scores) for comparison with SDPA; last for its model
    # (it ran out of memory on an 80 GB H100 at 63.6 GiB allocated + a 16 GiB request: expected, not a failure)
    {"model": "Qwen3-0.6B", "mode": "update", "micro_batch_tokens": 16384, "attention": "megatron", "expect": "oom"},
    {"model": "Qwen3-1.7B", "mode": "update", "micro_batch_tokens": 8192},
    {"model": "Qwen3-1.7B", "mode": "update", "micro_batch_tokens": 16384},
    {"model": "Qwen3-4B", "mode": "logprob", "micro_batch_tokens": 8192},
    {"model": "Qwen3-4B", "mode": "logprob", "micro_batch_tokens": 16384},
    {"model": "Qwen3-8B", "mode": "logprob", "micro_batch_tokens": 8192},
    {"model": "Qwen3-8B", "mode": "logprob", "micro_batch_tokens": 16384},
]
# Mixture of experts (issue 25): random-weight stand-ins with Qwen3-30B-A3B's layer (hidden 2048, 128 experts of
# width 768, 8 routed per token, every layer sparse). GPU: 4 layers for parity and the log-prob pass (3.0B params),
# 2 for the update (1.9B params: ~34 GB of bf16 weights, fp32 grads, master and Adam state on one H100).
MOE_CONFIG = "Qwen3-30B-A3B"
SMOKE_MOE_SHAPE = {**SMOKE_SHAPE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
MOE_GPU_CASES = [
    {"model": MOE_CONFIG, "mode": "update", "micro_batch_tokens": 8192, "overrides": {"num_hidden_layers": 2}},
    {"model": MOE_CONFIG, "mode": "logprob", "micro_batch_tokens": 16384, "overrides": {"num_hidden_layers": 4}},
]
MOE_SMOKE_CASES = [
    {"model": MOE_CONFIG, "mode": "update", "micro_batch_tokens": 64, "overrides": SMOKE_MOE_SHAPE},
    {"model": MOE_CONFIG, "mode": "logprob", "micro_batch_tokens": 64, "overrides": SMOKE_MOE_SHAPE},
]
SMOKE_CASES = [
    {"model": "Qwen3-0.6B", "mode": "update", "micro_batch_tokens": 64, "overrides": SMOKE_SHAPE},
    {"model": "Qwen3-0.6B", "mode": "logprob", "micro_batch_tokens": 64, "overrides": SMOKE_SHAPE},
]


def _has_cuda() -> bool:
    """Ask a child process, so the driver itself never holds a CUDA context on the GPU."""
    code = "import torch; print(int(torch.cuda.is_available()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return out.stdout.strip().endswith("1")


def _versions() -> dict:
    # Versions from the installed distributions' metadata: importing transformers and megatron.core only to read
    # __version__ cost ~4 s of CPU (megatron.core imports torch's compiler stack); megatron.core is imported only
    # when no distribution metadata names it (a source checkout on PYTHONPATH).
    code = (
        "import json, sys, torch, importlib.metadata as md\n"
        "v = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "     'transformers': md.version('transformers')}\n"
        "try: v['megatron-core'] = md.version('megatron-core')\n"
        "except md.PackageNotFoundError:\n"
        "    import megatron.core; v['megatron-core'] = megatron.core.__version__\n"
        "for name in ('mbridge', 'transformer-engine', 'flash-attn'):\n"
        "    try: v[name] = md.version(name)\n"
        "    except md.PackageNotFoundError: v[name] = None\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    v['device'] = p.name; v['device_memory_gib'] = p.total_memory / 2**30\n"
        "    v['sm'] = f'{p.major}.{p.minor}'\n"
        "print(json.dumps(v))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"error": out.stderr[-2000:]}
    info["platform"] = platform.platform()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        info["nvidia_smi"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = None
    return info


# ------------------------------------------------------------------------------------ comparisons
def _flat(xs: list) -> "Any":
    import torch

    xs = [x.float().reshape(-1) for x in xs if x.numel()]
    return torch.cat(xs) if xs else torch.zeros(0)


def _err(a: list, b: list) -> dict:
    d = (_flat(a) - _flat(b)).abs()
    return {"max": float(d.max()) if d.numel() else 0.0, "mean": float(d.mean()) if d.numel() else 0.0}


def _compare(mg, hf: dict, *, gpu: bool) -> dict:
    """Megatron vs HF references (``LogProbs``; HF's by dtype) for log_probs and entropy; verdict per the
    tolerance rules above."""
    out: dict[str, Any] = {"passed": True}
    for key in ("log_probs", "entropy"):
        e32 = _err(getattr(mg, key), getattr(hf["float32"], key))
        rec: dict[str, Any] = {"megatron_vs_hf_fp32": e32}
        if gpu:
            floor = _err(getattr(hf["bfloat16"], key), getattr(hf["float32"], key))
            rec["hf_bf16_vs_hf_fp32"] = floor
            rec["megatron_vs_hf_bf16"] = _err(getattr(mg, key), getattr(hf["bfloat16"], key))
            tol = {"max": BF16_FACTOR * floor["max"] + BF16_MAX_FLOOR, "mean": BF16_FACTOR * floor["mean"] + BF16_MEAN_FLOOR}
        else:
            tol = {"max": FP32_TOL, "mean": FP32_TOL}
        rec["tolerance"] = tol
        rec["passed"] = e32["max"] <= tol["max"] and e32["mean"] <= tol["mean"]
        out[key] = rec
        out["passed"] = out["passed"] and rec["passed"]
    out["mean_entropy_hf_fp32"] = float(_flat(hf["float32"].entropy).mean())
    out["num_response_tokens"] = int(_flat(hf["float32"].log_probs).numel())
    return out


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ------------------------------------------------------------------------------------ sections
class SkipSection(Exception):
    """A section that cannot run here (no GPU, a wheel not carried): recorded with the reason."""


ALL_SECTIONS = ("parity", "train", "throughput", "offload", "cuda_ipc", "zero2", "te_spec", "moe")
# The recorded sections in the order they are reported (``train`` records ``train_resume`` and ``export``).
RECORD_ORDER = ("parity", "train_resume", "export", "throughput", "offload", "cuda_ipc", "zero2", "te_spec", "moe")
# --jobs > 1 (smoke only) starts the sections that launch two rank processes first, so the lanes end together.
TWO_PROCESS_SECTIONS = ("moe", "train")


class Kit:
    def __init__(self, out_dir: str, smoke: bool, workdir: str, timeout: float) -> None:
        self.out_dir, self.smoke, self.workdir, self.timeout = out_dir, smoke, workdir, timeout
        self.gpu = False if smoke else _has_cuda()
        self.kind = "gpu" if self.gpu else "cpu"
        self.result: dict[str, Any] = {
            "kit": "openrlhf-shape GPU verification kit",
            "mode": "smoke" if smoke else "gpu",
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "versions": _versions(),
            "tolerances": {"fp32": FP32_TOL, "bf16_factor": BF16_FACTOR, "bf16_max_floor": BF16_MAX_FLOOR,
                           "bf16_mean_floor": BF16_MEAN_FLOOR, "resume": RESUME_TOL[self.kind]},
            "sections": {},
        }
        if not smoke and not self.gpu:
            raise SystemExit("gpu_kit: no CUDA device visible; run with --smoke for the CPU check")
        self.base_cfg: dict[str, Any] = {"layer_spec": "local", "seed": 1234}
        self._lock = threading.Lock()  # sections may record from several threads (--jobs, smoke only)
        self.spawner: Any = None  # how run_ranks starts a rank; None: its default, a fresh interpreter

    def _run(self, target: str, kwargs: dict, module: str = "kit_sections") -> Any:
        from openrlhf_shape.actor.launch import run_ranks

        spawner = {"spawner": self.spawner} if self.spawner else {}
        return run_ranks(f"{module}:{target}", 1, kwargs=kwargs, timeout=self.timeout,
                         extra_pythonpath=[HERE], threads_per_rank=1 if self.smoke else 8, **spawner)[0]

    def _record(self, name: str, fn) -> None:
        t0 = time.time()
        print(f"[gpu_kit] section {name} ...", flush=True)
        try:
            rec = fn()
        except SkipSection as skip:
            rec = {"passed": None, "skip_reason": str(skip)}
        except Exception as exc:  # noqa: BLE001  (recorded; the next section still runs)
            rec = {"passed": False, "error": f"{type(exc).__name__}: {str(exc)[-6000:]}",
                   "traceback": traceback.format_exc()[-3000:]}
        rec["wall_seconds"] = time.time() - t0
        verdict = "SKIPPED: " + rec["skip_reason"] if "skip_reason" in rec else ("PASSED" if rec.get("passed") else "FAILED")
        print(f"[gpu_kit] section {name}: {verdict} "
              f"({rec['wall_seconds']:.0f}s){' ' + rec['error'][:2000] if 'error' in rec else ''}", flush=True)
        with self._lock:
            sections = {**self.result["sections"], name: rec}
            self.result["sections"] = {k: sections[k] for k in sorted(sections, key=RECORD_ORDER.index)}
            self.write()

    def _batch(self, n: int, lo: int, hi: int, vocab: int, seed: int) -> dict:
        from kit_sections import ragged_batch

        return ragged_batch(n, lo, hi, vocab, seed=seed, temperature=0.7)

    # ---------------------------------------------------------------- parity
    def parity(self) -> dict:
        if self.smoke:
            model = {"config": "Qwen3-0.6B", "overrides": SMOKE_SHAPE, "seed": 3}
            batch = self._batch(6, 8, 40, SMOKE_SHAPE["vocab_size"], seed=0)
        else:
            # full Qwen3-0.6B shape (28 layers, vocab 151936); larger init -> peakier distributions
            model = {"config": "Qwen3-0.6B", "overrides": {"initializer_range": 0.05}, "seed": 3}
            batch = self._batch(8, 64, 2048, 151936, seed=0)
        cfg = {**self.base_cfg, "micro_batch_max_tokens": 4096 if self.gpu else 96}
        res = self._run("parity", dict(cfg=cfg, model=model, batch=batch, workdir=self.workdir,
                                       attentions=["megatron", "sdpa"]))
        rec: dict[str, Any] = {"model": model, "cfg": cfg, "num_sequences": len(batch["sequences"]),
                               "sequence_lengths": [len(s) for s in batch["sequences"]],
                               "num_parameters": res["info"]["num_parameters"], "dtype": res["info"]["dtype"],
                               "temperature": batch["temperature"], "seconds": res["seconds"], "attention": {}}
        passed = True
        for attention, mg in res["megatron"].items():
            cmp = _compare(mg, res["hf"], gpu=self.gpu)
            rec["attention"][attention] = cmp
            passed = passed and cmp["passed"]
        neg = _compare(res["negative_control"], res["hf"], gpu=self.gpu)
        rec["negative_control_wrong_qkv"] = {
            "log_probs_vs_hf_fp32": neg["log_probs"]["megatron_vs_hf_fp32"],
            "entropy_vs_hf_fp32": neg["entropy"]["megatron_vs_hf_fp32"],
            "caught": not neg["passed"],
        }
        rec["passed"] = passed and not neg["passed"]
        return rec

    # ---------------------------------------------------------------- mixture of experts
    def moe(self) -> dict:
        """qwen3_moe on the Megatron backend at world 1: log-prob/entropy parity with HF (plus a negative control
        with the experts swapped pairwise) and the update / log-prob throughput with MFU from active parameters."""
        if self.smoke:
            model = {"config": MOE_CONFIG, "overrides": SMOKE_MOE_SHAPE, "seed": 11}
            batch = self._batch(6, 8, 40, SMOKE_MOE_SHAPE["vocab_size"], seed=2)
        else:
            model = {"config": MOE_CONFIG, "overrides": {"num_hidden_layers": 4, "initializer_range": 0.05}, "seed": 11}
            batch = self._batch(8, 64, 1024, 151936, seed=2)
        cfg = {**self.base_cfg, "local_attention": "sdpa", "micro_batch_max_tokens": 4096 if self.gpu else 96}
        res = self._run("moe_parity", dict(cfg=cfg, model=model, batch=batch, workdir=os.path.join(self.workdir, "moe")))
        cmp = _compare(res["megatron"], res["hf"], gpu=self.gpu)
        neg = _compare(res["negative_control"], res["hf"], gpu=self.gpu)
        tput = self.throughput(None, cases=MOE_SMOKE_CASES if self.smoke else MOE_GPU_CASES)
        rec = {"model": model, "cfg": cfg, "num_parameters": res["info"]["num_parameters"], "dtype": res["info"]["dtype"],
               "num_sequences": len(batch["sequences"]), "seconds": res["seconds"], "parity": cmp,
               "negative_control_swapped_experts": {
                   "swapped_tensors": res["swapped_tensors"],
                   "log_probs_vs_hf_fp32": neg["log_probs"]["megatron_vs_hf_fp32"],
                   "entropy_vs_hf_fp32": neg["entropy"]["megatron_vs_hf_fp32"], "caught": not neg["passed"]},
               "throughput": tput}
        rec["passed"] = bool(cmp["passed"] and not neg["passed"] and tput["passed"])
        return rec

    # ---------------------------------------------------------------- colocation (kit_colocation.py)
    def _small_model_and_batch(self, seed: int) -> tuple[dict, dict]:
        if self.smoke:
            return ({"config": "Qwen3-0.6B", "overrides": SMOKE_SHAPE, "seed": seed},
                    self._batch(6, 8, 40, SMOKE_SHAPE["vocab_size"], seed=seed))
        return ({"config": "Qwen3-0.6B", "overrides": {"num_hidden_layers": 4}, "seed": seed},
                self._batch(8, 128, 1024, 151936, seed=seed))

    def offload(self) -> dict:
        """Pinned offload/onload of a Megatron rank: memory really returned, buffers reused, bit-exact."""
        import kit_colocation

        model, batch = self._small_model_and_batch(7)
        cfg = {**self.base_cfg, "use_distributed_optimizer": True, "lr": 1e-4,
               "micro_batch_max_tokens": 96 if self.smoke else 2048}
        res = self._run("offload", dict(cfg=cfg, model=model, batch=batch,
                                        workdir=os.path.join(self.workdir, "offload")), module="kit_colocation")
        return kit_colocation.offload_verdict(res, self.gpu)

    def cuda_ipc(self) -> dict:
        """The colocated transport between two processes on one GPU (the receiver is the worker extension)."""
        if not self.gpu:
            raise SkipSection("CUDA IPC needs a GPU (the smoke run has none)")
        import kit_colocation

        return kit_colocation.cuda_ipc(timeout_s=min(self.timeout, 300.0))

    def zero2(self) -> dict:
        """One DeepSpeed ZeRO-2 step against one Megatron step (bf16 on GPU, fp32 in the smoke run)."""
        import kit_colocation

        why = kit_colocation.deepspeed_available()
        if why:
            raise SkipSection(why)
        model, batch = self._small_model_and_batch(9)
        cfg = {**self.base_cfg, "lr": 1e-4, "local_attention": "sdpa", "micro_batch_max_tokens": 96 if self.smoke else 2048}
        res = self._run("zero2_vs_megatron", dict(cfg=cfg, model=model, batch=batch,
                                                   workdir=os.path.join(self.workdir, "zero2")), module="kit_colocation")
        return kit_colocation.zero2_verdict(res, self.gpu)

    def te_spec(self) -> dict:
        """Parity of the transformer-engine layer spec against HF (as the parity section, layer_spec te)."""
        import kit_colocation

        why = kit_colocation.te_available()
        if why:
            raise SkipSection(why)
        model, batch = self._small_model_and_batch(3)
        cfg = {**self.base_cfg, "layer_spec": "te", "micro_batch_max_tokens": 96 if self.smoke else 4096}
        res = self._run("parity", dict(cfg=cfg, model=model, batch=batch, workdir=os.path.join(self.workdir, "te"),
                                       attentions=["megatron"]))
        cmp = _compare(res["megatron"]["megatron"], res["hf"], gpu=self.gpu)
        return {"te": cmp, "passed": cmp["passed"]}

    # ---------------------------------------------------------------- train + resume + export
    def train(self) -> None:
        k = self.kind
        if self.smoke:
            model = {"config": "Qwen3-0.6B", "overrides": SMOKE_SHAPE, "seed": 5}
            batch = self._batch(6, 8, 40, SMOKE_SHAPE["vocab_size"], seed=1)
            cfg = {**self.base_cfg, "lr": 2e-3, "micro_batch_max_tokens": 96, "entropy_chunk_size": 16}
            bucket_bytes = 100_000
        else:
            model = {"config": "Qwen3-0.6B", "overrides": {"num_hidden_layers": 4}, "seed": 5}
            batch = self._batch(8, 128, 1024, 151936, seed=1)
            cfg = {**self.base_cfg, "lr": 5e-5, "micro_batch_max_tokens": 2048}
            bucket_bytes = 64 << 20
        steps, save_at = TRAIN_STEPS[k], SAVE_AT[k]
        cfg.update(use_distributed_optimizer=True, local_attention="sdpa", lr_warmup_steps=1 if self.smoke else 2,
                   lr_scheduler="cosine_warmup_with_min_lr", total_steps=steps, min_lr=cfg["lr"] / 10, max_norm=1.0)
        state: dict[str, Any] = {}

        def train_section() -> dict:
            first = self._run("train_first", dict(cfg=cfg, model=model, batch=batch, steps=steps, save_at=save_at,
                                                  workdir=self.workdir))
            state["first"] = first
            resumed = self._run("train_resumed", dict(cfg=cfg, model_dir=first["model_dir"], ckpt=first["ckpt"],
                                                      train_batch=first["train_batch"], steps=steps, batch=batch,
                                                      workdir=self.workdir, bucket_bytes=bucket_bytes))
            state["resumed"] = resumed
            losses = [m["loss"] for m in first["metrics"]]
            finite = all(_finite(m["loss"]) and _finite(m["grad_norm"]) for m in first["metrics"])
            skipped = [m["skipped"] for m in first["metrics"]]
            decreasing_steps = sum(b < a for a, b in zip(losses, losses[1:]))
            ref = first["metrics"][save_at:]
            got = resumed["metrics"]
            diffs = {key: [abs(a[key] - b[key]) for a, b in zip(ref, got)] for key in ("loss", "grad_norm", "lr", "entropy")}
            final_diff = _err(resumed["final"].log_probs, first["final"].log_probs)
            tol = RESUME_TOL[k]
            resume_ok = (len(got) == len(ref) == steps - save_at and int(resumed["extra"]["step"]) == save_at
                         and max(diffs["loss"]) <= tol and max(diffs["lr"]) <= 1e-12)
            rec = {
                "model": model, "cfg": cfg, "num_parameters": first["info"]["num_parameters"],
                "steps": steps, "save_at": save_at, "losses": losses,
                "grad_norms": [m["grad_norm"] for m in first["metrics"]], "lrs": [m["lr"] for m in first["metrics"]],
                "clipfrac": [m["pg_clipfrac"] for m in first["metrics"]], "entropy": [m["entropy"] for m in first["metrics"]],
                "skipped": skipped, "tokens_per_step": first["metrics"][0]["num_tokens"],
                "step_seconds": first["step_seconds"], "save_seconds": first["save_seconds"],
                "load_seconds": resumed["load_seconds"], "decreasing_steps": decreasing_steps,
                "loss_finite": finite, "loss_decreased": losses[-1] < losses[0],
                "resumed_losses": [m["loss"] for m in got], "uninterrupted_losses": [m["loss"] for m in ref],
                "resume_abs_diff": diffs, "resume_final_logprob_diff": final_diff, "resume_tolerance": tol,
                "resume_equal": resume_ok,
            }
            rec["passed"] = finite and not any(skipped) and rec["loss_decreased"] and resume_ok
            return rec

        self._record("train_resume", train_section)

        def export_section() -> dict:
            if "resumed" not in state:
                return {"passed": False, "error": "train_resume failed before the export ran"}
            r = state["resumed"]
            within = all(b <= bucket_bytes or c == 1 for b, c in zip(r["bucket_bytes"], r["bucket_counts"]))
            cmp = _compare(r["final"], r["hf_after_export"], gpu=self.gpu)
            rec = {"bucket_bytes_bound": bucket_bytes, "num_buckets": len(r["bucket_bytes"]),
                   "bucket_bytes": r["bucket_bytes"], "buckets_within_bound": within,
                   "bucket_seconds": r["bucket_seconds"], "export_seconds": r["export_seconds"],
                   "export_num_tensors": r["export_num_tensors"], "export_dtype": r["export_dtype"],
                   "export_names_equal_buckets": r["export_names_equal"],
                   "export_max_abs_diff_vs_buckets": r["export_max_abs_diff_vs_buckets"],
                   "reloaded_hf_vs_megatron": cmp}
            rec["passed"] = within and r["export_names_equal"] and r["export_max_abs_diff_vs_buckets"] == 0.0 and cmp["passed"]
            return rec

        self._record("export", export_section)

    # ---------------------------------------------------------------- throughput
    def throughput(self, only: list[str] | None, cases: list[dict] | None = None) -> dict:
        cases = cases or (SMOKE_CASES if self.smoke else GPU_CASES)
        if only:
            cases = [c for c in cases if _case_id(c) in only]
        cfg = {**self.base_cfg, "local_attention": "sdpa", "gradient_checkpointing_enable": True,
               "use_distributed_optimizer": True, "lr": 1e-6, "entropy_chunk_size": 16 if self.smoke else 1024}
        n_mb = 2 if self.smoke else 4
        by_model: dict[tuple, list[dict]] = {}
        for c in cases:
            by_model.setdefault((c["model"], json.dumps(c.get("overrides", {}), sort_keys=True)), []).append(
                {**c, "num_micro_batches": n_mb})
        out_cases = []
        for (model, ov), mcases in by_model.items():
            try:
                res = self._run("throughput", dict(cfg=cfg, model=model, cases=mcases, workdir=self.workdir,
                                                   warmup=1, iters=1 if self.smoke else 2, overrides=json.loads(ov)))
                results = res["cases"]
            except Exception as exc:  # noqa: BLE001  (one model's process failing keeps the others)
                results = [{"case": c, "error": f"{type(exc).__name__}: {str(exc)[-4000:]}"} for c in mcases]
            for r in results:
                c = r["case"]
                update = c["mode"] == "update"
                r["planner_inputs"] = {
                    "model_config": os.path.relpath(kit_models.model_config_path(c["model"]), kit_models.REPO_ROOT),
                    "model_config_overrides": c.get("overrides", {}),
                    "tp": 1, "pp": 1, "dp": 1, "world_size": 1,
                    "micro_batch_tokens": c["micro_batch_tokens"],
                    "num_micro_batches": c["num_micro_batches"],
                    "sequences_per_micro_batch": 1,
                    "sequence_length": c["micro_batch_tokens"],
                    "prompt_length": max(1, c["micro_batch_tokens"] // 8),
                    "mode": c["mode"],
                    "recompute": ("full, uniform, 1 layer per checkpoint" if update else
                                  "none (forward only, no activations kept)"),
                    "sequence_parallel": False,
                    "dtype": "bf16 params (Float16Module), fp32 grad buffer" if update else "bf16 params",
                    "optimizer": ("distributed Adam (torch Adam fallback: fp32 main params + 2 fp32 moments), "
                                  "grad_reduce_in_fp32" if update else "none (forward only, no DDP buffers)"),
                    "logprob_chunk_size": cfg["entropy_chunk_size"],
                    "attention": ("local spec, torch SDPA" if c.get("attention", "sdpa") == "sdpa" else
                                  "local spec, Megatron DotProductAttention ([b*heads, s, s] scores buffer)"),
                    "measured_peak_bytes": r.get("peak_bytes"),
                }
                out_cases.append(r)
        for r in out_cases:
            if r["case"].get("expect") == "oom":
                r["as_expected"] = "OutOfMemoryError" in r.get("error", "")
        ok = all(("error" not in r) or r.get("as_expected") for r in out_cases) and all(
            all(_finite(x) for x in r.get("losses", [])) and not any(r.get("skipped", [])) for r in out_cases)
        planner = _planner_predictions(out_cases)
        return {"passed": ok and bool(out_cases), "peak_flops": kit_models.H100_BF16_DENSE_PEAK,
                "flop_formula": kit_models.__doc__.split("FLOP formula", 1)[1].split("Embedding", 1)[0].strip(),
                "cases": out_cases, "planner": planner}

    # ---------------------------------------------------------------- output
    def write(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, "gpu_kit.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1, default=_json_default)
        os.replace(path + ".tmp", path)
        with open(os.path.join(self.out_dir, "gpu_kit.md"), "w") as f:
            f.write(markdown(self.result))


def _case_id(c: dict) -> str:
    """MODEL:MODE:TOKENS[:ATTENTION] (attention only when not the default sdpa)."""
    base = f"{c['model']}:{c['mode']}:{c['micro_batch_tokens']}"
    return base + (f":{c['attention']}" if c.get("attention", "sdpa") != "sdpa" else "")


def _planner_predictions(cases: list[dict]) -> dict:
    """If the ``--dry_run`` memory planner (``openrlhf_shape.planner``) is importable, its predicted
    peak per case next to the measured one; else why not (the JSON carries the planner's inputs,
    and ``--replan JSON`` fills this in later without a GPU)."""
    try:
        from openrlhf_shape.planner.memory import megatron_memory  # type: ignore[import-not-found]
        from openrlhf_shape.planner.model import ModelShape  # type: ignore[import-not-found]
    except ImportError as exc:
        return {"available": False, "reason": f"no planner importable ({exc}); the JSON carries its inputs"}
    preds = []
    for c in cases:
        pi = c["planner_inputs"]
        try:
            with open(os.path.join(kit_models.REPO_ROOT, pi["model_config"])) as f:
                cfg = json.load(f)
            cfg.update(pi.get("model_config_overrides") or {})
            update = pi["mode"] == "update"
            mem = megatron_memory(
                ModelShape.from_dict(cfg, name=os.path.basename(pi["model_config"])), tp=pi["tp"], pp=pi["pp"],
                dp=pi["dp"], micro_batch_tokens=pi["micro_batch_tokens"], seq_len=pi["sequence_length"],
                recompute="full" if update else "none", sequence_parallel=pi["sequence_parallel"],
                distributed_optimizer=update, logprob_chunk=pi["logprob_chunk_size"], spec="local",
                num_micro_batches=pi["num_micro_batches"], forward_only=not update, with_optimizer=update,
                attention="sdpa" if "SDPA" in pi["attention"] else "megatron",
            )
            rec = {"case": c["case"], "predicted_peak_bytes": int(mem.peak), "measured_peak_bytes": pi["measured_peak_bytes"]}
            if pi["measured_peak_bytes"]:
                rec["predicted_over_measured"] = mem.peak / pi["measured_peak_bytes"]
            preds.append(rec)
        except Exception as exc:  # noqa: BLE001  (recorded per case)
            preds.append({"case": c["case"], "error": f"{type(exc).__name__}: {exc}"})
    return {"available": True, "predictions": preds}


def _json_default(o: Any) -> Any:
    import torch

    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)


def _fmt(x: Any, spec: str = ".3g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "-"


def markdown(res: dict) -> str:
    v = res["versions"]
    lines = [f"# GPU kit results ({res['mode']}, {res['date_utc']} UTC)", "",
             f"Device: {v.get('device', 'cpu')} ({v.get('nvidia_smi') or 'no nvidia-smi'}); python {v.get('python')}, "
             f"torch {v.get('torch')} (CUDA {v.get('cuda')}), transformers {v.get('transformers')}, "
             f"megatron-core {v.get('megatron-core')}, mbridge {v.get('mbridge')}, transformer-engine {v.get('transformer-engine')}.",
             "", "| section | passed | key numbers |", "|---|---|---|"]
    for name, rec in res["sections"].items():
        key = ""
        if "error" in rec:
            key = "error: " + rec["error"].splitlines()[0][:200]
        elif name == "parity":
            parts = []
            for att, cmp in rec["attention"].items():
                lp, en = cmp["log_probs"], cmp["entropy"]
                s = (f"{att}: logp max/mean err vs HF-fp32 {_fmt(lp['megatron_vs_hf_fp32']['max'])}/"
                     f"{_fmt(lp['megatron_vs_hf_fp32']['mean'])}, entropy {_fmt(en['megatron_vs_hf_fp32']['max'])}/"
                     f"{_fmt(en['megatron_vs_hf_fp32']['mean'])}")
                if "hf_bf16_vs_hf_fp32" in lp:
                    s += (f" (HF-bf16 vs HF-fp32: logp {_fmt(lp['hf_bf16_vs_hf_fp32']['max'])}/"
                          f"{_fmt(lp['hf_bf16_vs_hf_fp32']['mean'])}, entropy {_fmt(en['hf_bf16_vs_hf_fp32']['max'])}/"
                          f"{_fmt(en['hf_bf16_vs_hf_fp32']['mean'])})")
                parts.append(s)
            neg = rec.get("negative_control_wrong_qkv")
            if neg:
                parts.append(f"negative control (q/k/v without group interleave): logp max/mean err "
                             f"{_fmt(neg['log_probs_vs_hf_fp32']['max'])}/{_fmt(neg['log_probs_vs_hf_fp32']['mean'])}, "
                             f"caught: {neg['caught']}")
            key = "; ".join(parts)
        elif name == "train_resume":
            key = (f"losses {' '.join(_fmt(x, '.4f') for x in rec['losses'])}; resumed "
                   f"{' '.join(_fmt(x, '.6f') for x in rec['resumed_losses'])} vs "
                   f"{' '.join(_fmt(x, '.6f') for x in rec['uninterrupted_losses'])} "
                   f"(max abs diff {_fmt(max(rec['resume_abs_diff']['loss']))})")
        elif name == "export":
            c = rec["reloaded_hf_vs_megatron"]
            key = (f"{rec['num_buckets']} buckets <= {rec['bucket_bytes_bound']} B, files == buckets "
                   f"(max diff {_fmt(rec['export_max_abs_diff_vs_buckets'])}); reloaded HF vs Megatron logp max/mean "
                   f"{_fmt(c['log_probs']['megatron_vs_hf_fp32']['max'])}/{_fmt(c['log_probs']['megatron_vs_hf_fp32']['mean'])}")
        elif name == "throughput":
            key = f"{len(rec['cases'])} cases (table below)"
        elif "skip_reason" in rec:
            key = "skipped: " + rec["skip_reason"]
        elif name == "offload":
            key = (f"{rec['offloaded_bytes'] / 2**20:.1f} MiB offloaded in {rec['offload_seconds']:.3f} s, back in "
                   f"{rec['onload_seconds']:.3f} s (pinned: {rec['pinned']}); reserved {rec['reserved_before'] / 2**20:.0f} -> "
                   f"{rec['reserved_offloaded'] / 2**20:.0f} -> {rec['reserved_after'] / 2**20:.0f} MiB; host bytes "
                   f"{rec['host_bytes_first_round']} then {rec['host_bytes_second_round']} (reused); log-probs change "
                   f"{_fmt(rec['logprobs_max_abs_change'])}")
        elif name == "cuda_ipc":
            key = (f"{rec['tensors']} tensors, {rec['sender']['sync/bytes'] / 2**20:.0f} MiB in "
                   f"{rec['sender']['sync/buckets']:.0f} buckets, {rec['GBps']:.1f} GiB/s, mismatched {rec['mismatched']}")
        elif name == "zero2":
            key = (f"{rec['dtype']}: loss {_fmt(rec['loss']['megatron'], '.5f')} vs {_fmt(rec['loss']['deepspeed'], '.5f')}, "
                   f"grad norm {_fmt(rec['grad_norm']['megatron'])} vs {_fmt(rec['grad_norm']['deepspeed'])}, log-probs after "
                   f"the step mean/max {_fmt(rec['logprobs_after_step']['mean_abs'])}/{_fmt(rec['logprobs_after_step']['max_abs'])}")
        elif name == "moe":
            lp, en = rec["parity"]["log_probs"], rec["parity"]["entropy"]
            neg = rec["negative_control_swapped_experts"]
            cases = "; ".join(
                (f"{c['case']['mode']} {c['case']['micro_batch_tokens']} tokens: {c['tokens_per_second']:.0f} tok/s, "
                 f"MFU {c['mfu'] * 100:.1f}% (active params), peak {_fmt(c.get('peak_gib'), '.1f')} GiB")
                if "error" not in c else f"{c['case']['mode']}: error {c['error'].splitlines()[0][:80]}"
                for c in rec["throughput"].get("cases", []))
            key = (f"{rec['num_parameters'] / 1e9:.3g}B params; logp max/mean err vs HF-fp32 "
                   f"{_fmt(lp['megatron_vs_hf_fp32']['max'])}/{_fmt(lp['megatron_vs_hf_fp32']['mean'])}, entropy "
                   f"{_fmt(en['megatron_vs_hf_fp32']['max'])}/{_fmt(en['megatron_vs_hf_fp32']['mean'])}; experts swapped: "
                   f"logp max err {_fmt(neg['log_probs_vs_hf_fp32']['max'])}, caught: {neg['caught']}; {cases}")
        elif name == "te_spec":
            lp = rec["te"]["log_probs"]["megatron_vs_hf_fp32"]
            key = f"TE spec logp max/mean err vs HF-fp32 {_fmt(lp['max'])}/{_fmt(lp['mean'])}"
        passed = "skipped" if "skip_reason" in rec else ("yes" if rec.get("passed") else "NO")
        lines.append(f"| {name} | {passed} | {key} |")
    tp = res["sections"].get("throughput")
    if tp and "cases" in tp:
        lines += ["", "| model | mode | tokens/micro-batch | micro-batches | params | s/step | tokens/s | MFU | HFU | peak GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in tp["cases"]:
            c = r["case"]
            if "error" in r:
                peak = r.get("peak_bytes_at_error")
                note = " (expected)" if r.get("as_expected") else ""
                lines.append(f"| {c['model']} ({c.get('attention', 'sdpa')} attention){note} | {c['mode']} | {c['micro_batch_tokens']} | {c.get('num_micro_batches')} | - | "
                             f"- | - | - | - | error: {r['error'].splitlines()[0][:120]}"
                             f"{f' (peak {peak / 2**30:.1f} GiB)' if peak else ''} |")
                continue
            att = "" if c.get("attention", "sdpa") == "sdpa" else f" ({c['attention']} attention)"
            lines.append(f"| {c['model']}{att} | {c['mode']} | {c['micro_batch_tokens']} | {c['num_micro_batches']} | "
                         f"{r['num_parameters'] / 1e9:.2f}B | {r['seconds_per_step']:.3f} | {r['tokens_per_second']:.0f} | "
                         f"{r['mfu'] * 100:.1f}% | {r['hfu'] * 100:.1f}% | {_fmt(r['peak_gib'], '.2f')} |")
        planner = tp.get("planner") or {}
        if planner.get("available"):
            lines += ["", "| case | planner peak GiB | measured peak GiB | planner / measured |", "|---|---|---|---|"]
            for p in planner["predictions"]:
                c = p["case"]
                name = f"{c['model']} {c['mode']} {c['micro_batch_tokens']} {c.get('attention', 'sdpa')}"
                if "error" in p:
                    lines.append(f"| {name} | error: {p['error'][:100]} | - | - |")
                    continue
                m = p.get("measured_peak_bytes")
                lines.append(f"| {name} | {p['predicted_peak_bytes'] / 2**30:.2f} | {_fmt(m / 2**30 if m else None, '.2f')} | "
                             f"{_fmt(p.get('predicted_over_measured'), '.2f')} |")
        elif planner:
            lines += ["", f"Planner: {planner.get('reason')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, two steps, tiny throughput case")
    ap.add_argument("--sections", default=",".join(ALL_SECTIONS),
                    help="comma list of parity, train (train_resume + export), throughput, offload, cuda_ipc, "
                         "zero2 (DeepSpeed ZeRO-2 vs Megatron), te_spec, moe (Qwen3-MoE parity + throughput)")
    ap.add_argument("--cases", default="",
                    help="throughput cases to keep, MODEL:MODE:TOKENS[:ATTENTION], e.g. Qwen3-8B:logprob:16384 (comma list)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per section process")
    ap.add_argument("--workdir", default=None, help="scratch dir for models and checkpoints (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --smoke: run this many sections at a time (each in its own processes, as always)")
    ap.add_argument("--preload_ranks", action="store_true",
                    help="with --smoke, in the test suite (tests/ on PYTHONPATH): fork each rank from a process that "
                         "imported torch, Megatron and DeepSpeed once (tests/support/preload.py)")
    ap.add_argument("--replan", action="store_true",
                    help="OUT_DIR holds a finished gpu_kit.json: only recompute its planner predictions (no GPU)")
    args = ap.parse_args(argv)
    if args.jobs > 1 and not args.smoke:
        ap.error("--jobs > 1 is for --smoke only: on a GPU the sections share the device and measure its memory")
    if args.preload_ranks and not args.smoke:
        ap.error("--preload_ranks is for --smoke only: a fork after CUDA's initialisation has no usable GPU")
    if args.replan:
        path = os.path.join(args.out_dir, "gpu_kit.json")
        with open(path) as f:
            res = json.load(f)
        tp = res["sections"].get("throughput") or {}
        tp["planner"] = _planner_predictions(tp.get("cases", []))
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=_json_default)
        with open(os.path.join(args.out_dir, "gpu_kit.md"), "w") as f:
            f.write(markdown(res))
        print(json.dumps(tp["planner"], indent=1))
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_kit_")
    kit = Kit(os.path.abspath(args.out_dir), args.smoke, workdir, args.timeout)
    if args.preload_ranks:
        from support.preload import spawn_preloaded

        kit.spawner = spawn_preloaded
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(ALL_SECTIONS)
    if unknown:
        ap.error(f"unknown --sections {sorted(unknown)}; choose from {', '.join(ALL_SECTIONS)}")
    only = [c.strip() for c in args.cases.split(",") if c.strip()] or None
    jobs = {"parity": lambda: kit._record("parity", kit.parity), "train": kit.train,
            "throughput": lambda: kit._record("throughput", lambda: kit.throughput(only))}
    for name in ("offload", "cuda_ipc", "zero2", "te_spec", "moe"):
        jobs[name] = lambda name=name: kit._record(name, getattr(kit, name))
    order = [name for name in ALL_SECTIONS if name in sections]
    kit.write()
    try:
        if args.jobs <= 1:
            for name in order:
                jobs[name]()
        else:
            # Each section still runs in its own fresh rank processes, ``--jobs`` sections at a time (a smoke rank
            # runs one thread, so on a 2-core machine the second core would otherwise idle).
            order.sort(key=lambda name: name not in TWO_PROCESS_SECTIONS)
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                for fut in [pool.submit(jobs[name]) for name in order]:
                    fut.result()
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        kit.write()
    failed = [n for n, r in kit.result["sections"].items() if not r.get("passed") and "skip_reason" not in r]
    print(f"[gpu_kit] wrote {kit.out_dir}/gpu_kit.json and gpu_kit.md; failed sections: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
