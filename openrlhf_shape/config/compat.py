"""OpenRLHF's names that are not attribute paths here: value encodings, refusals, combined flags.

A flag's name is its attribute path (:mod:`openrlhf_shape.config.tree`). :func:`translate` turns
the ``(flag, value)`` pairs of a command line or a YAML file into such paths:

* an OpenRLHF 0.11 flag for a part this trainer does not have is refused, every such flag of the
  command line on its own line, with the reason and what to use (:mod:`openrlhf_shape.config.openrlhf`);
* the few OpenRLHF value encodings that differ are translated (:func:`_value`), and two OpenRLHF
  flags that set other flags are expanded (:func:`_combined`).

Only names an OpenRLHF user types are translated; every other name goes to the parser as it is.
:func:`notes` and :func:`implied` say (once, at load) what an accepted OpenRLHF flag does here when that
is not simply "the same setting": a switch that is always on, and the settings OpenRLHF's meaning implies
across flags (a ZeRO stage selects the DeepSpeed backend; ``--train.colocate_all`` under
``--train.async_enable`` colocates only the training models).
"""

from __future__ import annotations

from typing import Any

from openrlhf_shape.config.openrlhf import ALWAYS, BY_NAME, VALUES, refusal, translated_value
from openrlhf_shape.config.tree import DEFAULT_MAX_PROMPT_LEN

# OpenRLHF flags that set other flags (kept: OpenRLHF users type them).
COMBINED = ("data.max_len", "actor.eps_clip")


class FlagError(ValueError):
    """One or more flags refused; the message has one line per flag."""


def _value(name: str, value: Any) -> Any:
    """OpenRLHF encodings that differ here (each kept because OpenRLHF's own value would be refused or
    mean something else): -1 "off" steps, one-value thresholds, estimator and scheduler names."""
    if name in ("eval.steps", "ckpt.save_steps"):
        return 0 if float(value) < 0 else value  # OpenRLHF's -1 is our 0 (off)
    if name == "algo.advantage.estimator":  # OpenRLHF's group_norm is GRPO (our name)
        return "grpo" if translated_value(BY_NAME[name], value) == "group_norm" else translated_value(BY_NAME[name], value)
    if name == "actor.lr_scheduler":  # cosine_with_min_lr -> cosine, constant_with_warmup -> constant
        return translated_value(BY_NAME[name], value)
    if name == "algo.advantage.is_correction_threshold":
        vals = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
        return [0.0, float(vals[0])] if len(vals) == 1 else list(vals)  # one value: an upper bound only
    return value


def translate(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(flag, value)`` pairs -> pairs on flag paths (OpenRLHF values translated, its combined flags expanded).

    Raises :class:`FlagError` naming every refused flag (one per line)."""
    out: list[tuple[str, Any]] = []
    refused: list[str] = []
    for name, value in pairs:
        f = BY_NAME.get(name)
        if f is None:
            out.append((name, value))  # ours or unknown: the parser decides
            continue
        msg = refusal(name, value)
        if msg:
            refused.append(msg)
        elif name == "ckpt.load_enable":
            out.append(("ckpt.resume", "auto"))
        elif not (f.kind == ALWAYS or name in COMBINED or (f.kind == VALUES and translated_value(f, value) is None)):
            out.append((name, _value(name, value)))
    if refused:
        raise FlagError(f"{len(refused)} OpenRLHF flag(s) name parts this trainer does not have; remove them:\n  "
                        + "\n  ".join(refused))
    return out + _combined(dict(out), dict(pairs))


def _combined(ours: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if "actor.eps_clip" in given and "actor.eps_clip_low_high" not in ours:  # one clip for both ends
        e = float(given["actor.eps_clip"])
        out.append(("actor.eps_clip_low_high", [e, e]))
    if "data.max_len" in given:  # OpenRLHF: prompt + response tokens
        total = int(given["data.max_len"])
        new, prompt = ours.get("rollout.max_new_tokens"), ours.get("data.max_prompt_len")
        if new is None:
            out.append(("rollout.max_new_tokens", total - int(prompt if prompt is not None else DEFAULT_MAX_PROMPT_LEN)))
        elif prompt is None:
            out.append(("data.max_prompt_len", total - int(new)))
    return out


def notes(pairs: list[tuple[str, Any]]) -> list[str]:
    """One line per accepted OpenRLHF flag of ``pairs`` that switches on what is always on here (no effect)."""
    out: list[str] = []
    for name, _ in pairs:
        f = BY_NAME.get(name)
        if f is not None and f.kind == ALWAYS:
            out.append(f"--{name}: accepted, no switch here: {f.why}")
    return out


def implied(values: dict[str, Any]) -> list[str]:
    """OpenRLHF's meaning across flags, applied to ``values`` (resolved flag paths -> values, everything the
    YAML file and the command line gave); returns one line per change, to log.

    * ``--ds.zero_stage`` / ``--ds.adam_offload`` without ``--actor.backend``: OpenRLHF trains with DeepSpeed
      ZeRO, so the DeepSpeed backend (our default backend is Megatron, which has no ZeRO stage).
    * ``--train.colocate_all`` with ``--train.async_enable``: OpenRLHF then colocates only its training models
      and gives the engines their own GPUs (nothing could overlap otherwise), so the engines are disaggregated.
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
    return out
