"""``openrlhf-shape train --config configs/X.yaml [--section.key VALUE ...]``."""

from __future__ import annotations

import argparse

ACCEPTS_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML preset (see configs/); dotted flags override it")
    parser.add_argument("--resume", default=None, help="auto | none | a checkpoint directory (= --ckpt.resume)")
    parser.add_argument("--print_config", action="store_true", help="print the resolved config and exit")
    parser.add_argument(
        "--dry_run", action="store_true",
        help="print the placement map, the per-GPU memory plan and a step-time estimate, then exit "
        "(0: fits, 2: refused); reads only the model's config.json. --plan.<name> VALUE overrides "
        "the planner's assumptions (e.g. --plan.mfu 0.3, --plan.gpu_memory_gib 139)",
    )
    parser.epilog = (
        "Any option of the config can be given as a dotted flag, with OpenRLHF 0.11's names wherever the "
        "meaning is the same, e.g. --actor.model_name_or_path DIR --data.prompt_dataset FILE --rollout.batch_size 128 "
        "--rollout.n_samples_per_prompt 8 --train.batch_size 256 --actor.eps_clip_low_high 0.2 0.28 "
        "--algo.advantage.estimator shape|mrt|group_norm --shape.alpha 0.3 --megatron.tensor_model_parallel_size 2 "
        "--reward.remote_url my_reward.py. OpenRLHF flags for parts this trainer does not have are refused, "
        "each with the reason (docs/openrlhf_compat.md: every OpenRLHF flag)."
    )


def _names_a_flag(exc: BaseException) -> bool:
    """A user's mistake found once the run has started (a data key the prompt file lacks, a model the layout cannot
    split, bf16 on a CPU-only Megatron run): its message starts with the flag to change, as every message of a check
    does here. Those end the command with the message alone; anything else keeps its traceback."""
    msg = exc.args[0] if exc.args else None
    return isinstance(msg, str) and msg.startswith("--")


def run(args: argparse.Namespace) -> int:
    import yaml

    from openrlhf_shape.config import load_config

    overrides = list(getattr(args, "overrides", []) or [])
    if args.resume is not None:
        overrides += ["--ckpt.resume", args.resume]
    if args.dry_run:
        from openrlhf_shape.planner.cli import dry_run

        return dry_run(args.config, overrides)
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"openrlhf-shape train: error: {exc}")
    if args.print_config:
        from openrlhf_shape.config.load import flag_view

        print(yaml.safe_dump(flag_view(cfg), sort_keys=False))
        return 0
    from openrlhf_shape.trainer.ppo_trainer import check_resume, run_training

    try:  # a checkpoint this run cannot continue: one line, before the console, Ray and the engines start
        check_resume(cfg)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"openrlhf-shape train: error: {exc}")

    from openrlhf_shape.rollout import EngineLostError
    from openrlhf_shape.trainer.experience import FilteringExhausted
    from openrlhf_shape.trainer.ppo_trainer import RankLostError

    try:
        summary = run_training(cfg)
    except (FilteringExhausted, EngineLostError, RankLostError) as exc:
        # the data could not fill a batch, an engine or a rank is lost past its budget: the message names the
        # flags (and the engine or rank, the step), no traceback; the run checkpointed what it could
        raise SystemExit(f"openrlhf-shape train: stopped: {exc}") from None
    except (ValueError, KeyError, FileNotFoundError) as exc:
        if not _names_a_flag(exc):
            raise
        raise SystemExit(f"openrlhf-shape train: error: {exc.args[0]}") from None
    if summary:
        print(f"done: steps {summary['steps'][0]}..{summary['steps'][-1]}, report in {cfg.ckpt.output_dir}/report.md")
    return 0
