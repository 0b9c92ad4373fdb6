"""Rank configs from one flat mapping of field names, as the multi-process scenarios hand them on.

A scenario's settings travel as a flat dict (``{"tensor_model_parallel_size": 2, "lr": 2e-3,
"micro_batch_max_tokens": 96}``) so that a variant is one ``{**cfg, **variant}``. Each key is the name of
a field of the backend's settings class, of :class:`OptimConfig` or of its :class:`AdamConfig`, and goes
to the class that owns it: there is no table of names. (The trainer builds rank configs from the flag
tree instead: ``TrainConfig.megatron_config()`` / ``zero_config()``.)

A field a scenario leaves out takes the value the scenarios were written with (:data:`SCENARIO_DEFAULTS`: a
constant LR without warm-up, Adam betas (0.9, 0.999), clip 0.2/0.28, a floor of 0), not the flags' defaults (which
follow OpenRLHF's since issue 46): a scenario's numbers do not move when a flag's default does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from openrlhf_shape.actor.optim import AdamConfig, OptimConfig
from openrlhf_shape.megatron.config import MegatronConfig, MegatronSettings
from openrlhf_shape.zero.config import ZeroConfig, ZeroSettings


SCENARIO_DEFAULTS: dict[str, Any] = {"lr_scheduler": "constant", "lr_warmup_ratio": 0.0, "min_lr": 0.0,
                                     "betas": (0.9, 0.999), "eps_clip_low_high": (0.2, 0.28)}


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _sort(leaves: Mapping[str, Any], settings: type) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``leaves`` -> the keyword arguments of ``settings``, of :class:`OptimConfig` and of :class:`AdamConfig`."""
    own, optim, adam = {}, {}, {}
    for key, value in leaves.items():
        if key in _names(settings):
            own[key] = value
        elif key in _names(AdamConfig):
            adam[key] = value
        elif key in _names(OptimConfig) and key != "adam":
            optim[key] = value
        else:
            raise TypeError(f"{key!r} is a field of neither {settings.__name__}, OptimConfig nor AdamConfig")
    return own, optim, adam


def _split(leaves: Mapping[str, Any], settings: type) -> tuple[dict[str, Any], OptimConfig]:
    """``leaves`` (over :data:`SCENARIO_DEFAULTS`) -> (the ``settings`` class's keyword arguments, the
    :class:`OptimConfig`)."""
    own, optim, adam = _sort({**SCENARIO_DEFAULTS, **leaves}, settings)
    return own, OptimConfig(adam=AdamConfig(**adam), **optim)


def replaced(cfg: MegatronConfig | ZeroConfig, **leaves: Any) -> MegatronConfig | ZeroConfig:
    """``cfg`` with ``leaves`` (field names as above) replaced, the rest (a resolved ``bf16``, say) kept:
    a scenario's variant applied to the config a worker already holds."""
    own, optim, adam = _sort(leaves, MegatronSettings if isinstance(cfg, MegatronConfig) else ZeroSettings)
    new_optim = dataclasses.replace(cfg.optim, adam=dataclasses.replace(cfg.optim.adam, **adam), **optim)
    return dataclasses.replace(cfg, optim=new_optim, **own)


def megatron_config(leaves: Mapping[str, Any]) -> MegatronConfig:
    """A :class:`MegatronConfig` from layout, switch, optimiser and Adam field names in one mapping."""
    own, optim = _split(leaves, MegatronSettings)
    return MegatronConfig(**own, optim=optim)


def zero_config(leaves: Mapping[str, Any], **zero: Any) -> ZeroConfig:
    """A :class:`ZeroConfig` from optimiser and Adam field names in ``leaves`` and DeepSpeed's own in ``zero``
    (``leaves`` may hold DeepSpeed's too)."""
    own, optim = _split({**leaves, **zero}, ZeroSettings)
    return ZeroConfig(**own, optim=optim)
