"""``openrlhf-shape train --config X [flags] --dry_run``: resolve the config, plan, print, exit."""

from __future__ import annotations

import sys


def dry_run(config_path: str | None, overrides: list[str]) -> int:
    """Print the plan of ``config_path`` + ``overrides``; return 0 when it fits, 2 when refused.

    ``--plan.*`` flags go to the planner; every other flag resolves the training config as the
    trainer would (local paths of data, weights and checkpoints need not exist)."""
    from openrlhf_shape.planner.assumptions import parse_plan_options, split_plan_flags
    from openrlhf_shape.planner.plan import build_plan
    from openrlhf_shape.planner.report import format_plan
    from openrlhf_shape.planner.split import search_split
    from openrlhf_shape.config import load_config

    plan_flags, rest = split_plan_flags(overrides)
    try:
        options = parse_plan_options(plan_flags)
        cfg = load_config(config_path, rest, check_paths=False)
        plan = build_plan(cfg, options, config_path)
        plan.split = search_split(plan, cfg)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"openrlhf-shape train --dry_run: error: {exc}")
    print(format_plan(plan))
    sys.stdout.flush()
    return 0 if plan.fits else 2
