"""OpenRLHF's names that are not attribute paths here: value encodings, refusals, combined flags.

A flag's name is its attribute path (:mod:`openrlhf_shape.config.tree`). :func:`translate` turns
the ``(flag, value)`` pairs of a command line or a YAML file into such paths:

* an OpenRLHF 0.11 flag for a part this trainer does not have is refused, every such flag of the
  command line on its own line, with the reason and what to use (:mod:`openrlhf_shape.config.openrlhf`);
* the few OpenRLHF value encodings that differ are translated (:func:`_value`), an OpenRLHF flag that
  sets other flags is expanded (:func:`_combined`), and OpenRLHF 0.11.0's names for the rollout correction
  are turned into 0.11.2's (:func:`_renamed_correction`).

Only names an OpenRLHF user types are translated; every other name goes to the parser as it is.
:func:`notes` and :func:`implied` say (once, at load) what an accepted OpenRLHF flag does here when that
is not simply "the same setting": a switch that is always on, an old name, and the settings OpenRLHF's meaning
implies across flags (a ZeRO stage selects the DeepSpeed backend; ``--train.colocate_all`` under
``--train.async_enable`` colocates only the training models). :func:`own_defaults_note` names the OpenRLHF
defaults a run does not follow because it leaves those flags unset.
"""

from __future__ import annotations

from typing import Any

from openrlhf_shape.actor.lr_schedule import SCHEDULES
from openrlhf_shape.actor.optim import OptimSettings
from openrlhf_shape.config.flags import convert
from openrlhf_shape.config.openrlhf import (ALWAYS, BY_NAME, OPENRLHF_PPO_FLAGS, OWN, VALUES, our_default, refusal,
                                            show, translated_value)
from openrlhf_shape.config.tree import DEFAULT_MAX_PROMPT_LEN

# OpenRLHF flags that set other flags (kept: OpenRLHF users type them).
COMBINED = ("data.max_len",)

# OpenRLHF 0.11.0's rollout-correction flags (its launch scripts on GitHub still pass them); 0.11.2 replaced them by
# --algo.advantage.is_correction_level / _mode / _gating. Read from 0.11.0's models/loss.py (PolicyLoss.forward, PPO
# loss): only with is_correction_enable, each token's loss is weighted by w = exp(old - rollout log-prob), and by type
#   tis           w clamped into [low, high]                                 = level token, mode clip, gating ratio
#   icepop        w where low <= w <= high, else 0                           = level token, mode mask, gating ratio
#   seq-mask-tis  w where the response's geometric-mean w is in band, else 0 = level seq, mode mask, gating ratio
# (type tis is 0.11.0's default; without is_correction_enable the type does nothing; the threshold keeps its name).
OLD_IS_ENABLE, OLD_IS_TYPE = "algo.advantage.is_correction_enable", "algo.advantage.is_correction_type"
OLD_IS_TYPES = {"tis": ("token", "clip", "ratio"), "icepop": ("token", "mask", "ratio"),
                "seq-mask-tis": ("seq", "mask", "ratio")}
_IS_NEW = ("algo.advantage.is_correction_level", "algo.advantage.is_correction_mode",
           "algo.advantage.is_correction_gating")


class FlagError(ValueError):
    """One or more flags refused; the message has one line per flag."""


def _value(name: str, value: Any) -> Any:
    """OpenRLHF encodings that differ here (each kept because OpenRLHF's own value would be refused or
    mean something else): -1 "off" steps, one-value thresholds, estimator names."""
    if name in ("eval.steps", "ckpt.save_steps"):
        return 0 if float(value) < 0 else value  # OpenRLHF's -1 is our 0 (off)
    if name == "algo.advantage.estimator":  # OpenRLHF's group_norm is GRPO (our name); an unknown name: the parser's
        return BY_NAME[name].accept.get(str(value), value)
    if name == "algo.advantage.is_correction_threshold":
        vals = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
        return [0.0, float(vals[0])] if len(vals) == 1 else list(vals)  # one value: an upper bound only
    return value


