"""Benchmark the batched SHAPE maths and the memory of chunked entropy.

Prints, in one run on this machine:
1. wall time of segmentation + advantages + TCR for a padded batch (default 1024 x 8192 tokens);
2. peak memory of ``token_entropy`` chunked vs unchunked at vocab 151936, and their ratio.

Run: ``.venv/bin/python benchmarks/bench_algorithms.py [--batch 1024 --tokens 8192]``
"""

from __future__ import annotations

import argparse
import time

import torch

from openrlhf_shape.algorithms import ShapeConfig, compute_token_advantages, get_estimator, segment_batch, token_entropy


def bench_pipeline(batch: int, tokens: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    ent = torch.rand(batch, tokens, generator=g) * 3
    rewards = (torch.rand(batch, generator=g) > 0.5).float()
    cfg = ShapeConfig(num_segments=8, min_segment_len=8)
    estimator = get_estimator("shape", cfg)
    best = {"segment": float("inf"), "advantages+tcr": float("inf"), "cpu": float("inf")}
    for _ in range(repeats):
        c0 = time.process_time()
        t0 = time.perf_counter()
        bnd = segment_batch(ent, mask, cfg)
        t1 = time.perf_counter()
        n_seg = (bnd >= 0).sum(-1) + 1  # segments per response; Phi_{n_seg} = R
        phi = (torch.randint(0, 9, (batch, cfg.num_segments + 1), generator=g).float() / 8)
        phi.scatter_(1, n_seg[:, None], rewards[:, None])
        t2 = time.perf_counter()
        compute_token_advantages(estimator, mask, rewards, 8, tokens, ent, bnd, phi)
        t3 = time.perf_counter()
        best["cpu"] = min(best["cpu"], time.process_time() - c0)
        best["segment"] = min(best["segment"], t1 - t0)
        best["advantages+tcr"] = min(best["advantages+tcr"], t3 - t2)
    best["total"] = best["segment"] + best["advantages+tcr"]
    return best




def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _entropy_peak_child(tokens: int, vocab: int, chunk: int | None, queue) -> None:
    """In a fresh process: extra peak RSS (bytes) of one token_entropy call over bf16 logits."""
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM (peak RSS) to the current RSS
        f.write("5")
    base = _rss_kib("VmRSS")
    token_entropy(logits, temperature=0.6, chunk_size=chunk)
    queue.put((_rss_kib("VmHWM") - base) * 1024)


def bench_entropy_memory(tokens: int, vocab: int) -> dict[str, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def peak(chunk):
        q = ctx.Queue()
        p = ctx.Process(target=_entropy_peak_child, args=(tokens, vocab, chunk, q))
        p.start()
        value = q.get(timeout=600)
        p.join()
        return value

    unchunked = peak(tokens)  # one chunk = the whole batch upcast at once
    chunked = peak(None)  # default chunking (~64 MiB of float32 per chunk)
    return {
        "logits_bf16_MiB": tokens * vocab * 2 / 2**20,
        "unchunked_peak_MiB": unchunked / 2**20,
        "chunked_peak_MiB": chunked / 2**20,
        "ratio": unchunked / max(chunked, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--entropy_tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    t = bench_pipeline(args.batch, args.tokens, args.repeats)
    print(
        f"[pipeline] {args.batch} x {args.tokens} tokens, K=8: segmentation {t['segment']:.3f} s, "
        f"advantages+TCR {t['advantages+tcr']:.3f} s, total {t['total']:.3f} s wall (target < 2 s), "
        f"{t['cpu']:.3f} s CPU time over {torch.get_num_threads()} threads (wall inflates when the machine is shared)"
    )
    m = bench_entropy_memory(args.entropy_tokens, args.vocab)
    print(
        f"[entropy] {args.entropy_tokens} tokens x vocab {args.vocab} (bf16 logits {m['logits_bf16_MiB']:.0f} MiB): "
        f"peak extra RSS unchunked {m['unchunked_peak_MiB']:.0f} MiB, chunked {m['chunked_peak_MiB']:.0f} MiB, "
        f"ratio {m['ratio']:.1f}x"
    )


if __name__ == "__main__":
    main()
