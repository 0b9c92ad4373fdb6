"""``openrlhf-shape eval``: avg@N pass@1 with Math-Verify (the paper's appendix B.1.2 protocol).

Example (the paper's five benchmarks, 4 engines)::

    openrlhf-shape eval --model /ckpt/hf --out_dir /runs/x/eval --preset paper --num_engines 4 \\
        --benchmark aime24=/data/aime24.jsonl --benchmark aime25=/data/aime25.jsonl \\
        --benchmark amc23=/data/amc23.jsonl --benchmark math500=/data/math500.jsonl \\
        --benchmark minerva=/data/minerva.jsonl --benchmark_keys minerva=question,answer
"""

from __future__ import annotations

import argparse

from openrlhf_shape.eval.config import (
    PRESETS,
    BenchmarkSpec,
    EvalConfig,
    parse_benchmark_arg,
    parse_keys_arg,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory or one of our Megatron checkpoints")
    p.add_argument(
        "--benchmark",
        action="append",
        required=True,
        metavar="NAME=SOURCE",
        help="repeatable; SOURCE is a .jsonl/.json/.parquet file or an HF dataset id org/name[@split]",
    )
    p.add_argument("--out_dir", required=True, help="results, report.json and report.md (resumable)")
    p.add_argument("--preset", default="paper", choices=sorted(PRESETS), help="paper: N by benchmark name, "
                   "32768 tokens; cpu: N=2, 256 tokens (same T/top-p/top-k)")
    p.add_argument("--n_samples", type=int, default=None, help="N for every benchmark (overrides the preset)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="overrides the preset's token limit")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--input_key", default="problem", help="question field (default for every benchmark)")
    p.add_argument("--label_key", default="answer", help="reference answer field (default for every benchmark)")
    p.add_argument("--id_key", default=None, help="problem id field (default: row index)")
    p.add_argument("--benchmark_keys", action="append", default=[], metavar="NAME=INPUT_KEY,LABEL_KEY",
                   help="per-benchmark question/answer fields")
    p.add_argument("--prompt_template", default=None, help="text with '{question}' (default: the R1 boxed prompt)")
    p.add_argument("--no_chat_template", action="store_true", help="feed the raw prompt, no chat template")
    p.add_argument("--system_prompt", default=None)
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--num_engines", type=int, default=1, help="vLLM engines (Ray actors when > 1)")
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    p.add_argument("--kv_cache_gib", type=float, default=1.0, help="CPU only: KV cache space per engine")
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--max_model_len", type=int, default=None, help="default: longest prompt + max_new_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk_size", type=int, default=None,
                   help="problems per generate call, the resume granularity (default: 512 sequences per engine "
                        "with --preset paper, 16 with cpu)")
    p.add_argument("--scorer_workers", type=int, default=2)
    p.add_argument("--bootstrap_samples", type=int, default=1000)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--no_save_responses", action="store_true", help="keep only scores and token counts")
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out_dir")


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    keys = {}
    for text in args.benchmark_keys:
        name, ik, lk = parse_keys_arg(text)
        keys[name] = (ik, lk)
    benches = []
    for text in args.benchmark:
        name, source = parse_benchmark_arg(text)
        ik, lk = keys.pop(name, (args.input_key, args.label_key))
        benches.append(BenchmarkSpec(name=name, source=source, input_key=ik, label_key=lk, id_key=args.id_key))
    if keys:
        raise ValueError(f"--benchmark_keys names no --benchmark: {sorted(keys)}")
    extra = {} if args.prompt_template is None else {"prompt_template": args.prompt_template}
    return EvalConfig(
        model_path=args.model,
        benchmarks=benches,
        out_dir=args.out_dir,
        preset=args.preset,
        n_samples=args.n_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        apply_chat_template=not args.no_chat_template,
        system_prompt=args.system_prompt,
        limit=args.limit,
        num_engines=args.num_engines,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        chunk_size=args.chunk_size,
        scorer_workers=args.scorer_workers,
        bootstrap_samples=args.bootstrap_samples,
        confidence=args.confidence,
        save_responses=not args.no_save_responses,
        overwrite=args.overwrite,
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    import signal
    import sys

    from openrlhf_shape.eval.runner import evaluate

    cfg = config_from_args(args)
    # SIGTERM (a scheduler's kill, `timeout`) -> SystemExit, so engines, Ray and the scorer pool are
    # shut down on the way out; finished problems are already on disk and the next run resumes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = evaluate(cfg)
    print(report.to_markdown())
    print(f"wrote {report.json_path} and {report.markdown_path}")
    return 0
