"""Defaults <- YAML preset <- dotted flags: :func:`load_config`, and an old run's saved config."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Mapping

import yaml

from openrlhf_shape.config.checks import validate
from openrlhf_shape.config.compat import implied, notes, own_defaults_note, translate
from openrlhf_shape.config.flags import FlagSpace, flatten_mapping, parse_overrides
from openrlhf_shape.config.openrlhf import OPENRLHF_PPO_FLAGS, OWN, SAME, VALUES, OpenRLHFFlag, refusal, show
from openrlhf_shape.config.tree import TrainConfig

# Fields decided at set-up, never flags (the value names the flag to use instead).
DERIVED: dict[str, str] = {
    "vllm.model_path": "--actor.model_name_or_path",
    "vllm.seed": "--train.seed",
    "vllm.enable_sleep_mode": "--train.colocate_all",
    "vllm.return_routed_experts": "--megatron.routing_replay r3",
    "vllm.sampled_entropy": "--shape.entropy_source engine",
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
    (:func:`~openrlhf_shape.config.compat.notes`, :func:`~openrlhf_shape.config.compat.implied`), and so, in one
    line, are the OpenRLHF defaults the run does not follow because neither the file nor the flags set them
    (:func:`~openrlhf_shape.config.compat.own_defaults_note`). ``check_paths=False`` (the dry run) skips the checks
    that the data and model paths exist on this machine."""
    values: dict[str, Any] = {}
    said: list[str] = []
    given: set[str] = set()  # every name the file and the command line set, as typed and as resolved
    if yaml_path:
        try:
            pairs = flatten_mapping(_read_yaml(yaml_path), FLAGS)
            values.update(_resolved(pairs))
        except ValueError as exc:
            raise ValueError(f"{yaml_path}: {exc}") from None
        said += notes(pairs)
        given |= {name for name, _ in pairs}
    pairs = parse_overrides(list(overrides or []))
    values.update(_resolved(pairs))
    given |= {name for name, _ in pairs} | set(values)
    said += notes(pairs) + implied(values) + [own_defaults_note(given) or ""]
    cfg = FLAGS.build(TrainConfig(), values)
    validate(cfg, check_paths)
    for line in dict.fromkeys(filter(None, said)):  # once each, after the config is known to be valid
        log.warning("%s", line)
    return cfg


def _same(value: Any, other: Any) -> bool:
    as_list = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
    return as_list(value) == as_list(other)


def _shown(cfg: TrainConfig, path: str) -> str:
    try:
        return show(cfg.get(path))
    except AttributeError:
        return "(no such flag here)"


def _effective(f: OpenRLHFFlag, value: Any) -> dict[str, Any] | None:
    """What OpenRLHF's ``--f.name value`` sets here (flag path -> typed value); None when it cannot be given."""
    try:
        out: dict[str, Any] = {}
        for path, v in translate([(f.name, value)]):
            out.update(FLAGS.resolve(path, v))
        return out
    except (TypeError, ValueError):
        return None


def default_mismatches(theirs: Mapping[str, Any], rows: Iterable[OpenRLHFFlag] = OPENRLHF_PPO_FLAGS,
                       ours: TrainConfig | None = None) -> list[str]:
    """The rule of docs/openrlhf_compat.md, checked: one line per row of ``rows`` that breaks it, given OpenRLHF's
    parser defaults ``theirs`` (flag name -> default; tests read them from the installed package) and our defaults
    ``ours`` (a fresh :class:`TrainConfig`). A row breaks it when its recorded default is not OpenRLHF's; when it
    is ``same`` and OpenRLHF's default, given as the flag, would change our config; when it is ``own`` and it would
    not (then it is ``same``); or when it is ``values`` and OpenRLHF's accepted default is not our default."""
    ours = ours if ours is not None else TrainConfig()
    out: list[str] = []
    for f in rows:
        if f.name not in theirs:
            out.append(f"--{f.name}: not a flag of OpenRLHF's parser")
            continue
        want = theirs[f.name]
        if not _same(f.default, want) and f.name != "logger.wandb.run_name":  # that default is the start time
            out.append(f"--{f.name}: the table records the default {f.default!r}, OpenRLHF's parser has {want!r}")
        if f.kind not in (SAME, OWN, VALUES) or (f.kind == VALUES and refusal(f.name, want)):
            continue
        sets = _effective(f, want)
        follows = sets is not None and all(_same(ours.get(p), v) for p, v in sets.items())
        if f.kind in (SAME, VALUES) and not follows:
            here = ", ".join(f"--{p} {_shown(ours, p)}" for p in (sets or {f.ours or f.name: None}))
            out.append(f"--{f.name}: {f.kind} row, but OpenRLHF's default {show(want)} is not ours ({here}); "
                       "change our default or make the row own with the reason")
        elif f.kind == OWN and follows:
            out.append(f"--{f.name}: own row, but our default is OpenRLHF's {show(want)}: make it same")
    return out


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