def _renamed_correction(pairs: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], str | None]:
    """OpenRLHF 0.11.0's ``--algo.advantage.is_correction_enable`` / ``_type`` in ``pairs`` -> 0.11.2's level, mode
    and gating (the table above ``OLD_IS_TYPES``); returns the pairs and the one-line note (None: no old name)."""
    old = {n: v for n, v in pairs if n in (OLD_IS_ENABLE, OLD_IS_TYPE)}
    if not old:
        return pairs, None
    rest = [(n, v) for n, v in pairs if n not in old]
    mixed = sorted({n for n, _ in rest} & set(_IS_NEW))
    if mixed:
        raise FlagError(f"--{OLD_IS_ENABLE} / --{OLD_IS_TYPE} are OpenRLHF 0.11.0's names for what --{mixed[0]} sets "
                        "(0.11.2's names): give one or the other")
    kind = str(old.get(OLD_IS_TYPE, "tis"))
    if kind not in OLD_IS_TYPES:
        raise FlagError(f"--{OLD_IS_TYPE} {kind}: OpenRLHF 0.11.0 takes {', '.join(OLD_IS_TYPES)}")
    typed = f" --{OLD_IS_TYPE} {kind}" if OLD_IS_TYPE in old else ""
    if not convert(old.get(OLD_IS_ENABLE, False), bool, OLD_IS_ENABLE):
        return rest, f"--{OLD_IS_TYPE} {kind} (OpenRLHF 0.11.0's name): no effect without --{OLD_IS_ENABLE}, as in 0.11.0"
    new = dict(zip(_IS_NEW, OLD_IS_TYPES[kind]))
    said = " ".join(f"--{n} {v}" for n, v in new.items())
    return rest + list(new.items()), f"--{OLD_IS_ENABLE}{typed} (OpenRLHF 0.11.0's names) is 0.11.2's {said}"


