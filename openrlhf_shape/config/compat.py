"""Names that are not attribute paths: this project's old names, and OpenRLHF's value encodings.

A flag's name is its attribute path (:mod:`openrlhf_shape.config.tree`). :func:`translate` turns
the ``(flag, value)`` pairs of a command line or a YAML file into such paths:

* an old name of this project (the tree's layout before flag = path) still works: one notice
  line names the new flag (:data:`DEPRECATED`, which also reads an old run's saved config);
* an OpenRLHF 0.11 flag for a part this trainer does not have is refused, every such flag of the
  command line on its own line, with the reason and what to use (:mod:`openrlhf_shape.config.openrlhf`);
* the few OpenRLHF value encodings that differ are translated (:func:`_value`), and two OpenRLHF
  flags that set other flags are expanded (:func:`_combined`).
"""

from __future__ import annotations

import sys
from typing import Any

from openrlhf_shape.config.openrlhf import ALWAYS, BY_NAME, VALUES, refusal, translated_value

_TRAINER = {  # the old loop section ``trainer.*``
    "output_dir": "ckpt.output_dir", "ckpt_path": "ckpt.path", "num_episodes": "train.num_episodes",
    "num_steps": "train.num_steps", "save_steps": "ckpt.save_steps", "max_ckpts_keep": "ckpt.max_num",
    "eval_steps": "eval.steps", "val_before_train": "eval.val_before_train", "eval_temperature": "eval.temperature",
    "eval_n_samples_per_prompt": "eval.n_samples_per_prompt", "eval_top_p": "eval.top_p", "eval_top_k": "eval.top_k",
    "resume": "ckpt.resume", "seed": "train.seed", "ray_address": "train.ray_address",
    "use_tensorboard": "logger.use_tensorboard", "wandb_project": "logger.wandb.project",
    "wandb_org": "logger.wandb.org", "wandb_group": "logger.wandb.group", "wandb_run_name": "logger.wandb.run_name",
    "tensorboard_dir": "logger.tensorboard_dir", "export_hf": "ckpt.save_hf", "log_samples": "logger.log_samples",
    "stop_after_steps": "train.stop_after_steps", "verbose": "logger.verbose", "gpus_per_node": "train.gpus_per_node",
    "num_nodes": "train.num_nodes",
}
_MEGATRON = {  # backend-neutral settings that lived under ``megatron.*``
    "lr": "actor.adam.lr", "min_lr": "actor.min_lr", "lr_warmup_fraction": "actor.lr_warmup_ratio",
    "lr_warmup_steps": "actor.lr_warmup_steps", "lr_decay_style": "actor.lr_scheduler",
    "weight_decay": "actor.adam.weight_decay", "adam_beta1": "actor.adam.betas[0]", "adam_beta2": "actor.adam.betas[1]",
    "adam_eps": "actor.adam.eps", "clip_grad": "actor.max_norm", "micro_batch_max_tokens": "train.max_tokens_per_gpu",
    "eps_clip_low": "actor.eps_clip_low_high[0]", "eps_clip_high": "actor.eps_clip_low_high[1]",
    "dual_clip": "actor.dual_clip", "entropy_chunk_size": "actor.entropy_chunk_size",
    "recompute_activations": "actor.gradient_checkpointing_enable", "min_lr_ratio": "actor.min_lr_ratio",
    "world_size": "actor.num_gpus_per_node",  # ranks on one node: the same world size
}
_SAMPLING = {"n": "rollout.n_samples_per_prompt", "max_tokens": "rollout.max_new_tokens"}  # others keep their name
_ENGINE = ("tensor_parallel_size", "block_size", "kv_cache_gib", "gpu_memory_utilization", "max_model_len",
           "enforce_eager", "enable_prefix_caching", "dtype", "logprobs_mode")
