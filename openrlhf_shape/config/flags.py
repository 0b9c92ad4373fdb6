"""Dotted flags over nested config dataclasses: one generic mechanism for every command.

A config is a tree of dataclasses; each leaf field is reachable as ``--a.b.c VALUE`` (the path of
attribute names; flag = path, no other names: OpenRLHF's are translated before, in
:mod:`openrlhf_shape.config.compat`). :class:`FlagSpace` lists the leaves of a root dataclass,
converts strings to the field's type, and applies values by rebuilding the touched dataclasses with
:func:`dataclasses.replace` (so each component validates itself in ``__post_init__``). ``derived``
names the paths computed from other settings (never a flag), with the flag that sets them instead,
for the error message. Errors raised by a component (``EngineConfig.block_size must ...``) are
re-worded to the flag (``--vllm.block_size``) by :meth:`FlagSpace.build`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaf_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": type}`` for every leaf field of dataclass ``cls`` (``extra`` dicts excluded)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "extra" or not f.init:
            continue
        tp = hints[f.name]
        if _is_config(tp):
            out.update(leaf_types(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


def config_classes(cls: type, prefix: str = "") -> dict[str, type]:
    """``{"section": class}`` for every nested dataclass (``""`` is the root)."""
    out = {prefix.rstrip("."): cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            out.update(config_classes(hints[f.name], f"{prefix}{f.name}."))
    return out


def convert(value: Any, tp: Any, flag: str) -> Any:
    """``value`` (a YAML value or a command-line string) as type ``tp``; errors name ``--flag``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        return convert(value, non_none[0], flag)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true/false, got {value!r}")
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if origin is tuple:
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            if len(items) != len(args):
                raise ValueError(f"expected {len(args)} values, got {len(items)}")
            return tuple(convert(v, a, flag) for v, a in zip(items, args))
        if origin is list:
            items = value if isinstance(value, (list, tuple)) else [value]
            return [convert(v, args[0], flag) for v in items] if args else list(items)
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ValueError("expected a mapping")
            return value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--{flag}: {exc}") from None
    return value


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """``['--a.b', '1', '--c.d=x', '--e.f', '0.2', '0.28', '--flag']`` -> [(flag, value)].

    A flag followed by several non-flag tokens collects a list (for tuples); a bare flag means true.
    """
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) < 3:
            raise ValueError(f"unexpected argument {tok!r}: options look like --section.name VALUE")
        name = tok[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            out.append((name, value))
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not is_flag(argv[i]):
            values.append(argv[i])
            i += 1
        out.append((name, True if not values else values[0] if len(values) == 1 else values))
    return out


def is_flag(token: str) -> bool:
    """True for ``--name`` tokens (a negative number such as ``--1e-3`` is a value, not a flag)."""
    return token.startswith("--") and len(token) > 2 and not _is_number(token)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


class FlagSpace:
    """The flags of one root config class, with its derived table."""

    def __init__(self, root: type, derived: dict[str, str] | None = None):
        self.root = root
        self.types = leaf_types(root)
        self.derived = dict(derived or {})
        self.sections = config_classes(root)

    def flags(self) -> list[str]:
        """Every accepted flag: the canonical paths minus the derived ones."""
        return [p for p in self.types if p not in self.derived]

    def is_leaf(self, name: str) -> bool:
        return name in self.types

    def resolve(self, flag: str, value: Any) -> list[tuple[str, Any]]:
        """``(canonical path, typed value)`` pairs for one flag; errors name the flag and the fix."""
        if flag in self.derived:
            raise ValueError(f"--{flag} is derived from other settings and cannot be set; use {self.derived[flag]}")
        if flag not in self.types:
            close = difflib.get_close_matches(flag, self.flags(), n=3)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ValueError(f"unknown option --{flag}{hint}")
        return [(flag, convert(value, self.types[flag], flag))]

    def build(self, base: Any, values: dict[str, Any]) -> Any:
        """``base`` with ``values`` (canonical path -> typed value) applied, sections re-validated."""
        return self._replace(base, "", dict(values))

    def _replace(self, obj: Any, prefix: str, values: dict[str, Any]) -> Any:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            path = f"{prefix}{f.name}"
            if path in values:
                changes[f.name] = values[path]
            elif any(k.startswith(path + ".") for k in values):
                changes[f.name] = self._replace(getattr(obj, f.name), path + ".", values)
        if not changes:
            return obj
        try:
            return dataclasses.replace(obj, **changes)
        except ValueError as exc:
            raise ValueError(self._flag_words(str(exc), prefix.rstrip("."), type(obj))) from None
        except TypeError as exc:
            raise ValueError(f"--{prefix or ''}*: {exc}") from None

    @staticmethod
    def _flag_words(msg: str, section: str, cls: type) -> str:
        """``ClassName.field`` in a component's message -> ``--section.field``."""
        if msg.startswith("--"):
            return msg
        names = {c.__name__ for c in cls.__mro__ if dataclasses.is_dataclass(c)}
        pattern = r"\b(" + "|".join(map(re.escape, names)) + r")\.(\w+)"
        new = re.sub(pattern, lambda m: f"--{section}.{m.group(2)}" if section else f"--{m.group(2)}", msg)
        return new if new != msg else (f"--{section}.*: {msg}" if section else msg)


def flatten_mapping(data: dict[str, Any], space: FlagSpace, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested YAML mapping -> ``[(dotted flag, value)]`` (a mapping at a leaf stays a value)."""
    out = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not space.is_leaf(name):
            out.extend(flatten_mapping(value, space, name + "."))
        else:
            out.append((name, value))
    return out
