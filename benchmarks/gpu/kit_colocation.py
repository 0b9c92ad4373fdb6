"""Colocation sections of the GPU verification kit: what a colocated step does with one GPU's memory.

* ``offload`` (rank side, through ``launch.run_ranks``): a Megatron rank with the distributed optimizer
  trains a step, offloads every state group to (pinned) host memory and back twice. Measured:
  ``torch.cuda.memory_reserved`` before / offloaded / after (the memory must really go back to the
  driver for vLLM to take it), the host bytes the offloader ever allocated (the second round trip must
  allocate nothing), and the log-probs after the round trips equal those before bit for bit.
* ``cuda_ipc`` (two processes on ONE GPU, spawned here): the colocated weight-sync transport. The
  sender is our ``CudaIpcSender``; the receiver is the worker extension's own
  ``shape_init_receiver`` / ``shape_receive`` with the ``cuda_ipc`` transport (the code an engine worker runs), mixed into a stand-in that has no vLLM:
  its ``reload_weights`` compares every tensor that arrives with what the sender sent. CUDA only.
* ``zero2_vs_megatron`` (rank side): one PPO step of DeepSpeed ZeRO-2 and one of Megatron from the
  same weights and batch, in the platform's dtype (bf16 on GPU): loss, grad norm and the log-probs
  after the step agree within the dtype's tolerance. Skipped, with the reason, when deepspeed is absent.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any

import torch
from openrlhf_shape.platform import detect_platform  # noqa: E402  (driverless: decides for this process)

N_IPC_TENSORS = 48


def _reserved() -> int:
    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


def _max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


# ------------------------------------------------------------------------------------------- offload
def offload(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: dict,
            batch: dict, workdir: str) -> dict:
    from kit_sections import _make_model, _megatron_logprobs, _train_batch, _worker

    model_dir = _make_model(model, workdir)
    w = _worker(cfg, rank, world_size, master_addr, master_port)
    w.init_model(model_dir)
    old = _megatron_logprobs(w, batch).log_probs
    w.train_step(_train_batch(batch, old, seed=11))  # optimizer states exist from here on
    before = _megatron_logprobs(w, batch).log_probs
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    out: dict[str, Any] = {"reserved_before": _reserved()}
    t0 = time.perf_counter()
    off = w.offload_states()
    out["offload_seconds"] = time.perf_counter() - t0
    out["reserved_offloaded"] = _reserved()
    t0 = time.perf_counter()
    w.onload_states()
    out["onload_seconds"] = time.perf_counter() - t0
    out["reserved_after"] = _reserved()
    out["offloaded_bytes"] = float(off["offloaded_bytes"])
    out["host_bytes_first_round"] = w.offloader.host_bytes_allocated
    w.offload_states()
    w.onload_states()
    out["host_bytes_second_round"] = w.offloader.host_bytes_allocated
    after = _megatron_logprobs(w, batch).log_probs
    out["logprobs_max_abs_change"] = _max_abs(before, after)
    out["pinned"] = bool(w.offloader.pin_memory)
    w.shutdown()
    return out


def offload_verdict(res: dict, gpu: bool) -> dict:
    rec = dict(res)
    ok = res["logprobs_max_abs_change"] == 0.0 and res["host_bytes_first_round"] == res["host_bytes_second_round"] > 0
    if gpu:
        returned = res["reserved_before"] - res["reserved_offloaded"]
        rec["returned_over_offloaded"] = returned / max(res["offloaded_bytes"], 1.0)
        ok = ok and rec["returned_over_offloaded"] >= 0.9 and res["pinned"]
    rec["passed"] = bool(ok)
    return rec


# ------------------------------------------------------------------------------------------- CUDA IPC
def _ipc_tensor(i: int) -> tuple[str, torch.Tensor]:
    """The i-th tensor both sides agree on (bf16, 1-8 MiB), generated on the GPU from a seed."""
    g = torch.Generator(device="cuda").manual_seed(1000 + i)
    rows = 256 * (1 + i % 8)
    return f"model.layers.{i}.weight", torch.randn(rows, 2048, generator=g, device="cuda").to(torch.bfloat16)


def _ipc_sender(queue, ack, result, bucket_bytes: int, timeout_s: float) -> None:
    from openrlhf_shape.weight_sync.cuda_ipc import CudaIpcSender

    torch.cuda.set_device(0)
    sender = CudaIpcSender([queue], [ack], timeout_s=timeout_s)
    sender.begin()
    bucket, size = [], 0
    for i in range(N_IPC_TENSORS):
        name, t = _ipc_tensor(i)
        if bucket and size + t.numel() * 2 > bucket_bytes:
            sender.send(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * 2
    sender.send(bucket)
    stats = sender.finish()
    result.put({"sender": stats.as_metrics(), "reserved_sender": _reserved()})


def _ipc_receiver(queue, ack, result, timeout_s: float) -> None:
    from openrlhf_shape.rollout.worker_ext import WeightSyncExtension

    class Receiver(WeightSyncExtension):
        """The extension's receiving code on a stand-in worker: rank 0 on cuda:0, no vLLM; its
        ``reload_weights`` checks each tensor against the sender's."""

        rank, device = 0, torch.device("cuda", 0)

        def __init__(self) -> None:
            self._shape_tied = None  # no vLLM model to inspect: no tied head,
            self._shape_moe_repacked = 0  # no CPU-packed MoE experts to re-pack
            self._shape_expected = frozenset(_ipc_tensor(i)[0] for i in range(N_IPC_TENSORS))
            self.mismatched: list[str] = []

        def reload_weights(self, weights_iterator) -> None:
            expected = dict(_ipc_tensor(i) for i in range(N_IPC_TENSORS))
            for name, t in weights_iterator:
                if t.device != self.device or not torch.equal(t, expected[name]):
                    self.mismatched.append(name)

    torch.cuda.set_device(0)
    r = Receiver()
    r.shape_init_receiver("cuda_ipc", "kit", {"queues": [queue], "acks": [ack]}, timeout_s)
    stats = r.shape_receive("kit")
    result.put({"receiver": stats, "mismatched": r.mismatched})


