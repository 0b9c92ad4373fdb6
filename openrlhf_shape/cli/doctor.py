"""``openrlhf-shape doctor --config configs/X.yaml [--section.key VALUE ...]``: check the Ray cluster a
job will run on (nodes, placement groups, rendezvous, shared paths, NCCL environment) before starting it.

Takes the same config and flags as ``train``; joins ``--train.ray_address`` (or starts a local Ray).
Exit 0 when every check passed, 1 otherwise (openrlhf_shape/cluster/doctor.py says what each check does).
It also says what recovery costs on the job's layout (the planner's estimate, ``planner/recovery.py``: per engine
failure an engine start + one weight sync, per rank failure a rank group start + the checkpoint load + a re-sync +
the steps since the last checkpoint); ``--plan.*`` flags change its assumptions as in ``train --dry_run``. The
critic's and a reward model's directories are checked for OpenRLHF's value head (:func:`value_model_report`).
"""

from __future__ import annotations

import argparse

ACCEPTS_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="the job's YAML preset (see configs/); dotted flags override it")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one check may wait (default 60)")


def recovery_report(cfg, plan_flags: list[str]) -> list[str]:
    """The planner's recovery lines for ``cfg`` (its layout, model and ``--ckpt.save_steps``) under ``plan_flags``
    (``--plan.*``), or one line saying why there is no estimate."""
    from openrlhf_shape.planner.assumptions import parse_plan_options
    from openrlhf_shape.planner.plan import build_plan
    from openrlhf_shape.planner.recovery import recovery_lines

    try:
        plan = build_plan(cfg, parse_plan_options(plan_flags))
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        return [f"recovery cost: no estimate ({exc})"]
    return recovery_lines(plan.recovery)


def value_model_report(cfg) -> list[tuple[str, str | None]]:
    """``(flag, problem or None)`` for each value model the run starts from a directory: the critic (estimators with
    a critic; none to check when it starts from the actor's path, where OpenRLHF initialises a fresh value head) and
    a reward model (``--reward.model_name_or_path`` when the config has it): the directory exists and holds
    OpenRLHF's value head (planner/value_models.py: ``<prefix>.weight`` of ``[1, hidden_size]``, the prefix config.json's
    or ``--ds.value_head_prefix``) and, for the reward model under ``--reward.normalize_enable``, its mean and std."""
    from openrlhf_shape.planner.value_models import value_head_problem

    paths = []
    if cfg.advantage_estimator().needs_critic and cfg.critic_model_path() != cfg.actor.model_name_or_path:
        paths.append(("critic.model_name_or_path", cfg.critic_model_path(), False))
    for path in filter(None, str(getattr(cfg.reward, "model_name_or_path", None) or "").split(",")):
        paths.append(("reward.model_name_or_path", path, cfg.reward.normalize_enable))
    return [(flag, value_head_problem(path, cfg.ds.value_head_prefix, normalize=norm)) for flag, path, norm in paths]


def run(args: argparse.Namespace) -> int:
    from openrlhf_shape.config import load_config
    from openrlhf_shape.planner.assumptions import split_plan_flags

    plan_flags, rest = split_plan_flags(list(getattr(args, "overrides", []) or []))
    try:
        cfg = load_config(args.config, rest, check_paths=False)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"openrlhf-shape doctor: error: {exc}")
    recovery = recovery_report(cfg, plan_flags)
    import ray

    from openrlhf_shape.cluster.doctor import run_doctor
    from openrlhf_shape.platform import detect_platform
    from openrlhf_shape.trainer.setup import start_ray

    owned = start_ray(cfg)
    try:
        platform = detect_platform(cfg)
        print(f"doctor: {cfg.train.ray_address or 'local Ray'}, {platform.device} run "
              f"({platform.cluster_gpus:g} GPUs seen)")
        checks = run_doctor(cfg, platform.on_gpu, args.timeout)
    finally:
        if owned:
            ray.shutdown()
    for c in checks:
        print(c.line())
    for line in recovery:
        print(f"doctor: {line}")
    values = value_model_report(cfg)
    for flag, problem in values:
        print(f"doctor: --{flag}: " + (problem or "ok (a value head in OpenRLHF's format)"))
    failed = [c.name for c in checks if not c.ok] + [flag for flag, problem in values if problem]
    total = len(checks) + len(values)
    print(f"doctor: {total - len(failed)} ok, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0