def translate(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(flag, value)`` pairs -> pairs on flag paths (OpenRLHF values translated, its combined flags expanded,
    0.11.0's rollout-correction names renamed).

    Raises :class:`FlagError` naming every refused flag (one per line)."""
    out: list[tuple[str, Any]] = []
    refused: list[str] = []
    pairs, _ = _renamed_correction(pairs)
    for name, value in pairs:
        f = BY_NAME.get(name)
        if f is None:
            out.append((name, value))  # ours or unknown: the parser decides
            continue
        msg = refusal(name, value)
        if msg:
            refused.append(msg)
        elif name == "ckpt.load_enable":  # OpenRLHF's switch: load the newest checkpoint when there is one
            out.append(("ckpt.resume", "auto" if convert(value, bool, name) else "none"))
        elif not (f.kind == ALWAYS or name in COMBINED or (f.kind == VALUES and translated_value(f, value) is None)):
            out.append((name, _value(name, value)))
    if refused:
        raise FlagError(f"{len(refused)} OpenRLHF flag(s) name parts this trainer does not have; remove them:\n  "
                        + "\n  ".join(refused))
    return out + _combined(dict(out), dict(pairs))


def _combined(ours: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if "data.max_len" in given:  # OpenRLHF: prompt + response tokens
        total = int(given["data.max_len"])
        new, prompt = ours.get("rollout.max_new_tokens"), ours.get("data.max_prompt_len")
        if new is None:
            out.append(("rollout.max_new_tokens", total - int(prompt if prompt is not None else DEFAULT_MAX_PROMPT_LEN)))
        elif prompt is None:
            out.append(("data.max_prompt_len", total - int(new)))
    return out


def notes(pairs: list[tuple[str, Any]]) -> list[str]:
    """One line per accepted OpenRLHF flag of ``pairs`` that switches on what is always on here (no effect), and one
    for OpenRLHF 0.11.0's rollout-correction names."""
    pairs, renamed = _renamed_correction(pairs)
    out: list[str] = [renamed] if renamed else []
    for name, _ in pairs:
        f = BY_NAME.get(name)
        if f is not None and f.kind == ALWAYS:
            out.append(f"--{name}: accepted, no switch here: {f.why}")
    return out


def touched(name: str) -> set[str]:
    """The flag paths OpenRLHF's flag ``name`` sets here (itself, its ``ours``, what its translation sets)."""
    f = BY_NAME[name]
    out = {name, f.ours or name}
    try:
        out |= {p for p, _ in translate([(name, f.default)])}
    except (FlagError, TypeError, ValueError):
        pass  # a refused default sets nothing
    return out


def own_defaults_note(given: set[str]) -> str | None:
    """One line naming the OpenRLHF defaults a run does not follow: every ``own`` row (and every accepted flag whose
    OpenRLHF default is refused here) that ``given`` (the flag names and paths the YAML file and the command line
    set) leaves unset, with our default and, in brackets, OpenRLHF's. None when there is none."""
    parts = []
    for f in OPENRLHF_PPO_FLAGS:
        if f.kind == OWN:
            theirs = show(f.default)
        elif f.kind == VALUES and refusal(f.name, f.default):
            theirs = f"{show(f.default)}, refused here"
        else:
            continue
        if not touched(f.name) & given:
            parts.append(f"--{f.name} {show(our_default(f))} [{theirs}]")
    if not parts:
        return None
    return ("OpenRLHF defaults this run does not follow (flags it leaves unset: our default [OpenRLHF's]; give a flag "
            "OpenRLHF's value to get it; why each differs: docs/openrlhf_compat.md): " + ", ".join(parts))


def _unread_schedule_flags(values: dict[str, Any]) -> list[str]:
    name = values.get("actor.lr_scheduler", OptimSettings.lr_scheduler)
    schedule = SCHEDULES.get(name)
    if schedule is None:  # refused by the config's checks, naming the accepted names
        return []
    unread = [f"--actor.{flag} {show(values[f'actor.{flag}'])}" for flag, read in
              (("lr_warmup_ratio", schedule.warms_up), ("min_lr_ratio", schedule.has_floor))
              if values.get(f"actor.{flag}") and not read]
    if not unread:
        return []
    return [f"{' and '.join(unread)}: --actor.lr_scheduler {name} does not read it, as in OpenRLHF (transformers' "
            "schedules: constant_with_warmup warms up, cosine_with_min_lr decays to the floor)"]


def implied(values: dict[str, Any]) -> list[str]:
    """OpenRLHF's meaning across flags, applied to ``values`` (resolved flag paths -> values, everything the
    YAML file and the command line gave); returns one line per change, to log.

    * ``--ds.zero_stage`` / ``--ds.adam_offload`` without ``--actor.backend``: OpenRLHF trains with DeepSpeed
      ZeRO, so the DeepSpeed backend (our default backend is Megatron, which has no ZeRO stage).
    * ``--train.colocate_all`` with ``--train.async_enable``: OpenRLHF then colocates only its training models
      and gives the engines their own GPUs (nothing could overlap otherwise), so the engines are disaggregated.
    * ``--train.partial_rollout_enable`` with ``--train.agent_func_path`` (OpenRLHF's agent-async script passes
      both): an agent's episode is not cut; it runs whole inside one window of the asynchronous schedule, so every
      token of it comes from one policy version (the agent's state lives in its executor's coroutines, which a
      checkpoint cannot hold). OpenRLHF's episodes continue under new weights only when a sync lands mid-episode.
    * ``--actor.lr_warmup_ratio`` / ``--actor.min_lr_ratio`` given to an ``--actor.lr_scheduler`` that does not read
      them (``constant`` never warms up, only the ``*_with_min_lr`` schedules have a floor): unread, as in OpenRLHF.
    * ``--train.num_episodes`` with ``--algo.dynamic_filtering_enable`` (three of OpenRLHF's RL scripts pass both):
      the step count is fixed before the filter runs, so the run reads more passes than asked; said, not refused.
    """
    out: list[str] = []
    if "actor.backend" not in values and ("ds.zero_stage" in values or values.get("ds.adam_offload")):
        values["actor.backend"] = "deepspeed"
        given = "--ds.zero_stage" if "ds.zero_stage" in values else "--ds.adam_offload"
        out.append(f"{given} without --actor.backend: --actor.backend deepspeed (ZeRO is OpenRLHF's backend; "
                   "give --actor.backend megatron for Megatron)")
    if values.get("train.async_enable") and values.get("train.colocate_all"):
        values["train.colocate_all"] = False
        out.append("--train.colocate_all with --train.async_enable: as in OpenRLHF, only the training models share "
                   "GPUs; the vLLM engines get their own (--train.colocate_all false for the engines)")
    out += _unread_schedule_flags(values)
    if values.get("train.partial_rollout_enable") and values.get("train.agent_func_path"):
        out.append("--train.partial_rollout_enable with --train.agent_func_path: agent episodes are not cut; each runs "
                   "whole inside one window of the asynchronous schedule, on one policy version (its state lives in the "
                   "agent's coroutines, which a checkpoint cannot hold); single-turn responses have no agent here")
    if values.get("train.num_episodes") and values.get("algo.dynamic_filtering_enable"):
        e = values["train.num_episodes"]
        out.append(f"--train.num_episodes {e} with --algo.dynamic_filtering_enable: the run takes {e} x (prompts // "
                   "--rollout.batch_size) steps, each on a full batch (the filter's refills take further prompts), so it "
                   f"reads about {e} / (the filter's pass rate) passes over the prompts (each prompt at most once per "
                   f"pass) and its LR schedule ends with its last step; OpenRLHF stops after {e} pass(es) instead (each "
                   "pass's last step short), its LR schedule unfinished. --train.num_steps sizes a run in steps")
    return out