_ROLLOUT = {
    "rollout_batch_size": "rollout.batch_size", "num_engines": "vllm.num_engines",
    "num_cpus_per_engine": "vllm.num_cpus_per_engine", "colocate": "train.colocate_all",
    "dynamic_filtering": "algo.dynamic_filtering_enable", "dynamic_filtering_range": "algo.dynamic_filtering_range",
    "weight_sync_bucket_mb": "vllm.weight_sync_bucket_mb", "generate_max_len": "rollout.max_new_tokens",
    "engine_tensor_parallel_size": "vllm.tensor_parallel_size",
    **{f"is_correction_{k}": f"algo.advantage.is_correction_{k}" for k in ("level", "mode", "gating", "threshold")},
    **{k: f"vllm.{k}" for k in ("kv_cache_gib", "gpu_memory_utilization", "block_size", "dtype", "max_model_len")},
}
_OTHER = {
    "actor.pretrain": "actor.model_name_or_path", "actor.train_batch_size": "train.batch_size",
    "actor.max_epochs": "train.max_epochs", "actor.learning_rate": "actor.adam.lr", "actor.lr": "actor.adam.lr",
    "actor.weight_decay": "actor.adam.weight_decay", "actor.lr_decay_style": "actor.lr_scheduler",
    "actor.micro_batch_max_tokens": "train.max_tokens_per_gpu",
    "actor.micro_train_batch_size_tokens": "train.max_tokens_per_gpu",
    "data.prompt_data": "data.prompt_dataset", "data.eval_data": "eval.dataset",
    "data.eval_max_samples": "eval.max_samples", "data.eval_split": "eval.split",
    "shape.estimator": "algo.advantage.estimator", "shape.num_probes": "probe.num_probes",
    "shape.probe_max_tokens": "probe.max_tokens",
}
# This project's old flag names (and the old config tree's paths) -> the flag path now. Each still
# works, with one notice line; the old saved configs (run.json) are read through it too.
DEPRECATED: dict[str, str] = {
    **{f"trainer.{k}": v for k, v in _TRAINER.items()}, **{f"megatron.{k}": v for k, v in _MEGATRON.items()},
    **{f"sampling.{k}": _SAMPLING.get(k, f"rollout.{k}") for k in
       ("n", "temperature", "top_p", "top_k", "max_tokens", "logprobs", "stop", "stop_token_ids")},
    **{f"engine.{k}": f"vllm.{k}" for k in _ENGINE}, **{f"rollout.{k}": v for k, v in _ROLLOUT.items()}, **_OTHER,
}
# Old paths that were computed at set-up, never flags: an old saved config's values are dropped.
OLD_DERIVED = ("engine.model_path", "engine.seed", "engine.enable_sleep_mode", "megatron.total_steps",
               "megatron.seed", "probe.num_probes", "probe.max_tokens")

# OpenRLHF flags that set other flags (kept: OpenRLHF users type them).
COMBINED = ("data.max_len", "actor.eps_clip")
DEFAULT_MAX_PROMPT_LEN = 1024  # = tree.DEFAULT_MAX_PROMPT_LEN (data.max_len subtracts it when no prompt length is given)


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


def translate(pairs: list[tuple[str, Any]], notify=None) -> list[tuple[str, Any]]:
    """``(flag, value)`` pairs -> pairs on flag paths (old names renamed, OpenRLHF values translated).

    Raises :class:`FlagError` naming every refused flag (one per line). ``notify(msg)`` receives
    the deprecation lines (default: printed to stderr once per name)."""
    notify = notify or (lambda msg: print(msg, file=sys.stderr))
    out: list[tuple[str, Any]] = []
    refused: list[str] = []
    noted: set[str] = set()
    for name, value in pairs:
        if name in DEPRECATED:
            if name not in noted:
                noted.add(name)
                notify(f"[deprecated] --{name} will be removed in the next release; use --{DEPRECATED[name].split('[')[0]}")
            name = DEPRECATED[name]
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
