"""OpenRLHF 0.11 flag names on our config, and the project's old names as deprecated aliases.

:func:`translate` turns the ``(flag, value)`` pairs of a command line (or a YAML file) into pairs
on our config fields:

* an OpenRLHF flag of the same meaning goes to its field (:data:`TARGETS`), values translated where
  the encodings differ (``-1`` "off" is ``0`` here, ``group_norm`` is GRPO, ...); a few combine
  (``actor.num_nodes x actor.num_gpus_per_node`` ranks, ``actor.min_lr_ratio x actor.adam.lr``,
  ``data.max_len`` as prompt + response budget, ``actor.eps_clip`` for both clip ends);
* a flag whose part this trainer does not have is refused: every such flag of the command line is
  named on its own line, with the reason and what to use (trainer/openrlhf_flags.py);
* an old name of this project still works for one release and prints one deprecation line.

The table of OpenRLHF flags is trainer/openrlhf_flags.py; the table in docs/openrlhf_compat.md is generated from it.
"""

from __future__ import annotations

import sys
from typing import Any

from openrlhf_shape.trainer.openrlhf_flags import ALWAYS, BY_NAME, VALUES, refusal, translated_value

DEFAULT_MAX_PROMPT_LEN = 1024  # --data.max_prompt_len's default (TrainConfig's data section reads it from here)

# OpenRLHF name -> our config field (a canonical path of TrainConfig, or a tuple of paths for one
# flag that sets several fields). These rows join the config's alias table (trainer/config.py).
TARGETS: dict[str, str | tuple[str, ...]] = {
    "actor.model_name_or_path": "actor.pretrain",
    "actor.adam.lr": "megatron.lr",
    "actor.adam.betas": ("megatron.adam_beta1", "megatron.adam_beta2"),
    "actor.adam.eps": "megatron.adam_eps",
    "actor.adam.weight_decay": "megatron.weight_decay",
    "actor.lr_warmup_ratio": "megatron.lr_warmup_fraction",
    "actor.min_lr_ratio": "megatron.min_lr_ratio",
    "actor.lr_scheduler": "megatron.lr_decay_style",
    "actor.max_norm": "megatron.clip_grad",
    "actor.eps_clip_low_high": ("megatron.eps_clip_low", "megatron.eps_clip_high"),
    "actor.dual_clip": "megatron.dual_clip",
    "actor.gradient_checkpointing_enable": "megatron.recompute_activations",
    "train.batch_size": "actor.train_batch_size",
    "train.max_epochs": "actor.max_epochs",
    "train.max_tokens_per_gpu": "megatron.micro_batch_max_tokens",
    "train.seed": "trainer.seed",
    "train.colocate_all": "rollout.colocate",
    "train.num_episodes": "trainer.num_episodes",
    "rollout.batch_size": "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt": "sampling.n",
    "rollout.max_new_tokens": "sampling.max_tokens",
    "rollout.temperature": "sampling.temperature",
    "rollout.top_p": "sampling.top_p",
    "vllm.num_engines": "rollout.num_engines",
    "vllm.tensor_parallel_size": "engine.tensor_parallel_size",
    "vllm.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "vllm.enforce_eager": "engine.enforce_eager",
    "algo.advantage.estimator": "shape.estimator",
    "algo.advantage.is_correction_level": "rollout.is_correction_level",
    "algo.advantage.is_correction_mode": "rollout.is_correction_mode",
    "algo.advantage.is_correction_gating": "rollout.is_correction_gating",
    "algo.advantage.is_correction_threshold": "rollout.is_correction_threshold",
    "algo.dynamic_filtering_enable": "rollout.dynamic_filtering",
    "algo.dynamic_filtering_range": "rollout.dynamic_filtering_range",
    "data.prompt_dataset": "data.prompt_dataset",
    "data.prompt_split": "data.prompt_split",
    "data.input_key": "data.input_key",
    "data.label_key": "data.label_key",
    "data.input_template": "data.input_template",
    "data.apply_chat_template": "data.apply_chat_template",
    "data.max_samples": "data.max_samples",
    "eval.dataset": "data.eval_data",
    "eval.split": "data.eval_split",
    "eval.steps": "trainer.eval_steps",
    "eval.temperature": "trainer.eval_temperature",
    "eval.n_samples_per_prompt": "trainer.eval_n_samples_per_prompt",
    "ckpt.output_dir": "trainer.output_dir",
    "ckpt.path": "trainer.ckpt_path",
    "ckpt.save_steps": "trainer.save_steps",
    "ckpt.max_num": "trainer.max_ckpts_keep",
    "ckpt.save_hf": "trainer.export_hf",
    "ckpt.load_enable": "trainer.resume",
    "logger.wandb.project": "trainer.wandb_project",
    "logger.wandb.org": "trainer.wandb_org",
    "logger.wandb.group": "trainer.wandb_group",
    "logger.wandb.run_name": "trainer.wandb_run_name",
    "logger.tensorboard_dir": "trainer.tensorboard_dir",
    "reward.remote_url": "reward.remote_url",
    "reward.clip_range": "reward.clip_range",
}
# Our own settings that OpenRLHF does not have but that belong to one of its sections: public name
# -> our config field (settings under megatron.*, shape.*, probe.*, reward.* keep their names).
OURS: dict[str, str] = {
    "train.num_steps": "trainer.num_steps",
    "train.stop_after_steps": "trainer.stop_after_steps",
    "train.ray_address": "trainer.ray_address",
    "ckpt.resume": "trainer.resume",
    "logger.verbose": "trainer.verbose",
    "logger.log_samples": "trainer.log_samples",
    "logger.use_tensorboard": "trainer.use_tensorboard",
    "eval.max_samples": "data.eval_max_samples",
    "rollout.top_k": "sampling.top_k",
    "vllm.kv_cache_gib": "engine.kv_cache_gib",
    "vllm.block_size": "engine.block_size",
    "vllm.dtype": "engine.dtype",
    "vllm.max_model_len": "engine.max_model_len",
    "vllm.num_cpus_per_engine": "rollout.num_cpus_per_engine",
    "vllm.weight_sync_bucket_mb": "rollout.weight_sync_bucket_mb",
}
PUBLIC: dict[str, str | tuple[str, ...]] = {**TARGETS, **OURS}