def cuda_ipc(bucket_bytes: int = 32 << 20, timeout_s: float = 120.0) -> dict:
    """Driver side: one sender and one receiver process on GPU 0; both report into a result queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, ack, result = ctx.Queue(maxsize=2), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_ipc_sender, args=(q, ack, result, bucket_bytes, timeout_s)),
             ctx.Process(target=_ipc_receiver, args=(q, ack, result, timeout_s))]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    reports: list[dict] = []
    deadline = time.monotonic() + timeout_s + 60
    while len(reports) < len(procs):  # stop at once when a side dies (its partner would wait its whole timeout)
        try:
            reports.append(result.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"cuda_ipc: {'a side exited with ' + str(dead) if dead else 'no report in time'}; "
                                   "its traceback is in the log above") from None
    for p in procs:
        p.join(timeout=60)
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"tensors": N_IPC_TENSORS, "bucket_bytes": bucket_bytes, "wall_seconds": seconds,
                           "exit_codes": [p.exitcode for p in procs]}
    for r in reports:
        out.update(r)
    sent = out["sender"]["sync/bytes"]
    out["GBps"] = sent / 2**30 / max(out["receiver"]["seconds"], 1e-9)
    out["passed"] = (not out["mismatched"] and out["receiver"]["tensors"] == N_IPC_TENSORS
                     and out["receiver"]["bytes"] == sent and out["exit_codes"] == [0, 0])
    return out


# ---------------------------------------------------------------------------------- ZeRO-2 vs Megatron
def zero2_vs_megatron(*, rank: int, world_size: int, master_addr: str, master_port: int, cfg: dict, model: dict,
                      batch: dict, workdir: str) -> dict:
    """Megatron first, then DeepSpeed ZeRO-2 in the same process group, from the same HF weights."""
    from kit_sections import _make_model, _megatron_logprobs, _train_batch, _worker

    from openrlhf_shape.actor.rank_outputs import merge_rank_outputs
    from openrlhf_shape.megatron.config import MegatronSettings
    from openrlhf_shape.testing.rank_configs import zero_config
    from openrlhf_shape.zero.worker import ZeroRankWorker

    model_dir = _make_model(model, workdir)
    mg = _worker(cfg, rank, world_size, master_addr, master_port)
    mg.init_model(model_dir)
    old = _megatron_logprobs(mg, batch).log_probs
    tb = _train_batch(batch, old, seed=21)
    out: dict[str, Any] = {"megatron": {"metrics": mg.train_step(tb)}}
    out["megatron"]["after"] = _megatron_logprobs(mg, batch).log_probs
    mg.shutdown()
    megatron_only = {f.name for f in dataclasses.fields(MegatronSettings)}  # the Megatron rank's layout and switches
    ds = ZeroRankWorker(zero_config({k: v for k, v in cfg.items() if k not in megatron_only}, zero_stage=2),
                        rank=rank, world_size=world_size,
                        master_addr=master_addr, master_port=master_port, platform=detect_platform())
    ds.init_model(model_dir)
    out["deepspeed"] = {"metrics": ds.train_step(tb)}
    out["deepspeed"]["after"] = merge_rank_outputs([ds.compute_logprobs_and_entropy(batch)],
                                                   len(batch["sequences"])).log_probs
    out["dtype"] = str(ds.cfg.param_dtype)
    ds.shutdown()
    return out


def zero2_verdict(res: dict, gpu: bool) -> dict:
    mg, ds = res["megatron"], res["deepspeed"]
    tol = {"loss": 2e-2, "grad_norm_rel": 5e-2, "logprob_mean": 2e-2} if gpu else \
        {"loss": 1e-4, "grad_norm_rel": 1e-3, "logprob_mean": 1e-4}
    lp = torch.cat([(a.float() - b.float()).abs() for a, b in zip(mg["after"], ds["after"]) if a.numel()])
    rec = {"dtype": res["dtype"], "tolerances": tol,
           "loss": {"megatron": mg["metrics"]["loss"], "deepspeed": ds["metrics"]["loss"]},
           "grad_norm": {"megatron": mg["metrics"]["grad_norm"], "deepspeed": ds["metrics"]["grad_norm"]},
           "logprobs_after_step": {"mean_abs": float(lp.mean()), "max_abs": float(lp.max())}}
    gn = abs(mg["metrics"]["grad_norm"] - ds["metrics"]["grad_norm"]) / max(abs(mg["metrics"]["grad_norm"]), 1e-12)
    rec["passed"] = bool(abs(mg["metrics"]["loss"] - ds["metrics"]["loss"]) <= tol["loss"]
                         and gn <= tol["grad_norm_rel"] and rec["logprobs_after_step"]["mean_abs"] <= tol["logprob_mean"])
    return rec


def deepspeed_available() -> str | None:
    """None when deepspeed imports, else why not."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"deepspeed not importable ({type(e).__name__}: {e}); carry its wheel in .whl/"
    return None


def te_available() -> str | None:
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"transformer_engine not importable ({type(e).__name__}); the TE layer spec needs its wheel"
    return None


