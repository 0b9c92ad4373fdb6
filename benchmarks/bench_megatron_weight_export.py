"""Bucketed HF weight export throughput (MB/s) vs one tensor at a time, through the real worker.

A world-1 Megatron worker (CPU, gloo) holds a ~100M-parameter random Qwen3-shaped model and
streams its HF-named weights with ``iter_hf_weights``; every bucket goes to a sink: ``ray.put``
into a local Ray object store (what the weight sync does before vLLM's ``reload_weights``;
``--sink pickle`` serialises into memory instead). Both variants run in the same process, one
after the other, twice each (the first pass warms up); the best pass counts.

    python benchmarks/bench_megatron_weight_export.py [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
import tempfile
import time
from openrlhf_shape.platform import detect_platform  # noqa: E402  (driverless: decides for this process)


def run_rank(*, rank: int, world_size: int, master_addr: str, master_port: int, model_dir: str, bucket_mb: int, sink: str) -> dict:
    from openrlhf_shape.megatron.config import MegatronConfig
    from openrlhf_shape.megatron.worker import MegatronRankWorker

    worker = MegatronRankWorker(MegatronConfig(), rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, platform=detect_platform())
    info = worker.init_model(model_dir)
    out = {"params": info["num_parameters"]}
    if sink == "ray":
        import ray

        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False)
    for label, bucket_bytes in (("one_tensor", 1), ("bucketed", bucket_mb << 20)):
        best = None
        for _ in range(2):
            t0 = time.perf_counter()
            total, calls = 0, 0
            refs = []
            for bucket in worker.iter_hf_weights(bucket_bytes):
                if sink == "ray":
                    refs.append(ray.put(bucket))
                else:
                    pickle.dump(bucket, io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                calls += 1
            dt = time.perf_counter() - t0
            del refs
            best = dt if best is None else min(best, dt)
        out[label] = {"seconds": best, "mb": total / 2**20, "calls": calls}
    if sink == "ray":
        ray.shutdown()
    worker.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sink", choices=["ray", "pickle"], default="ray")
    args = ap.parse_args()
    from openrlhf_shape.actor.launch import run_ranks
    from openrlhf_shape.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(os.path.join(tmp, "m"), arch="qwen3", num_layers=args.layers, vocab_size=8192,
                                        hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                                        num_key_value_heads=8, head_dim=64))
        res = run_ranks(f"{os.path.splitext(os.path.basename(__file__))[0]}:run_rank", 1,
                        kwargs={"model_dir": model_dir, "bucket_mb": args.bucket_mb, "sink": args.sink}, timeout=900,
                        extra_pythonpath=[os.path.dirname(os.path.abspath(__file__))])[0]
    print(f"model: {res['params'] / 1e6:.1f}M params, {res['bucketed']['mb']:.0f} MB float32; sink: {args.sink}")
    rates = {}
    for label in ("one_tensor", "bucketed"):
        r = res[label]
        rates[label] = r["mb"] / r["seconds"]
        print(f"  {label:10s}: {r['calls']:4d} calls  {r['seconds']:.2f} s  {rates[label]:8.1f} MB/s")
    print(f"  throughput ratio bucketed({args.bucket_mb} MB)/one-tensor = {rates['bucketed'] / rates['one_tensor']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