# Combined into other fields by translate(): not one-to-one.
COMBINED = ("actor.num_nodes", "actor.num_gpus_per_node", "data.max_len", "actor.eps_clip")

# The project's names of the previous release (and two aliases that named no OpenRLHF 0.11 flag) ->
# the public name: they work for one more release, with one deprecation line each.
DEPRECATED: dict[str, str] = {
    "actor.pretrain": "actor.model_name_or_path",
    "actor.learning_rate": "actor.adam.lr",
    "actor.lr": "actor.adam.lr",
    "actor.weight_decay": "actor.adam.weight_decay",
    "actor.lr_decay_style": "actor.lr_scheduler",
    "actor.train_batch_size": "train.batch_size",
    "actor.max_epochs": "train.max_epochs",
    "actor.micro_batch_max_tokens": "train.max_tokens_per_gpu",
    "actor.micro_train_batch_size_tokens": "train.max_tokens_per_gpu",
    "megatron.recompute_activations": "actor.gradient_checkpointing_enable",
    "rollout.colocate": "train.colocate_all",
    "rollout.rollout_batch_size": "rollout.batch_size",
    "rollout.num_engines": "vllm.num_engines",
    "rollout.engine_tensor_parallel_size": "vllm.tensor_parallel_size",
    "rollout.gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "rollout.dynamic_filtering": "algo.dynamic_filtering_enable",
    "rollout.generate_max_len": "rollout.max_new_tokens",
    "rollout.kv_cache_gib": "vllm.kv_cache_gib",
    "rollout.block_size": "vllm.block_size",
    "rollout.dtype": "vllm.dtype",
    "rollout.max_model_len": "vllm.max_model_len",
    "rollout.num_cpus_per_engine": "vllm.num_cpus_per_engine",
    "rollout.weight_sync_bucket_mb": "vllm.weight_sync_bucket_mb",
    "data.prompt_data": "data.prompt_dataset",
    "data.eval_data": "eval.dataset",
    "data.eval_max_samples": "eval.max_samples",
    "trainer.seed": "train.seed",
    "trainer.num_steps": "train.num_steps",
    "trainer.stop_after_steps": "train.stop_after_steps",
    "trainer.ray_address": "train.ray_address",
    "trainer.eval_steps": "eval.steps",
    "trainer.output_dir": "ckpt.output_dir",
    "trainer.save_steps": "ckpt.save_steps",
    "trainer.max_ckpts_keep": "ckpt.max_num",
    "trainer.export_hf": "ckpt.save_hf",
    "trainer.resume": "ckpt.resume",
    "trainer.wandb_project": "logger.wandb.project",
    "trainer.log_samples": "logger.log_samples",
    "trainer.use_tensorboard": "logger.use_tensorboard",
    "trainer.verbose": "logger.verbose",
    "actor.min_lr": "actor.min_lr_ratio",  # absolute lr: still set as given
    "megatron.world_size": "actor.num_nodes x actor.num_gpus_per_node",  # still set as given
}
_DIRECT_OLD = {"actor.min_lr", "megatron.world_size"}

# OpenRLHF value encodings that differ here.
_ESTIMATORS = {"group_norm": "grpo", "grpo": "grpo", "shape": "shape", "mrt": "mrt"}
_SCHEDULERS = {"cosine": "cosine", "constant": "constant", "linear": "linear"}


