"""The ``openrlhf-shape`` console script: ``train | eval | convert | analyze | frontier | doctor``.

Each sub-command lives in its own module under ``openrlhf_shape.cli`` and registers itself in
``SUBCOMMANDS`` below; heavy imports (torch, Ray, vLLM, Megatron) happen only inside the command
that needs them, so ``openrlhf-shape --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from openrlhf_shape import __version__

# name -> (module, one-line help). The module exposes ``add_arguments(parser)`` and ``run(args)``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("openrlhf_shape.cli.train", "SHAPE / MRT / GRPO training (Megatron actor, vLLM rollouts)"),
    "eval": ("openrlhf_shape.cli.evaluate", "avg@N pass@1 evaluation with Math-Verify"),
    "convert": ("openrlhf_shape.cli.convert", "convert checkpoints (GGUF/Megatron -> Hugging Face)"),
    "analyze": ("openrlhf_shape.cli.analyze", "the paper's analysis figures from metrics files"),
    "frontier": ("openrlhf_shape.cli.frontier", "keep the training problems the policy solves sometimes (pass-rate band)"),
    "doctor": ("openrlhf_shape.cli.doctor", "check the Ray cluster a job will use: nodes, placement, rendezvous, shared paths"),
}


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def build_parser(with_subcommand: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openrlhf-shape",
        description="SHAPE: stage-aware hierarchical advantage via potential estimation.",
    )
    parser.add_argument("--version", action="version", version=f"openrlhf-shape {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen sub-command imports its module (keeps --help fast).
        if name == with_subcommand:
            module = _load(name)
            if module is None:
                p.set_defaults(_unavailable=True)
            else:
                module.add_arguments(p)
                p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(chosen)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Commands that take dotted config flags (train) receive the rest; others reject it.
        module = _load(args.command) if args.command else None
        if module is None or not getattr(module, "ACCEPTS_OVERRIDES", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = unknown
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "_unavailable", False):
        parser.error(f"'{args.command}' is not available in this build yet")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
