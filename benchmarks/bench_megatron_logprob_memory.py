"""Peak memory of the chunked log-prob + entropy path vs a naive full-logits computation.

Vocab 151936 (Qwen3). Each method runs in a fresh subprocess; peak = ru_maxrss after the
computation minus ru_maxrss after the inputs were allocated (CPU, float32, TP=1: the chunked
path is the same code the Megatron worker runs on its vocab shard). Prints both peaks, times,
the max abs difference of the results, and the ratio, all from one run.

    python benchmarks/bench_megatron_logprob_memory.py [--tokens 1024] [--hidden 256] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VOCAB = 151936


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _child(method: str, tokens: int, hidden: int, chunk: int, temperature: float) -> None:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g) * 0.05
    w = torch.randn(VOCAB, hidden, generator=g) * 0.05
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    base = _maxrss_mb()
    t0 = time.perf_counter()
    if method == "naive":
        logits = (h @ w.t()).float() / temperature  # [tokens, vocab] float32
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None])[:, 0]
        ent = -(logp_all.exp() * logp_all).sum(-1)
    else:
        from openrlhf_shape.actor.logprobs import vocab_parallel_logprobs_entropy

        logp, ent = vocab_parallel_logprobs_entropy(h, w, targets, vocab_start=0, temperature=temperature, chunk_size=chunk)
    elapsed = time.perf_counter() - t0
    peak = _maxrss_mb() - base
    print(json.dumps({"peak_mb": peak, "seconds": elapsed, "logp": logp[:64].tolist(), "ent": ent[:64].tolist()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--child", choices=["naive", "chunked"])
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.tokens, args.hidden, args.chunk, args.temperature)
        return
    results = {}
    for method in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--child", method, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
               "--chunk", str(args.chunk), "--temperature", str(args.temperature)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])
    diff = max(
        max(abs(a - b) for a, b in zip(results["naive"][k], results["chunked"][k])) for k in ("logp", "ent")
    )
    full_mb = args.tokens * VOCAB * 4 / 2**20
    print(f"tokens={args.tokens} hidden={args.hidden} vocab={VOCAB} chunk={args.chunk} "
          f"(one float32 [tokens, vocab] tensor = {full_mb:.0f} MB)")
    for method in ("naive", "chunked"):
        r = results[method]
        print(f"  {method:8s} peak +{r['peak_mb']:8.1f} MB   {r['seconds']:.2f} s")
    ratio = results["naive"]["peak_mb"] / max(results["chunked"]["peak_mb"], 1e-9)
    print(f"  peak memory ratio naive/chunked = {ratio:.1f}x; max |diff| on 64 tokens = {diff:.2e}")


if __name__ == "__main__":
    main()