class FlagError(ValueError):
    """One or more flags refused; the message has one line per flag."""


def _value(name: str, value: Any) -> Any:
    if name in ("eval.steps", "ckpt.save_steps"):
        return 0 if float(value) < 0 else value  # OpenRLHF's -1 is our 0 (off)
    if name == "ckpt.load_enable":
        return "auto"
    if name == "ckpt.save_hf":
        return True if value is True or str(value).lower() in ("1", "true", "yes", "on") else False
    if name == "algo.advantage.estimator":
        return _ESTIMATORS[str(translated_value(BY_NAME[name], value))]
    if name == "actor.lr_scheduler":
        return _SCHEDULERS[str(translated_value(BY_NAME[name], value))]
    if name == "algo.advantage.is_correction_threshold":
        vals = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
        return [0.0, float(vals[0])] if len(vals) == 1 else list(vals)  # one value: an upper bound only
    return value


def translate(pairs: list[tuple[str, Any]], notify=None) -> list[tuple[str, Any]]:
    """OpenRLHF-named / old-named ``(flag, value)`` pairs -> pairs on our config fields.

    Raises :class:`FlagError` naming every refused flag (one per line). ``notify(msg)`` receives
    the deprecation lines (default: printed to stderr once per name).
    """
    notify = notify or (lambda msg: print(msg, file=sys.stderr))
    given = dict(pairs)
    out: list[tuple[str, Any]] = []
    refused: list[str] = []
    noted: set[str] = set()
    for name, value in pairs:
        if name in DEPRECATED and name not in noted:
            noted.add(name)
            notify(f"[deprecated] --{name} will be removed in the next release; use --{DEPRECATED[name]}")
        if name in DEPRECATED and name not in _DIRECT_OLD:
            name = DEPRECATED[name]  # continue as its public name
        f = BY_NAME.get(name)
        if f is None:
            out.append((name, value))  # ours (megatron.*, shape.*, probe.*, ...) or unknown: the parser decides
            continue
        msg = refusal(name, value)
        if msg:
            refused.append(msg)
            continue
        if f.kind == ALWAYS or (f.kind == VALUES and name not in TARGETS):
            continue
        if name in COMBINED:
            continue
        out.append((name, _value(name, value)))  # the config's alias table maps the public name
    if refused:
        raise FlagError(
            f"{len(refused)} OpenRLHF flag(s) name parts this trainer does not have; remove them:\n  "
            + "\n  ".join(refused)
        )
    out.extend(_combined(given))
    return out


def _combined(given: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if "actor.num_nodes" in given or "actor.num_gpus_per_node" in given:
        nodes = int(given.get("actor.num_nodes", 1))
        per_node = int(given.get("actor.num_gpus_per_node", BY_NAME["actor.num_gpus_per_node"].default))
        out.append(("megatron.world_size", nodes * per_node))
    if "actor.eps_clip" in given and "actor.eps_clip_low_high" not in given:
        e = float(given["actor.eps_clip"])
        out.append(("actor.eps_clip_low_high", [e, e]))
    if "data.max_len" in given:  # OpenRLHF: prompt + response tokens
        total = int(given["data.max_len"])
        new = given.get("rollout.max_new_tokens", given.get("rollout.generate_max_len"))
        prompt = given.get("data.max_prompt_len")
        if new is None:
            out.append(("rollout.max_new_tokens", total - int(prompt if prompt is not None else DEFAULT_MAX_PROMPT_LEN)))
        elif prompt is None:
            out.append(("data.max_prompt_len", total - int(new)))
    return out


def public_name(path: str) -> str:
    """The flag a user types for a config field or an old name: the public (OpenRLHF-style) name."""
    if path in DEPRECATED and path not in _DIRECT_OLD:
        return DEPRECATED[path]
    for public, target in PUBLIC.items():
        if target == path:
            return public
    return path


def canonical_view(cfg_dict: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The resolved config keyed by the public names (OpenRLHF's where they exist, ours for the
    rest), nested by dots: what ``--print_config`` prints."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and k != "extra":
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v

    walk(cfg_dict, "")
    out_flat: dict[str, Any] = {}
    used: set[str] = set()
    for public, target in PUBLIC.items():
        if public == "ckpt.load_enable":
            continue  # shown as ckpt.resume
        if isinstance(target, tuple) and all(t in flat for t in target):
            out_flat[public] = [flat[t] for t in target]
            used.update(target)
        elif isinstance(target, str) and target in flat:
            out_flat[public] = flat[target]
            used.add(target)
    for path, v in flat.items():
        if path not in used:
            out_flat["actor.num_gpus_per_node" if path == "megatron.world_size" else path] = v
    out_flat.setdefault("actor.num_nodes", 1)
    out: dict[str, Any] = {}
    for path, v in out_flat.items():
        node = out
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out
