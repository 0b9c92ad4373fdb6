"""``openrlhf-shape eval``: avg@N pass@1 (the paper's appendix B.1.2 protocol), judged as training judges answers:
Math-Verify, or with ``--reward.remote_url`` an OpenRLHF ``reward_func`` file or HTTP reward server (its ``scores``).

Example (the paper's five benchmarks, 4 engines)::

    openrlhf-shape eval --model /ckpt/hf --out_dir /runs/x/eval --preset paper --num_engines 4 \\
        --benchmark aime24=/data/aime24.jsonl --benchmark aime25=/data/aime25.jsonl \\
        --benchmark amc23=/data/amc23.jsonl --benchmark math500=/data/math500.jsonl \\
        --benchmark minerva=/data/minerva.jsonl --benchmark_keys minerva=question,answer
"""

from __future__ import annotations

import argparse

from openrlhf_shape.eval.config import (
    FLAT_FLAGS,
    PRESETS,
    BenchmarkSpec,
    EvalConfig,
    parse_benchmark_arg,
    parse_keys_arg,
)

# Help for the generated flags (their types and defaults come from EvalConfig and its components).
_HELP = {
    "n_samples": "N for every benchmark (overrides the preset)",
    "max_new_tokens": "overrides the preset's token limit",
    "limit": "first N problems of each benchmark",
    "num_engines": "vLLM engines (Ray actors when > 1)",
    "kv_cache_gib": "CPU only: KV cache space per engine",
    "max_model_len": "default: longest prompt + max_new_tokens",
    "chunk_size": "problems per generate call, the resume granularity (default: 512 sequences per engine "
                  "with --preset paper, 16 with cpu)",
    "scorer_workers": "Math-Verify processes (= --reward.num_workers)",
    "scorer_timeout_s": "seconds per Math-Verify answer (= --reward.timeout_s)",
    "reward.remote_url": "judge with this reward_func .py file or http(s) reward server(s), comma-separated, as "
                         "training's --reward.remote_url (its `scores` count); default: Math-Verify",
    "reward.remote_timeout_s": "per HTTP request to the reward server",
    "reward.remote_retries": "retries per HTTP request to the reward server",
    "reward.max_chars": "Math-Verify reads the last this many characters of a response",
}
# The flat flags that training spells --reward.*: both names work.
_TRAINING_NAMES = {"scorer_workers": "reward.num_workers", "scorer_timeout_s": "reward.timeout_s"}


def _flat_defaults() -> dict[str, tuple[type, object]]:
    """flat flag -> (type, default), read from the EvalConfig dataclasses."""
    from openrlhf_shape.config.flags import leaf_types

    types = leaf_types(EvalConfig)
    base = EvalConfig("m", [BenchmarkSpec("aime24", "x")], ".")
    out = {}
    for flag, path in FLAT_FLAGS.items():
        obj = base
        for part in path.split("."):
            obj = getattr(obj, part)
        out[flag] = (types[path], obj)
    return out


def _arg_type(tp):
    import functools

    from openrlhf_shape.config.flags import convert

    return functools.partial(convert, tp=tp, flag="eval")


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
    p.add_argument("--input_key", default="problem", help="question field (default for every benchmark)")
    p.add_argument("--label_key", default="answer", help="reference answer field (default for every benchmark)")
    p.add_argument("--id_key", default=None, help="problem id field (default: row index)")
    p.add_argument("--benchmark_keys", action="append", default=[], metavar="NAME=INPUT_KEY,LABEL_KEY",
                   help="per-benchmark question/answer fields")
    p.add_argument("--prompt_template", default=None, help="text with '{question}' (or OpenRLHF's '{}', braces doubled) for the problem "
                   "(default: the R1 boxed prompt)")
    p.add_argument("--no_chat_template", action="store_true", help="feed the raw prompt, no chat template")
    p.add_argument("--no_save_responses", action="store_true", help="keep only scores and token counts")
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out_dir")
    for flag, (tp, default) in _flat_defaults().items():
        names = [f"--{flag}"] + ([f"--{_TRAINING_NAMES[flag]}"] if flag in _TRAINING_NAMES else [])
        p.add_argument(*names, dest=flag, type=_arg_type(tp), default=default,
                       help=_HELP.get(flag, f"= {FLAT_FLAGS[flag]}"))


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    from openrlhf_shape.config.flags import FlagSpace

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
    base = EvalConfig(model_path=args.model, benchmarks=benches, out_dir=args.out_dir, preset=args.preset,
                      apply_chat_template=not args.no_chat_template, save_responses=not args.no_save_responses,
                      overwrite=args.overwrite, **extra)
    values = {path: getattr(args, flag) for flag, path in FLAT_FLAGS.items()}
    try:
        return FlagSpace(EvalConfig).build(base, values)
    except ValueError as exc:  # name the flat flag, not the field path
        msg = str(exc)
        for flag, path in FLAT_FLAGS.items():
            msg = msg.replace(f"--{path}", f"--{flag}")
        raise ValueError(msg) from None


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
