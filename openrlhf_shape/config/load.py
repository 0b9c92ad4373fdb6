"""Defaults <- YAML preset <- dotted flags: :func:`load_config`, and an old run's saved config."""

from __future__ import annotations

import logging
import os
from typing import Any

import yaml

from openrlhf_shape.config.checks import validate
from openrlhf_shape.config.compat import implied, notes, translate
from openrlhf_shape.config.flags import FlagSpace, flatten_mapping, parse_overrides
from openrlhf_shape.config.tree import TrainConfig

# Fields decided at set-up, never flags (the value names the flag to use instead).
DERIVED: dict[str, str] = {
    "vllm.model_path": "--actor.model_name_or_path",
    "vllm.seed": "--train.seed",
    "vllm.enable_sleep_mode": "--train.colocate_all",
    "vllm.return_routed_experts": "--megatron.routing_replay r3",
}
FLAGS = FlagSpace(TrainConfig, derived=DERIVED)
log = logging.getLogger(__name__)


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: {path} does not exist (presets live in configs/)")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of sections")
    return data


def _resolved(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for flag, value in translate(pairs):
        values.update(FLAGS.resolve(flag, value))
    return values


def load_config(yaml_path: str | None = None, overrides: list[str] | None = None, *,
                check_paths: bool = True) -> TrainConfig:
    """Defaults <- YAML file <- dotted flags; returns a validated :class:`TrainConfig`.

    Flags and YAML keys go through :func:`~openrlhf_shape.config.compat.translate` first: OpenRLHF
    flags for parts this trainer does not have are refused (all of them, one line each), OpenRLHF's
    value encodings are translated, and what an accepted OpenRLHF flag implies here is logged once
    (:func:`~openrlhf_shape.config.compat.notes`, :func:`~openrlhf_shape.config.compat.implied`). ``check_paths=False`` (the
    dry run) skips the checks that the data and model paths exist on this machine."""
    values: dict[str, Any] = {}
    said: list[str] = []
    if yaml_path:
        try:
            pairs = flatten_mapping(_read_yaml(yaml_path), FLAGS)
            values.update(_resolved(pairs))
        except ValueError as exc:
            raise ValueError(f"{yaml_path}: {exc}") from None
        said += notes(pairs)
    pairs = parse_overrides(list(overrides or []))
    values.update(_resolved(pairs))
    said += notes(pairs) + implied(values)
    cfg = FLAGS.build(TrainConfig(), values)
    validate(cfg, check_paths)
    for line in dict.fromkeys(said):  # once each, after the config is known to be valid
        log.warning("%s", line)
    return cfg


def config_from_dict(saved: dict[str, Any]) -> TrainConfig:
    """A saved config (``run.json``'s ``config``: ``to_dict()`` of this tree), not validated."""
    values: dict[str, Any] = {}
    for path, value in _flat(saved):
        if path not in DERIVED:
            values.update(FLAGS.resolve(path, value))
    return FLAGS.build(TrainConfig(), values)


def _flat(node: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if isinstance(value, dict) and key != "extra" and f"{prefix}{key}" not in FLAGS.types:
            out.extend(_flat(value, f"{prefix}{key}."))
        elif key != "extra":
            out.append((f"{prefix}{key}", value))
    return out


def flag_view(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config as the flags a user types, nested by dots: what ``--print_config`` prints
    (a valid preset: every key is a flag path; derived fields are left out)."""
    out: dict[str, Any] = {}
    for path in FLAGS.types:
        if path in DERIVED:
            continue
        value = cfg.get(path)
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out
